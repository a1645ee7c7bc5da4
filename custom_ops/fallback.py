"""Python registrations of ``custom::npu_fused_gdn_decode`` for devices without a C++ kernel.

- CUDA: the Triton kernel (``custom_ops.triton_kernel``) when triton is installed, else the
  pure-torch reference.
- CompositeExplicitAutograd: the reference, so the op runs on every other device (XPU, MPS, ...).
  Backend-specific kernels win over this key, so the C++ CPU, Meta and PrivateUse1 (NPU) kernels
  are untouched; it only fills keys that have no kernel of their own.

Both paths run the shared C++ input check first (through the Meta kernel, see ``check_inputs``),
so they reject exactly what the CPU op rejects, with the same TypeError/ValueError messages.

Slot indices (range and uniqueness) need their values on the host, i.e. a device sync. The Triton
path checks them only when ``CUSTOM_OPS_CHECK_INDICES=1`` is set or after
``set_check_indices(True)`` (never during CUDA-graph capture), as the NPU path leaves them to the
caller. The reference path always checks them: it synchronises anyway (boolean-mask indexing).
"""

import importlib.util
import logging
import math
import os

import torch

from .reference import fused_gdn_decode_reference

log = logging.getLogger(__name__)

OP_NAME = "npu_fused_gdn_decode"
_PREFIX = "npu_fused_gdn_decode: "
_ARG_NAMES = ("mixed_qkv", "a", "b", "a_log", "dt_bias", "state_ref", "ssm_state_indices")

_TRUE = ("1", "true", "on", "yes")
_check_indices = os.environ.get("CUSTOM_OPS_CHECK_INDICES", "0").lower() in _TRUE


def set_check_indices(enabled: bool) -> bool:
    """Turn the host-side slot-index check of the Triton path on or off; returns the old value.

    Off by default: it copies ``ssm_state_indices`` to the host (a device sync) on every call.
    ``CUSTOM_OPS_CHECK_INDICES=1`` turns it on at import.
    """
    global _check_indices
    old, _check_indices = _check_indices, bool(enabled)
    return old


def check_indices_enabled() -> bool:
    return _check_indices


# Signatures (sizes, strides, dtypes, finiteness of the floats) that already passed the check:
# the check depends on nothing else, so a decode loop pays for it once.
_ACCEPTED = set()
_ACCEPTED_MAX = 1024


def check_inputs(tensors, scale, softplus_threshold):
    """Runs the shared C++ input check on ``tensors`` (the op's seven tensor arguments in order).

    Devices are compared here, as the C++ check does first; the rest runs in the registered Meta
    kernel on meta tensors with the same sizes, strides and dtypes, so it raises exactly the
    TypeError/ValueError the CPU op raises.
    """
    device = tensors[0].device
    for name, t in zip(_ARG_NAMES[1:], tensors[1:]):
        if t.device != device:
            raise ValueError(
                f"{_PREFIX}all tensors must be on one device: expected {name} on {device} "
                f"(the device of mixed_qkv), but got {t.device}")
    key = (tuple((tuple(t.shape), t.stride(), t.dtype) for t in tensors),
           math.isfinite(scale), math.isfinite(softplus_threshold))
    if key in _ACCEPTED:
        return
    # empty_strided, not .to("meta"): .to() makes a non-dense view contiguous and would hide a
    # non-contiguous state_ref from the check.
    metas = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
             for t in tensors]
    torch.ops.custom.npu_fused_gdn_decode(*metas, scale, softplus_threshold=softplus_threshold)
    if len(_ACCEPTED) >= _ACCEPTED_MAX:
        _ACCEPTED.clear()
    _ACCEPTED.add(key)


def check_slot_indices(ssm_state_indices, block_num):
    """Every positive index < BlockNum and no positive index twice (SPEC "Slot rules"): the CPU
    path's own C++ check, so the rules and messages are the same. Copies the indices to the host.
    """
    torch.ops.custom_ops_internal.check_slot_indices(ssm_state_indices.cpu(), block_num)


def _capturing(t):
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def fused_gdn_decode_fallback(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices,
                              scale, softplus_threshold=20.0):
    """The reference, checked like the op: the implementation for devices without a kernel."""
    tensors = (mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices)
    check_inputs(tensors, scale, softplus_threshold)
    check_slot_indices(ssm_state_indices, state_ref.shape[0])
    return fused_gdn_decode_reference(
        mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale,
        softplus_threshold=softplus_threshold)


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


def fused_gdn_decode_triton_checked(mixed_qkv, a, b, a_log, dt_bias, state_ref,
                                    ssm_state_indices, scale, softplus_threshold=20.0):
    """The Triton kernel behind the shared check: the CUDA implementation when triton is present.

    Also runs on CPU tensors under ``TRITON_INTERPRET=1`` (the tests call it that way).
    """
    tensors = (mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices)
    check_inputs(tensors, scale, softplus_threshold)
    launch = _load_triton()
    if launch is None:
        return fused_gdn_decode_fallback(mixed_qkv, a, b, a_log, dt_bias, state_ref,
                                         ssm_state_indices, scale, softplus_threshold)
    if _check_indices and not _capturing(ssm_state_indices):
        check_slot_indices(ssm_state_indices, state_ref.shape[0])
    return launch(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices,
                  scale, softplus_threshold)


def triton_available() -> bool:
    # find_spec, not import: importing triton costs about a second; the kernel module is imported
    # on the first CUDA call instead.
    return importlib.util.find_spec("triton") is not None


# Key -> the function registered there (for tests and introspection).
REGISTERED = {}
_lib = None


def register():
    """Registers the Python kernels once (called on import of custom_ops)."""
    global _lib
    if _lib is not None:
        return REGISTERED
    _lib = torch.library.Library("custom", "IMPL")
    cuda_impl = fused_gdn_decode_triton_checked if triton_available() else fused_gdn_decode_fallback
    if cuda_impl is fused_gdn_decode_fallback:
        log.info("custom_ops: triton not installed; CUDA runs the pure-torch reference")
    for key, fn in (("CUDA", cuda_impl), ("CompositeExplicitAutograd", fused_gdn_decode_fallback)):
        _lib.impl(OP_NAME, fn, key)
        REGISTERED[key] = fn
    return REGISTERED


register()
