"""Property-based tests (hypothesis) of the CPU op and of the shared input check.

- every accepted input (shapes, dtype pairs, strides, storage offsets, slot vectors, kernel
  variant, thread count, huge gates) matches the reference; slots not named and the memory around
  the state stay bit-identical;
- NaN/Inf in any input or in the state propagate exactly like the reference (equal_nan);
- random garbage (any rank, size, dtype, device, scalar) never crashes and never raises anything
  but TypeError/ValueError from the op's check (each rejection rule itself, on every backend, is in
  test_validation.py's table).

Example counts: the default run is derandomized (reproducible in CI) and takes well under a minute;
`pytest --slow` runs 25x more with fresh randomness; CUSTOM_OPS_FUZZ_EXAMPLES=N sets N per test.
"""

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import custom_ops
from custom_ops import fused_gdn_decode_reference
from custom_ops.testing import (
    ALL_DTYPES,
    ARG_NAMES,
    DTYPE_PAIRS,
    OP,
    RANK,
    assert_close,
    call,
    storage_bytes,
    use_cpu_isa,
    use_threads,
)

_SLOW = os.environ.get("CUSTOM_OPS_FUZZ_SLOW") == "1"
_N = int(os.environ.get("CUSTOM_OPS_FUZZ_EXAMPLES", "0"))
INT32_MIN = -(2**31)
ISAS = custom_ops.cpu_isas()


def fuzz(default_examples):
    """Hypothesis settings: `default_examples` per test, 25x under --slow, or N from the env."""
    n = _N or (default_examples * 25 if _SLOW else default_examples)
    return settings(
        max_examples=n, deadline=None, derandomize=not (_SLOW or _N), print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much])


# ---------------------------------------------------------------------------------------------
# Accepted inputs


def _ks(state_dtype):
    """K values: both ends of the range and values leaving partial vectors (16 and 32 lanes).
    With a float32 state only K % 16 == 0 or >= 8 is legal (row padding)."""
    ks = [64, 72, 88, 120, 128, 136, 200, 2032]
    if state_dtype != torch.float32:
        ks += [65, 100, 129, 2031]
    return ks


def _layout_2d(t, kind):
    """The same values as t (B, N) in another memory layout."""
    B, N = t.shape
    if kind == "column_slice":  # a column slice of a wider projection: storage offset, row stride
        big = torch.zeros(B, N + 5, dtype=t.dtype)
        big[:, 3:3 + N] = t
        return big[:, 3:3 + N]
    if kind == "column_major":
        return t.t().contiguous().t()
    if kind == "row_step":
        big = torch.zeros(2 * B, N, dtype=t.dtype)
        big[1::2] = t
        return big[1::2]
    if kind == "column_step":
        big = torch.zeros(B, 2 * N, dtype=t.dtype)
        big[:, 1::2] = t
        return big[:, 1::2]
    if kind == "broadcast_row":  # stride 0: every row reads row 0 (both sides see the same values)
        return t[:1].expand(B, N)
    return t.contiguous()


def _layout_1d(t, kind):
    if kind == "step":
        big = torch.zeros(2 * t.numel() + 1, dtype=t.dtype)
        big[1::2] = t
        return big[1::2]
    if kind == "broadcast":
        return t[:1].expand(t.numel())
    return t.contiguous()


LAYOUTS_2D = ["contiguous", "column_slice", "column_major", "row_step", "column_step",
              "broadcast_row"]
INVALID_INDEX = st.sampled_from([0, -1, -7, INT32_MIN])
# Gate magnitudes: realistic, large, and far beyond any softplus/sigmoid saturation (1e30 is inf in
# float16).
GATE_SCALE = st.sampled_from([1.0, 10.0, 1e3, 1e30])
SPECIALS = [float("nan"), float("inf"), float("-inf")]
GUARD = 37  # elements of the state's storage before and after it; must never change


@st.composite
def cases(draw, specials=False):
    """One accepted call, as a dict of plain parameters (tensors are built by _build)."""
    dtype, state_dtype = draw(st.sampled_from(DTYPE_PAIRS))
    K = draw(st.sampled_from(_ks(state_dtype)))
    H = draw(st.sampled_from([1, 2, 3]))
    Hv = H * draw(st.sampled_from([1, 2, 3, 4]))
    V = draw(st.integers(1, 8 if K > 1000 else 40))
    B = draw(st.integers(1, 9))
    block_num = draw(st.integers(1, 12))  # B > BlockNum happens: then some rows must be invalid
    n_valid = draw(st.integers(0, min(B, block_num - 1)))
    slots = draw(st.permutations(range(1, block_num)))[:n_valid]
    rows = draw(st.permutations(range(B)))[:n_valid]
    idx = [draw(INVALID_INDEX) for _ in range(B)]
    for r, s in zip(rows, slots):
        idx[r] = s
    p = dict(
        dtype=dtype, state_dtype=state_dtype, B=B, H=H, Hv=Hv, K=K, V=V, block_num=block_num,
        idx=idx, seed=draw(st.integers(0, 2**31 - 1)),
        qkv_scale=draw(st.sampled_from([1.0, 0.01, 30.0])),
        a_scale=draw(GATE_SCALE), b_scale=draw(GATE_SCALE),
        a_log_scale=draw(st.sampled_from([0.5, 3.0, 30.0])),
        state_scale=draw(st.sampled_from([0.5, 10.0])),
        scale=draw(st.sampled_from([K**-0.5, 1.0, 0.0, -2.5])),
        softplus_threshold=draw(st.sampled_from([20.0, 1.0, 0.0, -5.0, 1e4])),
        qkv_layout=draw(st.sampled_from(LAYOUTS_2D)),
        ab_layout=draw(st.sampled_from(LAYOUTS_2D[:-1] + ["projection"])),
        vec_layout=draw(st.sampled_from(["contiguous", "step", "broadcast"])),
        idx_layout=draw(st.sampled_from(["contiguous", "step"])),
        isa=draw(st.sampled_from(ISAS)), threads=draw(st.sampled_from([1, 2])),
        inject=[],
    )
    if specials:
        # v weighted up: an Inf there makes delta infinite, the case that once leaked NaN out of
        # the kernel's padded lanes.
        targets = ["q", "k", "v", "v", "v", "a", "b", "dt_bias", "a_log", "state_named",
                   "state_other"]
        # q = k makes every term of out = S q the same sign, so an Inf stays Inf instead of
        # turning into NaN by cancellation: NaN where the reference has Inf is then visible.
        p["q_equals_k"] = draw(st.booleans())
        p["inject"] = draw(st.lists(st.tuples(st.sampled_from(targets), st.integers(0, 2**20),
                                              st.sampled_from(SPECIALS)), min_size=1, max_size=3))
    return p


def _build(p):
    """Tensors of one call from the parameters of `cases` (specials injected before the layouts,
    since stride-0 views cannot be written)."""
    g = torch.Generator().manual_seed(p["seed"])
    B, H, Hv, K, V, P = p["B"], p["H"], p["Hv"], p["K"], p["V"], p["block_num"]
    dt, sdt = p["dtype"], p["state_dtype"]
    W = 2 * H * K + Hv * V

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    qkv = randn(B, W) * p["qkv_scale"]
    if p.get("q_equals_k"):
        qkv[:, :H * K] = qkv[:, H * K:2 * H * K]
    a = randn(B, Hv) * p["a_scale"]
    b = randn(B, Hv) * p["b_scale"]
    a_log = randn(Hv) * p["a_log_scale"]
    dt_bias = randn(Hv) * 0.5
    state = randn(P, Hv, V, K) * p["state_scale"]
    named = [s for s in p["idx"] if s > 0]
    others = [s for s in range(P) if s not in named]
    for target, pos, value in p["inject"]:
        if target in ("q", "k", "v"):
            lo, n = {"q": (0, H * K), "k": (H * K, H * K), "v": (2 * H * K, Hv * V)}[target]
            qkv[pos % B, lo + pos % n] = value
        elif target in ("a", "b"):
            (a if target == "a" else b).view(-1)[pos % (B * Hv)] = value
        elif target in ("dt_bias", "a_log"):
            (dt_bias if target == "dt_bias" else a_log)[pos % Hv] = value
        else:
            pool = named if target == "state_named" else others
            if pool:
                state[pool[pos % len(pool)]].view(-1)[pos % (Hv * V * K)] = value

    qkv, a, b, dt_bias = qkv.to(dt), a.to(dt), b.to(dt), dt_bias.to(dt)
    if p["ab_layout"] == "projection":  # a and b: column slices of one (B, 2*Hv) projection
        ab = torch.cat([a, b], dim=1)
        a, b = ab[:, :Hv], ab[:, Hv:]
    else:
        a, b = _layout_2d(a, p["ab_layout"]), _layout_2d(b, p["ab_layout"])
    # A contiguous state with a storage offset and guard elements on both sides in one storage.
    storage = torch.randn(GUARD + state.numel() + GUARD, generator=g).to(sdt)
    state_ref = storage[GUARD:GUARD + state.numel()].view(P, Hv, V, K)
    state_ref.copy_(state.to(sdt))
    return dict(
        mixed_qkv=_layout_2d(qkv, p["qkv_layout"]), a=a, b=b,
        a_log=_layout_1d(a_log, p["vec_layout"]), dt_bias=_layout_1d(dt_bias, p["vec_layout"]),
        state_ref=state_ref,
        ssm_state_indices=_layout_1d(torch.tensor(p["idx"], dtype=torch.int32), p["idx_layout"]),
        scale=p["scale"],
    )


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _assert_matches(actual, expected, what):
    assert_close(actual, expected, what, equal_nan=True)


def _check_case(p):
    x = _build(p)
    ref_x = dict(x, state_ref=x["state_ref"].clone())
    storage_before = storage_bytes(x["state_ref"])
    state_before = x["state_ref"].clone()
    thr = p["softplus_threshold"]
    with use_cpu_isa(p["isa"]), use_threads(p["threads"]):
        out = call(OP, x, softplus_threshold=thr)
    out_ref = call(fused_gdn_decode_reference, ref_x, softplus_threshold=thr)

    assert out.shape == out_ref.shape and out.dtype == out_ref.dtype and out.is_contiguous()
    _assert_matches(out, out_ref, "out")
    _assert_matches(x["state_ref"], ref_x["state_ref"], "state")
    invalid = torch.tensor([s <= 0 for s in p["idx"]])
    assert torch.all(out[invalid] == 0), "an invalid row has a non-zero output"
    # Bit-exact: slots not named and the guard memory around the state are untouched.
    named = {s for s in p["idx"] if s > 0}
    for s in range(p["block_num"]):
        if s not in named:
            assert torch.equal(_bits(x["state_ref"][s]), _bits(state_before[s])), f"slot {s}"
    storage_after = storage_bytes(x["state_ref"])
    nbytes = GUARD * x["state_ref"].element_size()
    assert torch.equal(storage_after[:nbytes], storage_before[:nbytes]), "wrote before the state"
    assert torch.equal(storage_after[-nbytes:], storage_before[-nbytes:]), "wrote after the state"


@fuzz(100)
@given(cases())
def test_accepted_inputs_match_reference(p):
    _check_case(p)


@fuzz(100)
@given(cases(specials=True))
def test_nan_inf_propagate_like_reference(p):
    _check_case(p)


# ---------------------------------------------------------------------------------------------
# Garbage: nothing crashes; only the op's own TypeError/ValueError comes out

DIM = st.sampled_from([0, 1, 2, 3, 4, 8, 16, 64, 65, 72, 128, 2033])


@st.composite
def garbage(draw):
    x = {}
    for name in ARG_NAMES:
        rank = draw(st.one_of(st.just(RANK[name]), st.integers(0, 5)))
        shape = draw(st.lists(DIM, min_size=rank, max_size=rank))
        n = 1
        for d in shape:
            n *= d
        assume(n <= 1 << 20)
        dtype = draw(st.sampled_from(ALL_DTYPES))
        device = draw(st.sampled_from(["cpu"] * 9 + ["meta"]))
        t = (torch.randn(shape) * 4).to(dtype) if dtype != torch.bool else torch.ones(shape,
                                                                                         dtype=dtype)
        x[name] = t.to(device)
    x["scale"] = draw(st.floats(allow_nan=True, allow_infinity=True))
    return x, draw(st.floats(allow_nan=True, allow_infinity=True))


@fuzz(300)
@given(garbage())
def test_garbage_never_crashes(case):
    x, thr = case
    state = x["state_ref"]
    on_cpu = state.device.type == "cpu"
    before = storage_bytes(state) if on_cpu else None
    ref_x = dict(x, state_ref=state.clone())
    try:
        out = call(OP, x, softplus_threshold=thr)
    except (TypeError, ValueError) as e:
        assert "npu_fused_gdn_decode" in str(e), str(e)
        if on_cpu:
            assert torch.equal(storage_bytes(state), before), "a rejected call changed state_ref"
        return
    # Accepted by chance: then it must be right.
    if out.device.type == "cpu":
        out_ref = call(fused_gdn_decode_reference, ref_x, softplus_threshold=thr)
        _assert_matches(out, out_ref, "out")
        _assert_matches(state, ref_x["state_ref"], "state")


# ---------------------------------------------------------------------------------------------
# Named adversarial cases (each is also in the strategies above; here they always run)


def _simple(B=3, Hv=4, H=2, K=64, V=16, P=8, dtype=torch.bfloat16, state_dtype=torch.float32,
            idx=None, seed=0):
    p = dict(dtype=dtype, state_dtype=state_dtype, B=B, H=H, Hv=Hv, K=K, V=V, block_num=P,
             idx=idx if idx is not None else list(range(1, B + 1)), seed=seed, qkv_scale=1.0,
             a_scale=1.0, b_scale=1.0, a_log_scale=0.5, state_scale=0.5, scale=K**-0.5,
             softplus_threshold=20.0, qkv_layout="contiguous", ab_layout="projection",
             vec_layout="contiguous", idx_layout="contiguous", inject=[],
             isa=custom_ops.cpu_isa(), threads=torch.get_num_threads())
    return p


@pytest.mark.parametrize("K,state_dtype", [(72, torch.float32), (136, torch.float32),
                                           (100, torch.bfloat16), (64, torch.float32)],
                         ids=["K72-fp32", "K136-fp32", "K100-bf16", "K64-fp32"])
def test_inf_in_v_stays_inf_with_partial_vectors(isa, K, state_dtype):
    """With an Inf in v, delta is infinite: the zero-padded lanes of the last partial vector (any
    K that is not a multiple of the vector step) give delta * 0 = NaN, which must not reach out
    (the reference gives Inf there)."""
    x = _build(_simple(B=2, H=1, Hv=2, K=K, V=8, state_dtype=state_dtype))
    x["mixed_qkv"][:, :2 * K] = 1.0  # q = k: every q_t * k_t > 0, so out is +Inf, not NaN
    x["mixed_qkv"][0, 2 * K] = float("inf")
    ref_x = dict(x, state_ref=x["state_ref"].clone())
    out = call(OP, x)  # on the kernel variant of the isa fixture
    out_ref = call(fused_gdn_decode_reference, ref_x)
    assert out_ref[0, 0, 0, 0] == float("inf")
    _assert_matches(out, out_ref, "out")
    _assert_matches(x["state_ref"], ref_x["state_ref"], "state")


@pytest.mark.parametrize("dtype,state_dtype", DTYPE_PAIRS)
def test_infinite_state_with_a_vanishing_decay(isa, dtype, state_dtype):
    """exp(g) = 1.4e-44 (a float32 denormal) on a state holding +-Inf where k is small: the
    contract decays each state element before the dot product, (exp(g) s) k = Inf k = Inf;
    s (exp(g) k) would round exp(g) k to zero there and give Inf * 0 = NaN for the whole row."""
    K = 72
    x = _build(_simple(B=2, H=1, Hv=2, K=K, V=8, dtype=dtype, state_dtype=state_dtype))
    x["mixed_qkv"][:, K:2 * K] = 1.0
    x["mixed_qkv"][:, K + 3] = 1e-3  # k[3] ~ 1e-4 after normalising: exp(g) k[3] underflows
    x["a"].fill_(1.0)
    x["dt_bias"].zero_()
    x["a_log"].fill_(math.log(101.0 / math.log1p(math.e)))  # g = -exp(a_log) softplus(1) = -101
    x["state_ref"][1, 0, 0, 3] = float("inf")
    x["state_ref"][2, 1, 5, 3] = float("-inf")
    ref_x = dict(x, state_ref=x["state_ref"].clone())
    out = call(OP, x)
    out_ref = call(fused_gdn_decode_reference, ref_x)
    assert ref_x["state_ref"][1, 0, 0].isinf().sum() == K - 1, "the reference keeps the Infs"
    _assert_matches(out, out_ref, "out")
    _assert_matches(x["state_ref"], ref_x["state_ref"], "state")


@pytest.mark.parametrize("dtype,state_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("K", [64, 2032])
def test_k_at_both_ends(dtype, state_dtype, K):
    _check_case(_simple(B=2, H=1, Hv=2, K=K, V=4, dtype=dtype, state_dtype=state_dtype))


@pytest.mark.parametrize("name,idx", [
    ("BlockNum-1", [7, 1, 2]),
    ("INT32_MIN-invalid", [INT32_MIN, 7, -1]),
    ("all-invalid", [0, -1, INT32_MIN]),
    ("B-larger-than-BlockNum", [0, 2, -1, 0, 1, -5, 0, 0, 0, 0]),
])
def test_accepted_slot_vectors(name, idx):
    P = 3 if name == "B-larger-than-BlockNum" else 8
    _check_case(_simple(B=len(idx), P=P, idx=idx))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [1e30, -1e30, 6e4, -6e4, float("inf"), float("-inf")])
def test_huge_gates(dtype, value):
    """a and b far beyond saturation (or infinite): decay 0 or 1, beta 0 or 1, like the
    reference."""
    for which in ("a", "b"):
        p = _simple(dtype=dtype)
        x = _build(p)
        x[which][1] = value
        ref_x = dict(x, state_ref=x["state_ref"].clone())
        out = call(OP, x)
        out_ref = call(fused_gdn_decode_reference, ref_x)
        _assert_matches(out, out_ref, f"out ({which} = {value})")
        _assert_matches(x["state_ref"], ref_x["state_ref"], f"state ({which} = {value})")
