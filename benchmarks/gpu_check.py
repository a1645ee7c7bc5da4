"""GPU checks of the CUDA path (Triton kernel) and the CUDA benchmark, in one run.

Prints one ``PASS name`` / ``FAIL name: why`` line per check, then the benchmark table, the
target verdict and a tile sweep; exits 1 if any check failed. Sized to finish in a few minutes
on an H200 (``--quick`` for a shorter run).

    python setup.py build_ext --inplace          # the extension, built on that machine
    pip install --no-deps .wheels/fla_core-*.whl # optional: FLA for the comparison
    PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py [--quick] [--no-bench] [--no-sweep]
"""

import argparse
import dataclasses
import math
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Run as a script, this directory would come first on sys.path and its cuda.py would shadow the
# `cuda` package that torch imports; the repository root (custom_ops, benchmarks) takes its place.
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import torch  # noqa: E402

import custom_ops  # noqa: E402
from benchmarks import cuda as tb  # noqa: E402
from custom_ops import composite  # noqa: E402
from custom_ops import cuda as cuda_backend  # noqa: E402
from custom_ops.testing import (  # noqa: E402
    DTYPE_PAIRS,
    TOLERANCES,
    VALUE_PLACES,
    Case,
    assert_close,
    call,
    check_against_reference,
    clone_inputs,
    make_inputs,
    short,
    with_value_at,
)

DEV = "cuda"
OP = torch.ops.custom.npu_fused_gdn_decode
FAILED = []


def check(name):
    """Runs the decorated function at once; prints PASS/FAIL with its time."""
    def run(fn):
        t0 = time.time()
        try:
            note = fn()
            print(f"PASS {name} ({time.time() - t0:.1f}s){' ' + note if note else ''}", flush=True)
        except Exception as e:  # report and go on with the other checks
            FAILED.append(name)
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3)
        return fn
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer cases and batch sizes")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU: run the correctness checks on CPU tensors through the Triton "
                        "interpreter (the CUDA dispatch entry), skip graph/compile/bench")
    args = p.parse_args()
    global DEV, OP
    if args.cpu_smoke:
        DEV = "cpu"
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is first jitted
        keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
        OP = lambda *a, **kw: torch.ops.custom.npu_fused_gdn_decode.default.redispatch(  # noqa
            keyset, *a, **kw)
        args.quick = args.no_bench = args.no_sweep = True

    # The reference's einsum must not use TF32, or it, not the kernel, is the inaccurate side.
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        import triton
        tv = triton.__version__
    except Exception as e:
        tv = f"missing ({e})"
    print(f"torch {torch.__version__}, triton {tv}, "
          f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}",
          flush=True)

    @check("cuda-registration")
    def _():
        assert args.cpu_smoke or torch.cuda.is_available(), "no CUDA device"
        impl = cuda_backend.KERNEL
        assert impl is cuda_backend.fused_gdn_decode_cuda, f"CUDA holds {impl.__name__}"
        assert cuda_backend._load_triton() is not None, "triton kernel module failed to import"

    cases = []
    for d, s in DTYPE_PAIRS:
        for ratio in (1, 2, 3, 4):
            H = 4 if ratio < 3 else 2
            B = 3 if args.cpu_smoke else 33
            cases.append(Case(B=B, H=H, Hv=H * ratio, K=128, V=128, dtype=d, state_dtype=s,
                              pool=80, invalid_rows=(0, B - 1), seed=ratio))
    for K, V, s in [(136, 48, torch.float32), (136, 8, torch.bfloat16), (64, 8, torch.float32),
                    (2032, 16, torch.float32), (2032, 16, torch.bfloat16),
                    (256, 256, torch.float32)]:
        cases.append(Case(B=5, H=1, Hv=2, K=K, V=V, state_dtype=s, invalid_rows=(2,), seed=K))
    if not args.quick:
        for s in (torch.float32, torch.bfloat16):
            cases.append(Case(B=256, H=16, Hv=32, K=128, V=128, state_dtype=s, pool=300))

    @check(f"correctness-vs-reference ({len(cases)} cases, 3 steps each)")
    def _():
        for c in cases:
            try:
                check_against_reference(make_inputs(c, device=DEV), steps=3, fn=OP)
            except AssertionError as e:
                raise AssertionError(f"{c.id()}: {e}") from None

    @check("non-contiguous-inputs")
    def _():
        x = make_inputs(Case(B=9, H=2, Hv=4, K=128, V=64, invalid_rows=(3,), layout="strided"),
                        device=DEV)
        check_against_reference(x, steps=2, fn=OP)

    @check("checked-reference-on-cuda")
    def _():
        x = make_inputs(Case(B=7, H=2, Hv=4, K=128, V=64, invalid_rows=(1,)), device=DEV)
        check_against_reference(x, steps=2, fn=composite.fused_gdn_decode_checked_reference)

    @check("input-check-and-debug-index-switch")
    def _():
        x = make_inputs(Case(B=3, H=1, Hv=2, K=128, V=64), device=DEV)
        try:
            call(OP, dict(x, a_log=x["a_log"].half()))
            raise AssertionError("fp16 a_log accepted")
        except TypeError:
            pass
        try:
            call(OP, dict(x, b=x["b"].to("meta" if DEV == "cpu" else "cpu")))
            raise AssertionError("device mismatch accepted")
        except ValueError as e:
            assert "all tensors must be on one device" in str(e)
        pool = x["state_ref"].shape[0]
        bad = dict(x, ssm_state_indices=torch.tensor([1, pool, 2], dtype=torch.int32, device=DEV))
        old = cuda_backend.set_check_indices(True)
        try:
            call(OP, bad)
            raise AssertionError("out-of-range index accepted with the debug switch on")
        except ValueError as e:
            assert "out of range" in str(e)
        finally:
            cuda_backend.set_check_indices(old)
        before = x["state_ref"].clone()
        out = call(OP, clone_inputs(bad))  # switch off: no error, no access outside the pool
        assert torch.count_nonzero(out[1]) == 0
        del before

    @check("nan-and-inf-like-reference (every input, K = 136: padded lanes)")
    def _():
        # The compiled kernel's exp/log/min/max on NaN and Inf: NaN and +-Inf where the
        # reference has them, in out and in the whole state (tests/test_triton_interpret.py runs
        # the same cases through the interpreter).
        n = 0
        for sdt in (torch.float32, torch.bfloat16):
            x = make_inputs(Case(B=2, H=1, Hv=2, K=136, V=16, state_dtype=sdt, seed=11),
                            device=DEV)
            x["mixed_qkv"][:, :136] = x["mixed_qkv"][:, 136:272]  # q = k: Inf survives in out
            for place in VALUE_PLACES:
                for value in (float("nan"), float("inf"), float("-inf")):
                    y = with_value_at(x, place, value)
                    ours, ref = clone_inputs(y), clone_inputs(y)
                    out = call(OP, ours)
                    out_ref = call(custom_ops.fused_gdn_decode_reference, ref)
                    what = f"{short(sdt)} state, {place} = {value}"
                    assert_close(out, out_ref, f"out ({what})", equal_nan=True)
                    assert_close(ours["state_ref"], ref["state_ref"], f"state ({what})",
                                 equal_nan=True)
                    n += 1
        return f"({n} cases)"

    if args.cpu_smoke:
        print(f"\n{len(FAILED)} check(s) failed (cpu smoke: graph/compile/fla/bench skipped)")
        return 1 if FAILED else 0

    @check("cuda-graph-decode-loop-equals-eager")
    def _():
        steps = 8
        c = Case(B=48, H=4, Hv=8, K=128, V=128, pool=100, invalid_rows=(7,))
        x = make_inputs(c, device=DEV)
        qkvs = [make_inputs(dataclasses.replace(c, seed=1 + t), device=DEV,
                            state_ref=x["state_ref"])["mixed_qkv"] for t in range(steps)]
        eager_state = x["state_ref"].clone()
        graph_state = x["state_ref"].clone()
        eager_outs = [call(OP, dict(x, mixed_qkv=qkvs[t], state_ref=eager_state))
                      for t in range(steps)]
        # The debug switch must not sync (and so break) a capture: it is skipped while capturing.
        old = cuda_backend.set_check_indices(True)
        try:
            warm = graph_state.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                call(OP, dict(x, mixed_qkv=qkvs[0], state_ref=warm))
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graph_outs = [call(OP, dict(x, mixed_qkv=qkvs[t], state_ref=graph_state))
                              for t in range(steps)]
        finally:
            cuda_backend.set_check_indices(old)
        graph_state.copy_(x["state_ref"])  # capture does not run the kernels; start from scratch
        graph.replay()
        torch.cuda.synchronize()
        for t in range(steps):
            assert torch.equal(graph_outs[t], eager_outs[t]), f"out differs at step {t}"
        assert torch.equal(graph_state, eager_state), "state differs"

    def step_fn(qkv, a, b, a_log, dt_bias, state, idx, scale):
        out = OP(qkv, a, b, a_log, dt_bias, state, idx, scale)
        return out.float().square().sum(-1)  # some surrounding ops for the compiler to fuse

    def compiled_equals_eager(mode):
        c = Case(B=16, H=4, Hv=8, K=128, V=128, pool=40, invalid_rows=(2,))
        x = make_inputs(c, device=DEV)
        fn = torch.compile(step_fn, fullgraph=True, mode=mode)
        eager, comp = clone_inputs(x), clone_inputs(x)
        for t in range(3):
            r_e = call(step_fn, eager)
            r_c = call(fn, comp)
            torch.testing.assert_close(r_c, r_e, atol=1e-4, rtol=1e-4)
            assert torch.equal(comp["state_ref"], eager["state_ref"]), f"state differs, step {t}"

    @check("multi-gpu-device-guard (tensors on cuda:1 while cuda:0 is current)")
    def _():
        if torch.cuda.device_count() < 2:
            return "skipped: one GPU"
        with torch.cuda.device(0):
            x = make_inputs(Case(B=9, H=2, Hv=4, K=128, V=64, invalid_rows=(3,)), device="cuda:1")
            check_against_reference(x, steps=2, fn=OP)
            assert torch.cuda.current_device() == 0, "the launch changed the current device"

    @check("torch.compile(fullgraph=True)")
    def _():
        compiled_equals_eager(None)

    @check("torch.compile(fullgraph=True, mode='reduce-overhead')")
    def _():
        compiled_equals_eager("reduce-overhead")

    @check("fla-agrees-with-reference (so its timing is of the same step)")
    def _():
        errs = []
        for sdt in (torch.float32, torch.bfloat16):  # FLA gets the state in this dtype
            x = make_inputs(tb.decode_case(8, 4, 8, 128, 128, state_dtype=sdt), device="cuda")
            fn, note = tb._fla_call(x, 4, 8, 128, 128)
            if fn is None:
                return f"skipped: {note}"
            o, _ = fn()
            ref = call(custom_ops.fused_gdn_decode_reference, clone_inputs(x))
            err = (o.reshape(ref.shape).float() - ref.float()).abs().max().item()
            atol, _ = TOLERANCES[ref.dtype]
            assert err <= 4 * atol, f"{short(sdt)} state: max |fla - ref| = {err:.3g} ({note})"
            errs.append(f"{short(sdt)} {err:.2g}")
        return f"(max err {', '.join(errs)}; {note})"

    if not args.no_bench:
        batch = (1, 64, 256) if args.quick else (1, 16, 64, 128, 256)
        print("\n== bench (device time per call from CUDA-graph replays) ==", flush=True)
        rows = tb.bench_cuda(batch_sizes=batch, shapes=("qwen3-next",))
        print("\n" + tb.format_table(rows), flush=True)
        print("\n== target: qwen3-next, fp32 and bf16 state, B >= 64: "
              "ours >= 85% of copy, faster than fla (ratios from this run) ==")
        by = {(r["state"], r["B"], r["method"]): r for r in rows}
        for state in ("float32", "bfloat16"):
            for B in [b for b in batch if b >= 64]:
                ours = by[(state, B, "ours")]
                pct, vs = ours["pct_copy"], ours["vs_fla"]
                if math.isnan(vs):
                    verdict = "UNDECIDED (fla n/a)" if pct >= 85 else "NOT MET"
                else:
                    verdict = "MET" if pct >= 85 and vs > 1 else "NOT MET"
                print(f"TARGET {verdict} {state} B={B}: ours {ours['us']:.1f} us, "
                      f"{pct:.0f}% of copy, {vs:.2f}x fla's speed", flush=True)

    if not args.no_sweep:
        print("\n== tile sweep (qwen3-next; top 5 per case; current rule's pick marked *) ==")
        from custom_ops import triton_kernel as tk
        for sdt in (torch.float32, torch.bfloat16):
            for B in ((64,) if args.quick else (64, 256)):
                res = tb.sweep_tiles(B=B, state_dtype=sdt)
                cur = tk.tile_config(128, 128, sdt)
                cur_us = next((us for us, cfg in res if cfg == cur), float("nan"))
                print(f"B={B} state={short(sdt)}: rule {cur} {cur_us:.2f} us")
                for us, cfg in res[:5]:
                    print(f"  {us:8.2f} us  BV={cfg.BV:<3} num_warps={cfg.num_warps}"
                          f"{' *' if cfg == cur else ''}", flush=True)

    print(f"\n{len(FAILED)} check(s) failed" + (": " + ", ".join(FAILED) if FAILED else ""))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
