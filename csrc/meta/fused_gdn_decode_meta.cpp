// Meta kernel: shape inference for FakeTensor / torch.compile. Runs the same check as every
// backend (on symbolic sizes where they are symbolic) and returns out as the real kernels do.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "fused_gdn_decode.h"

namespace custom_ops::meta {

at::Tensor npu_fused_gdn_decode_meta(
    const at::Tensor& mixed_qkv,
    const at::Tensor& a,
    const at::Tensor& b,
    const at::Tensor& a_log,
    const at::Tensor& dt_bias,
    at::Tensor& state_ref,
    const at::Tensor& ssm_state_indices,
    double scale,
    double softplus_threshold) {
  // Names this backend under torch.profiler (a child of the dispatcher's op event).
  RECORD_FUNCTION("custom_ops::npu_fused_gdn_decode_meta", c10::ArrayRef<const c10::IValue>{});
  const GdnDims d = check_fused_gdn_decode_inputs(
      mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale, softplus_threshold);
  return at::empty_symint({d.batch, 1, d.num_v_heads, d.head_v}, mixed_qkv.options());
}

at::Tensor& npu_fused_gdn_decode_out_meta(
    const at::Tensor& mixed_qkv,
    const at::Tensor& a,
    const at::Tensor& b,
    const at::Tensor& a_log,
    const at::Tensor& dt_bias,
    at::Tensor& state_ref,
    const at::Tensor& ssm_state_indices,
    double scale,
    double softplus_threshold,
    at::Tensor& out) {
  RECORD_FUNCTION("custom_ops::npu_fused_gdn_decode_meta", c10::ArrayRef<const c10::IValue>{});
  const GdnDims d = check_fused_gdn_decode_inputs(
      mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale, softplus_threshold);
  check_fused_gdn_decode_out(out, d, mixed_qkv, state_ref);
  return out;
}

} // namespace custom_ops::meta

TORCH_LIBRARY_IMPL(custom, Meta, m) {
  m.impl("npu_fused_gdn_decode", &custom_ops::meta::npu_fused_gdn_decode_meta);
  m.impl("npu_fused_gdn_decode.out", &custom_ops::meta::npu_fused_gdn_decode_out_meta);
}
