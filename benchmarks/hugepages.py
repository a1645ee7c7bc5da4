"""Transparent huge pages and the op from DRAM: an interleaved A/B on the CPU (Linux).

    python -m benchmarks.hugepages [--state-dtype ...] [--batch ...] [--threads ...]

Qwen3-Next shapes (H=16, Hv=32, K=V=128), the op's default kernel variant, two state pools in one
process, each at least 4x the last-level cache as in ``python -m benchmarks`` (every call on
fresh slots): one advised ``MADV_NOHUGEPAGE`` (4 KiB pages) and one ``MADV_HUGEPAGE`` (2 MiB
pages where the kernel's THP setting is ``madvise`` or ``always``: what torch's CPU allocator
does for allocations of 2 MiB or more under ``THP_MEM_ALLOC_ENABLE=1``), both advised before
their first touch. The op and an in-place rmw of the same bytes run on each pool, all four timed
interleaved. Prints µs per call, the op's % of rmw on each pool, and how much faster huge pages
make the op and the rmw (4 KiB time / 2 MiB time). The header says how many bytes of the pools
the kernel gave huge pages (``AnonHugePages``).
"""

import argparse
import ctypes
import math
import platform

import torch

from benchmarks.__main__ import (
    DTYPES,
    POOL_OVER_CACHE,
    DramPool,
    _ceiling_fn,
    input_dtype_for,
    last_level_cache_bytes,
    machine_description,
    run_started,
    source_commit,
)
from benchmarks._harness import moved_bytes, time_calls
from custom_ops.testing import Case, call, make_inputs

MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15  # linux/mman.h
PAGE = 4096


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.hugepages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-dtype", nargs="+", default=["fp32", "bf16", "fp16"],
                   choices=["fp32", "bf16", "fp16"])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--min-time", type=float, default=1.0, help="seconds per timed function")
    p.add_argument("--cache-bytes", type=int, default=None,
                   help="last-level cache size to size the pools by (default: ask the OS)")
    return p.parse_args(argv)


def thp_setting():
    """The kernel's transparent-huge-page line ("always [madvise] never"), or "unknown"."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def thp_mode():
    """The setting chosen in that line: "always", "madvise" or "never" (or "unknown")."""
    line = thp_setting()
    return line.split("[")[1].split("]")[0] if "[" in line and "]" in line else "unknown"


def anon_huge_bytes():
    """This process's anonymous memory in transparent huge pages (0 where Linux does not say)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class AdvisedPool(DramPool):
    """A DramPool whose memory is advised (huge pages or not) before its first touch;
    ``huge_bytes`` is how much of the current pool came in huge pages."""

    def __init__(self, *args, advice, **kwargs):
        super().__init__(*args, **kwargs)
        self.advice = advice
        self.huge_bytes = 0

    def ensure(self, B):
        slots = max(math.ceil(self.min_bytes / self.slot_bytes), POOL_OVER_CACHE * B) + 1
        if self.state is None or self.state.shape[0] < slots:
            self.state = None  # freed before the count below starts
            before = anon_huge_bytes()
            state = torch.empty((slots, *self.shape), dtype=self.state_dtype)
            start = state.data_ptr()
            first = -(-start // PAGE) * PAGE
            last = (start + state.numel() * state.element_size()) // PAGE * PAGE
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), self.advice):
                raise OSError(ctypes.get_errno(), "madvise failed")
            g = torch.Generator().manual_seed(self.seed)
            for i in range(0, slots, 64):  # first touch, in chunks as DramPool does
                chunk = state[i:i + 64]
                chunk.copy_(torch.randn(chunk.shape, generator=g) * 0.5)
            self.huge_bytes = anon_huge_bytes() - before
            self.state = state
        return self.state


def run(a, cache_bytes):
    H, Hv, D = 16, 32, 128
    op = torch.ops.custom.npu_fused_gdn_decode
    rows = []
    for sd in a.state_dtype:
        dtype = DTYPES[input_dtype_for(sd, "bf16")]
        pools = {name: AdvisedPool(Hv, D, DTYPES[sd], cache_bytes, "cpu", advice=advice)
                 for name, advice in (("4k", MADV_NOHUGEPAGE), ("2m", MADV_HUGEPAGE))}
        for B in a.batch:
            x = make_inputs(Case(B=B, H=H, Hv=Hv, K=D, V=D, dtype=dtype, state_dtype=DTYPES[sd],
                                 pool=2 * B + 1, layout="projection"))
            nbytes = moved_bytes(B, Hv, D, D, DTYPES[sd])
            for threads in a.threads:
                torch.set_num_threads(threads)
                fns = {}
                for name, pool in pools.items():
                    state = pool.ensure(B)
                    windows = pool.windows(B)
                    fns["rmw " + name] = _ceiling_fn("rmw", pool.byte_chunks(nbytes))

                    def fn(x=x, state=state, windows=windows):
                        call(op, dict(x, state_ref=state, ssm_state_indices=next(windows)))
                    fns["ours " + name] = fn
                t = time_calls(fns, lambda: None, a.min_time)
                rows.append((sd, B, threads, t))
        print(f"{sd} pools: {pools['4k'].state.nbytes / 2**20:.0f} MiB each; in huge pages: "
              f"4k pool {pools['4k'].huge_bytes / 2**20:.0f} MiB, "
              f"2m pool {pools['2m'].huge_bytes / 2**20:.0f} MiB",
              flush=True)
    return rows


def main(argv=None):
    a = parse_args(argv)
    if platform.system() != "Linux":
        print("benchmarks.hugepages: Linux only (madvise, /proc/self/smaps_rollup)")
        return 0
    cache_bytes, said = ((a.cache_bytes, f"--cache-bytes {a.cache_bytes}") if a.cache_bytes
                         else last_level_cache_bytes())
    if cache_bytes is None:
        raise SystemExit(f"benchmarks.hugepages: {said}; cannot size the DRAM pools")
    thp = thp_setting()
    print(f"hugepages: the op and rmw from DRAM on a pool of 4 KiB pages vs one of 2 MiB pages, "
          f"interleaved, median per call; H=16 Hv=32 K=V=128; pools sized by {said}; "
          f"transparent_hugepage/enabled: {thp}; {machine_description('cpu')}, "
          f"{platform.machine()}, torch {torch.__version__}, commit {source_commit()}, "
          f"started {run_started()}")
    rows = run(a, cache_bytes)
    print(f"{'state':<5} {'B':>4} {'thr':>3} | {'ours 4k':>9} {'rmw 4k':>9} {'%rmw':>5} | "
          f"{'ours 2m':>9} {'rmw 2m':>9} {'%rmw':>5} | {'2m gain ours':>12} {'rmw':>6}")
    for sd, B, threads, t in rows:
        print(f"{sd:<5} {B:4d} {threads:3d} | {t['ours 4k'] * 1e6:9.1f} {t['rmw 4k'] * 1e6:9.1f} "
              f"{100 * t['rmw 4k'] / t['ours 4k']:5.1f} | {t['ours 2m'] * 1e6:9.1f} "
              f"{t['rmw 2m'] * 1e6:9.1f} {100 * t['rmw 2m'] / t['ours 2m']:5.1f} | "
              f"{t['ours 4k'] / t['ours 2m']:12.3f} {t['rmw 4k'] / t['rmw 2m']:6.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
