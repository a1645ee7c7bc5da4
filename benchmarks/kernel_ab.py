"""A/B of CPU kernel sources: ``python -m benchmarks.kernel_ab [SOURCE ...]``.

For work on the kernel body (csrc/cpu/kernel_impl.h, vec.h), where the question is whether a
change is faster on this machine and keeps the bits. Each SOURCE is a git revision (``HEAD``,
``main~3``) or a directory holding ``csrc/cpu`` (``.``: the working tree); the default compares
the working tree with HEAD. Each source's kernel body is compiled for one variant's instruction
set (``--isa``, default: the one the op picks here) under its own CPU_CAPABILITY name (AB0, AB1,
.. in the order given) and linked into one program (benchmarks/kernel_ab.cpp) that

- calls every build on the same inputs and state first, and stops (exit status 1) if one's output
  or updated state differs from AB0's by a bit (``--no-bit-check``: says so and times it anyway,
  for what-if builds that drop work on purpose, or a change of an order of operations);
- then times them interleaved with an in-place read-modify-write of the same bytes, in a cycle
  of calls in which each build and the rmw follow every other one exactly once, so that a shared
  machine's drift, and what one call leaves the next (dirty lines to write back), hit all alike.
  Name a source twice (``A B A B``) to see the spread between copies of one build;
- ends each line with the core's clock read before and after it (a chain of dependent adds,
  x86-64): a shared VM's cores slow for minutes while memory does not (or a neighbour shares the
  core, which reads the same), which lowers every ratio to rmw, so levels from a slow spell are not
  the kernel's, and differences between sources can shrink in one.

Modes: ``dram`` (fresh slots of a pool of 4x the last-level cache every call, as in serving),
``cache`` (the same B slots every call), ``l1`` (ns per state row of one value head on one
thread in L1/L2, from 512 rows less 128, the per-call costs cancelled: the larger head is in L2)
and ``l1only`` (the same from 40 rows less 8, the state in L1: the kernel's arithmetic alone).
Shapes are Qwen3-Next's (H=16, Hv=32, K=V=128). The op's own figures come from
``python -m benchmarks``; this is for comparing sources, the build flags being the extension's
(setup.py).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import cpu_variants  # noqa: E402  (csrc/cpu/variants.def)

# setup.py's kernel flags (CXX_FLAGS + _TORCH_CXX + -ffp-contract=off), without -fPIC.
BASE_FLAGS = ["-O3", "-fvisibility=hidden", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas",
              "-fopenmp", "-std=c++20", "-ffp-contract=off"]
MODES = ("dram", "cache", "l1", "l1only")
STATES = ("fp32", "bf16", "fp16")


def _default_isa():
    try:
        import custom_ops
        return custom_ops.cpu_isa()
    except Exception:  # not built: the widest variant this CPU runs is not known without it
        return "avx2"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernel_ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="*", default=["HEAD", "."],
                   help="git revisions or directories holding csrc/cpu (default: HEAD .)")
    p.add_argument("--isa", default=None,
                   help="the variant of csrc/cpu/variants.def to compile for (default: the op's "
                        "choice here)")
    p.add_argument("--mode", default="l1,dram", help=f"comma-separated of {', '.join(MODES)}")
    p.add_argument("--states", default=",".join(STATES), help="comma-separated state dtypes")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--batch", default="8,32", help="comma-separated batch sizes")
    p.add_argument("--reps", type=int, default=25, help="timed repetitions per line")
    p.add_argument("--cache-bytes", type=int, default=None,
                   help="last-level cache size to size the DRAM pool by (default: ask the OS)")
    p.add_argument("--no-bit-check", action="store_true",
                   help="time builds whose bits differ from AB0's (what-if experiments)")
    p.add_argument("--build-dir", default=None, help="where to build (default: a temporary one)")
    args = p.parse_args(argv)
    for mode in args.mode.split(","):
        if mode not in MODES:
            p.error(f"--mode: expected a comma-separated list of {MODES}, got {mode!r}")
    for state in args.states.split(","):
        if state not in STATES:
            p.error(f"--states: expected a comma-separated list of {STATES}, got {state!r}")
    for name in ("threads", "batch"):
        value = getattr(args, name)
        if not all(x.isdigit() and int(x) > 0 for x in value.split(",")):
            p.error(f"--{name}: expected comma-separated positive integers, got {value!r}")
    if args.reps < 1:
        p.error(f"--reps: expected a positive integer, got {args.reps}")
    return args


def _git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True,
                          text=True).stdout


def materialise(source, dest):
    """(the csrc directory of `source`, a label naming it): a directory as it is, or a git
    revision exported into dest."""
    if os.path.isdir(source):
        csrc = os.path.join(source, "csrc")
        if not os.path.isfile(os.path.join(csrc, "cpu", "kernel_impl.h")):
            raise SystemExit(f"kernel_ab: {source} has no csrc/cpu/kernel_impl.h")
        label = source
        if os.path.samefile(source, ROOT):
            changed = _git("status", "--porcelain", "--", "csrc").strip()
            label = (f"{source} (the working tree: {_git('rev-parse', '--short', 'HEAD').strip()}"
                     f"{' with uncommitted csrc changes' if changed else ''})")
        return os.path.abspath(csrc), label
    try:
        commit = _git("rev-parse", "--verify", f"{source}^{{commit}}").strip()
    except subprocess.CalledProcessError:
        raise SystemExit(f"kernel_ab: {source!r} is neither a directory nor a git revision")
    os.makedirs(dest, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit, "csrc/cpu"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    named = commit.startswith(source.lower())
    return os.path.join(dest, "csrc"), source if named else f"{source} ({commit[:7]})"


def _params_struct(csrc):
    """The text of GdnParams in csrc/cpu/kernel.h: the driver's calls need the same layout."""
    with open(os.path.join(csrc, "cpu", "kernel.h")) as f:
        text = f.read()
    start = text.index("struct GdnParams")
    return text[start:text.index("};", start)]


def build(args, workdir):
    """Compiles every source's kernel body and the driver: (the program, the variant, a label
    per source)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    import torch

    variants = {v.name: v for v in cpu_variants.variants()}
    isa = args.isa or _default_isa()
    if isa not in variants:
        raise SystemExit(f"kernel_ab: --isa must be one of {sorted(variants)}, got {isa!r}")
    # The variant's flags with its CPU_CAPABILITY name replaced by each build's.
    isa_flags = [f for f in variants[isa].flags if not f.startswith("-DCPU_CAPABILITY=")]
    cxx = os.environ.get("CXX", "c++")
    torch_flags = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                   *[f"-I{p}" for p in include_paths()]]
    here = os.path.join(ROOT, "csrc")
    csrcs, labels = zip(*[materialise(s, os.path.join(workdir, f"src{i}"))
                          for i, s in enumerate(args.sources)])
    for source, csrc in zip(args.sources, csrcs):
        if _params_struct(csrc) != _params_struct(here):
            raise SystemExit(f"kernel_ab: {source}'s GdnParams (csrc/cpu/kernel.h) differs from "
                             "the working tree's, which the driver is built with")
    unit = os.path.join(workdir, "kernel.cpp")
    with open(unit, "w") as f:
        f.write('#include "cpu/kernel_impl.h"\n')
    with open(os.path.join(workdir, "kernel_ab_builds.inc"), "w") as f:
        f.write("".join(f"AB_BUILD({i})\n" for i in range(len(csrcs))))
    jobs = [[cxx, *BASE_FLAGS, f"-DCPU_CAPABILITY=AB{i}", *isa_flags, f"-I{csrc}", *torch_flags,
             "-c", unit, "-o", os.path.join(workdir, f"ab{i}.o")] for i, csrc in enumerate(csrcs)]
    # The driver too, so that its rmw uses the same vector width.
    jobs.append([cxx, *BASE_FLAGS, *isa_flags, f"-I{workdir}", f"-I{here}", *torch_flags, "-c",
                 os.path.join(ROOT, "benchmarks", "kernel_ab.cpp"), "-o",
                 os.path.join(workdir, "driver.o")])
    jobs_at_once = int(os.environ.get("MAX_JOBS", "2"))
    print(f"kernel_ab: compiling {len(csrcs)} build(s) for {isa} ({' '.join(isa_flags)}), "
          f"{jobs_at_once} at a time", flush=True)
    with ThreadPoolExecutor(max_workers=jobs_at_once) as pool:
        for r in pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), jobs):
            if r.returncode:
                raise SystemExit(f"kernel_ab: compiling failed:\n{' '.join(r.args)}\n{r.stderr}")
    libs = library_paths()
    exe = os.path.join(workdir, "kernel_ab")
    subprocess.run([cxx, *[os.path.join(workdir, f"ab{i}.o") for i in range(len(csrcs))],
                    os.path.join(workdir, "driver.o"), "-fopenmp",
                    *[f"-L{p}" for p in libs], *[f"-Wl,-rpath,{p}" for p in libs],
                    "-lc10", "-ltorch_cpu", "-o", exe], check=True)
    return exe, isa, labels


def main(argv=None):
    args = parse_args(argv)
    from benchmarks.__main__ import POOL_OVER_CACHE, last_level_cache_bytes

    cache, where = (args.cache_bytes, "--cache-bytes")
    if cache is None:
        cache, where = last_level_cache_bytes()
        cache, where = (cache, where) if cache else (256 << 20, "assumed")
    workdir = args.build_dir or tempfile.mkdtemp(prefix="kernel_ab-")
    os.makedirs(workdir, exist_ok=True)
    try:
        exe, isa, labels = build(args, workdir)
        for i, label in enumerate(labels):
            print(f"AB{i}: {label}")
        print(f"{isa}; DRAM pool {POOL_OVER_CACHE} x {cache >> 20} MiB ({where}); "
              f"% = rmw time / build time", flush=True)
        status = 0
        for mode in args.mode.split(","):
            r = subprocess.run([exe, mode, args.states, args.threads, args.batch, str(args.reps),
                                str(POOL_OVER_CACHE * cache), "0" if args.no_bit_check else "1"])
            status = status or r.returncode
        return status
    finally:
        if args.build_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
