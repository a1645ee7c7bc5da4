// Shared declarations of custom::npu_fused_gdn_decode: the schema and its C++ signature, the
// adapters that turn one backend function into the kernels of both overloads, the input check
// every backend runs, and the sizes it derives.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/SymInt.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>

namespace custom_ops {

// The error message prefix of every check of the op.
inline constexpr const char* kOp = "npu_fused_gdn_decode: ";

// The drop-in schema of the vendor's torch_ops_extension (docs/spec.md, "Schema"); declared once
// in ops.cpp.
inline constexpr const char* kFusedGdnDecodeSchema =
    "npu_fused_gdn_decode(Tensor mixed_qkv, Tensor a, Tensor b, Tensor a_log, Tensor dt_bias, "
    "Tensor(a!) state_ref, Tensor ssm_state_indices, float scale, *, "
    "float softplus_threshold=20.0) -> Tensor";

// The out variant: the same op writing into a caller's buffer (an engine's own output tensor).
inline constexpr const char* kFusedGdnDecodeOutSchema =
    "npu_fused_gdn_decode.out(Tensor mixed_qkv, Tensor a, Tensor b, Tensor a_log, "
    "Tensor dt_bias, Tensor(a!) state_ref, Tensor ssm_state_indices, float scale, *, "
    "float softplus_threshold=20.0, Tensor(b!) out) -> Tensor(b!)";

// The op's C++ signature, written once (as ATen's forward_fn in native/layer_norm.h): the
// dispatcher calls a kernel of the default overload as FusedGdnDecodeFn, one of the out overload
// with `at::Tensor& out` appended and out returned (FusedGdnDecodeOutFn). A change of the schema
// changes this alias and the matching GdnArgs below; every kernel is made from them by
// FusedGdnDecodeKernels.
using FusedGdnDecodeFn = at::Tensor(const at::Tensor& mixed_qkv, const at::Tensor& a,
                                    const at::Tensor& b, const at::Tensor& a_log,
                                    const at::Tensor& dt_bias, at::Tensor& state_ref,
                                    const at::Tensor& ssm_state_indices, double scale,
                                    double softplus_threshold);

// The arguments of one call, in schema order, as a backend function takes them (references to
// the caller's tensors).
struct GdnArgs {
  const at::Tensor& mixed_qkv;
  const at::Tensor& a;
  const at::Tensor& b;
  const at::Tensor& a_log;
  const at::Tensor& dt_bias;
  at::Tensor& state_ref;
  const at::Tensor& ssm_state_indices;
  double scale;
  double softplus_threshold;

  // f(arguments in schema order): to call or redispatch the op with them.
  template <class F>
  decltype(auto) apply(F&& f) const {
    return f(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale,
             softplus_threshold);
  }
};

// A backend function serves both overloads: out is null for the default one (the function
// allocates the result) and the caller's buffer for the out overload; it returns the result.
using GdnKernel = at::Tensor (*)(const GdnArgs& args, at::Tensor* out);
// The same for kernels that redispatch (the keys above the backends): the dispatch key set first.
using GdnKeysetKernel = at::Tensor (*)(c10::DispatchKeySet ks, const GdnArgs& args,
                                       at::Tensor* out);

// The dispatcher's kernels made from one backend function, typed by FusedGdnDecodeFn.
template <class Fn>
struct FusedGdnDecodeKernels;

template <class... Arg>
struct FusedGdnDecodeKernels<at::Tensor(Arg...)> {
  // The out overload's signature.
  using OutFn = at::Tensor&(Arg..., at::Tensor& out);

  template <GdnKernel run>
  static at::Tensor functional(Arg... arg) {
    return run(GdnArgs{arg...}, nullptr);
  }
  template <GdnKernel run>
  static at::Tensor& out(Arg... arg, at::Tensor& out) {
    run(GdnArgs{arg...}, &out);
    return out;
  }
  template <GdnKeysetKernel run>
  static at::Tensor functional_ks(c10::DispatchKeySet ks, Arg... arg) {
    return run(ks, GdnArgs{arg...}, nullptr);
  }
  template <GdnKeysetKernel run>
  static at::Tensor& out_ks(c10::DispatchKeySet ks, Arg... arg, at::Tensor& out) {
    run(ks, GdnArgs{arg...}, &out);
    return out;
  }
};
using Kernels = FusedGdnDecodeKernels<FusedGdnDecodeFn>;
using FusedGdnDecodeOutFn = Kernels::OutFn;

// Registers `run` for both overloads at the dispatch key of the enclosing TORCH_LIBRARY_IMPL.
template <GdnKernel run>
void impl_fused_gdn_decode(torch::Library& m) {
  m.impl("npu_fused_gdn_decode", &Kernels::functional<run>);
  m.impl("npu_fused_gdn_decode.out", &Kernels::out<run>);
}
template <GdnKeysetKernel run>
void impl_fused_gdn_decode_ks(torch::Library& m) {
  m.impl("npu_fused_gdn_decode", &Kernels::functional_ks<run>);
  m.impl("npu_fused_gdn_decode.out", &Kernels::out_ks<run>);
}

// Whether the environment switch `name` is on: "1", "true", "on" or "yes" (any case), as the
// Python package reads its switches (custom_ops/_env.py).
bool env_flag(const char* name);

// Sizes derived by the check. SymInt so that the Meta kernel serves symbolic shapes too; on
// real tensors they are plain integers.
struct GdnDims {
  c10::SymInt batch;       // B
  c10::SymInt block_num;   // BlockNum (state slots)
  c10::SymInt num_heads;   // H, key heads
  c10::SymInt num_v_heads; // Hv, value heads
  c10::SymInt head_k;      // K
  c10::SymInt head_v;      // V
};

// Every backend (CPU, NPU, Meta, fallback) calls this first. Throws TypeError for dtype
// problems and ValueError for shape/value/device problems; touches no data.
GdnDims check_fused_gdn_decode_inputs(const GdnArgs& args);

// The out variant's extra check: out is [B, 1, Hv, V], mixed_qkv's dtype and device, contiguous,
// sharing no memory with any input. Run after the input check.
void check_fused_gdn_decode_out(const at::Tensor& out, const GdnDims& d, const GdnArgs& args);

// The slot values, read once into host memory (4 bytes a row; no allocation up to 64 rows). The
// CPU op checks and runs on this copy, so nothing that writes ssm_state_indices during the call
// (another thread, or the call's own state update when the indices live inside state_ref) can
// reach the kernel unchecked.
class SlotSnapshot {
 public:
  explicit SlotSnapshot(const at::Tensor& ssm_state_indices_cpu);
  SlotSnapshot(const SlotSnapshot&) = delete;
  SlotSnapshot& operator=(const SlotSnapshot&) = delete;
  const int32_t* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  int32_t inline_[64];
  std::unique_ptr<int32_t[]> heap_;
  int32_t* data_;
  int64_t size_;
};

// Host-side slot check: every index < BlockNum, positive ones distinct. The CPU path always runs
// it; device backends only behind their debug switch.
void check_slot_indices(const int32_t* slots, int64_t n, int64_t block_num);
void check_slot_indices(const at::Tensor& ssm_state_indices_cpu, int64_t block_num);

} // namespace custom_ops
