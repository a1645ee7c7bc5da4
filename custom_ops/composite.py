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


def fused_gdn_decode_checked_reference(mixed_qkv, a, b, a_log, dt_bias, state_ref,
                                       ssm_state_indices, scale, softplus_threshold=20.0):
    """The reference behind the op's input and slot checks: the kernel of devices without one."""
    with profiler_scope(PROFILER_EVENT):
        torch.ops.custom_ops_internal.check_inputs(
            mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale,
            softplus_threshold)
        torch.ops.custom_ops_internal.check_slot_indices(ssm_state_indices.cpu(),
                                                         state_ref.shape[0])
        return fused_gdn_decode_reference(
            mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale,
            softplus_threshold=softplus_threshold)


_lib = torch.library.Library("custom", "IMPL")
_lib.impl(OP_NAME, fused_gdn_decode_checked_reference, "CompositeExplicitAutograd")
