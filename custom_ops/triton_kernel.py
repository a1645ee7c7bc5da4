"""Triton kernel of ``custom::npu_fused_gdn_decode`` (CUDA, and CPU tensors under the interpreter).

One program per (batch row i, value head j, tile of BV value rows), on a 1-D grid with the V tile
fastest, so neighbouring programs read neighbouring rows of one head. It issues every load (the
state tile first, then q, k, v and the gates) before any arithmetic, so the tile's memory trip
overlaps the norms and gates; L2-normalises q and k of key head ``j // (Hv / H)`` in registers,
updates the tile in fp32, reads the output from the updated tile and writes the tile back once. An
invalid row writes its zeros and returns before it touches the state. The full K extent of a row
stays in registers because u = S k needs the whole row before the rank-one update.

This module does no input checking: ``custom_ops.cuda`` registers the checked entry point.
Importing it needs triton. ``TRITON_INTERPRET=1`` must be set before triton is imported: triton
decorates its own library functions (and ``_to_bf16`` here) for one mode when they are imported, and
a kernel of the other mode cannot call them (tests/conftest.py chooses per process).
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


@triton.jit
def _to_bf16(x, CVT_RN: tl.constexpr):
    """fp32 -> bf16 rounded to nearest even, NaN as torch's canonical quiet NaN 0x7FC0. Compiled,
    .to() rounds so (cvt.rn; it gives NaN as 0x7FFF); the interpreter truncates, so there it is
    the bit formula of c10's round_to_nearest_even."""
    if CVT_RN:
        bits = x.to(tl.bfloat16).to(tl.uint16, bitcast=True)
    else:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
    bits = tl.where(x != x, 0x7FC0, bits).to(tl.uint16)
    return bits.to(tl.bfloat16, bitcast=True)


def _kernel_body(
    qkv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, idx_ptr, out_ptr,
    scale, softplus_threshold, block_num,
    stride_qkv_row, stride_qkv_col,
    stride_a_row, stride_a_col,
    stride_b_row, stride_b_col,
    stride_a_log, stride_dt_bias, stride_idx, stride_state_slot,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    EVEN: tl.constexpr,    # V % BV == 0 and K == BK: no masks on the state tile
    STATE_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
    CVT_RN: tl.constexpr,  # fp32 -> bf16 by the compiler's cvt.rn (the interpreter truncates)
    PDL: tl.constexpr,     # launched as a programmatic dependent launch (sm_90 and later)
):
    # One program per V tile of (row, value head), V tile fastest: see launch_config.
    pid = tl.program_id(0).to(tl.int64)
    row_head = pid // NV
    v_tile = pid % NV
    i = row_head // HV
    j = row_head % HV
    h = j // (HV // H)
    if PDL:
        # Wait for the kernel before this one (its writes of the inputs and the state become
        # visible) before any load; let the next one launch now: it waits for this one in turn.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K
    offs_v = v_tile * BV + tl.arange(0, BV)
    mask_v = offs_v < V
    out = out_ptr + row_head * V + offs_v

    slot = tl.load(idx_ptr + i * stride_idx).to(tl.int64)
    # Slot <= 0 is an invalid row. An index >= BlockNum is a caller error (checked only behind
    # the debug switch); it too writes zeros and leaves the pool alone.
    if (slot <= 0) | (slot >= block_num):
        tl.store(out, tl.zeros([BV], dtype=out_ptr.dtype.element_ty), mask=mask_v)
        return

    # The (BV, K) tile of state_ref[slot, j]; K is the contiguous axis, each slot is contiguous
    # and slots sit stride_state_slot apart (an engine's paged pool). int64 offsets: a pool of
    # a few thousand Qwen3-Next slots already exceeds 2**31 elements.
    tile = (state_ptr + slot * stride_state_slot + j * (V * K)
            + offs_v.to(tl.int64)[:, None] * K + offs_k[None, :])
    mask_s = mask_v[:, None] & mask_k[None, :]
    # Every load before the first arithmetic, the state first: one memory round trip per program.
    if EVEN:
        s_in = tl.load(tile)
    else:
        s_in = tl.load(tile, mask=mask_s, other=0.0)
    # q | k | v of row i; strides are general (non-contiguous views are allowed).
    row = qkv_ptr + i * stride_qkv_row
    q_in = tl.load(row + (h * K + offs_k) * stride_qkv_col, mask=mask_k, other=0.0)
    k_in = tl.load(row + (H * K + h * K + offs_k) * stride_qkv_col, mask=mask_k, other=0.0)
    v_in = tl.load(row + (2 * H * K + j * V + offs_v) * stride_qkv_col, mask=mask_v, other=0.0)
    a = tl.load(a_ptr + i * stride_a_row + j * stride_a_col).to(tl.float32)
    b = tl.load(b_ptr + i * stride_b_row + j * stride_b_col).to(tl.float32)
    a_log = tl.load(a_log_ptr + j * stride_a_log).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + j * stride_dt_bias).to(tl.float32)

    # L2 norm with eps inside the root (SPEC step 2); sqrt_rn: IEEE sqrt, not the approximation.
    q = q_in.to(tl.float32)
    k = k_in.to(tl.float32)
    v = v_in.to(tl.float32)
    q = scale * q / tl.sqrt_rn(tl.sum(q * q, axis=0) + NORM_EPS)
    k = k / tl.sqrt_rn(tl.sum(k * k, axis=0) + NORM_EPS)

    # Gates (SPEC step 3). propagate_nan=ALL: the default returns the non-NaN operand, which
    # would drop a NaN in a/dt_bias.
    x = a + dt_bias
    sp = tl.log(1.0 + tl.exp(tl.minimum(x, softplus_threshold, propagate_nan=tl.PropagateNan.ALL)))
    softplus = tl.maximum(x, sp, propagate_nan=tl.PropagateNan.ALL)
    decay = tl.exp(-tl.exp(a_log) * softplus)
    beta = 1.0 / (1.0 + tl.exp(-b))

    # Decay, delta rule, rank-one update (SPEC step 4), all in fp32.
    s = s_in.to(tl.float32) * decay
    u = tl.sum(s * k[None, :], axis=1)
    delta = beta * (v - u)
    s = s + delta[:, None] * k[None, :]
    if K != BK:
        # The padded K lanes hold k = 0, so an infinite delta makes them inf * 0 = NaN, which
        # would reach out. Zeroed: the reference has no such lanes.
        s = tl.where(mask_k[None, :], s, 0.0)

    # Output from the updated fp32 state (step 5).
    o = tl.sum(s * q[None, :], axis=1)

    # Round to nearest even (step 6).
    if STATE_BF16:
        s_out = _to_bf16(s, CVT_RN)
    else:
        s_out = s.to(state_ptr.dtype.element_ty)
    if EVEN:
        tl.store(tile, s_out)
    else:
        tl.store(tile, s_out, mask=mask_s)
    if OUT_BF16:
        tl.store(out, _to_bf16(o, CVT_RN), mask=mask_v)
    else:
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=mask_v)


def _interpret_mode() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return env_flag("TRITON_INTERPRET")


@functools.lru_cache(maxsize=None)
def _jitted(interpret: bool):
    # The kernel, jitted once per mode on first launch (the tests replace it through this).
    del interpret  # only the cache key
    return triton.jit(_kernel_body)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    BK: int  # K extent held in registers (next power of two >= K)
    BV: int  # value rows per program
    num_warps: int


# Programs per launch on grid axis 0: CUDA's limit.
GRID_X_MAX = 2**31 - 1
# ROCm limits threads, not programs: gridDim.x * blockDim.x < 2**32, with 64 lanes per warp.
HIP_THREADS_MAX = 2**32 - 1


def programs_per_launch(num_warps: int) -> int:
    """The most programs one launch may have on this build's GPUs."""
    if torch.version.hip is not None:
        return min(GRID_X_MAX, HIP_THREADS_MAX // (num_warps * 64))
    return GRID_X_MAX


# Rule: about 4 KiB of state per program (1024 fp32 or 2048 16-bit elements) in one warp, a warp
# more per 1024 elements of K (only fp32 rows with K > 1024 pass 4 KiB: one row per program).
# On an H200 at K = V = 128 these tiles (BV 8 fp32, 16 bf16) were the fastest of the sweep at
# B = 64 and 256, 1-warp tiles ahead of 2- and 4-warp ones (docs/gpu.md).
_TILE_BYTES = 4096
_K_PER_WARP = 1024


@functools.lru_cache(maxsize=None)
def tile_config(K: int, V: int, state_dtype: torch.dtype) -> TileConfig:
    """Tile sizes for one (K, V, state dtype); cached, so no tuning on the decode hot path."""
    bk = triton.next_power_of_2(K)
    elem_bytes = torch.empty((), dtype=state_dtype).element_size()
    bv = max(1, min(triton.next_power_of_2(V), _TILE_BYTES // (bk * elem_bytes)))
    warps = max(1, min(8, bk // _K_PER_WARP))
    return TileConfig(BK=bk, BV=bv, num_warps=warps)


# Whether this triton has griddepcontrol (3.3 and later).
HAS_GDC = hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait")


@functools.lru_cache(maxsize=None)
def pdl_supported(device_index: int) -> bool:
    """Whether launches on this CUDA device may be programmatic dependent launches: NVIDIA
    sm_90 or later, with a triton that has the instructions (HAS_GDC)."""
    if torch.version.hip is not None or not HAS_GDC:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_config(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, out, scale,
                  softplus_threshold, config=None, *, interpret=False, pdl=False):
    """(grid, args, kwargs) of the kernel launch for these tensors: built in one place for the
    launcher and for the ahead-of-time compile check (benchmarks/triton_compile.py).
    ``interpret``: for Triton's interpreter (bf16 by the bit formula); ``pdl``: a programmatic
    dependent launch (only where ``pdl_supported``)."""
    B = mixed_qkv.shape[0]
    block_num, Hv, V, K = state_ref.shape
    H = (mixed_qkv.shape[1] - Hv * V) // (2 * K)
    cfg = config or tile_config(K, V, state_ref.dtype)
    # One axis: B * Hv * (V tiles) programs (fused_gdn_decode_triton launches at most
    # programs_per_launch of them at a time).
    v_tiles = triton.cdiv(V, cfg.BV)
    grid = (B * Hv * v_tiles,)
    args = (
        mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, out,
        float(scale), float(softplus_threshold), block_num,
        mixed_qkv.stride(0), mixed_qkv.stride(1),
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1),
        a_log.stride(0), dt_bias.stride(0), ssm_state_indices.stride(0), state_ref.stride(0),
    )
    kwargs = dict(
        H=H, HV=Hv, K=K, V=V, BK=cfg.BK, BV=cfg.BV, NV=v_tiles,
        EVEN=V % cfg.BV == 0 and K == cfg.BK,
        STATE_BF16=state_ref.dtype == torch.bfloat16, OUT_BF16=out.dtype == torch.bfloat16,
        CVT_RN=not interpret, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=1,
        # Stated, not left to Triton's default: 3.9 warns that the default turns off in 3.10.
        enable_fp_fusion=True,
    )
    if pdl:
        kwargs["launch_pdl"] = True
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
    _, Hv, V, K = state_ref.shape
    if out is None:
        out = torch.empty((B, 1, Hv, V), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    # At most programs_per_launch programs per launch: more rows go in chunks (views).
    # Hv * (V tiles) alone stays below it: a pool that large would not fit in any GPU.
    cfg = config or tile_config(K, V, state_ref.dtype)
    per_row = Hv * triton.cdiv(V, cfg.BV)
    rows = max(1, programs_per_launch(cfg.num_warps) // per_row)
    parts = [(mixed_qkv, a, b, ssm_state_indices, out)] if B <= rows else [
        tuple(t[r:r + rows] for t in (mixed_qkv, a, b, ssm_state_indices, out))
        for r in range(0, B, rows)]
    interpret = _interpret_mode()
    kernel = _jitted(interpret)
    # Triton launches on the current device and its current stream: make them the tensors'.
    device = mixed_qkv.device
    on_cuda = device.type == "cuda"
    pdl = on_cuda and not interpret and pdl_supported(
        device.index if device.index is not None else torch.cuda.current_device())
    with torch.cuda.device(device) if on_cuda else contextlib.nullcontext():
        for x, a_, b_, idx, o in parts:
            grid, args, kwargs = launch_config(x, a_, b_, a_log, dt_bias, state_ref, idx, o,
                                               scale, softplus_threshold, cfg,
                                               interpret=interpret, pdl=pdl)
            kernel[grid](*args, **kwargs)
    return out
