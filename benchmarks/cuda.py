"""CUDA measurements of the decode step: our Triton kernel against FLA, torch.compile of the
reference, and a device-to-device copy of the same state bytes (the bandwidth ceiling).

``bench_cuda(...)`` returns rows (dicts); ``format_table(rows)`` prints them. ``python -m benchmarks
--device cuda`` calls these; ``benchmarks/gpu_check.py`` runs them after its checks.

Timing: each method's calls are captured in one CUDA graph and the graph replayed, so the numbers
are device time without Python launch cost (the compiled reference syncs on its boolean-mask
indexing and cannot be captured: it is timed eagerly, marked so in the table).

Cold state, as in serving (between two steps of one sequence every other layer's and sequence's
state passes through the GPU): the calls rotate over disjoint sets of B slots, enough that at
least 4x the L2 size of other state is read and written before a set comes round again. The copy
ceiling and FLA rotate the same way over buffers of the same bytes.
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


# Bytes of other state read and written between two calls on one slot set, in L2 sizes.
REUSE_L2 = 4


def decode_case(B, H, Hv, K, V, dtype=torch.bfloat16, state_dtype=torch.float32, sets=2):
    """The benchmarked call: mixed_qkv, a and b column views of one projection; a pool of
    sets * B + 1 slots (slot_sets splits it into the rotated sets)."""
    return Case(B=B, H=H, Hv=Hv, K=K, V=V, dtype=dtype, state_dtype=state_dtype,
                pool=sets * B + 1, layout="projection")


def rotation_sets(B, slot_bytes, l2_bytes, reuse=REUSE_L2):
    """Disjoint sets of B slots to rotate over so that between two calls on one set the other
    calls read and write at least ``reuse`` x ``l2_bytes`` of state: (sets - 1) * B * slot_bytes
    >= reuse * l2_bytes. Each timed call then finds its slots cold in L2."""
    return 1 + max(1, math.ceil(reuse * l2_bytes / (B * slot_bytes)))


def slot_sets(B, sets, seed=0, device="cpu"):
    """``sets`` disjoint int32 index tensors of B distinct slots each, drawn from [1, sets*B]."""
    g = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(sets * B, generator=g) + 1).to(torch.int32)
    return [perm[i * B:(i + 1) * B].to(device) for i in range(sets)]


def _cycle(fns):
    return list(fns) if isinstance(fns, (list, tuple)) else [fns]


def time_graph(fns, inner=20, reps=20, warmup=3):
    """Microseconds per call from CUDA-graph replays: the graph holds ``inner`` calls (at least
    one per function) that cycle through ``fns`` (a callable or a list of them, no arguments)."""
    fns = _cycle(fns)
    n = len(fns) * math.ceil(inner / len(fns))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for t in range(warmup):
            fns[t % len(fns)]()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for t in range(n):
            fns[t % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * n)


def time_eager(fns, iters=50, warmup=5):
    """Microseconds per call launched from Python (launch overhead included), cycling through
    ``fns`` (a callable or a list of them)."""
    fns = _cycle(fns)
    for t in range(warmup):
        fns[t % len(fns)]()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for t in range(iters):
        fns[t % len(fns)]()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _fla_call(x, H, Hv, K, V):
    """FLA's fused_recurrent_gated_delta_rule on the same step, or (None, reason).

    Uses its in-kernel L2 norm, gate (A_log/dt_bias) and beta sigmoid where the installed version
    has them; what it lacks is computed beforehand, outside the timed call, which favours FLA.
    FLA keeps a dense [B, Hv, K, V] state (no slot indices): it gets the rows of x's slots in
    the state's own dtype, and writes a new final state (fp32 in fla-core 0.6).
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
    state = x["state_ref"][x["ssm_state_indices"].long()]  # [B, Hv, V, K], state dtype
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
    vs_fla (fla time / method time: above 1 is faster than FLA), sets (slot sets rotated over),
    timing ("graph" or "eager"), note. Methods: "ours" (the op, Triton kernel), "ours-eager"
    (the op launched from Python), "fla", "compile-ref" (torch.compile of the reference),
    "copy" (the state bytes of B slots, device to device). All ratios come from this one run.
    """
    op = torch.ops.custom.npu_fused_gdn_decode
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    rows = []
    compiled_ref = torch.compile(fused_gdn_decode_reference) if include_compile else None
    for shape in shapes:
        H, Hv, K, V = SHAPES[shape] if isinstance(shape, str) else shape
        name = shape if isinstance(shape, str) else f"H{H}-Hv{Hv}-K{K}-V{V}"
        for sdt in state_dtypes:
            sname = str(sdt).replace("torch.", "")
            slot_bytes = Hv * V * K * torch.empty((), dtype=sdt).element_size()
            for B in batch_sizes:
                sets = rotation_sets(B, slot_bytes, l2)
                x = make_inputs(decode_case(B, H, Hv, K, V, dtype, sdt, sets), device="cuda")
                xs = [dict(x, ssm_state_indices=idx)
                      for idx in slot_sets(B, sets, seed=B, device="cuda")]
                state_bytes = B * slot_bytes
                moved = 2 * state_bytes

                def row(method, us, timing, note=""):
                    r = dict(shape=name, B=B, state=sname, method=method, us=us,
                             gbps=moved / (us * 1e-6) / 1e9 if us else float("nan"),
                             pct_copy=float("nan"), vs_fla=float("nan"), sets=sets,
                             timing=timing, note=note)
                    rows.append(r)
                    log(format_row(r))
                    return r

                src = torch.empty(sets, state_bytes, dtype=torch.uint8, device="cuda")
                dst = torch.empty_like(src)
                copy = row("copy", time_graph([lambda d=d, s=s: d.copy_(s)
                                               for d, s in zip(dst, src)], inner, reps), "graph")
                del src, dst
                results = [copy]
                ours_fns = [lambda x=x: call(op, x) for x in xs]
                ours = row("ours", time_graph(ours_fns, inner, reps), "graph")
                results.append(ours)
                results.append(row("ours-eager", time_eager(ours_fns), "eager"))
                fla = None
                if include_fla:
                    calls = [_fla_call(x, H, Hv, K, V) for x in xs]
                    fns, note = [c[0] for c in calls], calls[0][1]
                    if fns[0] is None:
                        results.append(row("fla", float("nan"), "-", note))
                    else:
                        try:
                            fla = row("fla", time_graph(fns, inner, reps), "graph", note)
                            results.append(fla)
                        except Exception as e:  # report, keep benchmarking
                            results.append(row("fla", float("nan"), "-",
                                               f"{note}; failed: {type(e).__name__}: {e}"))
                    del calls, fns
                if compiled_ref is not None:
                    try:
                        results.append(row("compile-ref",
                                           time_eager([lambda x=x: call(compiled_ref, x)
                                                       for x in xs], iters=20),
                                           "eager", "syncs (boolean-mask index): not capturable"))
                    except Exception as e:
                        results.append(row("compile-ref", float("nan"), "-",
                                           f"failed: {type(e).__name__}: {e}"))
                for r in results:
                    if r["us"] and not math.isnan(r["us"]):
                        r["pct_copy"] = 100.0 * copy["us"] / r["us"]
                        if fla is not None:
                            r["vs_fla"] = fla["us"] / r["us"]
                del x, xs
                torch.cuda.empty_cache()
    return rows


_COLUMNS = ("shape", "state", "B", "method", "us", "gbps", "pct_copy", "vs_fla", "sets",
            "timing", "note")


def format_row(r):
    return (f"{r['shape']:>14} {r['state']:>8} {r['B']:>4} {r['method']:>11} "
            f"{r['us']:>9.2f} {r['gbps']:>8.1f} {r['pct_copy']:>7.1f}% {r['vs_fla']:>6.2f}x "
            f"{r['sets']:>4} {r['timing']:>5}  {r['note']}")


def format_table(rows):
    head = (f"{'shape':>14} {'state':>8} {'B':>4} {'method':>11} {'us/call':>9} {'GB/s':>8} "
            f"{'%copy':>8} {'vs fla':>7} {'sets':>4} {'time':>5}  note")
    return "\n".join([head] + [format_row(r) for r in rows])


def sweep_tiles(B=64, shape="qwen3-next", state_dtype=torch.float32, dtype=torch.bfloat16,
                bvs=(1, 2, 4, 8, 16, 32, 64, 128), warps=(1, 2, 4, 8), inner=20, reps=10):
    """Times the kernel for each (BV, num_warps); returns [(us, TileConfig)], fastest first.

    The winners go into ``custom_ops.triton_kernel.TUNED_TILES`` (a fixed table: nothing is tuned
    at call time).
    """
    from custom_ops import triton_kernel as tk

    H, Hv, K, V = SHAPES[shape] if isinstance(shape, str) else shape
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    sets = rotation_sets(B, Hv * V * K * torch.empty((), dtype=state_dtype).element_size(), l2)
    x = make_inputs(decode_case(B, H, Hv, K, V, dtype, state_dtype, sets), device="cuda")
    xs = [dict(x, ssm_state_indices=idx) for idx in slot_sets(B, sets, seed=B, device="cuda")]
    bk = 1 << (K - 1).bit_length()
    results = []
    for bv in bvs:
        if bv > (1 << (V - 1).bit_length()) or bv * bk > 32768:
            continue
        for w in warps:
            cfg = tk.TileConfig(BK=bk, BV=bv, num_warps=w)
            def launch(*args, cfg=cfg):
                return tk.fused_gdn_decode_triton(*args, config=cfg)

            try:
                us = time_graph([lambda x=x: call(launch, x) for x in xs], inner, reps)
            except Exception as e:  # e.g. out of resources for a large tile
                print(f"  {cfg}: failed: {type(e).__name__}")
                continue
            results.append((us, cfg))
    results.sort(key=lambda t: t[0])
    return results
