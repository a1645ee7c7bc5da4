"""Which Triton the tests in this process run: interpreted or compiled.

Triton's interpreter is a choice per process. A triton imported with ``TRITON_INTERPRET=1`` cannot
compile (its standard-library functions are interpreter objects; Triton 3.6 then fails every
compiled launch with an AssertionError in its own gluon import), and a compiled kernel cannot
take CPU tensors. conftest.py chooses before anything imports triton: the interpreter where there
is no CUDA device, the compiler where there is one, unless ``TRITON_INTERPRET`` is already set. So
on a GPU host the interpreter's tests need a second run with ``TRITON_INTERPRET=1``
(docs/gpu.md)."""

import pytest
import torch

from custom_ops._env import env_flag

INTERPRETER = env_flag("TRITON_INTERPRET")  # as custom_ops.triton_kernel and Triton read it

needs_interpreter = pytest.mark.skipif(
    not INTERPRETER,
    reason="runs the Triton kernel on CPU tensors through Triton's interpreter, which is off in "
           "this process (TRITON_INTERPRET=1 turns it on)")


def _compiled_cuda_skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if INTERPRETER:
        return ("runs the compiled Triton kernel: Triton's interpreter is on in this process "
                "(TRITON_INTERPRET=1), and a triton imported with it cannot compile")
    return None


needs_compiled_cuda = pytest.mark.skipif(_compiled_cuda_skip_reason() is not None,
                                         reason=_compiled_cuda_skip_reason() or "")


def skip_unless_interpreter():
    """For a test that reaches the Triton kernel with CPU tensors only in some parameters."""
    if not INTERPRETER:
        pytest.skip(needs_interpreter.kwargs["reason"])


NONFINITE = [float("nan"), float("inf"), float("-inf")]


def check_nonfinite_case(fn, device, state_dtype, place, value):
    """NaN and +-Inf in out and in the whole state exactly where the reference has them (the
    finite rest within tolerance), for ``value`` at ``place`` (custom_ops.testing.VALUE_PLACES).
    K = 136 leaves 120 padded lanes in the kernel's 256-wide rows. q = k makes every term of
    out = S q the same sign, so an Inf reaching out stays an Inf in the reference instead of
    turning into NaN by cancellation. Run interpreted (numpy's exp/log/min/max) and compiled."""
    from custom_ops import fused_gdn_decode_reference
    from custom_ops.testing import (
        Case,
        assert_close,
        call,
        clone_inputs,
        make_inputs,
        with_value_at,
    )

    H, K = 1, 136
    x = make_inputs(Case(B=2, H=H, Hv=2, K=K, V=16, state_dtype=state_dtype,
                         dtype=torch.bfloat16, seed=11), device=device)
    x["mixed_qkv"][:, :H * K] = x["mixed_qkv"][:, H * K:2 * H * K]
    y = with_value_at(x, place, value)
    ours, ref = clone_inputs(y), clone_inputs(y)
    out = call(fn, ours)
    out_ref = call(fused_gdn_decode_reference, ref)
    assert_close(out, out_ref, "out", equal_nan=True)
    assert_close(ours["state_ref"], ref["state_ref"], "state", equal_nan=True)
    # A bf16 NaN is stored as torch's canonical 0x7FC0 (as the CPU kernel does), not as the
    # 0x7FFF of the GPU's cvt.rn.
    for name, t in (("out", out), ("state", ours["state_ref"])):
        if t.dtype == torch.bfloat16:
            bits = t.view(torch.int16)[t.isnan()]
            assert bits.numel() == 0 or (bits == 0x7FC0).all(), (
                f"{name}: NaN bits {sorted({hex(b & 0xFFFF) for b in bits.tolist()})}, "
                "want 0x7fc0")
