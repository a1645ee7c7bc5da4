// custom::npu_fused_gdn_decode at the device-independent keys above the backends.
//
// Autograd + ADInplaceOrView: the op writes state_ref in place and has no derivative, so it
// behaves like a native in-place op without a derivative formula: it bumps state_ref's version
// counter (a graph that saved state_ref before the call then fails in backward instead of using
// the new values), refuses to update a leaf that requires grad or an inference tensor outside
// inference_mode (native messages, raised before anything is written), and gives out and
// state_ref a backward node that raises when an input requires grad. Under inference_mode
// neither kernel runs; under no_grad they cost one redispatch each and a version bump.
//
// Negative + Conjugate: PyTorch's fallback for these views materialises them, runs the op on the
// copies and then expects it to return the mutated tensor, which this op does not (an internal
// assert). Here the shared check runs first (it rejects such a state_ref), then the read-only
// inputs are materialised as the fallback would.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "fused_gdn_decode.h"

namespace custom_ops {
namespace {

using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&,
                             double, double);

const c10::TypedOperatorHandle<Signature>& op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("custom::npu_fused_gdn_decode", "")
                                 .typed<Signature>();
  return handle;
}

namespace ag = torch::autograd;

// Older torch releases hold autograd nodes by std::shared_ptr, newer ones (2.13 here) by
// c10::intrusive_ptr; the extension is built against whichever is installed (Ascend hosts pin
// older ones).
using NodePtr = decltype(ag::Edge::function);

template <typename Ptr, typename NodeT>
Ptr make_node(std::string message) {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<ag::Node>>) {
    // deleteNode, as torch's own kernels use: frees long chains of nodes without deep recursion.
    return Ptr(new NodeT(std::move(message)), [](NodeT* node) { deleteNode(node); });
  } else {
    return c10::make_intrusive<NodeT>(std::move(message));
  }
}

constexpr const char* kNoBackward =
    "npu_fused_gdn_decode is not differentiable: it is an inference-only decode step with no "
    "backward. Call it under torch.no_grad() or torch.inference_mode(), or pass inputs that do "
    "not require grad";

at::Tensor npu_fused_gdn_decode_autograd(
    c10::DispatchKeySet ks,
    const at::Tensor& mixed_qkv,
    const at::Tensor& a,
    const at::Tensor& b,
    const at::Tensor& a_log,
    const at::Tensor& dt_bias,
    at::Tensor& state_ref,
    const at::Tensor& ssm_state_indices,
    double scale,
    double softplus_threshold) {
  const at::Tensor* differentiable[] = {&mixed_qkv, &a, &b, &a_log, &dt_bias, &state_ref};
  for (const at::Tensor* t : differentiable) {
    TORCH_CHECK_NOT_IMPLEMENTED(!ag::isFwGradDefined(*t), kNoBackward, " (forward-mode AD)");
  }
  const bool requires_grad = ag::compute_requires_grad(mixed_qkv, a, b, a_log, dt_bias, state_ref);
  if (state_ref.defined()) {
    ag::check_inplace(state_ref, requires_grad);  // the native leaf / view-of-leaf errors
  }
  NodePtr grad_fn;
  if (requires_grad) {
    grad_fn = make_node<NodePtr, ag::Error>(kNoBackward);
    grad_fn->set_next_edges(ag::collect_next_edges(mixed_qkv, a, b, a_log, dt_bias, state_ref));
  }
  at::Tensor out;
  {
    at::AutoDispatchBelowAutograd guard;
    out = op().redispatch(ks & c10::after_autograd_keyset, mixed_qkv, a, b, a_log, dt_bias,
                          state_ref, ssm_state_indices, scale, softplus_threshold);
  }
  if (grad_fn) {
    ag::rebase_history(std::vector<at::Tensor>{state_ref}, grad_fn);
    ag::set_history(out, grad_fn);
  }
  return out;
}

at::Tensor npu_fused_gdn_decode_ad_inplace_or_view(
    c10::DispatchKeySet ks,
    const at::Tensor& mixed_qkv,
    const at::Tensor& a,
    const at::Tensor& b,
    const at::Tensor& a_log,
    const at::Tensor& dt_bias,
    at::Tensor& state_ref,
    const at::Tensor& ssm_state_indices,
    double scale,
    double softplus_threshold) {
  // Native in-place ops find an inference tensor outside inference_mode when they bump its
  // version after writing; bumping once before the call raises the same error with state_ref
  // still untouched.
  if (state_ref.defined() && state_ref.is_inference() && !c10::InferenceMode::is_enabled()) {
    torch::autograd::increment_version(state_ref);
  }
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = op().redispatch(ks & c10::after_ADInplaceOrView_keyset, mixed_qkv, a, b, a_log, dt_bias,
                          state_ref, ssm_state_indices, scale, softplus_threshold);
  }
  torch::autograd::increment_version(state_ref);
  return out;
}

at::Tensor npu_fused_gdn_decode_math_bits(
    c10::DispatchKeySet ks,
    const at::Tensor& mixed_qkv,
    const at::Tensor& a,
    const at::Tensor& b,
    const at::Tensor& a_log,
    const at::Tensor& dt_bias,
    at::Tensor& state_ref,
    const at::Tensor& ssm_state_indices,
    double scale,
    double softplus_threshold) {
  // Rejects a negative view as state_ref; conjugate bits exist only on complex tensors, which it
  // rejects by dtype.
  check_fused_gdn_decode_inputs(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices,
                                scale, softplus_threshold);
  const auto resolve = [](const at::Tensor& t) { return t.resolve_neg(); };
  return op().redispatch(
      ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Conjugate),
      resolve(mixed_qkv), resolve(a), resolve(b), resolve(a_log), resolve(dt_bias), state_ref,
      resolve(ssm_state_indices), scale, softplus_threshold);
}

using OutSignature = at::Tensor&(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, at::Tensor&,
                                 const at::Tensor&, double, double, at::Tensor&);

at::Tensor& npu_fused_gdn_decode_out_math_bits(
    c10::DispatchKeySet ks,
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
  // As above; the out check rejects a negative out before anything is written.
  const GdnDims d = check_fused_gdn_decode_inputs(
      mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale, softplus_threshold);
  check_fused_gdn_decode_out(out, d, mixed_qkv, state_ref);
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("custom::npu_fused_gdn_decode", "out")
                                 .typed<OutSignature>();
  const auto resolve = [](const at::Tensor& t) { return t.resolve_neg(); };
  return handle.redispatch(
      ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Conjugate),
      resolve(mixed_qkv), resolve(a), resolve(b), resolve(a_log), resolve(dt_bias), state_ref,
      resolve(ssm_state_indices), scale, softplus_threshold, out);
}

} // namespace
} // namespace custom_ops

// The out overload: torch's generic fallbacks, which read the schema's (a!)/(b!) annotations
// (in-place checks, version bumps of state_ref and out, a backward that raises).
TORCH_LIBRARY_IMPL(custom, Autograd, m) {
  m.impl("npu_fused_gdn_decode", &custom_ops::npu_fused_gdn_decode_autograd);
  m.impl("npu_fused_gdn_decode.out", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(custom, ADInplaceOrView, m) {
  m.impl("npu_fused_gdn_decode", &custom_ops::npu_fused_gdn_decode_ad_inplace_or_view);
  m.impl("npu_fused_gdn_decode.out",
         torch::autograd::autogradNotImplementedInplaceOrViewFallback());
}

TORCH_LIBRARY_IMPL(custom, Negative, m) {
  m.impl("npu_fused_gdn_decode", &custom_ops::npu_fused_gdn_decode_math_bits);
  m.impl("npu_fused_gdn_decode.out", &custom_ops::npu_fused_gdn_decode_out_math_bits);
}

TORCH_LIBRARY_IMPL(custom, Conjugate, m) {
  m.impl("npu_fused_gdn_decode", &custom_ops::npu_fused_gdn_decode_math_bits);
  m.impl("npu_fused_gdn_decode.out", &custom_ops::npu_fused_gdn_decode_out_math_bits);
}
