"""The Python registrations (custom_ops/fallback.py): which keys hold which kernel, the reference
fallback against the reference and the CPU op, and its input checks against the C++ check.

CPU-only machines have no XPU/MPS/CUDA tensors, so the registered kernels are reached with
``OpOverload.redispatch`` on CPU tensors: the dispatcher runs whatever that key's table entry holds.
"""

import os
import subprocess
import sys

import pytest
import torch

from custom_ops import fallback
from utils import DTYPE_PAIRS, OP, Case, call, check_against_reference, make_inputs, short

OVERLOAD = torch.ops.custom.npu_fused_gdn_decode.default
QUALNAME = "custom::npu_fused_gdn_decode"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def via(key):
    """The op as dispatched to `key`'s kernel, whatever the inputs' device."""
    keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    return lambda *args, **kw: OVERLOAD.redispatch(keyset, *args, **kw)


def dispatch_table():
    """{key: where its kernel was registered} from the computed dispatch table."""
    table = {}
    for line in torch._C._dispatch_dump_table(QUALNAME).splitlines():
        if ": " in line:
            key, rest = line.split(": ", 1)
            table[key.strip()] = rest
    return table


# --- registration -------------------------------------------------------------------------------

def test_cpp_kernels_keep_their_keys():
    table = dispatch_table()
    assert "fused_gdn_decode_cpu.cpp" in table["CPU"]
    assert "fused_gdn_decode_meta.cpp" in table["Meta"]


@pytest.mark.parametrize("key", ["CUDA", "XPU", "MPS", "HPU"])
def test_python_kernels_cover_other_devices(key):
    assert "fallback.py" in dispatch_table()[key]


def test_cuda_kernel_choice():
    expected = (fallback.fused_gdn_decode_triton_checked if fallback.triton_available()
                else fallback.fused_gdn_decode_fallback)
    assert fallback.REGISTERED["CUDA"] is expected
    assert fallback.REGISTERED["CompositeExplicitAutograd"] is fallback.fused_gdn_decode_fallback


def test_import_without_triton():
    # A None entry in sys.modules makes `import triton` fail and find_spec raise ValueError... so
    # hide it from find_spec too; the package must import and send CUDA to the reference.
    code = (
        "import sys, importlib.util\n"
        "sys.modules['triton'] = None\n"
        "_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n == 'triton' else _find(n, *a)\n"
        "import custom_ops, torch\n"
        "from custom_ops import fallback\n"
        "assert fallback.REGISTERED['CUDA'] is fallback.fused_gdn_decode_fallback\n"
        "assert 'fallback.py' in torch._C._dispatch_dump_table('custom::npu_fused_gdn_decode')\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# --- the reference fallback computes the op ------------------------------------------------------

@pytest.mark.parametrize("dtype,state_dtype", DTYPE_PAIRS,
                         ids=[f"{short(d)}-{short(s)}" for d, s in DTYPE_PAIRS])
def test_fallback_matches_reference(dtype, state_dtype):
    x = make_inputs(Case(B=4, H=1, Hv=3, K=64, V=8, dtype=dtype, state_dtype=state_dtype,
                         invalid_rows=(1, 2)))
    check_against_reference(x, steps=2, fn=via("XPU"))


def test_fallback_matches_cpu_op():
    x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16, invalid_rows=(0,)))
    ours, cpu = check_against_reference(x, fn=fallback.fused_gdn_decode_fallback)
    out_cpu = call(OP, cpu)  # one more step on both, the CPU op against the fallback
    out = call(fallback.fused_gdn_decode_fallback, ours)
    torch.testing.assert_close(out, out_cpu, atol=1e-2, rtol=1.6e-2)


# --- the fallback rejects exactly what the C++ check rejects --------------------------------------

def _strided_state(x):
    s = x["state_ref"]
    wide = torch.zeros(*s.shape[:-1], s.shape[-1] + 16, dtype=s.dtype)
    return dict(x, state_ref=wide[..., : s.shape[-1]])  # a view with row padding: not contiguous


BAD_INPUTS = {
    # name: (case, mutation of the inputs dict)
    "mixed_fp32": (Case(), lambda x: dict(x, mixed_qkv=x["mixed_qkv"].float())),
    "a_log_fp16": (Case(), lambda x: dict(x, a_log=x["a_log"].half())),
    "dt_bias_fp32": (Case(), lambda x: dict(x, dt_bias=x["dt_bias"].float())),
    "pair_fp16_bf16": (Case(dtype=torch.float16, state_dtype=torch.bfloat16), lambda x: x),
    "indices_int64": (Case(), lambda x: dict(x, ssm_state_indices=x["ssm_state_indices"].long())),
    "a_log_2d": (Case(), lambda x: dict(x, a_log=x["a_log"][None])),
    "a_wrong_shape": (Case(), lambda x: dict(x, a=torch.cat([x["a"], x["a"][:, :1]], 1))),
    "indices_wrong_len": (Case(), lambda x: dict(x, ssm_state_indices=x["ssm_state_indices"][:2])),
    "width_not_multiple": (Case(), lambda x: dict(x, mixed_qkv=x["mixed_qkv"][:, 1:])),
    "hv_not_multiple_of_h": (Case(H=3, Hv=4), lambda x: x),
    "k_too_small": (Case(K=32), lambda x: x),
    "k129_fp32_state": (Case(K=129), lambda x: x),
    "state_not_contiguous": (Case(), _strided_state),
    "scale_inf": (Case(), lambda x: dict(x, scale=float("inf"))),
    "empty_batch": (Case(), lambda x: dict(
        x, mixed_qkv=x["mixed_qkv"][:0], a=x["a"][:0], b=x["b"][:0],
        ssm_state_indices=x["ssm_state_indices"][:0])),
    "device_mismatch": (Case(), lambda x: dict(x, dt_bias=x["dt_bias"].to("meta"))),
    "index_out_of_range": (Case(), lambda x: dict(
        x, ssm_state_indices=torch.tensor([1, x["state_ref"].shape[0], 2], dtype=torch.int32))),
    "index_repeated": (Case(), lambda x: dict(
        x, ssm_state_indices=torch.tensor([3, 0, 3], dtype=torch.int32))),
}


def expected_error(x, **kw):
    """The CPU op's error on these inputs (the C++ check and the CPU slot check)."""
    with pytest.raises((TypeError, ValueError)) as info:
        call(via("CPU"), x, **kw)
    return info


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_fallback_rejects_like_cpu(name):
    case, mutate = BAD_INPUTS[name]
    x = mutate(make_inputs(case))
    cpu = expected_error(x)
    before = x["state_ref"].clone()
    with pytest.raises(cpu.type) as ours:
        call(via("XPU"), x)
    assert str(ours.value) == str(cpu.value)
    assert torch.equal(x["state_ref"], before)


def test_fallback_rejects_nan_threshold_like_cpu():
    x = make_inputs(Case())
    cpu = expected_error(x, softplus_threshold=float("nan"))
    with pytest.raises(cpu.type, match="softplus_threshold must be finite"):
        call(via("XPU"), x, softplus_threshold=float("nan"))


def test_check_cache_does_not_hide_errors():
    # Same sizes, strides and dtypes pass from the cache; a finite -> inf scale must still fail.
    x = make_inputs(Case())
    call(fallback.fused_gdn_decode_fallback, x)
    with pytest.raises(ValueError, match="scale must be finite"):
        call(fallback.fused_gdn_decode_fallback, dict(x, scale=float("inf")))


def test_check_indices_switch():
    old = fallback.set_check_indices(True)
    try:
        assert fallback.check_indices_enabled()
    finally:
        fallback.set_check_indices(old)
    assert fallback.check_indices_enabled() == old


def test_broken_triton_falls_back_to_reference(monkeypatch):
    # triton found but its kernel module failed to import: the CUDA entry still computes the op.
    monkeypatch.setattr(fallback, "_triton_launch", False)
    x = make_inputs(Case(B=3, H=1, Hv=2, K=64, V=8, invalid_rows=(1,)))
    check_against_reference(x, fn=fallback.fused_gdn_decode_triton_checked)
