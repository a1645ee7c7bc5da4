"""Triton kernel of ``custom::npu_fused_gdn_decode`` (CUDA, and CPU tensors under the interpreter).

One program per (batch row i, value head j, tile of BV value rows): grid (B*Hv, V/BV). It loads
q and k of key head ``j // (Hv / H)`` and L2-normalises them in registers, computes the gates,
reads its (BV, K) tile of ``state_ref[slot, j]`` once, updates it in fp32, reads the output from
the updated tile and writes the tile back once. The full K extent of a row stays in registers
because u = S k needs the whole row before the rank-one update.

This module does no input checking: ``custom_ops.cuda`` registers the checked entry point.
Importing it needs triton; the kernel is jitted on first launch, so ``TRITON_INTERPRET=1`` may be
set any time before the first call (the tests rely on that).
"""

import contextlib
import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ._env import env_flag

# A constexpr: the compiler refuses a plain module global inside @triton.jit (the interpreter
# accepts one), so a plain float would fail every compiled launch with a NameError.
NORM_EPS = tl.constexpr(1e-6)


def _kernel_body(
    qkv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, idx_ptr, out_ptr,
    scale, softplus_threshold, block_num,
    stride_qkv_row, stride_qkv_col,
    stride_a_row, stride_a_col,
    stride_b_row, stride_b_col,
    stride_a_log, stride_dt_bias, stride_idx, stride_state_slot,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, STATE_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
):
    # Grid (B*Hv, V tiles split over axes 1 and 2): see launch_config. A tile past the last
    # (the split rounds up) is all masked.
    row_head = tl.program_id(0).to(tl.int64)
    i = row_head // HV
    j = row_head % HV
    v_tile = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
    h = j // (HV // H)

    slot = tl.load(idx_ptr + i * stride_idx).to(tl.int64)
    # Slot <= 0 is an invalid row. An index >= BlockNum is a caller error (checked only behind
    # the debug switch); masking it too keeps the kernel from touching memory outside the pool.
    valid = (slot > 0) & (slot < block_num)

    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K
    offs_v = v_tile * BV + tl.arange(0, BV)
    mask_v = offs_v < V

    # q | k | v of row i; strides are general (non-contiguous views are allowed).
    row = qkv_ptr + i * stride_qkv_row
    q = tl.load(row + (h * K + offs_k) * stride_qkv_col, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(row + (H * K + h * K + offs_k) * stride_qkv_col, mask=mask_k, other=0.0)
    k = k.to(tl.float32)
    v = tl.load(row + (2 * H * K + j * V + offs_v) * stride_qkv_col, mask=mask_v, other=0.0)
    v = v.to(tl.float32)

    # L2 norm with eps inside the root (SPEC step 2); sqrt_rn: IEEE sqrt, not the approximation.
    q = scale * q / tl.sqrt_rn(tl.sum(q * q, axis=0) + NORM_EPS)
    k = k / tl.sqrt_rn(tl.sum(k * k, axis=0) + NORM_EPS)

    # Gates (SPEC step 3).
    a = tl.load(a_ptr + i * stride_a_row + j * stride_a_col).to(tl.float32)
    b = tl.load(b_ptr + i * stride_b_row + j * stride_b_col).to(tl.float32)
    a_log = tl.load(a_log_ptr + j * stride_a_log).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + j * stride_dt_bias).to(tl.float32)
    x = a + dt_bias
    # propagate_nan=ALL: the default returns the non-NaN operand, which would drop a NaN in
    # a/dt_bias.
    sp = tl.log(1.0 + tl.exp(tl.minimum(x, softplus_threshold, propagate_nan=tl.PropagateNan.ALL)))
    softplus = tl.maximum(x, sp, propagate_nan=tl.PropagateNan.ALL)
    decay = tl.exp(-tl.exp(a_log) * softplus)
    beta = 1.0 / (1.0 + tl.exp(-b))

    # The (BV, K) tile of state_ref[slot, j]; K is the contiguous axis, each slot is contiguous
    # and slots sit stride_state_slot apart (an engine's paged pool). int64 offsets: a pool of
    # a few thousand Qwen3-Next slots already exceeds 2**31 elements.
    tile = (state_ptr + slot * stride_state_slot + j * (V * K)
            + offs_v.to(tl.int64)[:, None] * K + offs_k[None, :])
    # valid is folded in through a vector compare: the interpreter rejects a scalar-broadcast mask.
    slot_v = tl.zeros([BV], dtype=tl.int64) + slot
    live_v = mask_v & (slot_v > 0) & (slot_v < block_num)
    mask_s = live_v[:, None] & mask_k[None, :]
    s = tl.load(tile, mask=mask_s, other=0.0).to(tl.float32)

    # Decay, delta rule, rank-one update (SPEC step 4), all in fp32.
    s = s * decay
    u = tl.sum(s * k[None, :], axis=1)
    delta = beta * (v - u)
    s = s + delta[:, None] * k[None, :]
    # The padded K lanes (K < BK) hold k = 0, so an infinite delta makes them inf * 0 = NaN, which
    # would reach out. Zeroed: the reference has no such lanes.
    s = tl.where(mask_k[None, :], s, 0.0)

    # Output from the updated fp32 state (step 5); zeros for invalid rows.
    o = tl.sum(s * q[None, :], axis=1)
    o = tl.where(valid, o, 0.0)

    # Round to nearest even (step 6). Compiled, .to() already does (cvt.rn); bf16 is rounded by
    # hand because Triton's interpreter truncates fp32 -> bf16, and the tests run there. Same bit
    # formula as torch (c10 round_to_nearest_even), NaN -> canonical quiet NaN.
    if STATE_BF16:
        bits = s.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(s != s, 0x7FC0, bits)
        tl.store(tile, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask_s)
    else:
        tl.store(tile, s.to(state_ptr.dtype.element_ty), mask=mask_s)
    out = out_ptr + row_head * V + offs_v
    if OUT_BF16:
        obits = o.to(tl.uint32, bitcast=True)
        obits = (obits + 0x7FFF + ((obits >> 16) & 1)) >> 16
        obits = tl.where(o != o, 0x7FC0, obits)
        tl.store(out, obits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask_v)
    else:
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=mask_v)


def _interpret_mode() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return env_flag("TRITON_INTERPRET")


@functools.lru_cache(maxsize=None)
def _jitted(interpret: bool):
    # triton.jit picks compiled vs interpreted at decoration time; decorate lazily, once per mode.
    del interpret  # only the cache key
    return triton.jit(_kernel_body)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    BK: int  # K extent held in registers (next power of two >= K)
    BV: int  # value rows per program
    num_warps: int


# Programs per grid axis: CUDA's limits.
GRID_X_MAX = 2**31 - 1
GRID_YZ_MAX = 65535

# Rule: about 8 KiB of state per program (2048 fp32 or 4096 16-bit elements), i.e. 32 fp32
# registers per thread for the tile, enough bytes in flight per SM without spilling.
_TILE_BYTES = 8192
_ELEMS_PER_THREAD = 32


@functools.lru_cache(maxsize=None)
def tile_config(K: int, V: int, state_dtype: torch.dtype) -> TileConfig:
    """Tile sizes for one (K, V, state dtype); cached, so no tuning on the decode hot path."""
    bk = triton.next_power_of_2(K)
    elem_bytes = torch.empty((), dtype=state_dtype).element_size()
    budget = max(1, _TILE_BYTES // elem_bytes)
    bv = max(1, min(triton.next_power_of_2(V), budget // bk))
    warps = max(1, min(8, (bv * bk) // (32 * _ELEMS_PER_THREAD)))
    return TileConfig(BK=bk, BV=bv, num_warps=warps)


def launch_config(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, out, scale,
                  softplus_threshold, config=None):
    """(grid, args, kwargs) of the kernel launch for these tensors: built in one place for the
    launcher and for the ahead-of-time compile check (benchmarks/triton_compile.py)."""
    B = mixed_qkv.shape[0]
    block_num, Hv, V, K = state_ref.shape
    H = (mixed_qkv.shape[1] - Hv * V) // (2 * K)
    cfg = config or tile_config(K, V, state_ref.dtype)
    # CUDA allows GRID_X_MAX programs on axis 0 (fused_gdn_decode_triton launches at most that
    # many rows x value heads at a time) and 65535 on axes 1 and 2: the V tiles pass that for
    # V > 65535 with one fp32 row per tile (K > 1024), so they go over axes 1 and 2.
    v_tiles = triton.cdiv(V, cfg.BV)
    grid = (B * Hv, min(v_tiles, GRID_YZ_MAX), triton.cdiv(v_tiles, GRID_YZ_MAX))
    args = (
        mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, out,
        float(scale), float(softplus_threshold), block_num,
        mixed_qkv.stride(0), mixed_qkv.stride(1),
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1),
        a_log.stride(0), dt_bias.stride(0), ssm_state_indices.stride(0), state_ref.stride(0),
    )
    kwargs = dict(
        H=H, HV=Hv, K=K, V=V, BK=cfg.BK, BV=cfg.BV,
        STATE_BF16=state_ref.dtype == torch.bfloat16, OUT_BF16=out.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=1,
        # Stated, not left to Triton's default: 3.9 warns that the default turns off in 3.10.
        enable_fp_fusion=True,
    )
    return grid, args, kwargs


def fused_gdn_decode_triton(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_ref: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    scale: float,
    softplus_threshold: float = 20.0,
    *,
    config: TileConfig = None,
    out: torch.Tensor = None,
) -> torch.Tensor:
    """Launches the kernel; inputs (and ``out``, when given) must already have passed the op's
    checks.

    Works on CUDA tensors and, with ``TRITON_INTERPRET=1``, on CPU tensors. ``config`` overrides
    the tile table (used by the GPU sweep). Returns out [B, 1, Hv, V] in mixed_qkv's dtype.
    """
    B = mixed_qkv.shape[0]
    _, Hv, V, _ = state_ref.shape
    if out is None:
        out = torch.empty((B, 1, Hv, V), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    # At most GRID_X_MAX (row, value head) programs per launch: more rows go in chunks (views).
    # Hv alone stays below it (a pool of Hv > 2**31 value heads would not fit in any GPU).
    rows = max(1, GRID_X_MAX // Hv)
    parts = [(mixed_qkv, a, b, ssm_state_indices, out)] if B <= rows else [
        tuple(t[r:r + rows] for t in (mixed_qkv, a, b, ssm_state_indices, out))
        for r in range(0, B, rows)]
    kernel = _jitted(_interpret_mode())
    # Triton launches on the current device and its current stream: make them the tensors'.
    device = mixed_qkv.device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for x, a_, b_, idx, o in parts:
            grid, args, kwargs = launch_config(x, a_, b_, a_log, dt_bias, state_ref, idx, o,
                                               scale, softplus_threshold, config)
            kernel[grid](*args, **kwargs)
    return out
