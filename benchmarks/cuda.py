"""CUDA measurements of the decode step: our Triton kernel against FLA, torch.compile of the
reference, and a device-to-device copy of the same state bytes (the bandwidth ceiling).

``bench_cuda(...)`` returns rows (dicts); ``format_table(rows)`` prints them. ``python -m benchmarks
--device cuda`` calls these; ``benchmarks/gpu_check.py`` runs them after its checks.

Timing: each method's call is captured ``inner`` times in one CUDA graph and the graph replayed,
so the numbers are device time without Python launch cost (the compiled reference syncs on its
boolean-mask indexing and cannot be captured: it is timed eagerly, marked so in the table).
"""

import inspect
import math

import torch

from custom_ops import fused_gdn_decode_reference
from custom_ops.testing import Case, call, make_inputs

# (name, H, Hv, K, V): Qwen3-Next-80B-A3B and its TP=2 shard, Qwen3.5-397B-A17B (docs/spec.md).
SHAPES = {
    "qwen3-next": (16, 32, 128, 128),
    "qwen3-next-tp2": (8, 16, 128, 128),
    "qwen3.5-397b": (16, 64, 128, 128),
}


def decode_case(B, H, Hv, K, V, dtype=torch.bfloat16, state_dtype=torch.float32):
    """The benchmarked call: mixed_qkv, a and b column views of one projection, B distinct slots
    of a pool of 2B + 1."""
    return Case(B=B, H=H, Hv=Hv, K=K, V=V, dtype=dtype, state_dtype=state_dtype, pool=2 * B + 1,
                layout="projection")


def time_graph(fn, inner=20, reps=20, warmup=3):
    """Microseconds per call of `fn` (no arguments), from CUDA-graph replays of `inner` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * inner)


def time_eager(fn, iters=50, warmup=5):
    """Microseconds per call of `fn`, launched from Python (includes launch overhead)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _fla_call(x, H, Hv, K, V):
    """FLA's fused_recurrent_gated_delta_rule on the same step, or (None, reason).

    Uses its in-kernel L2 norm, gate (A_log/dt_bias) and beta sigmoid where the installed version
    has them; what it lacks is computed beforehand, outside the timed call, which favours FLA.
    FLA keeps a dense [B, Hv, K, V] state (no slot indices) and writes a new fp32 final state.
    """
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fn
    except Exception as e:  # not installed / incompatible
        return None, f"fla unavailable: {type(e).__name__}: {e}"
    params = set(inspect.signature(fla_fn).parameters)
    B = x["mixed_qkv"].shape[0]
    qkv = x["mixed_qkv"]
    q = qkv[:, : H * K].reshape(B, 1, H, K).contiguous()
    k = qkv[:, H * K: 2 * H * K].reshape(B, 1, H, K).contiguous()
    v = qkv[:, 2 * H * K:].reshape(B, 1, Hv, V).contiguous()
    a = x["a"].contiguous().reshape(B, 1, Hv)
    b = x["b"].contiguous().reshape(B, 1, Hv)
    kw = dict(scale=x["scale"], output_final_state=True)
    notes = []
    if "use_qk_l2norm_in_kernel" in params:
        kw["use_qk_l2norm_in_kernel"] = True
        notes.append("l2norm in kernel")
    else:
        q = torch.nn.functional.normalize(q.float(), dim=-1, eps=1e-6).to(q.dtype)
        k = torch.nn.functional.normalize(k.float(), dim=-1, eps=1e-6).to(k.dtype)
        notes.append("l2norm outside")
    if {"use_gate_in_kernel", "A_log", "dt_bias"} <= params:
        kw.update(g=a, A_log=x["a_log"], dt_bias=x["dt_bias"], use_gate_in_kernel=True)
        notes.append("gate in kernel")
    else:
        xg = a.float() + x["dt_bias"].float()
        sp = torch.maximum(xg, torch.log1p(torch.exp(torch.clamp(xg, max=20.0))))
        kw["g"] = -torch.exp(x["a_log"].float()) * sp
        notes.append("gate outside")
    if "use_beta_sigmoid_in_kernel" in params:
        kw.update(beta=b, use_beta_sigmoid_in_kernel=True)
        notes.append("beta in kernel")
    else:
        kw["beta"] = torch.sigmoid(b.float()).to(b.dtype)
        notes.append("beta outside")
    state = x["state_ref"][x["ssm_state_indices"].long()].float()  # [B, Hv, V, K]
    if "transpose_state_layout" in params:
        kw["transpose_state_layout"] = True
        notes.append("[V,K] state")
    elif "state_v_first" in params:
        kw["state_v_first"] = True
        notes.append("[V,K] state")
    else:
        state = state.transpose(-1, -2).contiguous()  # FLA's [B, Hv, K, V]
    kw["initial_state"] = state
    return (lambda: fla_fn(q, k, v, **kw)), ", ".join(notes)


def bench_cuda(batch_sizes=(1, 16, 64, 128, 256), shapes=("qwen3-next",),
               state_dtypes=(torch.float32, torch.bfloat16), dtype=torch.bfloat16,
               include_fla=True, include_compile=True, inner=20, reps=20, log=print):
    """Times one decode step per (shape, state dtype, B); returns a list of row dicts.

    Row keys: shape, B, state (dtype name), method, us (device microseconds per call),
    gbps (state bytes read + written per second), pct_copy (copy time / method time, in %),
    timing ("graph" or "eager"), note. Methods: "ours" (the op, Triton kernel), "ours-eager"
    (the op launched from Python), "fla", "compile-ref" (torch.compile of the reference),
    "copy" (state_ref bytes of B slots, device to device).
    """
    op = torch.ops.custom.npu_fused_gdn_decode
    rows = []
    compiled_ref = torch.compile(fused_gdn_decode_reference) if include_compile else None
    for shape in shapes:
        H, Hv, K, V = SHAPES[shape] if isinstance(shape, str) else shape
        name = shape if isinstance(shape, str) else f"H{H}-Hv{Hv}-K{K}-V{V}"
        for sdt in state_dtypes:
            sname = str(sdt).replace("torch.", "")
            for B in batch_sizes:
                x = make_inputs(decode_case(B, H, Hv, K, V, dtype, sdt), device="cuda")
                state_bytes = B * Hv * V * K * x["state_ref"].element_size()
                moved = 2 * state_bytes

                def row(method, us, timing, note=""):
                    r = dict(shape=name, B=B, state=sname, method=method, us=us,
                             gbps=moved / (us * 1e-6) / 1e9 if us else float("nan"),
                             pct_copy=float("nan"), timing=timing, note=note)
                    rows.append(r)
                    log(format_row(r))
                    return r

                src = torch.empty(state_bytes, dtype=torch.uint8, device="cuda")
                dst = torch.empty_like(src)
                copy = row("copy", time_graph(lambda src=src, dst=dst: dst.copy_(src), inner, reps),
                           "graph")
                del src, dst
                results = [copy]
                results.append(row("ours", time_graph(lambda x=x: call(op, x), inner, reps),
                                   "graph"))
                results.append(row("ours-eager", time_eager(lambda x=x: call(op, x)), "eager"))
                if include_fla:
                    fn, note = _fla_call(x, H, Hv, K, V)
                    if fn is None:
                        results.append(row("fla", float("nan"), "-", note))
                    else:
                        try:
                            results.append(row("fla", time_graph(fn, inner, reps), "graph", note))
                        except Exception as e:  # report, keep benchmarking
                            results.append(row("fla", float("nan"), "-",
                                               f"{note}; failed: {type(e).__name__}: {e}"))
                if compiled_ref is not None:
                    try:
                        results.append(row("compile-ref",
                                           time_eager(lambda x=x: call(compiled_ref, x),
                                                      iters=20),
                                           "eager", "syncs (boolean-mask index): not capturable"))
                    except Exception as e:
                        results.append(row("compile-ref", float("nan"), "-",
                                           f"failed: {type(e).__name__}: {e}"))
                for r in results:
                    if r["us"] and not math.isnan(r["us"]):
                        r["pct_copy"] = 100.0 * copy["us"] / r["us"]
                del x
                torch.cuda.empty_cache()
    return rows


_COLUMNS = ("shape", "state", "B", "method", "us", "gbps", "pct_copy", "timing", "note")


def format_row(r):
    return (f"{r['shape']:>14} {r['state']:>8} {r['B']:>4} {r['method']:>11} "
            f"{r['us']:>9.2f} {r['gbps']:>8.1f} {r['pct_copy']:>7.1f}% {r['timing']:>5}  "
            f"{r['note']}")


def format_table(rows):
    head = (f"{'shape':>14} {'state':>8} {'B':>4} {'method':>11} {'us/call':>9} {'GB/s':>8} "
            f"{'%copy':>8} {'time':>5}  note")
    return "\n".join([head] + [format_row(r) for r in rows])


def sweep_tiles(B=64, shape="qwen3-next", state_dtype=torch.float32, dtype=torch.bfloat16,
                bvs=(1, 2, 4, 8, 16, 32, 64, 128), warps=(1, 2, 4, 8), inner=20, reps=10):
    """Times the kernel for each (BV, num_warps); returns [(us, TileConfig)], fastest first.

    The winners go into ``custom_ops.triton_kernel.TUNED_TILES`` (a fixed table: nothing is tuned
    at call time).
    """
    from custom_ops import triton_kernel as tk

    H, Hv, K, V = SHAPES[shape] if isinstance(shape, str) else shape
    x = make_inputs(decode_case(B, H, Hv, K, V, dtype, state_dtype), device="cuda")
    bk = 1 << (K - 1).bit_length()
    results = []
    for bv in bvs:
        if bv > (1 << (V - 1).bit_length()) or bv * bk > 32768:
            continue
        for w in warps:
            cfg = tk.TileConfig(BK=bk, BV=bv, num_warps=w)
            try:
                us = time_graph(lambda: call(
                    lambda *a: tk.fused_gdn_decode_triton(*a, config=cfg), x), inner, reps)
            except Exception as e:  # e.g. out of resources for a large tile
                print(f"  {cfg}: failed: {type(e).__name__}")
                continue
            results.append((us, cfg))
    results.sort(key=lambda t: t[0])
    return results
