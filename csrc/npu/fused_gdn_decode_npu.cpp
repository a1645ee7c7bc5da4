// NPU (PrivateUse1) implementation of custom::npu_fused_gdn_decode: the shared input check, then
// CANN's two-phase aclnnFusedGdnDecode, bound at run time (vendor_loader.cpp).
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "fused_gdn_decode.h"
#include "npu/acl_api.h"
#include "npu/vendor_loader.h"

namespace custom_ops::npu {
namespace {

aclDataType acl_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ACL_FLOAT;
    case at::kHalf:
      return ACL_FLOAT16;
    case at::kBFloat16:
      return ACL_BF16;
    case at::kInt:
      return ACL_INT32;
    case at::kLong:
      return ACL_INT64;
    default:
      TORCH_INTERNAL_ASSERT(false, "dtype passed the check but has no ACL equivalent: ", t);
  }
}

const char* status_meaning(aclnnStatus s) {
  switch (s) {
    case ACLNN_ERR_PARAM_NULLPTR:
      return "ACLNN_ERR_PARAM_NULLPTR: a required argument is a null pointer";
    case ACLNN_ERR_PARAM_INVALID:
      return "ACLNN_ERR_PARAM_INVALID: an argument is invalid (shape, dtype or attribute)";
    case ACLNN_ERR_INNER_NULLPTR:
      return "ACLNN_ERR_INNER_NULLPTR: an inner step failed; for FusedGdnDecode usually the tiling, "
             "when the K/V tiles do not fit the on-chip buffer (docs/npu.md, K range)";
    default:
      return "see the CANN aclnn return-code list";
  }
}

void check_status(const VendorApi& api, aclnnStatus status, const char* call) {
  if (status == ACLNN_SUCCESS) {
    return;
  }
  const std::string vendor = recent_vendor_error(api);
  TORCH_CHECK(false, kOp, call, " failed with status ", status, " (", status_meaning(status),
              "), from ", api.op_library, ". Vendor message: ",
              vendor.empty() ? "(none available)" : vendor);
}

// The aclTensors of one call; each is destroyed when this goes out of scope, on every path, after
// the launch (the executor may refer to them until then).
class AclTensors {
 public:
  explicit AclTensors(const VendorApi& api) : api_(api) {}
  AclTensors(const AclTensors&) = delete;
  AclTensors& operator=(const AclTensors&) = delete;
  ~AclTensors() {
    for (auto it = tensors_.rbegin(); it != tensors_.rend(); ++it) {
      api_.destroy_tensor(*it);  // a destructor cannot report; the status is not actionable
    }
  }

  // Describes `t` as the vendor expects: its view (sizes, strides and offset in elements) over
  // its whole storage, given by base pointer and element count, format ND (op-plugin uses NCHW
  // for 4-D tensors, but FusedGdnDecode reshapes state to its ND view shape anyway).
  aclTensor* add(const at::Tensor& t, const char* name) {
    const int64_t item = static_cast<int64_t>(t.element_size());
    const int64_t storage_elems = static_cast<int64_t>(t.storage().nbytes()) / item;
    const auto sizes = t.sizes();
    const auto strides = t.strides();
    aclTensor* h = api_.create_tensor(
        sizes.data(), sizes.size(), acl_dtype(t.scalar_type()), strides.data(),
        t.storage_offset(), ACL_FORMAT_ND, &storage_elems, 1,
        const_cast<void*>(t.storage().data()));
    TORCH_CHECK(h != nullptr, kOp, "aclCreateTensor returned null for ", name, " (shape ",
                t.sizes(), ", strides ", t.strides(), ", dtype ", t.scalar_type(), ") from ",
                api_.meta_library);
    tensors_.push_back(h);
    return h;
  }

 private:
  const VendorApi& api_;
  std::vector<aclTensor*> tensors_;
};

// An executor from phase one that phase two has not consumed yet. If we fail in between (the
// workspace allocation), release it the documented way: make it repeatable, then destroy it.
class PendingExecutor {
 public:
  explicit PendingExecutor(const VendorApi& api) : api_(api) {}
  PendingExecutor(const PendingExecutor&) = delete;
  PendingExecutor& operator=(const PendingExecutor&) = delete;
  ~PendingExecutor() {
    if (executor != nullptr && api_.set_executor_repeatable && api_.destroy_executor) {
      api_.set_executor_repeatable(executor);
      api_.destroy_executor(executor);
    }
  }
  aclOpExecutor* executor = nullptr;

 private:
  const VendorApi& api_;
};

const char* format_name(int64_t f) {
  switch (f) {
    case ACL_FORMAT_NCHW:
      return "NCHW";
    case ACL_FORMAT_NHWC:
      return "NHWC";
    case ACL_FORMAT_ND:
      return "ND";
    case ACL_FORMAT_NC1HWC0:
      return "NC1HWC0";
    case ACL_FORMAT_FRACTAL_Z:
      return "FRACTAL_Z";
    case ACL_FORMAT_NDHWC:
      return "NDHWC";
    case ACL_FORMAT_FRACTAL_NZ:
      return "FRACTAL_NZ";
    case ACL_FORMAT_NCDHW:
      return "NCDHW";
    case ACL_FORMAT_NDC1HWC0:
      return "NDC1HWC0";
    default:
      return "a private format";
  }
}

// The kernel reads each tensor as plain row-major storage of its view (the binding describes it
// as ND). torch_npu may keep an NPU tensor in another storage format (npu_format_cast, e.g.
// FRACTAL_NZ): its bytes are then laid out differently and the results would be silently wrong.
// ND, NCHW and NCDHW are the formats whose storage is the tensor's own row-major layout.
void check_storage_format(const at::Tensor& t, const char* name) {
  const std::optional<int64_t> f = torch_npu_storage_format(t);
  if (!f) {
    return;  // not torch_npu: no private formats
  }
  TORCH_CHECK_VALUE(
      *f == ACL_FORMAT_ND || *f == ACL_FORMAT_NCHW || *f == ACL_FORMAT_NCDHW, kOp, name,
      " must be stored in a plain NPU format (ND, NCHW or NCDHW: row-major storage of its sizes), "
      "but torch_npu stores it as ", format_name(*f), " (aclFormat ", *f, "); convert it with "
      "torch_npu.npu_format_cast(", name, ", 2) (ND) before the call");
}

} // namespace

// Both overloads (GdnKernel): `out_arg` is null for the default one (allocated here after the
// checks).
at::Tensor run_npu(const GdnArgs& args, at::Tensor* out_arg) {
  const auto& [mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale,
               softplus_threshold] = args;
  // Names this backend under torch.profiler (a child of the dispatcher's op event).
  RECORD_FUNCTION("custom_ops::npu_fused_gdn_decode_npu", c10::ArrayRef<const c10::IValue>{});
  const GdnDims d = check_fused_gdn_decode_inputs(args);
  const std::pair<const at::Tensor*, const char*> tensors_in[] = {
      {&mixed_qkv, "mixed_qkv"}, {&a, "a"}, {&b, "b"}, {&a_log, "a_log"}, {&dt_bias, "dt_bias"},
      {&state_ref, "state_ref"}, {&ssm_state_indices, "ssm_state_indices"}};
  for (const auto& [t, name] : tensors_in) {
    check_storage_format(*t, name);
  }
  // aclnnFusedGdnDecode addresses slot s at s * Hv*V*K: a slot-strided pool (vLLM's) would be
  // read and written at the wrong places. Refused; an engine on Ascend allocates a contiguous
  // pool (vllm-ascend does), docs/vllm.md.
  TORCH_CHECK_VALUE(state_ref.is_contiguous(), kOp,
                    "on NPU state_ref must be contiguous (the vendor kernel takes no slot "
                    "stride): state_ref.stride(0) must be Hv*V*K = ",
                    d.num_v_heads * d.head_v * d.head_k, ", but got strides ",
                    state_ref.strides(), " for shape ", state_ref.sizes());
  if (out_arg != nullptr) {
    check_fused_gdn_decode_out(*out_arg, d, args);
    check_storage_format(*out_arg, "out");
  }
  const auto api_ref = vendor_api();  // throws, naming what was searched, before any allocation
  const VendorApi& api = *api_ref;
  const c10::DeviceGuard device_guard(mixed_qkv.device());
  const aclrtStream stream = current_acl_stream(mixed_qkv.device());
  // The vendor kernel does not check slots (docs/spec.md, "Validation"); this debug switch does, at the cost of a
  // device-to-host copy, which a stream being captured into an ACL graph cannot make.
  if (env_flag("CUSTOM_OPS_NPU_CHECK_INDICES")) {
    TORCH_CHECK(!stream_is_capturing(api, stream), kOp, "CUSTOM_OPS_NPU_CHECK_INDICES=1 copies "
                "ssm_state_indices to the host, which is not allowed while the stream is being "
                "captured into an ACL graph (torch.compile mode=\"reduce-overhead\", NPUGraph); "
                "unset it for captured runs");
    check_slot_indices(ssm_state_indices.cpu(), d.block_num.expect_int());
  }

  at::Tensor out = out_arg != nullptr ? *out_arg : at::empty(
      {d.batch.expect_int(), 1, d.num_v_heads.expect_int(), d.head_v.expect_int()},
      mixed_qkv.options());

  AclTensors tensors(api);
  aclTensor* t_mixed = tensors.add(mixed_qkv, "mixed_qkv");
  aclTensor* t_a = tensors.add(a, "a");
  aclTensor* t_b = tensors.add(b, "b");
  aclTensor* t_a_log = tensors.add(a_log, "a_log");
  aclTensor* t_dt_bias = tensors.add(dt_bias, "dt_bias");
  aclTensor* t_state = tensors.add(state_ref, "state_ref");
  aclTensor* t_idx = tensors.add(ssm_state_indices, "ssm_state_indices");
  aclTensor* t_out = tensors.add(out, "out");

  uint64_t workspace_size = 0;
  PendingExecutor pending(api);
  check_status(api,
               api.get_workspace_size(t_mixed, t_a, t_b, t_a_log, t_dt_bias, t_state, t_idx,
                                      static_cast<float>(scale),
                                      static_cast<float>(softplus_threshold), t_out,
                                      &workspace_size, &pending.executor),
               "aclnnFusedGdnDecodeGetWorkspaceSize");
  TORCH_CHECK(pending.executor != nullptr, kOp,
              "aclnnFusedGdnDecodeGetWorkspaceSize succeeded but returned no executor (",
              api.op_library, ")");

  // From torch's allocator on this device. The allocator is stream-ordered (as CUDA's caching
  // allocator): once this tensor dies its block is reused only by work queued later on this same
  // stream, so it stays valid for our kernel without a sync.
  at::Tensor workspace;
  void* workspace_ptr = nullptr;
  if (workspace_size > 0) {
    workspace = at::empty({static_cast<int64_t>(workspace_size)},
                          mixed_qkv.options().dtype(at::kByte));
    workspace_ptr = workspace.data_ptr();
  }

  // Phase two consumes the executor whatever its status.
  aclOpExecutor* executor = pending.executor;
  pending.executor = nullptr;
  check_status(api, api.launch(workspace_ptr, workspace_size, executor, stream),
               "aclnnFusedGdnDecode");
  return out;
}

} // namespace custom_ops::npu

TORCH_LIBRARY_IMPL(custom, PrivateUse1, m) {
  custom_ops::impl_fused_gdn_decode<&custom_ops::npu::run_npu>(m);
}

// Diagnostics of the NPU binding, kept out of the `custom` namespace (which torch_npu users may
// mirror onto torch_npu): vendor_info() says which libraries and stream source are in use (or why
// none were found); reset_vendor() makes the next call search again (tests, changed environment).
TORCH_LIBRARY(custom_ops_npu, m) {
  m.def("vendor_info() -> str", &custom_ops::npu::describe_vendor);
  m.def("reset_vendor() -> ()", &custom_ops::npu::reset_vendor_api);
  m.def("torch_npu_symbols() -> str[]", &custom_ops::npu::torch_npu_symbols);
}
