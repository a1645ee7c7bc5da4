"""What the op's dispatch layers cost per call, on its smallest call.

    python -m benchmarks.call_overhead [--calls N] [--rounds R]

The smallest accepted call (B=1, H=Hv=1, K=64, V=16, bf16 inputs, fp32 state, one thread), timed
in R interleaved rounds of N calls each, in five ways:

- ``grad``: the op with grad mode on and no input requiring grad (Autograd and ADInplaceOrView
  kernels run, and record nothing);
- ``no_grad``: the same under ``torch.no_grad()``;
- ``inference_mode``: under ``torch.inference_mode()`` (those kernels, and with them the checks
  of docs/bad_input.md's Autograd section, are skipped);
- ``cpu_key``, ``cpu_key_inference``: the call redispatched straight to the CPU kernel (no
  Autograd or ADInplaceOrView kernel), with grad mode on and under ``torch.inference_mode()``.

Prints the best round of each in µs per call, and each way less ``cpu_key``. docs/bad_input.md
quotes a stored run (docs/bench_call_overhead.txt).
"""

import argparse
import platform
import time

import torch

import custom_ops  # noqa: F401  (registers the op)
from benchmarks.__main__ import machine_description, source_commit
from custom_ops.testing import OP, Case, make_inputs, positional_args, redispatch


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.call_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="calls per round")
    p.add_argument("--rounds", type=int, default=40, help="interleaved rounds")
    return p.parse_args(argv)


def ways():
    args = positional_args(make_inputs(Case(B=1, H=1, Hv=1, K=64, V=16)))
    direct = redispatch(OP.default, "CPU")

    def under(context, fn):
        def run(n):
            with context():
                for _ in range(n):
                    fn(*args)
        return run

    def plain(fn):
        def run(n):
            for _ in range(n):
                fn(*args)
        return run

    return {
        "grad": plain(OP),
        "no_grad": under(torch.no_grad, OP),
        "inference_mode": under(torch.inference_mode, OP),
        "cpu_key": plain(direct),
        "cpu_key_inference": under(torch.inference_mode, direct),
    }


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(1)
    fns = ways()
    for fn in fns.values():
        fn(100)  # warm-up
    best = dict.fromkeys(fns, float("inf"))
    for r in range(a.rounds):
        names = list(fns)
        names = names[r % len(names):] + names[:r % len(names)]  # rotate the order every round
        for name in names:
            t0 = time.perf_counter()
            fns[name](a.calls)
            best[name] = min(best[name], (time.perf_counter() - t0) / a.calls)
    print(f"call_overhead: the smallest call (B=1, H=Hv=1, K=64, V=16, bf16 inputs, fp32 state), "
          f"1 thread, best of {a.rounds} rounds x {a.calls} calls, interleaved; "
          f"{machine_description('cpu')}, {platform.machine()}, torch {torch.__version__}, "
          f"commit {source_commit()}")
    print(f"{'way':<20} {'us/call':>8} {'- cpu_key':>10}")
    for name, t in best.items():
        print(f"{name:<20} {t * 1e6:8.2f} {(t - best['cpu_key']) * 1e6:+10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
