"""The Python registrations: ``custom_ops.cuda`` (CUDA: the Triton kernel behind the input check,
or the checked reference without triton) and ``custom_ops.composite`` (CompositeExplicitAutograd:
the checked reference for every other device). Which key runs which kernel, as the profiler sees
it (each backend names itself there), the checked reference against the reference and the CPU op,
the debug index switch, and a triton that fails to import. Every backend's rejections are in
test_validation.py's table.

CPU-only machines have no XPU/MPS/CUDA tensors, so the registered kernels are reached with
``custom_ops.testing.redispatch`` (``OpOverload.redispatch``) on CPU tensors: the dispatcher runs
whatever that key's table entry holds.
"""

import os
import subprocess
import sys

import pytest
import torch

from custom_ops import composite
from custom_ops import cuda as cuda_backend
from custom_ops.testing import (
    DTYPE_PAIR_IDS,
    DTYPE_PAIRS,
    OP,
    Case,
    assert_close,
    call,
    check_against_reference,
    clone_inputs,
    make_inputs,
    redispatch,
    storage_bytes,
    to_meta,
)
from triton_mode import skip_unless_interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE_EVENT = composite.PROFILER_EVENT
TRITON_EVENT = cuda_backend.PROFILER_EVENT


def profiled_events(fn):
    """Names of the profiler events recorded while fn() runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


# --- which kernel each key runs ---------------------------------------------------------------

def test_cpp_kernels_keep_their_keys():
    # CompositeExplicitAutograd must not shadow the C++ CPU and Meta kernels.
    x = make_inputs(Case(B=2, H=1, Hv=2, K=64, V=8))
    for key in ("CPU", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(OP.default.name(), key), key
    for run in (lambda: call(OP, x), lambda: call(OP, to_meta(x))):
        events = profiled_events(run)
        assert "custom::npu_fused_gdn_decode" in events
        assert not events & {REFERENCE_EVENT, TRITON_EVENT}, events


@pytest.mark.parametrize("key", ["CUDA", "XPU", "MPS", "HPU"])
def test_python_kernels_cover_other_devices(key):
    x = make_inputs(Case(B=2, H=1, Hv=2, K=64, V=8, invalid_rows=(1,)))
    triton = key == "CUDA" and cuda_backend.triton_available()
    if triton:
        skip_unless_interpreter()  # the Triton kernel on CPU tensors
    events = profiled_events(lambda: check_against_reference(x, fn=redispatch(OP.default, key)))
    assert (TRITON_EVENT if triton else REFERENCE_EVENT) in events, events
    assert (REFERENCE_EVENT if triton else TRITON_EVENT) not in events, events


def test_cuda_kernel_choice():
    expected = (cuda_backend.fused_gdn_decode_cuda if cuda_backend.triton_available()
                else composite.fused_gdn_decode_checked_reference)
    assert cuda_backend.KERNEL is expected


def test_import_without_triton():
    # A None entry in sys.modules makes `import triton` fail and find_spec raise ValueError... so
    # hide it from find_spec too; the package must import and send CUDA to the checked reference.
    code = (
        "import sys, importlib.util\n"
        "sys.modules['triton'] = None\n"
        "_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n == 'triton' else _find(n, *a)\n"
        "import torch, custom_ops\n"
        "from custom_ops import composite, cuda\n"
        "from custom_ops.testing import Case, OP, check_against_reference, make_inputs, "
        "redispatch\n"
        "assert cuda.KERNEL is composite.fused_gdn_decode_checked_reference\n"
        "entry = redispatch(OP.default, 'CUDA')\n"
        "check_against_reference(make_inputs(Case(invalid_rows=(1,))), steps=2, fn=entry)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_broken_triton_falls_back_to_reference(monkeypatch):
    # triton found but its kernel module failed to import: the CUDA entry still computes the op.
    monkeypatch.setattr(cuda_backend, "_triton_launch", False)
    x = make_inputs(Case(B=3, H=1, Hv=2, K=64, V=8, invalid_rows=(1,)))
    events = profiled_events(
        lambda: check_against_reference(x, fn=cuda_backend.fused_gdn_decode_cuda))
    assert REFERENCE_EVENT in events and TRITON_EVENT not in events, events


# --- the checked reference computes the op ----------------------------------------------------

@pytest.mark.parametrize("dtype,state_dtype", DTYPE_PAIRS, ids=DTYPE_PAIR_IDS)
def test_checked_reference_matches_reference(dtype, state_dtype):
    x = make_inputs(Case(B=4, H=1, Hv=3, K=64, V=8, dtype=dtype, state_dtype=state_dtype,
                         invalid_rows=(1, 2)))
    check_against_reference(x, steps=2, fn=redispatch(OP.default, "XPU"))


@pytest.mark.parametrize("overload", ["default", "out"])
def test_checked_reference_passes_softplus_threshold(overload):
    # x = a + dt_bias around 0.5: with a threshold of -5, softplus(x) becomes x (0.5 instead of
    # about 0.97), which halves g. Against the CPU op (its own threshold handling is tested in
    # test_correctness.py), both overloads.
    x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16, invalid_rows=(0,)))
    x["a"].fill_(0.5)
    x["dt_bias"].zero_()
    runs = {name: clone_inputs(x) for name in ("xpu", "cpu", "default")}
    entry = redispatch(getattr(OP, overload), "XPU")
    kw = {"softplus_threshold": -5.0}
    if overload == "out":
        kw["out"] = torch.zeros(3, 1, 4, 16, dtype=torch.bfloat16)
    out = call(entry, runs["xpu"], **kw)
    out_cpu = call(OP, runs["cpu"], softplus_threshold=-5.0)
    out_default = call(OP, runs["default"])
    assert_close(out, out_cpu, "out")
    assert_close(runs["xpu"]["state_ref"], runs["cpu"]["state_ref"], "state")
    with pytest.raises(AssertionError):  # else the case would not test the threshold
        assert_close(out_default, out_cpu, "out with the default threshold")
    if overload == "out":
        assert out is kw["out"]


def test_checked_reference_matches_cpu_op():
    x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16, invalid_rows=(0,)))
    ours, cpu = check_against_reference(x, fn=composite.fused_gdn_decode_checked_reference)
    out_cpu = call(OP, cpu)  # one more step on both, the CPU op against the checked reference
    out = call(composite.fused_gdn_decode_checked_reference, ours)
    assert_close(out, out_cpu, "out")
    assert_close(ours["state_ref"], cpu["state_ref"], "state")


def test_every_call_is_checked():
    # An accepted call does not let a later one with the same sizes through unchecked.
    x = make_inputs(Case())
    call(composite.fused_gdn_decode_checked_reference, x)
    before = storage_bytes(x["state_ref"])
    with pytest.raises(ValueError, match="scale must be finite"):
        call(composite.fused_gdn_decode_checked_reference, dict(x, scale=float("inf")))
    assert torch.equal(storage_bytes(x["state_ref"]), before), "a rejected call changed state"


def test_check_indices_switch(monkeypatch):
    # By default the environment decides, read on every call (set after import too); the
    # setter overrides it either way, and None hands it back.
    old = cuda_backend.set_check_indices(None)
    try:
        monkeypatch.setenv("CUSTOM_OPS_CHECK_INDICES", "1")
        assert cuda_backend.check_indices_enabled()
        monkeypatch.setenv("CUSTOM_OPS_CHECK_INDICES", "0")
        assert not cuda_backend.check_indices_enabled()
        assert cuda_backend.set_check_indices(True) is None
        assert cuda_backend.check_indices_enabled()
        monkeypatch.setenv("CUSTOM_OPS_CHECK_INDICES", "1")
        assert cuda_backend.set_check_indices(False) is True
        assert not cuda_backend.check_indices_enabled()
        assert cuda_backend.set_check_indices(None) is False
        assert cuda_backend.check_indices_enabled()
    finally:
        cuda_backend.set_check_indices(old)


@pytest.mark.parametrize("value", ["false", 0, 1, 1.0])
def test_check_indices_switch_takes_only_a_bool_or_none(value):
    # bool("false") is True: a string must not turn the check on by accident. The switch is
    # set first, so that a refusal which reset it would show.
    old = cuda_backend.set_check_indices(False)
    try:
        with pytest.raises(TypeError, match=r"set_check_indices: enabled must be a bool or None, "
                                            r"but got \w+ "):
            cuda_backend.set_check_indices(value)
        assert not cuda_backend.check_indices_enabled()
        assert cuda_backend.set_check_indices(True) is False  # unchanged by the refused call
        with pytest.raises(TypeError):
            cuda_backend.set_check_indices(value)
        assert cuda_backend.check_indices_enabled()
        assert cuda_backend.set_check_indices(None) is True
    finally:
        cuda_backend.set_check_indices(old)
