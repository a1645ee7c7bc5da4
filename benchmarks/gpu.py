"""CUDA measurements of the decode step: our Triton kernel against FLA, torch.compile of the
reference, and a device-to-device copy of the same state bytes (the bandwidth ceiling).

``bench_cuda(...)`` returns rows (dicts); ``format_table(rows)`` prints them. ``python -m benchmarks
--device cuda`` calls these. ``python -m benchmarks.gpu [--quick] [--no-sweep]`` prints the table
for Qwen3-Next, the target verdicts and a tile sweep (the CUDA path's checks are
tests/test_triton_device.py, under pytest).

Timing: each method's calls are captured in one CUDA graph and the graph replayed, so the numbers
are device time without Python launch cost (the compiled reference syncs on its boolean-mask
indexing and cannot be captured: it is timed eagerly, marked so in the table).

Cold state, as in serving (between two steps of one sequence every other layer's and sequence's
state passes through the GPU): the calls rotate over disjoint sets of B slots, enough that at
least 4x the L2 size of other state is read and written before a set comes round again. The copy
ceiling and FLA rotate the same way over buffers of the same bytes.
"""

import argparse
import inspect
import math

import torch

from custom_ops import fused_gdn_decode_reference
from custom_ops.reference import gates, l2_norm
from custom_ops.testing import Case, call, make_inputs

from ._harness import moved_bytes, rotation_sets, slot_bytes, slot_sets, time_eager, time_graph

# (name, H, Hv, K, V): Qwen3-Next-80B-A3B and its TP=2 shard, Qwen3.5-397B-A17B (docs/spec.md).
SHAPES = {
    "qwen3-next": (16, 32, 128, 128),
    "qwen3-next-tp2": (8, 16, 128, 128),
    "qwen3.5-397b": (16, 64, 128, 128),
}


def decode_case(B, H, Hv, K, V, dtype=torch.bfloat16, state_dtype=torch.float32, sets=2):
    """The benchmarked call: mixed_qkv, a and b column views of one projection; a pool of
    sets * B + 1 slots (slot_sets splits it into the rotated sets)."""
    return Case(B=B, H=H, Hv=Hv, K=K, V=V, dtype=dtype, state_dtype=state_dtype,
                pool=sets * B + 1, layout="projection")


def _fla_call(x, H, Hv, K, V, gather=False):
    """FLA's fused_recurrent_gated_delta_rule on the same step, or (None, reason).

    Uses its in-kernel L2 norm, gate (A_log/dt_bias) and beta sigmoid where the installed version
    has them; what it lacks is computed beforehand, outside the timed call, which favours FLA.
    FLA keeps a dense [B, Hv, K, V] state (no slot indices). Without ``gather`` it gets the rows
    of x's slots in the state's own dtype, gathered beforehand, and writes a new final state
    (fp32 in fla-core 0.6). With ``gather`` the call is FLA on an engine's slot pool, as ours
    is: it gathers x's slots from the pool, runs FLA, and writes the final state back into
    those slots in the pool's dtype, all inside the call.
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
        q = (q.float() / l2_norm(q.float())).to(q.dtype)
        k = (k.float() / l2_norm(k.float())).to(k.dtype)
        notes.append("l2norm outside")
    if {"use_gate_in_kernel", "A_log", "dt_bias"} <= params:
        kw.update(g=a, A_log=x["a_log"], dt_bias=x["dt_bias"], use_gate_in_kernel=True)
        notes.append("gate in kernel")
    else:
        kw["g"] = gates(a, b, x["a_log"], x["dt_bias"])[0]  # the op's default threshold
        notes.append("gate outside")
    if "use_beta_sigmoid_in_kernel" in params:
        kw.update(beta=b, use_beta_sigmoid_in_kernel=True)
        notes.append("beta in kernel")
    else:
        kw["beta"] = gates(a, b, x["a_log"], x["dt_bias"])[1].to(b.dtype)
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
    if not gather:
        kw["initial_state"] = state
        return (lambda: fla_fn(q, k, v, **kw)), ", ".join(notes)
    pool, idx = x["state_ref"], x["ssm_state_indices"].long()
    v_first = "transpose_state_layout" in kw or "state_v_first" in kw

    def gathered():
        initial = pool.index_select(0, idx)
        o, final = fla_fn(q, k, v, initial_state=initial if v_first
                          else initial.transpose(-1, -2).contiguous(), **kw)
        pool.index_copy_(0, idx, (final if v_first else final.transpose(-1, -2)).to(pool.dtype))
        return o, final

    return gathered, ", ".join(notes + ["gather + write-back in the call"])


def bench_cuda(batch_sizes=(1, 16, 64, 128, 256), shapes=("qwen3-next",),
               state_dtypes=(torch.float32, torch.bfloat16), dtype=torch.bfloat16,
               include_fla=True, include_compile=True, inner=20, reps=20, log=print):
    """Times one decode step per (shape, state dtype, B); returns a list of row dicts.

    Row keys: shape, B, state (dtype name), method, us (device microseconds per call),
    gbps (state bytes read + written per second), pct_copy (copy time / method time, in %),
    vs_fla (fla time / method time: above 1 is faster than FLA), sets (slot sets rotated over),
    timing ("graph" or "eager"), note. Methods: "ours" (the op, Triton kernel), "ours-eager"
    (the op launched from Python), "fla" (FLA on state gathered beforehand), "fla+gather" (FLA
    on the slot pool: gather, FLA, write-back, all timed), "compile-ref" (torch.compile of the
    reference), "copy" (the state bytes of B slots, device to device). All ratios come from
    this one run.
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
            slot_nbytes = slot_bytes(Hv, V, K, sdt)
            for B in batch_sizes:
                sets = rotation_sets(B, slot_nbytes, l2)
                x = make_inputs(decode_case(B, H, Hv, K, V, dtype, sdt, sets), device="cuda")
                xs = [dict(x, ssm_state_indices=idx)
                      for idx in slot_sets(B, sets, seed=B, device="cuda")]
                state_bytes = B * slot_nbytes
                moved = moved_bytes(B, Hv, V, K, sdt)

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
                for method, gather in (("fla", False), ("fla+gather", True)) if include_fla else ():
                    calls = [_fla_call(x, H, Hv, K, V, gather=gather) for x in xs]
                    fns, note = [c[0] for c in calls], calls[0][1]
                    if fns[0] is None:
                        results.append(row(method, float("nan"), "-", note))
                        break
                    try:
                        r = row(method, time_graph(fns, inner, reps), "graph", note)
                        results.append(r)
                        if not gather:
                            fla = r
                    except Exception as e:  # report, keep benchmarking
                        results.append(row(method, float("nan"), "-",
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

    A winner that beats ``tile_config``'s rule is a candidate for changing the rule (nothing is
    tuned at call time).
    """
    from custom_ops import triton_kernel as tk

    H, Hv, K, V = SHAPES[shape] if isinstance(shape, str) else shape
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    sets = rotation_sets(B, slot_bytes(Hv, V, K, state_dtype), l2)
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


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu",
        description="CUDA benchmark of the decode step (Qwen3-Next): the table, the target "
                    "verdicts and a tile sweep.")
    p.add_argument("--quick", action="store_true", help="fewer batch sizes")
    p.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    args = p.parse_args(argv)
    from custom_ops import triton_kernel as tk
    from custom_ops.testing import short

    # The reference's einsum must not use TF32, or it, not the kernel, is the inaccurate side.
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"device {torch.cuda.get_device_name()}", flush=True)
    batch = (1, 64, 256) if args.quick else (1, 16, 64, 128, 256)
    print("\n== bench (device time per call from CUDA-graph replays) ==", flush=True)
    rows = bench_cuda(batch_sizes=batch, shapes=("qwen3-next",))
    print("\n" + format_table(rows), flush=True)
    print("\n== target: qwen3-next, fp32 and bf16 state, B >= 64: "
          "ours >= 85% of copy, faster than fla (ratios from this run) ==")
    by = {(r["state"], r["B"], r["method"]): r for r in rows}
    for state in ("float32", "bfloat16"):
        for B in [b for b in batch if b >= 64]:
            ours = by[(state, B, "ours")]
            pct, vs = ours["pct_copy"], ours["vs_fla"]
            pool = by.get((state, B, "fla+gather"))
            vs_pool = pool["us"] / ours["us"] if pool else float("nan")
            if math.isnan(vs):
                verdict = "UNDECIDED (fla n/a)" if pct >= 85 else "NOT MET"
            else:
                verdict = "MET" if pct >= 85 and vs > 1 else "NOT MET"
            print(f"TARGET {verdict} {state} B={B}: ours {ours['us']:.1f} us, "
                  f"{pct:.0f}% of copy, {vs:.2f}x fla's speed, {vs_pool:.2f}x fla+gather's",
                  flush=True)
    if args.no_sweep:
        return
    print("\n== tile sweep (qwen3-next; top 5 per case; current rule's pick marked *) ==")
    for sdt in (torch.float32, torch.bfloat16):
        for B in ((64,) if args.quick else (64, 256)):
            res = sweep_tiles(B=B, state_dtype=sdt)
            cur = tk.tile_config(128, 128, sdt)
            cur_us = next((us for us, cfg in res if cfg == cur), float("nan"))
            print(f"B={B} state={short(sdt)}: rule {cur} {cur_us:.2f} us")
            for us, cfg in res[:5]:
                print(f"  {us:8.2f} us  BV={cfg.BV:<3} num_warps={cfg.num_warps}"
                      f"{' *' if cfg == cur else ''}", flush=True)


if __name__ == "__main__":
    main()
