// Meta kernel: shape inference for FakeTensor / torch.compile. Runs the same check as every
// backend (on symbolic sizes where they are symbolic) and returns out as the real kernels do.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "fused_gdn_decode.h"

namespace custom_ops::meta {

// Both overloads (GdnKernel): `out` is null for the default one.
at::Tensor run_meta(const GdnArgs& args, at::Tensor* out) {
  // Names this backend under torch.profiler (a child of the dispatcher's op event).
  RECORD_FUNCTION("custom_ops::npu_fused_gdn_decode_meta", c10::ArrayRef<const c10::IValue>{});
  const GdnDims d = check_fused_gdn_decode_inputs(args);
  if (out != nullptr) {
    check_fused_gdn_decode_out(*out, d, args);
    return *out;
  }
  return at::empty_symint({d.batch, 1, d.num_v_heads, d.head_v}, args.mixed_qkv.options());
}

} // namespace custom_ops::meta

TORCH_LIBRARY_IMPL(custom, Meta, m) {
  custom_ops::impl_fused_gdn_decode<&custom_ops::meta::run_meta>(m);
}
