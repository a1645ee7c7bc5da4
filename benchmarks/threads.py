"""Concurrent-callers benchmark: ``python -m benchmarks.threads`` (the last table of
``python -m benchmarks``).

N Python threads call torch.ops.custom.npu_fused_gdn_decode at once, each on its own B slots of
one shared slot pool (as a server's per-request threads would). The op holds no GIL while the
kernel runs (torch.ops releases it around the dispatcher call), so the aggregate throughput grows
with N until memory bandwidth or the cores run out; were the GIL held, it would stay flat.
That concurrent calls give the bits of the same calls made one after another is tested by
tests/test_concurrency.py.
"""

import argparse
import dataclasses
import threading
import time

import torch

import custom_ops
from custom_ops.testing import OP, Case, call, make_inputs, use_threads

from ._harness import moved_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _problem(callers, B, H, Hv, D, state_dtype, seed=0):
    """One shared pool of 1 + callers * B slots; caller c owns slots 1 + c*B .. (c+1)*B.
    Returns (state, inputs of each caller's call on that state)."""
    case = Case(B=B, H=H, Hv=Hv, K=D, V=D, state_dtype=state_dtype, pool=1 + callers * B)
    state, calls = None, []
    for c in range(callers):
        own = tuple(range(1 + c * B, 1 + (c + 1) * B))
        x = make_inputs(dataclasses.replace(case, indices=own, seed=seed + c), state_ref=state)
        state = x["state_ref"]
        calls.append(x)
    return state, calls


def _in_threads(fns):
    errors = []
    start = threading.Barrier(len(fns))

    def run(fn):
        try:
            start.wait()
            fn()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def concurrency_bench(callers=(1, 2, 4), batch=8, H=16, Hv=32, D=128, state_dtype="fp32",
                      intra_op_threads=1, min_time=0.5):
    """Aggregate throughput of `callers` concurrent Python threads. Returns one dict per N:
    callers, calls/s, GB/s of state traffic (read + write), speedup over one caller, and
    cpu_per_wall: the callers' summed CPU seconds per wall second, i.e. how many of them computed
    at once on average (at most 1 if the GIL serialised them; it also shows when the machine has
    fewer free cores than callers)."""
    sdt = DTYPES[state_dtype]
    rows = []
    with use_threads(intra_op_threads):
        for n in callers:
            state, calls = _problem(n, batch, H, Hv, D, sdt)

            # Calibrate calls per thread to about min_time, then time all threads together.
            t0 = time.perf_counter()
            call(OP, calls[0])
            per_call = max(time.perf_counter() - t0, 1e-6)
            iters = max(3, int(min_time / per_call))
            counts, cpu = [0] * n, [0.0] * n

            def loop(c):
                x = calls[c]
                t = time.thread_time()
                for _ in range(iters):
                    call(OP, x)
                    counts[c] += 1
                cpu[c] = time.thread_time() - t

            t0 = time.perf_counter()
            _in_threads([lambda c=c: loop(c) for c in range(n)])
            elapsed = time.perf_counter() - t0
            total = sum(counts)
            bytes_per_call = moved_bytes(batch, Hv, D, D, state.dtype)
            rows.append(dict(callers=n, calls_per_s=total / elapsed,
                             gb_per_s=total * bytes_per_call / elapsed / 1e9,
                             cpu_per_wall=sum(cpu) / elapsed))
    base = rows[0]["calls_per_s"] if rows else 1.0
    for r in rows:
        r["speedup"] = r["calls_per_s"] / base
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.threads", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--callers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, default=8, help="rows per call (per caller)")
    p.add_argument("--state-dtype", default="fp32", choices=list(DTYPES))
    p.add_argument("--intra-op-threads", type=int, default=1,
                   help="torch.set_num_threads while timing (1: all parallelism from the callers)")
    p.add_argument("--min-time", type=float, default=0.5)
    args = p.parse_args(argv)
    rows = concurrency_bench(args.callers, args.batch, state_dtype=args.state_dtype,
                             intra_op_threads=args.intra_op_threads, min_time=args.min_time)
    print(f"Qwen3-Next (H=16, Hv=32, K=V=128), B={args.batch} per caller, "
          f"{args.state_dtype} state, {args.intra_op_threads} intra-op thread(s), "
          f"CPU kernel {custom_ops.cpu_isa()}, {torch.get_num_threads()} cores for torch")
    print(f"{'callers':>8} {'calls/s':>10} {'GB/s':>8} {'speedup':>8} {'cpu/wall':>9}")
    for r in rows:
        print(f"{r['callers']:>8} {r['calls_per_s']:>10.1f} {r['gb_per_s']:>8.2f} "
              f"{r['speedup']:>8.2f} {r['cpu_per_wall']:>9.2f}")


if __name__ == "__main__":
    main()
