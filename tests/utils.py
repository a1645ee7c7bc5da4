"""Shared test helpers: one sample-input generator and the per-dtype tolerance table."""

import dataclasses

import torch

import custom_ops  # noqa: F401  (registers the op)
from custom_ops import fused_gdn_decode_reference
from custom_ops.reference import TOLERANCES

OP = torch.ops.custom.npu_fused_gdn_decode

# (mixed_qkv dtype, state dtype) pairs the op accepts.
DTYPE_PAIRS = [
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
]

# Per-dtype (atol, rtol), shared with the benchmark's result check.
TOL = TOLERANCES

_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def short(dtype):
    return _SHORT[dtype]


@dataclasses.dataclass
class Case:
    B: int = 3
    H: int = 2
    Hv: int = 4
    K: int = 64
    V: int = 16
    dtype: torch.dtype = torch.bfloat16
    state_dtype: torch.dtype = torch.float32
    pool: int = 0  # BlockNum; 0 means 2*B + 2
    invalid_rows: tuple = ()  # rows given index <= 0
    seed: int = 0

    def id(self):
        return (f"B{self.B}-H{self.H}-HV{self.Hv}-K{self.K}-V{self.V}-"
                f"{short(self.dtype)}-{short(self.state_dtype)}")


def make_inputs(case: Case, device="cpu"):
    """Inputs of one call: dict with the op's arguments (a and b are column views of one
    projection, as in models). Values are scaled so gates and state stay in a realistic range."""
    g = torch.Generator().manual_seed(case.seed)
    B, H, Hv, K, V = case.B, case.H, case.Hv, case.K, case.V
    pool = case.pool or 2 * B + 2
    dt = case.dtype

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    mixed_qkv = randn(B, 2 * H * K + Hv * V, dtype=dt)
    ab = randn(B, 2 * Hv, dtype=dt)  # one projection; a and b are its column slices
    a, b = ab[:, :Hv], ab[:, Hv:]
    a_log = randn(Hv, scale=0.5)
    dt_bias = randn(Hv, scale=0.5, dtype=dt)
    state = randn(pool, Hv, V, K, scale=0.5, dtype=case.state_dtype)
    perm = torch.randperm(pool - 1, generator=g)[:B] + 1  # distinct slots in [1, pool)
    idx = perm.to(torch.int32)
    for r in case.invalid_rows:
        idx[r] = -1 if r % 2 else 0
    return dict(
        mixed_qkv=mixed_qkv, a=a, b=b, a_log=a_log, dt_bias=dt_bias, state_ref=state,
        ssm_state_indices=idx.to(device), scale=K**-0.5,
    )


def call(fn, inputs, **kw):
    x = inputs
    return fn(x["mixed_qkv"], x["a"], x["b"], x["a_log"], x["dt_bias"], x["state_ref"],
              x["ssm_state_indices"], x["scale"], **kw)


def clone_inputs(inputs):
    out = dict(inputs)
    out["state_ref"] = inputs["state_ref"].clone()
    return out


def assert_close(actual, expected, what=""):
    atol, rtol = TOL[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def check_against_reference(inputs, steps=1, fn=OP, **kw):
    """Runs `fn` and the reference side by side for `steps` decode steps on their own copies of the
    state; checks out and the whole state after every step. Returns (ours, reference) inputs."""
    ours, ref = clone_inputs(inputs), clone_inputs(inputs)
    for step in range(steps):
        out = call(fn, ours, **kw)
        out_ref = call(fused_gdn_decode_reference, ref, **kw)
        assert out.shape == out_ref.shape and out.dtype == out_ref.dtype
        assert out.is_contiguous()
        assert_close(out, out_ref, f"out, step {step}")
        assert_close(ours["state_ref"], ref["state_ref"], f"state, step {step}")
    return ours, ref
