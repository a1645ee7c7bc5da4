"""Decode-step inputs and the call helper shared by the benchmarks (CPU, CUDA, threads)."""

import torch


def make_decode_inputs(B, H, Hv, K, V, dtype=torch.bfloat16, state_dtype=torch.float32,
                       pool=None, device="cpu", seed=0):
    """Inputs of one decode call on `device`, as a model produces them: mixed_qkv, a and b are
    column views of one projection; slots are distinct, drawn from [1, pool) (pool = 2B+1 by
    default, so the state is not all cache-resident)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pool = pool or 2 * B + 1

    def randn(*shape, scale=1.0, dt=torch.float32):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(device)

    w = 2 * H * K + Hv * V
    proj = randn(B, w + 2 * Hv, dt=dtype)
    slots = torch.randperm(pool - 1, generator=g)[:B] + 1
    return dict(
        mixed_qkv=proj[:, :w], a=proj[:, w:w + Hv], b=proj[:, w + Hv:],
        a_log=randn(Hv, scale=0.5), dt_bias=randn(Hv, scale=0.5, dt=dtype),
        state_ref=randn(pool, Hv, V, K, scale=0.5, dt=state_dtype),
        ssm_state_indices=slots.to(torch.int32).to(device),
        scale=K**-0.5,
    )


def call(fn, x):
    """fn(*the op's positional arguments taken from x)."""
    return fn(x["mixed_qkv"], x["a"], x["b"], x["a_log"], x["dt_bias"], x["state_ref"],
              x["ssm_state_indices"], x["scale"])
