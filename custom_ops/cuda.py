"""CUDA registration of ``custom::npu_fused_gdn_decode``: the Triton kernel
(``custom_ops.triton_kernel``) behind the shared C++ input check, or the checked reference
(``custom_ops.composite``) when triton is not installed or its kernel module fails to import.

Slot indices (range and uniqueness) need their values on the host, i.e. a device sync. The Triton
path checks them only while ``CUSTOM_OPS_CHECK_INDICES=1`` is set (read on every call) or after
``set_check_indices(True)`` (never during CUDA-graph capture), as the NPU path leaves them to the
caller; the kernel never touches a slot outside [1, BlockNum) either way.
"""

import importlib.util
import logging

import torch

from ._env import env_flag
from .composite import (OP_NAME, check_slots, fused_gdn_decode_checked_reference,
                        fused_gdn_decode_out_checked_reference, profiler_scope)
from .ops import DEFAULT_SOFTPLUS_THRESHOLD, OpArgs

log = logging.getLogger(__name__)

PROFILER_EVENT = "custom_ops::npu_fused_gdn_decode_triton"

# None: follow CUSTOM_OPS_CHECK_INDICES, read on every call (as the NPU path reads its switch);
# True/False: set_check_indices's override.
_check_indices = None


def set_check_indices(enabled: bool | None) -> bool | None:
    """Turn the host-side slot-index check of the Triton path on (True) or off (False), whatever
    the environment says, or back to following ``CUSTOM_OPS_CHECK_INDICES`` (None, the default);
    returns the previous setting.

    Off by default: it copies ``ssm_state_indices`` to the host (a device sync) on every call.
    """
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_check_indices: enabled must be a bool or None, but got "
                        f"{type(enabled).__name__} {enabled!r}")
    global _check_indices
    old, _check_indices = _check_indices, enabled
    return old


def _check_slots_if_enabled(args):
    if check_indices_enabled() and not _capturing(args.ssm_state_indices):
        check_slots(args)


def check_indices_enabled() -> bool:
    """Whether the next call checks its slot indices (outside CUDA-graph capture)."""
    if _check_indices is None:
        return env_flag("CUSTOM_OPS_CHECK_INDICES")
    return _check_indices


_triton_launch = None  # custom_ops.triton_kernel.fused_gdn_decode_triton once imported


def _load_triton():
    """The Triton launcher, or None when triton is installed but cannot be imported."""
    global _triton_launch
    if _triton_launch is None:
        try:
            from .triton_kernel import fused_gdn_decode_triton
            _triton_launch = fused_gdn_decode_triton
        except Exception as e:  # a broken triton install must not break the op
            log.warning("custom_ops: triton kernel unavailable (%s); using the reference", e)
            _triton_launch = False
    return _triton_launch or None


def _capturing(t):
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def fused_gdn_decode_cuda(*args, softplus_threshold=DEFAULT_SOFTPLUS_THRESHOLD):
    """The Triton kernel behind the shared check: the CUDA kernel when triton is installed.
    ``args``: the op's positional arguments (ops.ARG_NAMES).

    Also runs on CPU tensors under ``TRITON_INTERPRET=1`` (the tests call it that way).
    """
    launch = _load_triton()
    if launch is None:
        return fused_gdn_decode_checked_reference(*args, softplus_threshold=softplus_threshold)
    args = OpArgs(*args, softplus_threshold)
    with profiler_scope(PROFILER_EVENT):
        torch.ops.custom_ops_internal.check_inputs(*args)
        _check_slots_if_enabled(args)
        return args.call(launch)


def fused_gdn_decode_out_cuda(*args, softplus_threshold=DEFAULT_SOFTPLUS_THRESHOLD, out):
    """The out overload: the Triton kernel writes straight into out."""
    launch = _load_triton()
    if launch is None:
        return fused_gdn_decode_out_checked_reference(
            *args, softplus_threshold=softplus_threshold, out=out)
    args = OpArgs(*args, softplus_threshold)
    with profiler_scope(PROFILER_EVENT):
        torch.ops.custom_ops_internal.check_inputs_out(*args, out)
        _check_slots_if_enabled(args)
        args.call(launch, out=out)
        return out


def triton_available() -> bool:
    # find_spec, not import: importing triton costs about a second; the kernel module is imported
    # on the first CUDA call instead.
    return importlib.util.find_spec("triton") is not None


# The function registered for the CUDA key.
KERNEL = fused_gdn_decode_cuda if triton_available() else fused_gdn_decode_checked_reference
if KERNEL is fused_gdn_decode_checked_reference:
    log.info("custom_ops: triton not installed; CUDA runs the pure-torch reference")

_lib = torch.library.Library("custom", "IMPL")
_lib.impl(OP_NAME, KERNEL, "CUDA")
OUT_KERNEL = (fused_gdn_decode_out_cuda if KERNEL is fused_gdn_decode_cuda
              else fused_gdn_decode_out_checked_reference)
_lib.impl(OP_NAME + ".out", OUT_KERNEL, "CUDA")
