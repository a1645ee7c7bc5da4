"""CompositeExplicitAutograd registration of ``custom::npu_fused_gdn_decode``: the checked
reference.

Devices without a kernel of their own (XPU, MPS, HPU, ...) run the pure-torch reference behind the
shared C++ input check (``custom_ops_internal::check_inputs``) and the CPU path's slot check, so
they accept and reject exactly what the CPU op does, with the same TypeError/ValueError messages.
Backend kernels win over this key: CPU, Meta, PrivateUse1 (NPU) and CUDA keep theirs.

The slot check needs the index values on the host; the reference synchronises anyway (boolean-mask
indexing), so it always runs here.
"""

import contextlib

import torch

from .ops import DEFAULT_SOFTPLUS_THRESHOLD, OpArgs
from .reference import fused_gdn_decode_reference

OP_NAME = "npu_fused_gdn_decode"
# Profiler event of this backend, named like the C++ ones (custom_ops::npu_fused_gdn_decode_cpu.*).
PROFILER_EVENT = "custom_ops::npu_fused_gdn_decode_reference"


def profiler_scope(name: str):
    """``torch.profiler.record_function(name)`` while a profiler runs; nothing otherwise (it
    costs microseconds per call even when no profiler listens)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def check_slots(args: OpArgs):
    """The CPU path's slot check (range and uniqueness), on a host copy of the indices."""
    torch.ops.custom_ops_internal.check_slot_indices(args.ssm_state_indices.cpu(),
                                                     args.state_ref.shape[0])


def fused_gdn_decode_checked_reference(*args, softplus_threshold=DEFAULT_SOFTPLUS_THRESHOLD):
    """The reference behind the op's input and slot checks: the kernel of devices without one.
    ``args``: the op's positional arguments (ops.ARG_NAMES)."""
    args = OpArgs(*args, softplus_threshold)
    with profiler_scope(PROFILER_EVENT):
        torch.ops.custom_ops_internal.check_inputs(*args)
        check_slots(args)
        return args.call(fused_gdn_decode_reference)


def fused_gdn_decode_out_checked_reference(*args, softplus_threshold=DEFAULT_SOFTPLUS_THRESHOLD,
                                           out):
    """The out overload of devices without a kernel of their own: the reference, copied into
    out (out is checked with the inputs, before anything is written)."""
    args = OpArgs(*args, softplus_threshold)
    with profiler_scope(PROFILER_EVENT):
        torch.ops.custom_ops_internal.check_inputs_out(*args, out)
        check_slots(args)
        out.copy_(args.call(fused_gdn_decode_reference))
        return out


_lib = torch.library.Library("custom", "IMPL")
_lib.impl(OP_NAME, fused_gdn_decode_checked_reference, "CompositeExplicitAutograd")
_lib.impl(OP_NAME + ".out", fused_gdn_decode_out_checked_reference, "CompositeExplicitAutograd")


def _register_out_functionalization():
    """torch.compile / AOT: the functionalizer refuses a custom op whose output aliases an input
    (``-> Tensor(b!)``). Under FunctionalTensorMode the out overload becomes the default overload
    (functionalized like any mutating op) plus ``out.copy_``; eager calls keep writing into out
    directly."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    def unwrapped(t):
        # The tensor under a FunctionalTensor: the wrappers share no storage the check can read,
        # so on them every pair would look like one allocation.
        return torch._from_functional_tensor(t.elem) if isinstance(t, FunctionalTensor) else t

    @torch.library.register_torch_dispatch(f"custom::{OP_NAME}.out", FunctionalTensorMode)
    def _out_functional(mode, func, types, args, kwargs):
        kwargs = dict(kwargs)
        out = kwargs.pop("out")
        # out's own rules (dtype, shape, strides, no shared memory), which the default overload
        # does not check, before anything is written
        torch.ops.custom_ops_internal.check_inputs_out(
            *OpArgs(*map(unwrapped, args),
                    kwargs.get("softplus_threshold", DEFAULT_SOFTPLUS_THRESHOLD)),
            unwrapped(out))
        with mode:
            out.copy_(torch.ops.custom.npu_fused_gdn_decode.default(*args, **kwargs))
        return out


_register_out_functionalization()
