"""Two or more builds of the extension (checkouts, each with its custom_ops/_C*.so) timed in one
run, e.g. a GCC build against a clang one:

    python -m benchmarks.builds CHECKOUT [CHECKOUT ...] [--threads 1,2] [--batch 1,8]

Each checkout's op runs in a process of its own (PYTHONPATH=CHECKOUT, this interpreter) on
Qwen3-Next shapes (H=16, Hv=32, K=V=128; bf16 inputs, fp16 for an fp16 state) and B rows on
fixed slots, so that the state stays in cache where it fits; the processes take turns, ``--rounds``
times. Prints the median µs per call of each build and state dtype, and each build's time over the
first's. The builds must give the same results, which the tests check
(tests/test_cpu_kernel.py::test_clang_build_gives_the_same_bits); this times them only.
"""

import argparse
import os
import statistics
import subprocess
import sys

from benchmarks.__main__ import machine_description, source_commit

STATES = ("float32", "bfloat16", "float16")

# One measurement in the checkout's process: median µs per call of each state dtype.
_CHILD = """
import sys, time, torch, custom_ops
from custom_ops.testing import Case, make_inputs, call, OP
threads, B, reps = map(int, sys.argv[1:4])
torch.set_num_threads(threads)
try:  # builds before cpu_threaded: threaded
    threaded = torch.ops.custom_ops_internal.cpu_threaded()
except (AttributeError, RuntimeError):
    threaded = True
out = [custom_ops.__file__, custom_ops.cpu_isa(), str(threaded)]
for name in sys.argv[4:]:
    sd = getattr(torch, name)
    x = make_inputs(Case(B=B, H=16, Hv=32, K=128, V=128, state_dtype=sd, pool=B + 1,
                         dtype=torch.float16 if sd == torch.float16 else torch.bfloat16))
    n = max(10, 300 // B)
    for _ in range(n):
        call(OP, x)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            call(OP, x)
        times.append((time.perf_counter() - t) / n * 1e6)
    out.append(f"{sorted(times)[len(times) // 2]:.3f}")
print(" ".join(out))
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.builds", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkouts", nargs="+", help="repository checkouts with a built extension")
    p.add_argument("--threads", default="1,2", help="torch.set_num_threads values")
    p.add_argument("--batch", default="1,8", help="batch sizes B")
    p.add_argument("--rounds", type=int, default=3, help="turns each build takes per line")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per turn (median)")
    p.add_argument("--states", default=",".join(STATES), help="state dtypes")
    return p.parse_args(argv)


def measure(checkout, threads, batch, reps, states):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
    r = subprocess.run([sys.executable, "-c", _CHILD, str(threads), str(batch), str(reps),
                        *states], capture_output=True, text=True, env=env, check=False,
                       cwd=os.path.abspath(checkout))
    if r.returncode:
        raise SystemExit(f"benchmarks.builds: {checkout} failed:\n{r.stderr}")
    path, isa, threaded, *times = r.stdout.split()
    if not os.path.abspath(path).startswith(os.path.abspath(checkout)):
        raise SystemExit(f"benchmarks.builds: {checkout}'s process imported {path}")
    return isa, threaded == "True", [float(t) for t in times]


def main(argv=None):
    args = parse_args(argv)
    states = args.states.split(",")
    print(f"benchmarks.builds: {machine_description('cpu')}", flush=True)
    for i, c in enumerate(args.checkouts):
        print(f"build {i}: {c} (commit {source_commit(os.path.abspath(c))})")
    print(f"median us per call, H=16 Hv=32 K=V=128, state on fixed slots; x = over build 0; "
          f"{args.rounds} turns of each build per line")
    for threads in map(int, args.threads.split(",")):
        for batch in map(int, args.batch.split(",")):
            runs = [[] for _ in args.checkouts]
            info = [None] * len(args.checkouts)
            for _ in range(args.rounds):
                for i, c in enumerate(args.checkouts):
                    isa, threaded, times = measure(c, threads, batch, args.reps, states)
                    info[i] = f"{isa}{'' if threaded else ', one thread'}"
                    runs[i].append(times)
            best = [[statistics.median(r[s] for r in build) for s in range(len(states))]
                    for build in runs]
            for i in range(len(args.checkouts)):
                cells = "  ".join(f"{s} {t:8.1f} {t / best[0][k]:5.2f}x"
                                  for k, (s, t) in enumerate(zip(states, best[i], strict=True)))
                print(f"threads={threads} B={batch:<3d} build {i} ({info[i]}): {cells}",
                      flush=True)


if __name__ == "__main__":
    main()
