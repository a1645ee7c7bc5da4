// custom::npu_fused_gdn_decode at the device-independent keys above the backends.
//
// Autograd + ADInplaceOrView, both overloads: the op writes state_ref (and, the out overload, out)
// in place and has no derivative, so it behaves like a native in-place op without a derivative
// formula: it bumps the version counter of each tensor it writes (a graph that saved one before
// the call then fails in backward instead of using the new values), refuses to write a leaf that
// requires grad or an inference tensor outside inference_mode (native messages, raised before
// anything is written), and gives the written tensors and the result a backward node that raises
// when an input requires grad. Under inference_mode neither kernel runs; under no_grad they cost
// one redispatch each and the version bumps.
//
// Negative + Conjugate: PyTorch's fallback for these views materialises them, runs the op on the
// copies and then expects it to return the mutated tensor, which this op does not (an internal
// assert). Here the shared check runs first (it rejects such a state_ref), then the read-only
// inputs are materialised as the fallback would.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
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

// A node that raises kNoBackward in backward, with edges to the graphs of the call's inputs as
// they are before the call (so made before anything is rebased).
NodePtr no_backward_node(const GdnArgs& args, const at::Tensor& out) {
  NodePtr node = make_node<NodePtr, ag::Error>(kNoBackward);
  node->set_next_edges(ag::collect_next_edges(args.mixed_qkv, args.a, args.b, args.a_log,
                                              args.dt_bias, args.state_ref, out));
  return node;
}

// Both overloads (out null: the default one).
at::Tensor autograd_kernel(c10::DispatchKeySet ks, const GdnArgs& args, at::Tensor* out) {
  const auto& [mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale,
               softplus_threshold] = args;
  // out's old values are not read, but it is written in place: like self of a native in-place
  // op it counts as an input, so a graph it carried cannot outlive the call.
  static const at::Tensor kNoOut;
  const at::Tensor& out_or_none = out != nullptr ? *out : kNoOut;
  const at::Tensor* differentiable[] = {&mixed_qkv, &a, &b, &a_log, &dt_bias, &state_ref,
                                        &out_or_none};
  for (const at::Tensor* t : differentiable) {
    TORCH_CHECK_NOT_IMPLEMENTED(!ag::isFwGradDefined(*t), kNoBackward, " (forward-mode AD)");
  }
  const bool requires_grad =
      ag::compute_requires_grad(mixed_qkv, a, b, a_log, dt_bias, state_ref, out_or_none);
  const at::Tensor* written[] = {&state_ref, &out_or_none};
  for (const at::Tensor* t : written) {
    if (t->defined()) {
      ag::check_inplace(*t, requires_grad);  // the native leaf / view-of-leaf errors
    }
  }
  // One node for state_ref, one for the result (out for the out overload): rebasing a view in
  // place needs a node whose only output it is.
  NodePtr state_fn, result_fn;
  if (requires_grad) {
    state_fn = no_backward_node(args, out_or_none);
    result_fn = no_backward_node(args, out_or_none);
  }
  at::Tensor result;
  {
    at::AutoDispatchBelowAutograd guard;
    result = redispatch(ks & c10::after_autograd_keyset, args, out);
  }
  if (requires_grad) {
    ag::rebase_history(state_ref, std::move(state_fn));
    if (out != nullptr) {
      ag::rebase_history(*out, std::move(result_fn));
    } else {
      ag::set_history(result, result_fn);
    }
  }
  return result;
}

// Both overloads (out null: the default one).
at::Tensor ad_inplace_or_view_kernel(c10::DispatchKeySet ks, const GdnArgs& args,
                                     at::Tensor* out) {
  at::Tensor* const written[] = {&args.state_ref, out};
  // Native in-place ops find an inference tensor outside inference_mode when they bump its
  // version after writing; bumping once before the call raises the same error with nothing
  // written yet.
  if (!c10::InferenceMode::is_enabled()) {
    for (at::Tensor* t : written) {
      if (t != nullptr && t->defined() && t->is_inference()) {
        torch::autograd::increment_version(*t);
      }
    }
  }
  at::Tensor result;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    result = redispatch(ks & c10::after_ADInplaceOrView_keyset, args, out);
  }
  for (at::Tensor* t : written) {
    if (t != nullptr) {
      torch::autograd::increment_version(*t);
    }
  }
  return result;
}

// Both overloads: `out` is null for the default one.
at::Tensor math_bits_kernel(c10::DispatchKeySet ks, const GdnArgs& args, at::Tensor* out) {
  // Rejects a negative view as state_ref (and, for the out overload, as out) before anything is
  // written; conjugate bits exist only on complex tensors, which it rejects by dtype.
  const GdnDims d = check_fused_gdn_decode_inputs(args);
  if (out != nullptr) {
    check_fused_gdn_decode_out(*out, d, args);
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

TORCH_LIBRARY_IMPL(custom, Autograd, m) {
  custom_ops::impl_fused_gdn_decode_ks<&custom_ops::autograd_kernel>(m);
}

TORCH_LIBRARY_IMPL(custom, ADInplaceOrView, m) {
  custom_ops::impl_fused_gdn_decode_ks<&custom_ops::ad_inplace_or_view_kernel>(m);
}

TORCH_LIBRARY_IMPL(custom, Negative, m) {
  custom_ops::impl_fused_gdn_decode_ks<&custom_ops::math_bits_kernel>(m);
}

TORCH_LIBRARY_IMPL(custom, Conjugate, m) {
  custom_ops::impl_fused_gdn_decode_ks<&custom_ops::math_bits_kernel>(m);
}
