"""Benchmark of custom::npu_fused_gdn_decode: ``python -m benchmarks`` (from the repository root).

For Qwen3-Next shapes (H=16, Hv=32, K=V=128) and its tensor-parallel shards, every state dtype
and a range of batch sizes, it times in one run:
  ours      the registered op on the chosen device (CPU kernel, NPU aclnn, CUDA Triton);
  reference the pure-torch reference (custom_ops.reference);
  compiled  torch.compile of the reference;
  copy      a plain copy of the same state bytes (read + write): a reference stream, not a
            ceiling (a copy also reads its destination's lines in, which an update in place
            does not, so the op can beat it);
  rmw       an in-place read-modify-write stream over the same bytes (what the op's traffic is,
            with no arithmetic): the ceiling for an in-place update.
in two modes:
  dram      (the main table) every timed call works on fresh slots of a pool at least 4x the
            last-level cache (as the OS reports it), as in serving, where all layers' states of
            all sequences never fit in cache; the ceilings stream over fresh bytes of it too;
  cache     every call works on the same B slots (and the ceilings on the same bytes), which stay
            cache-resident where they fit.
copy and rmw are split over the threads as torch splits an elementwise op (byte-sized elements,
so that even the smallest state is more than one of its 32768-element chunks); the op splits by
(row, value head); in cache mode copy moves the bytes between the two halves of one buffer, so it
keeps no more bytes resident than the op. Every backend's result but the reference's own is
checked against the reference before it is timed. The tables give us per call, GB/s of state
traffic (2 * B * Hv * V * K * element size), % of copy and of rmw bandwidth for the same bytes in
the same mode, and speedup vs the reference; on the CPU a last table gives every kernel variant's
GB/s at one batch size from DRAM. --csv/--json/--plot write the rows and a GB/s-vs-B plot (both
modes, every state dtype).
"""
import argparse
import functools
import glob
import itertools
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time

import torch

import custom_ops
from custom_ops import fused_gdn_decode_reference
from custom_ops.testing import Case, agrees_with_reference, call, make_inputs

from benchmarks._harness import moved_bytes, slot_bytes, slot_windows, time_calls

QWEN3_NEXT = (16, 32)  # (H, Hv); K = V = 128
TP_SHARDS = [(8, 16), (4, 8), (2, 4)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BACKENDS = ("ours", "reference", "compiled", "copy", "rmw")
CEILINGS = ("copy", "rmw")
MODES = ("dram", "cache")
_STARTED = time.time()  # the header's run time: when the benchmark was imported


def input_dtype_for(state, input_dtype):
    """A 16-bit state takes inputs of its own dtype (the op's accepted pairs); an fp32 state
    takes --input-dtype."""
    return state if state != "fp32" else input_dtype
# The DRAM mode's pool holds at least this many times the last-level cache.
POOL_OVER_CACHE = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "npu", "cuda"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--state-dtype", nargs="+", default=["fp32", "bf16", "fp16"],
                   choices=["fp32", "bf16", "fp16"])
    p.add_argument("--input-dtype", default="bf16", choices=["bf16", "fp16"],
                   help="inputs of an fp32 state (a 16-bit state takes its own dtype)")
    p.add_argument("--shapes", default="all", choices=["all", "full", "shards"],
                   help="Qwen3-Next full (H=16, Hv=32), its TP shards, or both")
    p.add_argument("--head-dim", type=int, default=128, help="K = V")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                   help="dram: fresh slots of a pool >= 4x the last-level cache every call (the "
                        "serving case, main table); cache: the same slots every call")
    p.add_argument("--cache-bytes", type=int, default=None,
                   help="last-level cache size to size the DRAM pool by (default: ask the OS)")
    p.add_argument("--variants-batch", type=int, nargs="*", default=[8, 32],
                   help="CPU: batch sizes of the per-kernel-variant table (none: skip it)")
    p.add_argument("--variants-threads", type=int, nargs="+", default=[1, 2],
                   help="CPU: thread counts of the per-kernel-variant table")
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
    args.cache_source = "--cache-bytes"
    if args.cache_bytes is None:
        args.cache_bytes, args.cache_source = last_level_cache_bytes()
        if args.cache_bytes is None:
            args.cache_bytes, args.cache_source = 256 << 20, f"assumed ({args.cache_source})"
    if args.quick:
        args.shapes, args.batch = "full", [1, 8, 32]
    if args.device == "cuda" and args.modes != list(MODES):
        p.error("--modes applies to --device cpu/npu (the CUDA bench times CUDA-graph replays)")
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


def _size_bytes(text):
    """ "32768K" / "32M" / "1024" -> bytes."""
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * mult


def last_level_cache_bytes():
    """(bytes, where it came from) for the machine's total last-level (L3, else L2) cache as the
    OS reports it: the larger of Linux sysfs (each distinct cache instance counted once) and
    glibc's sysconf (`getconf`), which disagree on some virtual machines (one CCX's L3 against
    the whole chip's); a pool sized by the larger is big enough either way. (None, why) if neither
    says."""
    found = {}
    for level in (3, 2):
        sizes = {}
        for index in glob.glob("/sys/devices/system/cpu/cpu*/cache/index*"):
            try:
                with open(os.path.join(index, "level")) as f:
                    if int(f.read()) != level:
                        continue
                with open(os.path.join(index, "type")) as f:
                    if f.read().strip() == "Instruction":
                        continue
                with open(os.path.join(index, "shared_cpu_list")) as f:
                    shared = f.read().strip()
                with open(os.path.join(index, "size")) as f:
                    sizes[shared] = _size_bytes(f.read())
            except (OSError, ValueError):
                continue
        if sizes:
            found[f"sysfs L{level}"] = sum(sizes.values())
            break
    getconf = shutil.which("getconf")
    for name in ("LEVEL3_CACHE_SIZE", "LEVEL2_CACHE_SIZE") if getconf else ():
        try:
            out = subprocess.run([getconf, name], capture_output=True, text=True, timeout=10,
                                 check=False).stdout.strip()
            size = int(out)
        except (OSError, ValueError, subprocess.SubprocessError):
            continue
        if size > 0:
            found[f"getconf {name}"] = size
            break
    if not found:
        return None, "the OS reports no cache size"
    source = max(found, key=found.get)
    said = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in found.items())
    return found[source], f"the larger of {said}" if len(found) > 1 else said


class DramPool:
    """A state pool of at least POOL_OVER_CACHE x the last-level cache for one (shape, state
    dtype), and the slot windows that make every timed call touch bytes no recent call touched."""

    def __init__(self, Hv, D, state_dtype, cache_bytes, device, seed=0):
        self.slot_bytes = slot_bytes(Hv, D, D, state_dtype)
        self.min_bytes = POOL_OVER_CACHE * cache_bytes
        self.shape, self.state_dtype, self.device, self.seed = (Hv, D, D), state_dtype, device, seed
        self.state = None

    def ensure(self, B):
        """Grows the pool (if needed) to >= POOL_OVER_CACHE windows of B slots, and returns it."""
        slots = max(math.ceil(self.min_bytes / self.slot_bytes), POOL_OVER_CACHE * B) + 1
        if self.state is None or self.state.shape[0] < slots:
            self.state = None
            g = torch.Generator().manual_seed(self.seed)
            state = torch.empty((slots, *self.shape), dtype=self.state_dtype)
            for i in range(0, slots, 64):  # in chunks: no fp32 copy of a 16-bit pool
                chunk = state[i:i + 64]
                chunk.copy_(torch.randn(chunk.shape, generator=g) * 0.5)
            self.state = state.to(self.device)
        return self.state

    def windows(self, B, seed=0):
        """An endless cycle of index tensors: B distinct slots each, disjoint from the previous
        POOL_OVER_CACHE - 1 windows (a random permutation of the pool cut into windows)."""
        return itertools.cycle(slot_windows(B, self.state.shape[0] - 1, seed, self.device))

    def byte_chunks(self, nbytes):
        """An endless cycle of byte views of nbytes / 2 consecutive fresh bytes each (the
        ceilings' read-modify-write or copy source), taken from the pool's own memory."""
        flat = self.state.view(-1).view(torch.uint8)
        n = nbytes // 2  # bytes per chunk
        count = flat.numel() // n
        return itertools.cycle([flat[c * n:(c + 1) * n] for c in range(count)])


_COMPILED = {}


def compiled_reference():
    if "ref" not in _COMPILED:
        _COMPILED["ref"] = torch.compile(fused_gdn_decode_reference, dynamic=True)
    return _COMPILED["ref"]


def _ceiling_fn(backend, chunks):
    """copy: a chunk into the next one; rmw: x |= 0 in place (same bytes read and written).
    A chunk of None for copy: copy the last one's halves into each other (cache mode: the same
    bytes moved, and no more bytes resident than the op has)."""
    if backend == "copy":
        def fn():
            dst = next(chunks)
            if dst is None:
                src = next(chunks)
                half = src.numel() // 2
                src[half:2 * half].copy_(src[:half])
                src[:half].copy_(src[half:2 * half])
            else:
                dst.copy_(next(chunks))
    else:
        def fn():
            next(chunks).bitwise_or_(0)
    return fn


def run(args):
    device, sync = device_setup(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = []
    if args.shapes in ("all", "full"):
        shapes.append(QWEN3_NEXT)
    if args.shapes in ("all", "shards"):
        shapes += TP_SHARDS
    cache_bytes = args.cache_bytes
    configs = [(H, Hv, sd, B) for (H, Hv) in shapes for sd in args.state_dtype for B in args.batch]
    progress = Progress(len(configs) * len(args.backends) * len(args.modes),
                        enabled=not args.no_progress)
    op = torch.ops.custom.npu_fused_gdn_decode
    D = args.head_dim
    rows = []
    for (H, Hv, sd), group in itertools.groupby(configs, key=lambda c: c[:3]):
        state_dtype = DTYPES[sd]
        dtype = DTYPES[input_dtype_for(sd, args.input_dtype)]
        pool = None
        if "dram" in args.modes:
            pool = DramPool(Hv, D, state_dtype, cache_bytes, device)
        for _, _, _, B in group:
            # The check before timing, on a small pool (it compares the whole pool).
            case = Case(B=B, H=H, Hv=Hv, K=D, V=D, dtype=dtype, state_dtype=state_dtype,
                        pool=2 * B + 1, layout="projection")
            x = make_inputs(case, device=device)
            checked = {}
            for backend in args.backends:
                if backend not in CEILINGS:
                    if backend == "reference":  # nothing to check it against
                        checked[backend] = (fused_gdn_decode_reference, None)
                        continue
                    impl = op if backend == "ours" else compiled_reference()
                    # Runs impl and the reference once on copies of the state: out and state agree?
                    checked[backend] = (impl, agrees_with_reference(impl, x))
            nbytes = moved_bytes(B, Hv, D, D, x["state_ref"].dtype)
            for mode in args.modes:
                if mode == "dram":
                    xm = dict(x, state_ref=pool.ensure(B))
                    windows = pool.windows(B)
                    chunks = {c: pool.byte_chunks(nbytes) for c in CEILINGS}
                else:
                    xm, windows = x, None
                    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).fill_(1)
                    chunks = {"copy": itertools.cycle([None, src]), "rmw": itertools.repeat(src)}
                pool_slots = xm["state_ref"].shape[0]
                row = {"mode": mode, "H": H, "Hv": Hv, "K": D, "V": D, "B": B, "pool": pool_slots,
                       "input": input_dtype_for(sd, args.input_dtype), "state": sd,
                       "bytes": nbytes}
                fns = {}
                for backend in args.backends:
                    if backend in CEILINGS:
                        fns[backend] = _ceiling_fn(backend, chunks[backend])
                    else:
                        impl, ok = checked[backend]
                        if ok is not None:
                            row[f"{backend}_ok"] = ok
                        if windows is None:
                            fns[backend] = (lambda impl=impl, xm=xm: call(impl, xm))
                        else:
                            fns[backend] = (lambda impl=impl, xm=xm, windows=windows: call(
                                impl, dict(xm, ssm_state_indices=next(windows))))
                for backend, t in time_calls(fns, sync, args.min_time).items():
                    row[f"{backend}_us"] = t * 1e6
                    row[f"{backend}_GBps"] = nbytes / t / 1e9
                    progress.step(f"{mode} H={H} Hv={Hv} {sd} B={B} {backend}")
                _ratios(row, args.backends)
                rows.append(row)
            del x
    return rows


def _ratios(row, backends):
    for ceiling in CEILINGS:
        if f"{ceiling}_us" in row:
            for backend in backends:
                if backend not in CEILINGS:
                    row[f"{backend}_pct_{ceiling}"] = (
                        100.0 * row[f"{ceiling}_us"] / row[f"{backend}_us"])
    if "reference_us" in row and "ours_us" in row:
        row["speedup_vs_reference"] = row["reference_us"] / row["ours_us"]


def run_variants(args):
    """CPU: ours on every kernel variant this build runs here, Qwen3-Next full shape, each of
    --variants-batch, every state dtype, in each mode, at each of --variants-threads, timed
    interleaved with the rmw ceiling of the same bytes (so ratios of one row share the machine's
    slow spells)."""
    device, sync = device_setup("cpu")
    H, Hv = QWEN3_NEXT
    D = args.head_dim
    op = torch.ops.custom.npu_fused_gdn_decode
    rows = []
    old_isa, old_threads = custom_ops.cpu_isa(), torch.get_num_threads()
    try:
        for sd in args.state_dtype:
            dtype = DTYPES[input_dtype_for(sd, args.input_dtype)]
            pool = (DramPool(Hv, D, DTYPES[sd], args.cache_bytes, device)
                    if "dram" in args.modes else None)
            for B in args.variants_batch:
                case = Case(B=B, H=H, Hv=Hv, K=D, V=D, dtype=dtype, state_dtype=DTYPES[sd],
                            pool=2 * B + 1, layout="projection")
                x = make_inputs(case, device=device)
                ok = {}
                for isa in custom_ops.cpu_isas():
                    custom_ops.set_cpu_isa(isa)
                    ok[isa] = agrees_with_reference(op, x)
                nbytes = moved_bytes(B, Hv, D, D, x["state_ref"].dtype)
                for mode, threads in itertools.product(args.modes, args.variants_threads):
                    torch.set_num_threads(threads)
                    if mode == "dram":
                        state, rmw_chunks = pool.ensure(B), pool.byte_chunks(nbytes)
                    else:
                        state = x["state_ref"]
                        rmw_chunks = itertools.repeat(torch.ones(nbytes // 2, dtype=torch.uint8))
                    fns = {"rmw": _ceiling_fn("rmw", rmw_chunks)}
                    # One cycle for all variants: each call takes the next fresh window.
                    windows = pool.windows(B) if mode == "dram" else itertools.repeat(
                        x["ssm_state_indices"])
                    for isa in custom_ops.cpu_isas():

                        def fn(isa=isa, windows=windows, state=state):
                            custom_ops.set_cpu_isa(isa)
                            call(op, dict(x, state_ref=state, ssm_state_indices=next(windows)))
                        fns[isa] = fn
                    # The core's clock around the line: a slow spell (or a neighbour on the same
                    # core) lowers every ratio to rmw, the compute-bound 16-bit ones most.
                    before = torch.ops.custom_ops_internal.core_clock_ghz()
                    times = time_calls(fns, sync, args.min_time)
                    after = torch.ops.custom_ops_internal.core_clock_ghz()
                    for isa in custom_ops.cpu_isas():
                        t = times[isa]
                        rows.append({"variant": isa, "state": sd, "B": B, "mode": mode,
                                     "threads": threads, "us": t * 1e6,
                                     "GBps": nbytes / t / 1e9, "pct_rmw": 100.0 * times["rmw"] / t,
                                     "ns_per_row": t * 1e9 * threads / (B * Hv * D),
                                     "clock_ghz": [before, after], "ours_ok": ok[isa]})
    finally:
        custom_ops.set_cpu_isa(old_isa)
        torch.set_num_threads(old_threads)
    return rows


def format_variants(rows):
    """One line per (state, B, mode, threads): each variant's GB/s, % of rmw and ns per state row
    per thread, and the core's clock read before and after the line where it was read."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    header = f"{'state':>5} {'B':>4} {'mode':>5} {'thr':>3} |" + "".join(
        f" {v + ' GB/s':>15} {'%rmw':>5} {'ns/row':>6} |" for v in variants) + " check"
    lines = [header, "-" * len(header)]
    key = lambda r: (r["state"], r["B"], r["mode"], r["threads"])  # noqa: E731
    for k, group in itertools.groupby(rows, key=key):
        by = {r["variant"]: r for r in group}
        line = f"{k[0]:>5} {k[1]:>4} {k[2]:>5} {k[3]:>3} |"
        for v in variants:
            r = by.get(v)
            line += (f" {r['GBps']:15.1f} {r['pct_rmw']:5.0f} {r['ns_per_row']:6.1f} |" if r
                     else f" {'-':>15} {'-':>5} {'-':>6} |")
        line += f" {'ok' if all(r['ours_ok'] for r in by.values()) else 'FAIL'}"
        before, after = next(iter(by.values())).get("clock_ghz", (0, 0))
        if before > 0:
            line += f" | clock {before:.2f}-{after:.2f} GHz"
        lines.append(line)
    return "\n".join(lines)


def run_started():
    """When the run started (UTC) and its scheduling policy (chrt -f makes it SCHED_FIFO)."""
    policy = {getattr(os, n, None): n for n in ("SCHED_OTHER", "SCHED_FIFO", "SCHED_RR",
                                                 "SCHED_BATCH", "SCHED_IDLE")}
    try:
        sched = policy.get(os.sched_getscheduler(0), "unknown policy")
    except (AttributeError, OSError):
        sched = "unknown policy"
    return f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(_STARTED))}, {sched}"


def machine_description(device):
    if device == "cpu":
        cpu = platform.processor() or platform.machine()
        info = {}
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    info.setdefault(key.strip(), value.strip())
        except OSError:
            pass
        cpu = info.get("model name", cpu)
        if "cpu family" in info and "model" in info:  # a VM's model name can be just "AMD EPYC"
            cpu += f" (family {info['cpu family']} model {info['model']})"
        return (f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
                f"kernel variant {custom_ops.cpu_isa()}")
    if device == "cuda":
        return torch.cuda.get_device_name()
    return "Ascend NPU"


def format_table(rows, backends):
    """us per call and GB/s per backend; for ours also % of the copy stream and the rmw
    ceiling."""
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
        verdict = ("ok" if all(checks) else "FAIL") if checks else "-"
        line += f" {verdict:>5}"
        lines.append(line)
    return "\n".join(lines)


MODE_TITLES = {
    "dram": "state from DRAM: fresh slots of a pool >= {f}x the last-level cache every call",
    "cache": "state cache-resident where it fits: the same B slots every call",
}


def write_plot(rows, backends, path, title):
    """GB/s vs B: one panel per (state dtype, mode); the Qwen3-Next full shape with every backend
    and ceiling, its TP shards with ours only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    states = [s for s in DTYPES if any(r["state"] == s for r in rows)]
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    fig, axes = plt.subplots(len(states), len(modes), figsize=(6.4 * len(modes), 3.8 * len(states)),
                             squeeze=False)
    full = QWEN3_NEXT
    for (si, sd), (mi, mode) in itertools.product(enumerate(states), enumerate(modes)):
        ax = axes[si][mi]
        sub = [r for r in rows if r["state"] == sd and r["mode"] == mode]
        shapes = sorted({(r["H"], r["Hv"]) for r in sub}, reverse=True)
        for H, Hv in shapes:
            pts = sorted((r for r in sub if (r["H"], r["Hv"]) == (H, Hv)), key=lambda r: r["B"])
            bs = [r["B"] for r in pts]
            if (H, Hv) != full:
                ax.plot(bs, [r["ours_GBps"] for r in pts], marker=".", linewidth=0.8, alpha=0.7,
                        label=f"ours H={H} Hv={Hv}")
                continue
            for b in backends:
                if b in CEILINGS:
                    style = {"color": "black", "linestyle": "--" if b == "copy" else ":"}
                    label = "rmw ceiling" if b == "rmw" else "copy stream"
                else:
                    style = {"marker": "o", "linewidth": 2 if b == "ours" else 1}
                    label = f"{b} H={H} Hv={Hv}" if b == "ours" else b
                ax.plot(bs, [r[f"{b}_GBps"] for r in pts], label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch B")
        ax.set_ylabel("GB/s of state traffic")
        K = sub[0]["K"] if sub else "?"
        ax.set_title(f"{sd} state, K=V={K}\n{MODE_TITLES[mode].format(f=POOL_OVER_CACHE)}",
                     fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_cuda(args):
    """--device cuda: the Triton kernel against FLA, compiled reference and a device copy
    (benchmarks/gpu.py, which times with CUDA-graph replays)."""
    from benchmarks import gpu as triton_bench

    shapes = []
    if args.shapes in ("all", "full"):
        shapes.append((*QWEN3_NEXT, args.head_dim, args.head_dim))
    if args.shapes in ("all", "shards"):
        shapes += [(H, Hv, args.head_dim, args.head_dim) for H, Hv in TP_SHARDS]
    # One call per state dtype: a 16-bit state takes inputs of its own dtype (the accepted pairs).
    rows = []
    for sd in args.state_dtype:
        rows += triton_bench.bench_cuda(
            batch_sizes=tuple(args.batch), shapes=tuple(shapes), state_dtypes=(DTYPES[sd],),
            dtype=DTYPES[input_dtype_for(sd, args.input_dtype)],
            log=(lambda *a: None) if args.no_progress else (lambda *a: print(*a, file=sys.stderr)))
    print(f"benchmarks: npu_fused_gdn_decode on cuda ({torch.cuda.get_device_name()}), "
          f"torch {torch.__version__}")
    print(triton_bench.format_table(rows))
    return rows


# What the figures depend on: the build and the benchmark. Not docs/, where a run's own output goes
# (`> docs/bench_cpu.txt` changes a tracked file before the run starts).
SOURCE_PATHS = ("csrc", "custom_ops", "benchmarks", "scripts", "setup.py", "pyproject.toml")


@functools.lru_cache(maxsize=None)
def source_commit(root=None):
    """The commit of the checkout at root (default: this one), with "+changes" when its sources,
    SOURCE_PATHS, differ from it, or "unknown". Cached: main() asks before the run, so a commit
    made while it runs is not named."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True).stdout
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no",
                                "--", *SOURCE_PATHS],
                               capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.strip() + ("+changes" if dirty.strip() else "")


def _write_tables(args, rows, machine, variants=()):
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
            writer.writeheader()
            writer.writerows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "machine": machine, "torch": torch.__version__,
                       "commit": source_commit(), "rows": rows, "variants": list(variants)}, f,
                      indent=1, default=str)


def main(argv=None):
    args = parse_args(argv)
    source_commit()
    if args.device == "cuda":
        if args.plot:
            sys.exit("--plot is only supported for --device cpu/npu")
        rows = run_cuda(args)
        _write_tables(args, rows, machine=torch.cuda.get_device_name())
        return 0
    rows = run(args)
    machine = machine_description(args.device)
    print(f"benchmarks: npu_fused_gdn_decode on {args.device} ({machine}), torch "
          f"{torch.__version__}, input {args.input_dtype} (fp16 for an fp16 state), "
          f"K=V={args.head_dim}, commit {source_commit()}, {run_started()}; DRAM pools sized "
          f"by a last-level cache of {args.cache_bytes / 2**20:.0f} MiB ({args.cache_source})")
    for mode in args.modes:
        sub = [r for r in rows if r["mode"] == mode]
        if mode == "dram":
            pools = sorted({r["pool"] for r in sub})
            print(f"\nState from DRAM (serving): every timed call on fresh slots of a pool of "
                  f">= {POOL_OVER_CACHE}x the last-level cache ({pools[0]}-{pools[-1]} slots); "
                  f"copy/rmw on fresh bytes of it:")
        else:
            print("\nState cache-resident where it fits: the same B slots (pool 2B+1) every call; "
                  "copy/rmw on the same bytes every call:")
        print(format_table(sub, args.backends))
    variants = []
    if args.device == "cpu" and args.variants_batch:
        variants = run_variants(args)
        print(f"\nEvery CPU kernel variant, H={QWEN3_NEXT[0]} Hv={QWEN3_NEXT[1]} (ns/row: "
              f"per state row of K={args.head_dim} per thread; each line timed interleaved with "
              f"its rmw; the core's clock read before and after it, where it can be read):")
        print(format_variants(variants))
    _write_tables(args, rows, machine, variants)
    if args.device == "cpu" and args.callers:
        from benchmarks import threads as bench_threads

        # Flushed first: with stdout a file, a process forked meanwhile (torch.compile's workers)
        # would write the unflushed lines a second time.
        print("\nConcurrent callers (each on its own slots of one pool; the op releases the GIL):",
              flush=True)
        bench_threads.main(["--callers", *map(str, args.callers)])
    if args.plot:
        write_plot(rows, args.backends, args.plot, f"npu_fused_gdn_decode, {machine}")
    rows = rows + variants
    failed = [r for r in rows if not all(r[k] for k in r if k.endswith("_ok"))]
    if failed:
        print(f"FAIL: {len(failed)} configuration(s) disagree with the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
