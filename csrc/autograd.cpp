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

// The op and its out overload, for redispatching `args` below a key (out null: the default one).
at::Tensor redispatch(c10::DispatchKeySet ks, const GdnArgs& args, at::Tensor* out) {
  if (out == nullptr) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("custom::npu_fused_gdn_decode", "")
                               .typed<FusedGdnDecodeFn>();
    return args.apply([&](auto&&... arg) { return op.redispatch(ks, arg...); });
  }
  static const auto out_op = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("custom::npu_fused_gdn_decode", "out")
                                 .typed<FusedGdnDecodeOutFn>();
  return args.apply([&](auto&&... arg) { return out_op.redispatch(ks, arg..., *out); });
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

// Registered for the default overload only (out is null).
at::Tensor autograd_kernel(c10::DispatchKeySet ks, const GdnArgs& args, at::Tensor* out) {
  const auto& [mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale,
               softplus_threshold] = args;
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
  at::Tensor result;
  {
    at::AutoDispatchBelowAutograd guard;
    result = redispatch(ks & c10::after_autograd_keyset, args, out);
  }
  if (grad_fn) {
    ag::rebase_history(std::vector<at::Tensor>{state_ref}, grad_fn);
    ag::set_history(result, grad_fn);
  }
  return result;
}

// Registered for the default overload only (out is null).
at::Tensor ad_inplace_or_view_kernel(c10::DispatchKeySet ks, const GdnArgs& args,
                                     at::Tensor* out) {
  at::Tensor& state_ref = args.state_ref;
  // Native in-place ops find an inference tensor outside inference_mode when they bump its
  // version after writing; bumping once before the call raises the same error with state_ref
  // still untouched.
  if (state_ref.defined() && state_ref.is_inference() && !c10::InferenceMode::is_enabled()) {
    torch::autograd::increment_version(state_ref);
  }
  at::Tensor result;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    result = redispatch(ks & c10::after_ADInplaceOrView_keyset, args, out);
  }
  torch::autograd::increment_version(state_ref);
  return result;
}

// Both overloads: `out` is null for the default one.
at::Tensor math_bits_kernel(c10::DispatchKeySet ks, const GdnArgs& args, at::Tensor* out) {
  // Rejects a negative view as state_ref (and, for the out overload, as out) before anything is
  // written; conjugate bits exist only on complex tensors, which it rejects by dtype.
  const GdnDims d = check_fused_gdn_decode_inputs(args);
  if (out != nullptr) {
    check_fused_gdn_decode_out(*out, d, args.mixed_qkv, args.state_ref);
  }
  const at::Tensor mixed_qkv = args.mixed_qkv.resolve_neg(), a = args.a.resolve_neg(),
                   b = args.b.resolve_neg(), a_log = args.a_log.resolve_neg(),
                   dt_bias = args.dt_bias.resolve_neg(),
                   ssm_state_indices = args.ssm_state_indices.resolve_neg();
  return redispatch(
      ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Conjugate),
      GdnArgs{mixed_qkv, a, b, a_log, dt_bias, args.state_ref, ssm_state_indices, args.scale,
              args.softplus_threshold},
      out);
}

} // namespace
} // namespace custom_ops

// The out overload: torch's generic fallbacks, which read the schema's (a!)/(b!) annotations
// (in-place checks, version bumps of state_ref and out, a backward that raises).
TORCH_LIBRARY_IMPL(custom, Autograd, m) {
  m.impl("npu_fused_gdn_decode",
         &custom_ops::Kernels::functional_ks<&custom_ops::autograd_kernel>);
  m.impl("npu_fused_gdn_decode.out", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(custom, ADInplaceOrView, m) {
  m.impl("npu_fused_gdn_decode",
         &custom_ops::Kernels::functional_ks<&custom_ops::ad_inplace_or_view_kernel>);
  m.impl("npu_fused_gdn_decode.out",
         torch::autograd::autogradNotImplementedInplaceOrViewFallback());
}

TORCH_LIBRARY_IMPL(custom, Negative, m) {
  custom_ops::impl_fused_gdn_decode_ks<&custom_ops::math_bits_kernel>(m);
}

TORCH_LIBRARY_IMPL(custom, Conjugate, m) {
  custom_ops::impl_fused_gdn_decode_ks<&custom_ops::math_bits_kernel>(m);
}
