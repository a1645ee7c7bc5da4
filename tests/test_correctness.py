"""The CPU op against the pure-torch reference (docs/spec.md semantics), and its slot, stride and
determinism guarantees. The kernel variants against each other, bit for bit, and the variant
choice: test_cpu_kernel.py."""

import itertools

import numpy as np
import pytest
import torch

import custom_ops
from custom_ops import fused_gdn_decode_reference
from custom_ops.testing import (
    ARG_NAMES,
    DTYPE_PAIR_IDS,
    DTYPE_PAIRS,
    OP,
    TOLERANCES,
    Case,
    assert_close,
    call,
    check_against_reference,
    clone_inputs,
    make_inputs,
    short,
    use_threads,
)


def _matrix():
    """Every dtype pair x GQA ratio x K; V and B cycle through their values so each appears with
    every dtype pair. K = 129 is only legal with a 16-bit state."""
    cases = []
    vs, bs = itertools.cycle([8, 128]), itertools.cycle([1, 3, 17])
    for (dt, sdt), ratio, K in itertools.product(DTYPE_PAIRS, [1, 2, 4], [64, 128, 136, 2032]):
        H = 1 if K == 2032 else 2
        cases.append(Case(B=next(bs), H=H, Hv=H * ratio, K=K, V=next(vs), dtype=dt,
                          state_dtype=sdt, invalid_rows=()))
    for dt, sdt in DTYPE_PAIRS:
        if sdt != torch.float32:
            cases.append(Case(B=3, H=2, Hv=4, K=129, V=8, dtype=dt, state_dtype=sdt))
    return cases


@pytest.mark.parametrize("case", _matrix(), ids=Case.id)
def test_matches_reference(case):
    check_against_reference(make_inputs(case), steps=2)


@pytest.mark.parametrize("dtype,state_dtype", DTYPE_PAIRS, ids=DTYPE_PAIR_IDS)
def test_qwen3_next_decode_steps(dtype, state_dtype):
    """Realistic shapes (Qwen3-Next: H=16, Hv=32, K=V=128), several steps on the same slots with
    an invalid row among them."""
    case = Case(B=8, H=16, Hv=32, K=128, V=128, dtype=dtype, state_dtype=state_dtype,
                invalid_rows=(5,), pool=20)
    check_against_reference(make_inputs(case), steps=4)


@pytest.mark.parametrize("H,Hv", [(8, 16), (4, 8), (2, 4), (16, 64), (16, 48)])
def test_tensor_parallel_shards_and_qwen35(H, Hv):
    case = Case(B=4, H=H, Hv=Hv, K=128, V=128, pool=6)
    check_against_reference(make_inputs(case), steps=1)


_VARIANT_SHAPES = [
    (K, sdt)
    for K in (64, 72, 129, 136, 200)
    for sdt in (torch.float32, torch.bfloat16, torch.float16)
    if not (K == 129 and sdt == torch.float32)  # rejected with a float32 state
]


@pytest.mark.parametrize("K,state_dtype", _VARIANT_SHAPES,
                         ids=[f"K{k}-{short(s)}" for k, s in _VARIANT_SHAPES])
def test_every_kernel_variant(isa, threads, K, state_dtype):
    """Each instruction-set variant (portable included), with K values that leave a partial vector
    step for every vector width, on 1 and 2 threads."""
    dtype = torch.float16 if state_dtype == torch.float16 else torch.bfloat16
    case = Case(B=5, H=2, Hv=6, K=K, V=12, dtype=dtype, state_dtype=state_dtype,
                invalid_rows=(1, 4))
    check_against_reference(make_inputs(case), steps=2)


@pytest.mark.parametrize("dtype,state_dtype", DTYPE_PAIRS, ids=DTYPE_PAIR_IDS)
def test_results_round_to_nearest_even(dtype, state_dtype):
    # The kernel and the reference differ only by fp32 summation order, so with the same rounding
    # (to nearest even) their 16-bit results agree bit for bit almost everywhere; truncation or
    # another rounding would differ in about half of them and could still pass the tolerances.
    x = make_inputs(Case(B=3, H=2, Hv=4, K=128, V=64, dtype=dtype, state_dtype=state_dtype))
    ours, ref = clone_inputs(x), clone_inputs(x)
    out, out_ref = call(OP, ours), call(fused_gdn_decode_reference, ref)
    slots = x["ssm_state_indices"].long()
    valid = slots > 0  # invalid rows' zeros would count as matches
    same_out = (out[valid] == out_ref[valid]).float().mean().item()
    assert same_out > 0.95, f"only {same_out:.1%} of out matches the reference bit for bit"
    if state_dtype != torch.float32:
        rows = slots[valid]
        same = (ours["state_ref"][rows] == ref["state_ref"][rows]).float().mean().item()
        assert same > 0.99, f"only {same:.1%} of the state matches the reference bit for bit"


def test_norm_epsilon_inside_the_root():
    # q and k of about 1e-4 per element: their sums of squares (about 6e-7 at K = 64) are of the
    # size of the 1e-6 added before the square root (spec step 2), so an epsilon put anywhere
    # else changes the normalised vectors by tens of percent.
    x = make_inputs(Case(B=2, H=1, Hv=2, K=64, V=16, seed=11))
    x["mixed_qkv"][:, :2 * 64].mul_(1e-4)
    check_against_reference(x)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=short)
def test_invalid_rows_and_untouched_slots(state_dtype):
    """Rows with index <= 0 give zeros and read/write no state; slots not named are untouched."""
    case = Case(B=6, H=2, Hv=4, K=64, V=16, state_dtype=state_dtype, invalid_rows=(0, 3, 5))
    inputs = make_inputs(case)
    idx = inputs["ssm_state_indices"]
    assert (idx[[0, 3, 5]] <= 0).all() and (idx[[1, 2, 4]] > 0).all()
    before = inputs["state_ref"].clone()
    ours, _ = check_against_reference(inputs)
    out = call(OP, clone_inputs(inputs))
    assert torch.equal(out[[0, 3, 5]], torch.zeros_like(out[[0, 3, 5]]))
    assert (out[[1, 2, 4]] != 0).any()
    touched = set(idx[idx > 0].tolist())
    for slot in range(before.shape[0]):
        if slot not in touched:
            assert torch.equal(ours["state_ref"][slot], before[slot]), f"slot {slot} was written"
        else:
            assert not torch.equal(ours["state_ref"][slot], before[slot])


def test_all_rows_invalid():
    inputs = make_inputs(Case(B=3))
    inputs["ssm_state_indices"] = torch.tensor([0, -1, -7], dtype=torch.int32)
    before = inputs["state_ref"].clone()
    out = call(OP, inputs)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(inputs["state_ref"], before)


def test_invalid_slot_zero_is_not_read():
    """Slot 0 is the null slot: rows with index 0 (and -1) neither read nor write it, so NaN there
    leaks into no output and its bytes stay as they were; the valid row matches the reference."""
    inputs = make_inputs(Case(B=3, indices=(0, 5, -1)))
    inputs["state_ref"][0] = float("nan")
    ref = clone_inputs(inputs)
    before = inputs["state_ref"].clone()
    out = call(OP, inputs)
    out_ref = call(fused_gdn_decode_reference, ref)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    assert_close(out, out_ref, "out")
    assert_close(inputs["state_ref"][1:], ref["state_ref"][1:], "state")
    assert torch.equal(inputs["state_ref"][0].view(torch.int32), before[0].view(torch.int32))


def _strided_copy(t, pad=3):
    """The same values as `t`, laid out with non-unit strides and a storage offset."""
    big = torch.zeros(*[s * 2 + pad for s in t.shape], dtype=t.dtype)
    view = big[tuple(slice(1, 1 + 2 * s, 2) for s in t.shape)]
    view.copy_(t)
    assert not view.is_contiguous() and view.storage_offset() > 0
    return view


def test_non_contiguous_inputs_match_contiguous(isa):
    """Views (strided, offset) of every input but the state give bit-identical results."""
    inputs = make_inputs(Case(B=5, H=2, Hv=4, K=72, V=16, invalid_rows=(2,)))
    contiguous = {k: (v.contiguous() if torch.is_tensor(v) else v) for k, v in inputs.items()}
    strided = {k: (_strided_copy(v) if torch.is_tensor(v) and k != "state_ref" else v)
               for k, v in inputs.items()}
    # mixed_qkv as the transpose of a column-major buffer: column stride B, not 1.
    strided["mixed_qkv"] = inputs["mixed_qkv"].t().contiguous().t()
    assert strided["mixed_qkv"].stride() == (1, inputs["mixed_qkv"].shape[0])
    # The state may be a contiguous view with a storage offset.
    pool = torch.full((1 + inputs["state_ref"].shape[0],) + inputs["state_ref"].shape[1:], 7.0,
                      dtype=inputs["state_ref"].dtype)
    pool[1:] = inputs["state_ref"]
    strided["state_ref"] = pool[1:]
    contiguous["state_ref"] = inputs["state_ref"].clone()
    out_c = call(OP, contiguous)
    out_s = call(OP, strided)
    assert torch.equal(out_c, out_s)
    assert torch.equal(contiguous["state_ref"], strided["state_ref"])
    assert (pool[0] == 7.0).all()  # the storage before the view is not written


def test_softplus_threshold_keyword():
    """softplus_threshold is honoured (and keyword-only) the same way as in the reference."""
    inputs = make_inputs(Case(B=4, seed=3))
    # x = a + dt_bias in [2.25, 2.75]: above a threshold of 2, where softplus(x) - x is still
    # ~0.07-0.1; exp(a_log) = 0.37 keeps the decay (~0.4) from wiping the state.
    inputs["dt_bias"].fill_(0.5)
    inputs["a"].copy_(torch.linspace(1.75, 2.25, inputs["a"].numel()).view(inputs["a"].shape))
    inputs["a_log"].fill_(-1.0)
    # The test can fail: the two thresholds give states far apart at the state's tolerance.
    at_2, at_20 = clone_inputs(inputs), clone_inputs(inputs)
    call(fused_gdn_decode_reference, at_2, softplus_threshold=2.0)
    call(fused_gdn_decode_reference, at_20, softplus_threshold=20.0)
    atol, _ = TOLERANCES[inputs["state_ref"].dtype]
    assert (at_2["state_ref"] - at_20["state_ref"]).abs().max() > 100 * atol
    check_against_reference(inputs, softplus_threshold=2.0)
    with pytest.raises(RuntimeError, match="positional"):
        OP(*[inputs[k] for k in ("mixed_qkv", "a", "b", "a_log", "dt_bias", "state_ref",
                                 "ssm_state_indices", "scale")], 2.0)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=short)
def test_deterministic_across_runs_and_threads(state_dtype):
    inputs = make_inputs(Case(B=9, H=2, Hv=8, K=136, V=32, state_dtype=state_dtype))
    results = []
    for threads in (1, 2, 2, 1):
        with use_threads(threads):
            x = clone_inputs(inputs)
            results.append((call(OP, x), x["state_ref"]))
    for out, state in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(state, results[0][1])


@pytest.mark.parametrize("threshold", [20.0, 2.0])
def test_wrapper_matches_op(threshold):
    inputs = make_inputs(Case(seed=3))
    inputs["a"].mul_(0).add_(8)  # x = a + dt_bias around 8: above a threshold of 2
    a, b = clone_inputs(inputs), clone_inputs(inputs)
    out = custom_ops.fused_gdn_decode(*(a[k] for k in ARG_NAMES), a["scale"],
                                      softplus_threshold=threshold)
    assert torch.equal(out, call(OP, b, softplus_threshold=threshold))
    assert torch.equal(a["state_ref"], b["state_ref"])


def test_reference_square_root_is_correctly_rounded():
    # The reference's L2 norm takes IEEE sqrt, as the kernels do (numpy's float32 sqrt is IEEE),
    # on a tensor large enough for torch's vectorised sqrt, which is not.
    from custom_ops.reference import NORM_EPS, l2_norm

    x = torch.rand(300_000, 3, generator=torch.Generator().manual_seed(0)) * 50
    s = ((x * x).sum(-1, keepdim=True) + NORM_EPS).numpy()
    assert torch.equal(l2_norm(x), torch.from_numpy(np.sqrt(s)))
