// The one input check of custom::npu_fused_gdn_decode (docs/spec.md, "Validation"). CPU, NPU and
// Meta all call it before touching any data, so every backend accepts and rejects the same inputs.
// Written on SymInt so the Meta kernel can run it on symbolic shapes under torch.compile.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstring>
#include <iterator>
#include <memory>
#include <optional>
#include <string>

#include <c10/util/Exception.h>

#include "fused_gdn_decode.h"

namespace custom_ops {
namespace {

constexpr int64_t kUint32Max = 4294967295LL;
constexpr int64_t kMinK = 64;
constexpr int64_t kMaxK = 2032;
// The vendor kernel pads each K row to a multiple of 16 elements and allows at most 32 bytes of
// padding for a float32 state (op_host tiling).
constexpr int64_t kKAlign = 16;
constexpr int64_t kMaxFp32RowPadBytes = 32;

// Python spelling of a dtype ("torch.bfloat16"), as users write it.
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "torch.float32";
    case at::kHalf:
      return "torch.float16";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kDouble:
      return "torch.float64";
    case at::kInt:
      return "torch.int32";
    case at::kLong:
      return "torch.int64";
    case at::kShort:
      return "torch.int16";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    case at::kComplexHalf:
      return "torch.complex32";
    case at::kComplexFloat:
      return "torch.complex64";
    case at::kComplexDouble:
      return "torch.complex128";
    default: {
      std::string name = c10::toString(t);
      std::transform(name.begin(), name.end(), name.begin(), ::tolower);
      return "torch." + name;
    }
  }
}

// Python spelling of a layout ("torch.sparse_coo").
std::string layout_name(at::Layout layout) {
  switch (layout) {
    case at::kStrided:
      return "torch.strided";
    case at::kSparse:
      return "torch.sparse_coo";
    case at::kSparseCsr:
      return "torch.sparse_csr";
    case at::kSparseCsc:
      return "torch.sparse_csc";
    case at::kSparseBsr:
      return "torch.sparse_bsr";
    case at::kSparseBsc:
      return "torch.sparse_bsc";
    case at::kMkldnn:
      return "torch._mkldnn";
    default:
      return c10::str(layout);
  }
}

// Only plain dense tensors: the kernels read raw strided memory. None arrives as an undefined
// tensor; sparse and mkldnn tensors reach the Python backends (no kernel of their own) and would
// fail deep inside the reference. (Nested tensors never get here: PyTorch finds no kernel.)
void check_dense(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.defined(), kOp, name, " must be a tensor, but got None");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided, kOp, name,
                   " must be a dense (torch.strided) tensor, but got layout ",
                   layout_name(t.layout()));
}

// Whether t has addresses: not a meta tensor, and not a FakeTensor (a CPU or CUDA tensor whose
// storage holds no data), as the Python backends' checks see them under torch.compile.
bool has_data(const at::Tensor& t) {
  return t.has_storage() && !t.is_meta() && t.storage().data() != nullptr;
}

// The bytes from a tensor's first element to the end of its last (sizes > 0, strides >= 0): from
// its address where it has data, else from the start of its storage.
struct ByteSpan {
  int64_t begin, end;
  bool overlaps(const ByteSpan& o) const { return begin < o.end && o.begin < end; }
  std::string text(bool addresses) const {
    if (!addresses) {
      return c10::str("[", begin, ", ", end, ")");
    }
    return c10::str("[", reinterpret_cast<const void*>(begin), ", ",
                    reinterpret_cast<const void*>(end), ")");
  }
};

// Nothing where a size, stride or offset is symbolic (torch.compile tracing).
std::optional<ByteSpan> byte_span(const at::Tensor& t) {
  int64_t last = 0;
  for (int64_t dim = 0; dim < t.dim(); ++dim) {
    const auto size = t.sym_size(dim).maybe_as_int();
    const auto stride = t.sym_stride(dim).maybe_as_int();
    if (!size || !stride) {
      return std::nullopt;
    }
    last += (*size - 1) * *stride;
  }
  int64_t begin;
  if (has_data(t)) {
    begin = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.const_data_ptr()));
  } else {
    const auto offset = t.sym_storage_offset().maybe_as_int();
    if (!offset) {
      return std::nullopt;
    }
    begin = *offset * static_cast<int64_t>(t.element_size());
  }
  return ByteSpan{begin, begin + (last + 1) * static_cast<int64_t>(t.element_size())};
}

// Every kernel loads whole elements; an address that is not a multiple of the element size
// (torch.frombuffer with an odd offset) is undefined behaviour on CPU and a fault on devices.
void check_aligned(const at::Tensor& t, const char* name) {
  if (!has_data(t)) {
    return;  // no data (FakeTensor, torch.compile tracing)
  }
  const auto address = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  TORCH_CHECK_VALUE(
      address % t.element_size() == 0, kOp, name, " must be aligned to its element size (",
      t.element_size(), " bytes), but its data starts at address ", t.const_data_ptr());
}

void check_rank(const at::Tensor& t, const char* name, int64_t rank, const char* layout) {
  TORCH_CHECK_VALUE(
      t.dim() == rank, kOp, name, " must be a ", rank, "-D tensor ", layout, ", but got a ",
      t.dim(), "-D tensor of shape ", t.sym_sizes());
}

void check_not_empty(const at::Tensor& t, const char* name) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    TORCH_CHECK_VALUE(
        t.sym_size(d) > 0, kOp, name, " must not be empty: every dimension must be > 0, but got "
        "shape ", t.sym_sizes());
  }
}

void check_dtype(const at::Tensor& t, const char* name, at::ScalarType expected, const char* why) {
  TORCH_CHECK_TYPE(
      t.scalar_type() == expected, kOp, name, " must have dtype ", dtype_name(expected), why,
      ", but got ", dtype_name(t.scalar_type()));
}

void check_uint32(const c10::SymInt& v, const char* what) {
  TORCH_CHECK_VALUE(v <= kUint32Max, kOp, what, " must be at most UINT32_MAX (", kUint32Max,
                    "), but got ", v);
}

void check_shape(const at::Tensor& t, const char* name, c10::SymIntArrayRef expected,
                 const char* layout) {
  TORCH_CHECK_VALUE(
      t.sym_sizes() == expected, kOp, name, " must have shape ", layout, " = ", expected,
      ", but got ", t.sym_sizes());
}

// The kernels take the two floats as float32 (the vendor C API and GE attrs are float): a double
// beyond float32's range would become inf there, so it is rejected like inf and NaN.
void check_float32_attr(double v, const char* name) {
  if (std::isfinite(v) && std::fabs(v) <= std::numeric_limits<float>::max()) {
    return;
  }
  char given[32] = {};
  std::to_chars(given, given + sizeof(given) - 1, v);  // shortest form that reads back as v
  TORCH_CHECK_VALUE(false, kOp, name, " must be finite and within float32's range (|", name,
                    "| <= 3.4028234663852886e+38), but got ", given);
}

} // namespace

GdnDims check_fused_gdn_decode_inputs(const GdnArgs& args) {
  const auto& [mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale,
               softplus_threshold] = args;
  const std::pair<const at::Tensor*, const char*> all[] = {
      {&mixed_qkv, "mixed_qkv"}, {&a, "a"}, {&b, "b"}, {&a_log, "a_log"},
      {&dt_bias, "dt_bias"}, {&state_ref, "state_ref"},
      {&ssm_state_indices, "ssm_state_indices"}};
  for (const auto& [t, name] : all) {
    check_dense(*t, name);
  }

  // Devices: everything on mixed_qkv's device.
  const auto device = mixed_qkv.device();
  for (const auto& [t, name] : all) {
    TORCH_CHECK_VALUE(t->device() == device, kOp, "all tensors must be on one device: expected ",
                      name, " on ", device, " (the device of mixed_qkv), but got ", t->device());
  }

  check_rank(mixed_qkv, "mixed_qkv", 2, "(B, 2*H*K + Hv*V)");
  check_rank(a, "a", 2, "(B, Hv)");
  check_rank(b, "b", 2, "(B, Hv)");
  check_rank(a_log, "a_log", 1, "(Hv,)");
  check_rank(dt_bias, "dt_bias", 1, "(Hv,)");
  check_rank(state_ref, "state_ref", 4, "(BlockNum, Hv, V, K)");
  check_rank(ssm_state_indices, "ssm_state_indices", 1, "(B,)");

  const auto dtype = mixed_qkv.scalar_type();
  TORCH_CHECK_TYPE(
      dtype == at::kBFloat16 || dtype == at::kHalf, kOp,
      "mixed_qkv must have dtype torch.bfloat16 or torch.float16, but got ", dtype_name(dtype));
  check_dtype(a, "a", dtype, " (the dtype of mixed_qkv)");
  check_dtype(b, "b", dtype, " (the dtype of mixed_qkv)");
  check_dtype(dt_bias, "dt_bias", dtype, " (the dtype of mixed_qkv)");
  check_dtype(a_log, "a_log", at::kFloat, "");
  check_dtype(ssm_state_indices, "ssm_state_indices", at::kInt, "");
  const auto state_dtype = state_ref.scalar_type();
  TORCH_CHECK_TYPE(
      state_dtype == at::kFloat || state_dtype == dtype, kOp,
      "state_ref must have dtype torch.float32 or ", dtype_name(dtype),
      " (the dtype of mixed_qkv), but got ", dtype_name(state_dtype));

  check_not_empty(mixed_qkv, "mixed_qkv");
  check_not_empty(a, "a");
  check_not_empty(b, "b");
  check_not_empty(a_log, "a_log");
  check_not_empty(dt_bias, "dt_bias");
  check_not_empty(state_ref, "state_ref");
  check_not_empty(ssm_state_indices, "ssm_state_indices");

  GdnDims d;
  d.batch = mixed_qkv.sym_size(0);
  const c10::SymInt width = mixed_qkv.sym_size(1);
  d.block_num = state_ref.sym_size(0);
  d.num_v_heads = state_ref.sym_size(1);
  d.head_v = state_ref.sym_size(2);
  d.head_k = state_ref.sym_size(3);

  check_uint32(d.batch, "B (mixed_qkv.size(0))");
  check_uint32(width, "mixed_qkv.size(1)");
  check_uint32(d.block_num, "BlockNum (state_ref.size(0))");
  check_uint32(d.num_v_heads, "Hv (state_ref.size(1))");
  check_uint32(d.head_v, "V (state_ref.size(2))");
  check_uint32(d.head_k, "K (state_ref.size(3))");
  check_uint32(d.batch * d.num_v_heads, "B*Hv");

  const c10::SymInt& K = d.head_k;
  TORCH_CHECK_VALUE(K >= kMinK && K <= kMaxK, kOp, "K (state_ref.size(3)) must be in [", kMinK,
                    ", ", kMaxK, "], but got ", K);
  if (state_dtype == at::kFloat) {
    const c10::SymInt pad_bytes = ((K + (kKAlign - 1)) / kKAlign * kKAlign - K) * 4;
    TORCH_CHECK_VALUE(
        pad_bytes <= kMaxFp32RowPadBytes, kOp, "K = ", K,
        " is not supported with a float32 state_ref: rows are padded to a multiple of ", kKAlign,
        " elements and at most ", kMaxFp32RowPadBytes, " bytes of padding are allowed, but K = ",
        K, " needs ", pad_bytes, " bytes (use K % 16 == 0 or K % 16 >= 8, or a ", dtype_name(dtype),
        " state)");
  }

  const c10::SymInt hv_v = d.num_v_heads * d.head_v;
  TORCH_CHECK_VALUE(hv_v < width, kOp, "mixed_qkv.size(1) must be greater than Hv*V = ", hv_v,
                    " (it holds q and k of H heads before v), but got ", width);
  TORCH_CHECK_VALUE(
      (width - hv_v) % (2 * K) == 0, kOp, "mixed_qkv.size(1) - Hv*V = ", width - hv_v,
      " must be a multiple of 2*K = ", 2 * K, " (q and k of H heads), but got mixed_qkv.size(1) = ",
      width, " with Hv = ", d.num_v_heads, ", V = ", d.head_v, ", K = ", K);
  d.num_heads = (width - hv_v) / (2 * K);
  TORCH_CHECK_VALUE(
      d.num_v_heads % d.num_heads == 0, kOp, "Hv (state_ref.size(1)) must be a multiple of H = ",
      d.num_heads, " (derived from mixed_qkv.size(1)), but got Hv = ", d.num_v_heads);

  check_shape(a, "a", {d.batch, d.num_v_heads}, "(B, Hv)");
  check_shape(b, "b", {d.batch, d.num_v_heads}, "(B, Hv)");
  check_shape(a_log, "a_log", {d.num_v_heads}, "(Hv,)");
  check_shape(dt_bias, "dt_bias", {d.num_v_heads}, "(Hv,)");
  check_shape(ssm_state_indices, "ssm_state_indices", {d.batch}, "(B,)");

  for (const auto& [t, name] : all) {
    check_aligned(*t, name);
  }
  // A negative view's memory holds -state: the kernels would update the stored values as if they
  // were the state. (PyTorch's fallback for such views runs the op on a copy, then fails.)
  TORCH_CHECK_VALUE(!state_ref.is_neg(), kOp, "state_ref must not be a negative view "
                    "(torch._neg_view): it is updated in place, but got a tensor with the "
                    "negative bit set; pass the tensor it views");
  // Engines keep the state inside a paged pool: each slot [Hv, V, K] is contiguous, but slots sit
  // a block's page apart. Any slot stride that keeps slots from overlapping is accepted.
  const c10::SymInt slot_numel = d.num_v_heads * d.head_v * K;
  const c10::SymInt inner[3] = {d.head_v * K, K, 1};
  bool slot_contiguous = true;
  for (int64_t dim = 1; dim < 4; ++dim) {
    // A size-1 dimension is never stepped over, so its stride does not matter (as in
    // is_contiguous()).
    if (state_ref.sym_size(dim) != 1 && state_ref.sym_stride(dim) != inner[dim - 1]) {
      slot_contiguous = false;
    }
  }
  TORCH_CHECK_VALUE(slot_contiguous, kOp,
                    "state_ref must have contiguous slots (it is updated in place): strides of "
                    "dims 1-3 must be (V*K, K, 1) = (", inner[0], ", ", inner[1], ", 1), but got "
                    "strides ", state_ref.sym_strides(), " for shape ", state_ref.sym_sizes());
  TORCH_CHECK_VALUE(d.block_num == 1 || state_ref.sym_stride(0) >= slot_numel, kOp,
                    "state_ref.stride(0) (the slot stride) must be at least Hv*V*K = ", slot_numel,
                    " so that slots do not overlap, but got ", state_ref.sym_stride(0),
                    " for shape ", state_ref.sym_sizes());
  check_float32_attr(scale, "scale");
  check_float32_attr(softplus_threshold, "softplus_threshold");
  return d;
}

void check_fused_gdn_decode_out(const at::Tensor& out, const GdnDims& d, const GdnArgs& args) {
  const at::Tensor& mixed_qkv = args.mixed_qkv;
  check_dense(out, "out");
  TORCH_CHECK_VALUE(out.device() == mixed_qkv.device(), kOp, "out must be on ",
                    mixed_qkv.device(), " (the device of mixed_qkv), but got ", out.device());
  check_dtype(out, "out", mixed_qkv.scalar_type(), " (the dtype of mixed_qkv)");
  check_rank(out, "out", 4, "(B, 1, Hv, V)");
  check_shape(out, "out", {d.batch, 1, d.num_v_heads, d.head_v}, "(B, 1, Hv, V)");
  // The kernels write out as one dense block.
  TORCH_CHECK_VALUE(out.is_contiguous(), kOp, "out must be contiguous, but got strides ",
                    out.sym_strides(), " for shape ", out.sym_sizes());
  check_aligned(out, "out");
  TORCH_CHECK_VALUE(!out.is_neg(), kOp, "out must not be a negative view (torch._neg_view), "
                    "but got a tensor with the negative bit set");
  // Written while the inputs are read (the CPU kernel writes one task's rows while later tasks
  // still read theirs): sharing memory with any of them gives results that differ by backend.
  // Byte spans, not at::get_overlap_status, which cannot tell for a slot-strided pool.
  const std::optional<ByteSpan> out_span = byte_span(out);
  const std::pair<const at::Tensor*, const char*> inputs[] = {
      {&args.mixed_qkv, "mixed_qkv"}, {&args.a, "a"}, {&args.b, "b"}, {&args.a_log, "a_log"},
      {&args.dt_bias, "dt_bias"}, {&args.state_ref, "state_ref"},
      {&args.ssm_state_indices, "ssm_state_indices"}};
  for (const auto& [t, name] : inputs) {
    const std::optional<ByteSpan> span = byte_span(*t);
    if (!out_span || !span) {
      continue;  // symbolic sizes: checked when the call runs on data
    }
    // Meta tensors and FakeTensor have no addresses, but views of one storage keep their offsets
    // into it.
    const bool by_address = has_data(out) && has_data(*t);
    if (!by_address && !(out.has_storage() && t->has_storage() &&
                         out.storage().is_alias_of(t->storage()))) {
      continue;
    }
    TORCH_CHECK_VALUE(!out_span->overlaps(*span), kOp, "out must not share memory with ", name,
                      ", but ", by_address ? "out spans the bytes " :
                      "both are views of one storage, out spanning its bytes ",
                      out_span->text(by_address), " and ", name, " ", span->text(by_address));
  }
}

SlotSnapshot::SlotSnapshot(const at::Tensor& indices) {
  // Callers pass checked indices (the op's check, or check_slot_indices's below).
  TORCH_INTERNAL_ASSERT(
      indices.device().is_cpu() && indices.scalar_type() == at::kInt && indices.dim() == 1,
      "SlotSnapshot: expected 1-D CPU int32 indices, got ", indices.sizes(), " ",
      indices.scalar_type(), " on ", indices.device());
  size_ = indices.size(0);
  if (size_ <= static_cast<int64_t>(std::size(inline_))) {
    data_ = inline_;
  } else {
    heap_.reset(new int32_t[size_]);  // uninitialised: filled below
    data_ = heap_.get();
  }
  const int64_t stride = indices.stride(0);
  const auto* base = static_cast<const char*>(indices.const_data_ptr());
  for (int64_t i = 0; i < size_; ++i) {
    // memcpy: no alignment assumed (the helper op takes any CPU int32 tensor).
    std::memcpy(&data_[i], base + i * stride * int64_t{sizeof(int32_t)}, sizeof(int32_t));
  }
}

void check_slot_indices(const int32_t* slots, int64_t n, int64_t block_num) {
  int64_t num_valid = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t s = slots[i];
    if (s <= 0) {
      continue;  // invalid row (slot 0 is the null slot)
    }
    TORCH_CHECK_VALUE(s < block_num, kOp, "ssm_state_indices[", i, "] = ", s,
                      " is out of range: valid slots must be < BlockNum = ", block_num,
                      " (indices <= 0 mark invalid rows)");
    ++num_valid;
  }
  if (num_valid < 2) {
    return;
  }
  // The duplicate search sorts the valid slots: memory follows the valid rows, not B (a batch of
  // 2^31 - 1 invalid rows allocates nothing), and none up to 64 of them.
  int32_t inline_used[64];
  std::unique_ptr<int32_t[]> heap_used;
  int32_t* used = inline_used;
  if (num_valid > static_cast<int64_t>(std::size(inline_used))) {
    heap_used.reset(new int32_t[num_valid]);
    used = heap_used.get();
  }
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] > 0) {
      used[m++] = slots[i];
    }
  }
  std::sort(used, used + m);
  const int32_t* repeated = std::adjacent_find(used, used + m);
  if (repeated == used + m) {
    return;
  }
  int64_t rows[2] = {-1, -1};
  for (int64_t i = 0, found = 0; i < n && found < 2; ++i) {
    if (slots[i] == *repeated) {
      rows[found++] = i;
    }
  }
  TORCH_CHECK_VALUE(false, kOp, "ssm_state_indices must not repeat a positive slot, but slot ",
                    *repeated, " is used by rows ", rows[0], " and ", rows[1]);
}

void check_slot_indices(const at::Tensor& indices, int64_t block_num) {
  constexpr const char* kFn = "check_slot_indices: ";
  TORCH_CHECK_TYPE(indices.scalar_type() == at::kInt, kFn,
                   "indices must have dtype torch.int32, but got ",
                   dtype_name(indices.scalar_type()));
  TORCH_CHECK_VALUE(indices.device().is_cpu(), kFn, "indices must be on cpu, but got ",
                    indices.device());
  TORCH_CHECK_VALUE(indices.dim() == 1, kFn, "indices must be 1-D, but got shape ",
                    indices.sizes());
  const SlotSnapshot slots(indices);
  check_slot_indices(slots.data(), slots.size(), block_num);
}

} // namespace custom_ops
