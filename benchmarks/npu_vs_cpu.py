#!/usr/bin/env python3
"""Compare custom.npu_fused_gdn_decode on an Ascend NPU (A2/A3) with the CPU path, and time both.

Run on a host with CANN, the FusedGdnDecode op package (its set_env.bash sourced), torch_npu and
custom_ops installed (docs/npu.md):

    python -m benchmarks.npu_vs_cpu              # all checks + timings
    python -m benchmarks.npu_vs_cpu --quick      # a few small shapes, no timings

For each shape and (input, state) dtype pair it runs several decode steps on the NPU and on the
CPU from the same inputs (a and b as column slices of one projection, some invalid rows) and
compares the output and the whole state pool after every step, with the tolerances of the test
suite. It also checks strided views and storage offsets (state_ref inside a larger buffer), that
the op honours the current stream and work queued just before it, and two batch sizes at which
the vendor kernel's slot-index buffer looks one row short (docs/npu.md).
Exit status 0 only if everything matched.
"""

import argparse
import sys

import torch

try:
    import torch_npu  # noqa: F401  (registers the "npu" device)
except ImportError:
    sys.exit("torch_npu is not installed: this script needs an Ascend NPU host (docs/npu.md)")
import custom_ops  # noqa: E402,F401  (registers custom.npu_fused_gdn_decode)
from custom_ops.testing import (  # noqa: E402
    DTYPE_PAIRS,
    OP,
    Case,
    assert_close,
    call,
    make_inputs,
    short,
    to_device,
)

from ._harness import time_loop  # noqa: E402

# (name, H, Hv, K, V): Qwen3-Next-80B-A3B and its TP shards; Qwen3.5 ratios 3 and 4.
SHAPES = [
    ("qwen3-next", 16, 32, 128, 128),
    ("qwen3-next-tp2", 8, 16, 128, 128),
    ("qwen3-next-tp4", 4, 8, 128, 128),
    ("qwen3-next-tp8", 2, 4, 128, 128),
    ("qwen3.5-hv48", 16, 48, 128, 128),
    ("qwen3.5-hv64", 16, 64, 128, 128),
]
QUICK_SHAPES = [("small", 2, 4, 64, 16), ("qwen3-next-tp8", 2, 4, 128, 128)]


def inputs(B, H, Hv, K, V, dtype, state_dtype, seed=0, views=False):
    """One call's inputs (some invalid rows); with views=True, every input is a view: strided,
    at a storage offset (custom_ops.testing's "strided" layout)."""
    return make_inputs(Case(B=B, H=H, Hv=Hv, K=K, V=V, dtype=dtype, state_dtype=state_dtype,
                            invalid_rows=tuple(range(1, B, 7)), seed=seed,
                            layout="strided" if views else "split"))


def close(actual, expected):
    """None if actual is within the test suite's tolerance of expected, else why not."""
    try:
        assert_close(actual, expected)
        return None
    except AssertionError as e:
        return str(e).splitlines()[0] + " " + " ".join(str(e).splitlines()[1:4])


def check(device, B, H, Hv, K, V, dtype, state_dtype, steps, views=False):
    cpu = inputs(B, H, Hv, K, V, dtype, state_dtype, views=views)
    npu = to_device(cpu, device)
    cpu["state_ref"] = cpu["state_ref"].clone()
    errors = []
    for step in range(steps):
        out_cpu = call(OP, cpu)
        out_npu = call(OP, npu)
        for what, a, e in (("out", out_npu.cpu(), out_cpu),
                           ("state", npu["state_ref"].cpu(), cpu["state_ref"])):
            err = close(a, e)
            if err:
                errors.append(f"step {step} {what}: {err}")
    return errors


def check_stream(device):
    """On a side stream, with the inputs produced by ops queued just before the call (no sync):
    a binding that used another stream or skipped torch_npu's queue flush would read stale data."""
    cpu = inputs(64, 4, 8, 128, 128, torch.bfloat16, torch.float32, seed=1)
    src = to_device(cpu, device)
    cpu["state_ref"] = cpu["state_ref"].clone()
    out_cpu = call(OP, cpu)
    s = torch.npu.Stream()
    s.wait_stream(torch.npu.current_stream())
    with torch.npu.stream(s):
        x = dict(src)
        x["mixed_qkv"] = src["mixed_qkv"] * 1  # queued on s right before the op
        x["state_ref"] = src["state_ref"].clone()
        out = call(OP, x)
        out = out.clone()  # queued after the op, on the same stream
    torch.npu.synchronize()
    return [e for e in (close(out.cpu(), out_cpu), close(x["state_ref"].cpu(), cpu["state_ref"]))
            if e]


def check_index_buffer(device, B):
    """A batch whose rows straddle the vendor kernel's slot-index buffer: its tiling sizes the
    buffer for 1 + (tasks per core - 1) // Hv rows, a core whose tasks start inside a row can
    span one more, and the extra index would be overwritten by state data (read from the vendor
    source, docs/npu.md; not seen on hardware). B = 301 on 40 vector cores, 361 on 48, Hv = 4.
    A negative bf16 state keeps such an index negative: the symptom is then zero output rows and
    untouched slots, never an access outside the pool."""
    cpu = inputs(B, 2, 4, 128, 128, torch.bfloat16, torch.bfloat16, seed=2)
    cpu["state_ref"] = -(cpu["state_ref"].abs() + 0.01)
    npu = to_device(cpu, device)
    out_cpu, out_npu = call(OP, cpu), call(OP, npu)
    return [e for e in (close(out_npu.cpu(), out_cpu), close(npu["state_ref"].cpu(),
                                                              cpu["state_ref"])) if e]


def timing(device, B, H, Hv, K, V, dtype, state_dtype, iters):
    cpu = inputs(B, H, Hv, K, V, dtype, state_dtype)
    npu = to_device(cpu, device)
    t_npu = time_loop(lambda: call(OP, npu), torch.npu.synchronize, iters, warmup=5)
    t_cpu = time_loop(lambda: call(OP, cpu), lambda: None, max(1, iters // 10), warmup=1)
    return t_npu, t_cpu


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="npu:0")
    p.add_argument("--quick", action="store_true", help="small shapes only, no timings")
    p.add_argument("--steps", type=int, default=3, help="decode steps per check")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--iters", type=int, default=100)
    args = p.parse_args()

    torch.npu.set_device(args.device)
    print("custom_ops NPU binding:")
    print("  " + torch.ops.custom_ops_npu.vendor_info().strip().replace("\n", "\n  "))
    shapes = QUICK_SHAPES if args.quick else SHAPES
    batches = [1, 8] if args.quick else [int(b) for b in args.batches.split(",")]

    failures = 0
    for name, H, Hv, K, V in shapes:
        for dtype, state_dtype in DTYPE_PAIRS:
            for B in batches:
                tag = f"{name} B={B} H={H} Hv={Hv} K={K} V={V} {short(dtype)}/{short(state_dtype)}"
                errors = check(args.device, B, H, Hv, K, V, dtype, state_dtype, args.steps)
                failures += bool(errors)
                print(f"{'FAIL' if errors else 'ok  '} {tag}")
                for e in errors:
                    print(f"     {e}")
    # Views and storage offsets (state_ref at a non-zero offset inside its storage).
    for dtype, state_dtype in DTYPE_PAIRS:
        errors = check(args.device, 9, 2, 4, 128, 128, dtype, state_dtype, args.steps, views=True)
        failures += bool(errors)
        print(f"{'FAIL' if errors else 'ok  '} strided views + storage offsets "
              f"{short(dtype)}/{short(state_dtype)}")
        for e in errors:
            print(f"     {e}")
    errors = check_stream(args.device)
    failures += bool(errors)
    print(f"{'FAIL' if errors else 'ok  '} side stream + queued producer")
    for e in errors:
        print(f"     {e}")
    for B in (301, 361):
        errors = check_index_buffer(args.device, B)
        failures += bool(errors)
        print(f"{'FAIL' if errors else 'ok  '} B={B} Hv=4: rows straddling the vendor's slot-index "
              f"buffer (docs/npu.md)")
        for e in errors:
            print(f"     {e}")

    if not args.quick:
        print("\ntimings (per call; NPU includes launch, CPU on this host's cores):")
        for name, H, Hv, K, V in shapes[:3]:
            for B in batches:
                t_npu, t_cpu = timing(args.device, B, H, Hv, K, V, torch.bfloat16,
                                      torch.float32, args.iters)
                print(f"  {name:16s} B={B:4d} bf16/fp32  npu {t_npu * 1e6:9.1f} us   "
                      f"cpu {t_cpu * 1e6:9.1f} us")

    print(f"\n{'ALL MATCHED' if failures == 0 else f'{failures} CHECK(S) FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
