"""Every rejection in SPEC.md "Validation": exception type, a message fragment naming the argument,
and state_ref left bit-for-bit unchanged. The Meta kernel rejects the same inputs."""

import pytest
import torch

from utils import OP, Case, call, make_inputs

U32 = 2**32  # one past UINT32_MAX


def base(**kw):
    return make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16, **kw))


def with_(inputs, **changes):
    x = dict(inputs)
    x.update(changes)
    return x


def expanded(shape, dtype):
    """A huge tensor without memory (stride 0): lets the CPU path see sizes beyond UINT32_MAX."""
    return torch.zeros((1,) * len(shape), dtype=dtype).expand(*shape)


def _state_like(x, shape=None, dtype=None):
    s = x["state_ref"]
    return torch.zeros(shape or s.shape, dtype=dtype or s.dtype)


# (id, build(inputs) -> bad inputs, exception type, message fragment)
REJECTIONS = [
    # ranks
    ("rank-mixed_qkv", lambda x: with_(x, mixed_qkv=x["mixed_qkv"][None]), ValueError,
     "mixed_qkv must be a 2-D tensor"),
    ("rank-a", lambda x: with_(x, a=x["a"][0]), ValueError, "a must be a 2-D tensor"),
    ("rank-b", lambda x: with_(x, b=x["b"][None]), ValueError, "b must be a 2-D tensor"),
    ("rank-a_log", lambda x: with_(x, a_log=x["a_log"][None]), ValueError,
     "a_log must be a 1-D tensor"),
    ("rank-dt_bias", lambda x: with_(x, dt_bias=x["dt_bias"][0]), ValueError,
     "dt_bias must be a 1-D tensor"),
    ("rank-state_ref", lambda x: with_(x, state_ref=x["state_ref"][0]), ValueError,
     "state_ref must be a 4-D tensor"),
    ("rank-indices", lambda x: with_(x, ssm_state_indices=x["ssm_state_indices"][None]),
     ValueError, "ssm_state_indices must be a 1-D tensor"),
    # dtypes
    ("dtype-mixed_qkv-fp32", lambda x: with_(x, mixed_qkv=x["mixed_qkv"].float()), TypeError,
     "mixed_qkv must have dtype torch.bfloat16 or torch.float16, but got torch.float32"),
    ("dtype-a", lambda x: with_(x, a=x["a"].half()), TypeError,
     "a must have dtype torch.bfloat16 (the dtype of mixed_qkv), but got torch.float16"),
    ("dtype-b", lambda x: with_(x, b=x["b"].float()), TypeError, "b must have dtype torch.bfloat16"),
    ("dtype-dt_bias", lambda x: with_(x, dt_bias=x["dt_bias"].float()), TypeError,
     "dt_bias must have dtype torch.bfloat16"),
    ("dtype-a_log", lambda x: with_(x, a_log=x["a_log"].bfloat16()), TypeError,
     "a_log must have dtype torch.float32, but got torch.bfloat16"),
    ("dtype-indices-int64", lambda x: with_(x, ssm_state_indices=x["ssm_state_indices"].long()),
     TypeError, "ssm_state_indices must have dtype torch.int32, but got torch.int64"),
    ("dtype-state-fp16-with-bf16", lambda x: with_(x, state_ref=_state_like(x, dtype=torch.half)),
     TypeError, "state_ref must have dtype torch.float32 or torch.bfloat16 (the dtype of mixed_qkv), but got torch.float16"),
    ("dtype-state-fp64", lambda x: with_(x, state_ref=_state_like(x, dtype=torch.float64)),
     TypeError, "but got torch.float64"),
    # empty tensors
    ("empty-batch", lambda x: {**x, **{k: x[k][:0] for k in
                                       ("mixed_qkv", "a", "b", "ssm_state_indices")}},
     ValueError, "mixed_qkv must not be empty"),
    ("empty-state", lambda x: with_(x, state_ref=x["state_ref"][:0]), ValueError,
     "state_ref must not be empty"),
    ("empty-a_log", lambda x: with_(x, a_log=x["a_log"][:0]), ValueError,
     "a_log must not be empty"),
    # UINT32 limits (stride-0 tensors: no memory is allocated)
    ("u32-B", lambda x: with_(
        x, mixed_qkv=expanded((U32, x["mixed_qkv"].shape[1]), torch.bfloat16),
        a=expanded((U32, 4), torch.bfloat16), b=expanded((U32, 4), torch.bfloat16),
        ssm_state_indices=expanded((U32,), torch.int32)),
     ValueError, "B (mixed_qkv.size(0)) must be at most UINT32_MAX"),
    ("u32-width", lambda x: with_(x, mixed_qkv=expanded((3, U32), torch.bfloat16)), ValueError,
     "mixed_qkv.size(1) must be at most UINT32_MAX"),
    ("u32-BlockNum", lambda x: with_(x, state_ref=expanded((U32, 4, 16, 64), torch.float32)),
     ValueError, "BlockNum (state_ref.size(0)) must be at most UINT32_MAX"),
    ("u32-Hv", lambda x: with_(x, state_ref=expanded((2, U32, 16, 64), torch.float32)),
     ValueError, "Hv (state_ref.size(1)) must be at most UINT32_MAX"),
    ("u32-V", lambda x: with_(x, state_ref=expanded((2, 4, U32, 64), torch.float32)),
     ValueError, "V (state_ref.size(2)) must be at most UINT32_MAX"),
    ("u32-K", lambda x: with_(x, state_ref=expanded((2, 4, 16, U32), torch.float32)),
     ValueError, "K (state_ref.size(3)) must be at most UINT32_MAX"),
    ("u32-B*Hv", lambda x: with_(
        x, mixed_qkv=expanded((2**17, 2**16 + 128), torch.bfloat16),
        state_ref=expanded((2, 2**16, 1, 64), torch.float32)),
     ValueError, "B*Hv must be at most UINT32_MAX (4294967295), but got 8589934592"),
    # K range and fp32 row padding
    ("K-too-small", lambda x: with_(x, state_ref=_state_like(x, (8, 4, 16, 48))), ValueError,
     "K (state_ref.size(3)) must be in [64, 2032], but got 48"),
    ("K-too-large", lambda x: with_(x, state_ref=_state_like(x, (8, 4, 2, 2048))), ValueError,
     "must be in [64, 2032], but got 2048"),
    ("K-129-fp32-padding", lambda x: with_(x, state_ref=_state_like(x, (8, 4, 16, 129))),
     ValueError, "K = 129 is not supported with a float32 state_ref"),
    ("K-65-fp32-padding", lambda x: with_(x, state_ref=_state_like(x, (8, 4, 16, 65))),
     ValueError, "needs 60"),
    # derived shapes
    ("width-not-above-HvV", lambda x: with_(x, mixed_qkv=x["mixed_qkv"][:, :4 * 16]), ValueError,
     "mixed_qkv.size(1) must be greater than Hv*V = 64"),
    ("width-not-multiple-2K", lambda x: with_(x, mixed_qkv=x["mixed_qkv"][:, 1:]), ValueError,
     "must be a multiple of 2*K = 128"),
    ("Hv-not-multiple-of-H", lambda x: with_(
        x, mixed_qkv=torch.zeros(3, 2 * 3 * 64 + 4 * 16, dtype=torch.bfloat16)), ValueError,
     "Hv (state_ref.size(1)) must be a multiple of H = 3"),
    ("shape-a", lambda x: with_(x, a=torch.zeros(3, 5, dtype=torch.bfloat16)), ValueError,
     "a must have shape (B, Hv) = [3, 4], but got [3, 5]"),
    ("shape-b", lambda x: with_(x, b=torch.zeros(4, 4, dtype=torch.bfloat16)), ValueError,
     "b must have shape (B, Hv) = [3, 4], but got [4, 4]"),
    ("shape-a_log", lambda x: with_(x, a_log=torch.zeros(5)), ValueError,
     "a_log must have shape (Hv,) = [4], but got [5]"),
    ("shape-dt_bias", lambda x: with_(x, dt_bias=torch.zeros(3, dtype=torch.bfloat16)),
     ValueError, "dt_bias must have shape (Hv,) = [4], but got [3]"),
    ("shape-indices", lambda x: with_(x, ssm_state_indices=torch.ones(4, dtype=torch.int32)),
     ValueError, "ssm_state_indices must have shape (B,) = [3], but got [4]"),
    # layout and scalars
    ("state-not-contiguous", lambda x: with_(
        x, state_ref=torch.zeros(8, 4, 64, 16).transpose(2, 3)), ValueError,
     "state_ref must be contiguous"),
    ("scale-inf", lambda x: with_(x, scale=float("inf")), ValueError,
     "scale must be finite, but got inf"),
    ("scale-nan", lambda x: with_(x, scale=float("nan")), ValueError, "scale must be finite"),
]

# Rejections only the CPU path can make: they need the index values.
CPU_ONLY = [
    ("index-equals-BlockNum", lambda x: with_(
        x, ssm_state_indices=torch.tensor([1, x["state_ref"].shape[0], 2], dtype=torch.int32)),
     ValueError, "ssm_state_indices[1] = 8 is out of range: valid slots must be < BlockNum = 8"),
    ("index-int32-max", lambda x: with_(
        x, ssm_state_indices=torch.tensor([2**31 - 1, 1, 2], dtype=torch.int32)),
     ValueError, "ssm_state_indices[0] = 2147483647 is out of range"),
    ("index-duplicate", lambda x: with_(
        x, ssm_state_indices=torch.tensor([3, 1, 3], dtype=torch.int32)),
     ValueError, "slot 3 is used by rows 0 and 2"),
]


def _state_bits(t):
    """Every byte of the storage behind t (also works for stride-0 views of huge shapes)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def _run_rejected(inputs, exc, fragment, softplus_threshold=20.0):
    state = inputs["state_ref"]
    before = _state_bits(state)
    with pytest.raises(exc) as info:
        call(OP, inputs, softplus_threshold=softplus_threshold)
    assert fragment in str(info.value), str(info.value)
    assert "npu_fused_gdn_decode" in str(info.value)
    after = _state_bits(state)
    assert torch.equal(after, before), "a rejected call changed state_ref"
    return info.value


def _to_meta(inputs):
    return {k: (torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                if torch.is_tensor(v) else v) for k, v in inputs.items()}


ALL = REJECTIONS + CPU_ONLY


@pytest.mark.parametrize("name,build,exc,fragment", ALL, ids=[r[0] for r in ALL])
def test_cpu_rejects(name, build, exc, fragment):
    _run_rejected(build(base()), exc, fragment)


@pytest.mark.parametrize("name,build,exc,fragment", REJECTIONS, ids=[r[0] for r in REJECTIONS])
def test_meta_rejects_the_same(name, build, exc, fragment):
    with pytest.raises(exc) as info:
        call(OP, _to_meta(build(base())))
    assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("name,build,exc,fragment", CPU_ONLY, ids=[r[0] for r in CPU_ONLY])
def test_meta_accepts_index_values(name, build, exc, fragment):
    """Meta cannot see index values; as on NPU, range and uniqueness are the caller's duty there."""
    out = call(OP, _to_meta(build(base())))
    assert out.shape == (3, 1, 4, 16)


def test_softplus_threshold_must_be_finite():
    _run_rejected(base(), ValueError, "softplus_threshold must be finite, but got nan",
                  softplus_threshold=float("nan"))


def test_device_mismatch():
    x = base()
    x["ssm_state_indices"] = x["ssm_state_indices"].to("meta")
    _run_rejected(x, ValueError, "all tensors must be on one device: expected ssm_state_indices on cpu")


def test_low_precision_state_accepts_k129():
    x = make_inputs(Case(B=2, H=1, Hv=2, K=129, V=8, state_dtype=torch.bfloat16))
    assert call(OP, x).shape == (2, 1, 2, 8)


def test_duplicate_invalid_indices_are_fine():
    x = base()
    x["ssm_state_indices"] = torch.tensor([0, 0, -1], dtype=torch.int32)
    assert call(OP, x).abs().sum() == 0


def test_meta_output_matches_cpu_output():
    x = base()
    out = call(OP, x)
    meta = call(OP, _to_meta(x))
    assert meta.device.type == "meta"
    assert (meta.shape, meta.dtype, meta.stride()) == (out.shape, out.dtype, out.stride())
