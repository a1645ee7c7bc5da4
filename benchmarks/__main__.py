"""Benchmark of custom::npu_fused_gdn_decode: ``python -m benchmarks`` (from the repository root).

For Qwen3-Next shapes (H=16, Hv=32, K=V=128) and its tensor-parallel shards, fp32 and bf16 state,
and a range of batch sizes, it times in one run:
  ours      the registered op on the chosen device (CPU kernel, NPU aclnn, CUDA Triton);
  reference the pure-torch reference (custom_ops.reference);
  compiled  torch.compile of the reference;
  copy      a plain copy of the same state bytes (read + write): the memory-bandwidth ceiling;
  rmw       an in-place read-modify-write stream over the same bytes (what the op's traffic is,
            with no arithmetic): the ceiling for an in-place update.
Every backend's result is checked against the reference before it is timed. The table gives
us per call, GB/s of state traffic (2 * B * Hv * V * K * element size), % of copy and of rmw
bandwidth and speedup vs the reference. --csv/--json/--plot write the table and a GB/s-vs-B plot.
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

import custom_ops
from custom_ops import fused_gdn_decode_reference
from custom_ops.testing import Case, agrees_with_reference, call, make_inputs

QWEN3_NEXT = (16, 32)  # (H, Hv); K = V = 128
TP_SHARDS = [(8, 16), (4, 8), (2, 4)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BACKENDS = ("ours", "reference", "compiled", "copy", "rmw")
CEILINGS = ("copy", "rmw")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "npu", "cuda"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--state-dtype", nargs="+", default=["fp32", "bf16"],
                   choices=["fp32", "bf16", "fp16"])
    p.add_argument("--input-dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--shapes", default="all", choices=["all", "full", "shards"],
                   help="Qwen3-Next full (H=16, Hv=32), its TP shards, or both")
    p.add_argument("--head-dim", type=int, default=128, help="K = V")
    p.add_argument("--pool-factor", type=float, default=2.0,
                   help="slot pool = pool_factor * B + 1, so the state is not all cache-resident")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--min-time", type=float, default=0.3, help="seconds of timed calls per point")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--quick", action="store_true", help="Qwen3-Next full shape, B in {1, 8, 32}")
    p.add_argument("--csv", help="write the table as CSV")
    p.add_argument("--json", help="write the table as JSON")
    p.add_argument("--plot", help="write a PNG plot of GB/s vs B per backend (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--callers", type=int, nargs="*", default=[1, 2, 4],
                   help="CPU: also time N concurrent Python callers on disjoint slots (GIL check); "
                        "give no value to skip")
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.batch = "full", [1, 8, 32]
    return args


def device_setup(name):
    """Returns (torch.device, synchronize function)."""
    if name == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            sys.exit("--device npu needs torch_npu (and CANN with the FusedGdnDecode op package)")
        return torch.device("npu"), torch.npu.synchronize
    if name == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device is available")
        return torch.device("cuda"), torch.cuda.synchronize
    return torch.device("cpu"), lambda: None


class Progress:
    """A one-line text progress bar on stderr (no dependency)."""

    def __init__(self, total, enabled=True):
        self.total, self.done, self.enabled = total, 0, enabled and total > 0
        self.start = time.perf_counter()

    def step(self, label):
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / self.total)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{elapsed:5.0f}s {label:<40}")
        sys.stderr.flush()
        if self.done == self.total:
            sys.stderr.write("\n")


def time_call(fn, sync, min_time):
    """Median seconds per call over repeated calls (at least 5, about min_time in total)."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - t0, 1e-7)
    reps = int(min(max(5, min_time / once), 1000))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


_COMPILED = {}


def compiled_reference():
    if "ref" not in _COMPILED:
        _COMPILED["ref"] = torch.compile(fused_gdn_decode_reference, dynamic=True)
    return _COMPILED["ref"]


def run(args):
    device, sync = device_setup(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.input_dtype]
    shapes = []
    if args.shapes in ("all", "full"):
        shapes.append(QWEN3_NEXT)
    if args.shapes in ("all", "shards"):
        shapes += TP_SHARDS
    configs = [(H, Hv, sd, B) for (H, Hv) in shapes for sd in args.state_dtype for B in args.batch]
    progress = Progress(len(configs) * len(args.backends), enabled=not args.no_progress)
    op = torch.ops.custom.npu_fused_gdn_decode
    rows = []
    for H, Hv, sd, B in configs:
        state_dtype = DTYPES[sd]
        D = args.head_dim
        case = Case(B=B, H=H, Hv=Hv, K=D, V=D, dtype=dtype, state_dtype=state_dtype,
                    pool=int(args.pool_factor * B) + 1, layout="projection")
        x = make_inputs(case, device=device)
        nbytes = 2 * B * Hv * D * D * x["state_ref"].element_size()
        row = dict(H=H, Hv=Hv, K=D, V=D, B=B, pool=x["state_ref"].shape[0], input=args.input_dtype,
                   state=sd, bytes=nbytes)
        for backend in args.backends:
            label = f"H={H} Hv={Hv} {sd} B={B} {backend}"
            if backend in CEILINGS:
                src = torch.empty(nbytes // 8, dtype=torch.int32, device=device).fill_(1)
                if backend == "copy":
                    dst = torch.empty_like(src)

                    def fn(src=src, dst=dst):
                        return dst.copy_(src)
                else:
                    def fn(src=src):
                        return src.bitwise_or_(0)
                ok = True
            else:
                impl = {"ours": op, "reference": fused_gdn_decode_reference}.get(backend)
                impl = impl or compiled_reference()
                # Runs impl and the reference once on copies of the state: out and state agree?
                ok = agrees_with_reference(impl, x)
                def fn(impl=impl, x=x):
                    return call(impl, x)
            t = time_call(fn, sync, args.min_time)
            row[f"{backend}_us"] = t * 1e6
            row[f"{backend}_GBps"] = nbytes / t / 1e9
            if backend not in CEILINGS:
                row[f"{backend}_ok"] = ok
            progress.step(label)
        for ceiling in CEILINGS:
            if f"{ceiling}_us" in row:
                for backend in args.backends:
                    if backend not in CEILINGS:
                        row[f"{backend}_pct_{ceiling}"] = (
                            100.0 * row[f"{ceiling}_us"] / row[f"{backend}_us"])
        if "reference_us" in row and "ours_us" in row:
            row["speedup_vs_reference"] = row["reference_us"] / row["ours_us"]
        rows.append(row)
    return rows


def machine_description(device):
    if device == "cpu":
        cpu = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        cpu = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        return (f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
                f"kernel variant {custom_ops.cpu_isa()}")
    if device == "cuda":
        return torch.cuda.get_device_name()
    return "Ascend NPU"


def format_table(rows, backends):
    """us per call and GB/s per backend; for ours also % of the copy and rmw ceilings."""
    header = f"{'H':>3} {'Hv':>3} {'state':>5} {'B':>4} |"
    for b in backends:
        header += f" {b + ' us':>13} {'GB/s':>6}"
        if b == "ours":
            header += "".join(f" {'%' + c:>5}" for c in CEILINGS if c in backends)
    header += f" | {'vs ref':>7} {'check':>5}"
    lines = [header, "-" * len(header)]
    for r in rows:
        line = f"{r['H']:>3} {r['Hv']:>3} {r['state']:>5} {r['B']:>4} |"
        for b in backends:
            line += f" {r[f'{b}_us']:13.1f} {r[f'{b}_GBps']:6.1f}"
            if b == "ours":
                line += "".join(f" {r[f'ours_pct_{c}']:5.0f}" for c in CEILINGS if c in backends)
        sp = r.get("speedup_vs_reference")
        checks = [r[k] for k in r if k.endswith("_ok")]
        line += f" | {sp:6.1f}x" if sp is not None else f" | {'-':>7}"
        line += f" {'ok' if all(checks) else 'FAIL':>5}"
        lines.append(line)
    return "\n".join(lines)


def write_plot(rows, backends, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["H"], r["Hv"], r["state"]) for r in rows})
    n = len(groups)
    cols = min(n, 2)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 3.6 * nrows),
                             squeeze=False)
    for ax, (H, Hv, sd) in zip(axes.flat, groups):
        sub = sorted((r for r in rows if (r["H"], r["Hv"], r["state"]) == (H, Hv, sd)),
                     key=lambda r: r["B"])
        bs = [r["B"] for r in sub]
        for b in backends:
            if b in CEILINGS:
                style = dict(color="black", linestyle="--" if b == "copy" else ":")
                label = f"{b} ceiling"
            else:
                style, label = dict(marker="o"), b
            ax.plot(bs, [r[f"{b}_GBps"] for r in sub], label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch B")
        ax.set_ylabel("GB/s of state traffic")
        ax.set_title(f"H={H} Hv={Hv} K=V={sub[0]['K']} {sd} state")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_cuda(args):
    """--device cuda: the Triton kernel against FLA, compiled reference and a device copy
    (benchmarks/cuda.py, which times with CUDA-graph replays)."""
    from benchmarks import cuda as triton_bench

    shapes = []
    if args.shapes in ("all", "full"):
        shapes.append((*QWEN3_NEXT, args.head_dim, args.head_dim))
    if args.shapes in ("all", "shards"):
        shapes += [(H, Hv, args.head_dim, args.head_dim) for H, Hv in TP_SHARDS]
    rows = triton_bench.bench_cuda(
        batch_sizes=tuple(args.batch), shapes=tuple(shapes),
        state_dtypes=tuple(DTYPES[s] for s in args.state_dtype), dtype=DTYPES[args.input_dtype],
        log=(lambda *a: None) if args.no_progress else (lambda *a: print(*a, file=sys.stderr)))
    print(f"benchmarks: npu_fused_gdn_decode on cuda ({torch.cuda.get_device_name()}), "
          f"torch {torch.__version__}")
    print(triton_bench.format_table(rows))
    return rows


def _write_tables(args, rows, machine):
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
            writer.writeheader()
            writer.writerows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "machine": machine, "torch": torch.__version__,
                       "rows": rows}, f, indent=1, default=str)


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda":
        if args.plot:
            sys.exit("--plot is only supported for --device cpu/npu")
        rows = run_cuda(args)
        _write_tables(args, rows, machine=torch.cuda.get_device_name())
        return 0
    rows = run(args)
    machine = machine_description(args.device)
    print(f"benchmarks: npu_fused_gdn_decode on {args.device} ({machine}), torch "
          f"{torch.__version__}, input {args.input_dtype}, K=V={args.head_dim}, "
          f"pool = {args.pool_factor:g}*B+1 slots")
    print(format_table(rows, args.backends))
    _write_tables(args, rows, machine)
    if args.device == "cpu" and args.callers:
        from benchmarks import threads as bench_threads

        print("\nConcurrent callers (each on its own slots of one pool; the op releases the GIL):")
        bench_threads.main(["--callers", *map(str, args.callers)])
    if args.plot:
        write_plot(rows, args.backends, args.plot, f"npu_fused_gdn_decode, {machine}")
    failed = [r for r in rows if not all(r[k] for k in r if k.endswith("_ok"))]
    if failed:
        print(f"FAIL: {len(failed)} configuration(s) disagree with the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
