"""The Triton kernel on CPU tensors through Triton's interpreter, against the reference.

The kernel is reached the way CUDA calls reach it: through the dispatcher's CUDA entry
(``redispatch``), i.e. the registered, checked function, then the launcher. The interpreter is slow,
so shapes are small; K = 136 and V = 8 / 48 cover non-powers of two and partial tiles. conftest.py
sets TRITON_INTERPRET=1 before triton is imported where there is no CUDA device; on a GPU host these
tests need TRITON_INTERPRET=1 set (tests/triton_mode.py).
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from triton_mode import NONFINITE, check_nonfinite_case, needs_interpreter  # noqa: E402

from custom_ops import cuda as cuda_backend  # noqa: E402
from custom_ops import fused_gdn_decode_reference  # noqa: E402
from custom_ops import triton_kernel as tk  # noqa: E402
from custom_ops.testing import (  # noqa: E402
    ARG_NAMES,
    DTYPE_PAIR_IDS,
    DTYPE_PAIRS,
    VALUE_PLACES,
    Case,
    assert_close,
    call,
    check_against_reference,
    clone_inputs,
    make_inputs,
    redispatch,
    short,
)

OVERLOAD = torch.ops.custom.npu_fused_gdn_decode.default

if cuda_backend.KERNEL is not cuda_backend.fused_gdn_decode_cuda:
    pytest.skip("the CUDA key does not hold the Triton kernel", allow_module_level=True)

# Every test here runs the kernel on CPU tensors; the compiled kernel's cases are in
# test_triton_device.py.
pytestmark = needs_interpreter

# The op as the dispatcher runs it for CUDA tensors, here on CPU tensors.
cuda_entry = redispatch(OVERLOAD, "CUDA")


@pytest.mark.parametrize("ratio", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,state_dtype", DTYPE_PAIRS, ids=DTYPE_PAIR_IDS)
def test_dtype_pairs_and_gqa(dtype, state_dtype, ratio):
    H = 2 if ratio < 3 else 1
    x = make_inputs(Case(B=2, H=H, Hv=H * ratio, K=64, V=16, dtype=dtype,
                         state_dtype=state_dtype, seed=ratio))
    check_against_reference(x, steps=2, fn=cuda_entry)


@pytest.mark.parametrize("K,V", [(136, 8), (136, 48), (64, 48), (128, 8)])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=short)
def test_odd_sizes(K, V, state_dtype):
    # K = 136 fp32 rows have 32 bytes of padding: still accepted. V = 48 leaves a partial V tile.
    x = make_inputs(Case(B=2, H=1, Hv=2, K=K, V=V, state_dtype=state_dtype, seed=K + V))
    check_against_reference(x, fn=cuda_entry)


def test_invalid_rows_write_zeros_and_leave_state():
    x = make_inputs(Case(B=4, H=1, Hv=2, K=64, V=16, invalid_rows=(0, 3)))
    # NaN in the invalid rows' inputs must not leak into their (zero) outputs.
    x["mixed_qkv"][0] = float("nan")
    before = x["state_ref"].clone()
    ours, _ = check_against_reference(x, fn=cuda_entry)
    out = call(cuda_entry, clone_inputs(x))
    assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[3]) == 0
    touched = x["ssm_state_indices"][[1, 2]].long()
    untouched = torch.ones(before.shape[0], dtype=torch.bool)
    untouched[touched] = False
    assert torch.equal(ours["state_ref"][untouched], before[untouched])


def test_all_rows_invalid():
    x = make_inputs(Case(B=2, H=1, Hv=2, K=64, V=8, invalid_rows=(0, 1)))
    before = x["state_ref"].clone()
    out = call(cuda_entry, x)
    assert torch.count_nonzero(out) == 0 and torch.equal(x["state_ref"], before)


def test_non_contiguous_inputs():
    x = make_inputs(Case(B=3, H=1, Hv=2, K=64, V=16, invalid_rows=(1,), seed=7, layout="strided"))
    for t in ("mixed_qkv", "a_log", "dt_bias", "ssm_state_indices", "a", "b"):
        assert not x[t].is_contiguous(), t
    assert x["state_ref"].storage_offset() > 0
    check_against_reference(x, fn=cuda_entry)


def test_several_v_tiles_and_forced_config():
    # BV = 4 < V forces 4 programs per head; the result must not depend on the tiling.
    x = make_inputs(Case(B=2, H=1, Hv=2, K=64, V=16))
    cfg = tk.TileConfig(BK=64, BV=4, num_warps=1)
    check_against_reference(x, fn=lambda *a, **kw: tk.fused_gdn_decode_triton(*a, config=cfg, **kw))


def test_grid_limit_splits_batch_rows(monkeypatch):
    # CUDA's limit on grid axis 0 (GRID_X_MAX programs) made small: 3 rows x Hv = 2 x 5 V tiles
    # go as three launches of one row (10 programs each, V tile fastest). The results must not
    # depend on it.
    monkeypatch.setattr(tk, "GRID_X_MAX", 15)
    x = make_inputs(Case(B=3, H=1, Hv=2, K=64, V=20, invalid_rows=(1,)))
    cfg = tk.TileConfig(BK=64, BV=4, num_warps=1)
    out = torch.empty(3, 1, 2, 20, dtype=x["mixed_qkv"].dtype)
    grid, _, kwargs = tk.launch_config(*(x[n] for n in ARG_NAMES), out, 0.125, 20.0, cfg)
    assert grid == (30,) and kwargs["NV"] == 5 and kwargs["EVEN"]
    launches = []
    kernel = tk._jitted(tk._interpret_mode())

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(tk, "_jitted", lambda interpret: Counting())
    check_against_reference(x, fn=lambda *a, **kw: tk.fused_gdn_decode_triton(*a, config=cfg, **kw))
    assert launches == [(10,)] * 3


@pytest.mark.parametrize("K,V,state_dtype,even", [(2032, 140000, torch.float32, False),
                                                  (2032, 140000, torch.bfloat16, False),
                                                  (136, 48, torch.float32, False),
                                                  (64, 48, torch.bfloat16, False),
                                                  (128, 128, torch.float32, True)])
def test_grid_within_cuda_limits(K, V, state_dtype, even):
    # Shapes the op accepts with more than 65535 V tiles (one row per tile at K = 2032) go on the
    # one grid axis; a padded row (K < BK) or a partial V tile turns the state masks on. On meta
    # tensors: only the launch configuration.
    meta = {"device": "meta", "dtype": torch.bfloat16}
    mixed_qkv, ab = torch.empty(2, 2 * K + V, **meta), torch.empty(2, 1, **meta)
    a_log, dt_bias = torch.empty(1, device="meta"), torch.empty(1, **meta)
    state = torch.empty(2, 1, V, K, device="meta", dtype=state_dtype)
    idx = torch.empty(2, device="meta", dtype=torch.int32)
    out = torch.empty(2, 1, 1, V, **meta)
    grid, _, kwargs = tk.launch_config(mixed_qkv, ab, ab, a_log, dt_bias, state, idx, out, 0.125,
                                       20.0)
    v_tiles = triton.cdiv(V, tk.tile_config(K, V, state_dtype).BV)
    assert grid == (2 * v_tiles,) and kwargs["NV"] == v_tiles
    assert kwargs["EVEN"] is even


def test_programs_per_launch(monkeypatch):
    # CUDA: 2**31 - 1 programs on axis 0. ROCm limits the threads of a launch to 2**32 - 1, 64
    # lanes a warp, so fewer programs of more warps.
    monkeypatch.setattr(torch.version, "hip", None)
    assert tk.programs_per_launch(1) == tk.programs_per_launch(2) == 2**31 - 1
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert tk.programs_per_launch(1) == (2**32 - 1) // 64
    assert tk.programs_per_launch(2) == (2**32 - 1) // 128


def test_norm_epsilon_inside_the_root():
    # As test_correctness.py's: an epsilon anywhere but inside the root changes the normalised
    # q and k by tens of percent.
    x = make_inputs(Case(B=2, H=1, Hv=2, K=64, V=16, seed=11))
    x["mixed_qkv"][:, :2 * 64].mul_(1e-4)
    check_against_reference(x, fn=cuda_entry)


def test_deterministic():
    x = make_inputs(Case(B=2, H=1, Hv=2, K=64, V=16, state_dtype=torch.bfloat16))
    runs = [clone_inputs(x) for _ in range(2)]
    outs = [call(cuda_entry, r) for r in runs]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(runs[0]["state_ref"], runs[1]["state_ref"])


def test_softplus_threshold_passes_through():
    x = make_inputs(Case(B=2, H=1, Hv=2, K=64, V=8))
    x["a"].fill_(3.0)  # x = a + dt_bias around 3: the clamp at 1.0 changes the result
    check_against_reference(x, fn=cuda_entry, softplus_threshold=1.0)


def _out_of_range_slot():
    """Inputs whose row 1 names slot BlockNum (out of range), and a copy of their pool."""
    x = make_inputs(Case(B=3, H=1, Hv=2, K=64, V=8))
    pool = x["state_ref"].shape[0]
    y = dict(x, ssm_state_indices=torch.tensor([1, pool, 2], dtype=torch.int32))
    return y, pool, y["state_ref"].clone()


def test_index_values_unchecked_by_default():
    # Without the debug switch (the rejections with it are in test_validation.py's table), an
    # out-of-range slot is still never dereferenced: row 1 gets zeros and the pool is untouched
    # outside the two valid slots.
    y, pool, before = _out_of_range_slot()
    old = cuda_backend.set_check_indices(False)
    try:
        out = call(cuda_entry, y)
    finally:
        cuda_backend.set_check_indices(old)
    assert torch.count_nonzero(out[1]) == 0
    keep = torch.ones(pool, dtype=torch.bool)
    keep[[1, 2]] = False
    assert torch.equal(y["state_ref"][keep], before[keep])


def test_index_check_follows_the_environment_on_every_call(monkeypatch):
    # CUSTOM_OPS_CHECK_INDICES set after import turns the check on for the next call, as
    # CUSTOM_OPS_NPU_CHECK_INDICES does on NPU; the refused call leaves the pool as it was.
    y, pool, before = _out_of_range_slot()
    old = cuda_backend.set_check_indices(None)
    try:
        monkeypatch.setenv("CUSTOM_OPS_CHECK_INDICES", "1")
        with pytest.raises(ValueError, match=rf"ssm_state_indices\[1\] = {pool} is out of range"):
            call(cuda_entry, y)
        assert torch.equal(y["state_ref"], before)
        monkeypatch.setenv("CUSTOM_OPS_CHECK_INDICES", "0")
        out = call(cuda_entry, y)
    finally:
        cuda_backend.set_check_indices(old)
    assert torch.count_nonzero(out[1]) == 0
    assert not torch.equal(y["state_ref"], before)


@pytest.mark.parametrize("K,V,dtype", [(128, 128, torch.float32), (128, 128, torch.bfloat16),
                                       (2032, 128, torch.float32), (136, 48, torch.float16),
                                       (64, 8, torch.float32)])
def test_tile_table(K, V, dtype):
    cfg = tk.tile_config(K, V, dtype)
    assert cfg.BK >= K and cfg.BK & (cfg.BK - 1) == 0
    assert 1 <= cfg.BV <= triton.next_power_of_2(V) and cfg.BV & (cfg.BV - 1) == 0
    assert cfg.num_warps in (1, 2, 4, 8)
    elem = torch.empty((), dtype=dtype).element_size()
    assert cfg.BV * cfg.BK * elem <= 16384 or cfg.BV == 1  # bounded registers per program
    assert tk.tile_config(K, V, dtype) is cfg  # cached: no re-tuning per call


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16], ids=short)
def test_state_rounds_to_nearest_even(state_dtype):
    # Kernel and reference differ only by fp32 summation order, so with the same rounding their
    # 16-bit states agree bit for bit almost everywhere; truncation would differ in about half
    # the elements and still pass the tolerance check above.
    dtype = torch.float16 if state_dtype == torch.float16 else torch.bfloat16
    x = make_inputs(Case(B=3, H=1, Hv=2, K=64, V=16, dtype=dtype, state_dtype=state_dtype))
    ours, ref = check_against_reference(x, fn=cuda_entry)
    rows = x["ssm_state_indices"].long()
    same = (ours["state_ref"][rows] == ref["state_ref"][rows]).float().mean().item()
    assert same > 0.99, f"only {same:.1%} of the updated state matches the reference bit for bit"
    out, out_ref = call(cuda_entry, ours), call(fused_gdn_decode_reference, ref)
    same_out = (out == out_ref).float().mean().item()
    assert same_out > 0.9, f"only {same_out:.1%} of out matches the reference bit for bit"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter, on inf/NaN
@pytest.mark.parametrize("value", NONFINITE, ids=str)
@pytest.mark.parametrize("place", VALUE_PLACES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=short)
def test_nan_and_inf_like_the_reference(state_dtype, place, value):
    check_nonfinite_case(cuda_entry, "cpu", state_dtype, place, value)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_inf_in_v_stays_inf_with_padded_k():
    # The case behind the test above's v rows, spelled out: the reference gives +Inf; zero-padded
    # K lanes computing inf * 0 would give NaN.
    H, K = 1, 136
    x = make_inputs(Case(B=2, H=H, Hv=2, K=K, V=8, seed=3))
    x["mixed_qkv"][:, :2 * H * K] = 1.0
    x["mixed_qkv"][0, 2 * H * K] = float("inf")
    ours, ref = clone_inputs(x), clone_inputs(x)
    out, out_ref = call(cuda_entry, ours), call(fused_gdn_decode_reference, ref)
    assert out_ref[0, 0, 0, 0] == float("inf")
    assert_close(out, out_ref, "out", equal_nan=True)
