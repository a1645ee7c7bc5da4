"""Our op against vLLM's own CPU decode kernel, and vLLM's engine with and without the plugin.

Run in the vLLM venv (scripts/make_vllm_venv.sh), from the checkout:

    .venv-vllm/bin/python -m benchmarks.vllm_decode              # both tables
    .venv-vllm/bin/python -m benchmarks.vllm_decode --no-engine  # per-call table only

Per call: Qwen3-Next GDN shapes (H=16, Hv=32, K=V=128), B = 1..64, fp32 and bf16 state, one
thread, a paged pool in vLLM's page layout for ours (slot stride > Hv*V*K) and vLLM's own
K-major view for its kernel. Each side gets the inputs its engine path gives it (vLLM's: q, k, v
split and made contiguous as rearrange_mixed_qkv does; ours: the packed conv output); both are
first checked against the reference (output and state), then timed interleaved
(benchmarks._harness), medians.

Engine: decode tokens/s of vLLM's CPU engine (tests/vllm_driver.py, in-process engine, check mode
off) on a random Qwen3-Next whose two GDN layers have Qwen3-Next's shapes (H=16, Hv=32, K=V=128)
around a small rest (hidden 128, one attention layer, 2 tiny experts), so that the GDN state
traffic is a real model's per layer: --engine-batch requests of 8 prompt tokens in one batch.
Decode: the median wall time of the engine steps that decode all rows (vLLM's prefill, the same
code in both runs, costs more than many decode steps on CPU, and is left out). Plugin off and on
alternate, --engine-runs times each, every run a fresh process.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

import torch

from benchmarks._harness import time_calls

H, HV, K, V = 16, 32, 128, 128
ROOT = pathlib.Path(__file__).resolve().parent.parent
# tests/vllm_driver.py's model options for the engine table: Qwen3-Next's GDN layer shapes.
ENGINE_HIDDEN = 128
ENGINE_MODEL = ("--family", "qwen3_next", "--key-heads", str(H), "--value-heads", str(HV),
                "--linear-head-dim", str(K), "--hidden", str(ENGINE_HIDDEN))


def per_call(batches, min_time):
    import vllm._custom_ops as ops

    from custom_ops import fused_gdn_decode_reference
    from custom_ops.testing import TOLERANCES, assert_close

    rows = []
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for state_dtype in (torch.float32, torch.bfloat16):
        for B in batches:
            N = B + 2
            W = 2 * H * K + HV * V
            x = (torch.randn(B, W, generator=g) * 0.5).to(torch.bfloat16)
            ab = torch.randn(B, 2 * HV, generator=g).to(torch.bfloat16)
            a, b = ab[:, :HV], ab[:, HV:]
            a_log = torch.randn(HV, generator=g) * 0.5
            dt_bias = (torch.randn(HV, generator=g) * 0.5).to(torch.bfloat16)
            idx = torch.arange(1, B + 1, dtype=torch.int32)
            page = HV * V * K + 4096  # a conv state's worth of page in front, as vLLM
            buf = torch.zeros(N * page, dtype=state_dtype)
            pool = buf.as_strided((N, HV, V, K), (page, V * K, K, 1), 4096)
            pool.copy_(torch.randn(N, HV, V, K, generator=g) * 0.1)
            out = torch.empty(B, 1, HV, V, dtype=torch.bfloat16)
            # vLLM's kernel works on its own pool, K-major: the same states, transposed.
            vbuf = buf.clone()
            vpool = vbuf.as_strided((N, HV, K, V), (page, V * K, V, 1), 4096)
            vpool.copy_(pool.transpose(-1, -2))

            def ours():
                torch.ops.custom.npu_fused_gdn_decode.out(x, a, b, a_log, dt_bias, pool, idx,
                                                          K ** -0.5, out=out)

            q = x[:, :H * K].reshape(1, B, H, K).contiguous()
            k = x[:, H * K:2 * H * K].reshape(1, B, H, K).contiguous()
            v = x[:, 2 * H * K:].reshape(1, B, HV, V).contiguous()
            ac, bc = a.contiguous(), b.contiguous()
            cu = torch.arange(B + 1, dtype=torch.int32)
            a_log_v = a_log.to(torch.bfloat16)

            def theirs():
                return ops.fused_sigmoid_gating_delta_rule_update_cpu(
                    A_log=a_log_v, dt_bias=dt_bias, q=q, k=k, v=v, a=ac, b=bc,
                    initial_state_source=vpool, initial_state_indices=idx, cu_seqlens=cu,
                    use_qk_l2norm_in_kernel=True)

            # One step of each, from the same states, against the reference before anything is
            # timed: ours at its per-dtype tolerance; vLLM's kernel (given A_log in bf16, as its
            # engine holds it, ours the same values in fp32) at bf16's: it is less exact (1e-3
            # off the reference on fp32 states here).
            a_log.copy_(a_log_v.float())
            ref_pool = pool.clone()
            want = fused_gdn_decode_reference(x, a, b, a_log, dt_bias, ref_pool, idx, K ** -0.5)
            ours()
            assert_close(out, want, "ours: out")
            assert_close(pool, ref_pool, "ours: state")
            got = theirs().reshape(B, 1, HV, V)
            atol, rtol = TOLERANCES[torch.bfloat16]
            torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
            torch.testing.assert_close(vpool.transpose(-1, -2).float(), ref_pool.float(),
                                       atol=atol, rtol=rtol)
            t = time_calls({"ours": ours, "theirs": theirs}, lambda: None, min_time)
            rows.append((str(state_dtype).replace("torch.", ""), B, t["ours"] * 1e6,
                         t["theirs"] * 1e6))
    return rows


def engine(batch, tokens, runs, state_dtype):
    """The driver's results, {plugin on: [run, ...]}: plugin off and on alternating, each run
    a fresh process."""
    args = ["run", *ENGINE_MODEL, "--state-dtype", state_dtype,
            "--lengths", ",".join(["8"] * batch), "--max-num-seqs", str(batch),
            "--max-num-batched-tokens", str(max(32, 8 * batch)),
            "--max-model-len", str(8 + tokens + 8), "--max-tokens", str(tokens),
            "--max-tokens-step", "0", "--warmup", "4"]
    results = {False: [], True: []}
    for _ in range(runs):
        for plugin in (False, True):
            env = {k: v for k, v in os.environ.items()
                   if k not in ("CUSTOM_OPS_VLLM", "CUSTOM_OPS_VLLM_CHECK", "PYTHONPATH")}
            if plugin:
                env["CUSTOM_OPS_VLLM"] = "1"
            r = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_driver.py"), *args],
                               capture_output=True, text=True, env=env, cwd="/")
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
            if r.returncode or not line:
                raise RuntimeError(f"engine run failed:\n{r.stderr[-4000:]}")
            x = json.loads(line[-1][7:])
            if x["tokens"] != x["expected_tokens"] or (plugin and x["decode_calls"] == 0):
                raise RuntimeError(f"engine run incomplete: {x}")
            results[plugin].append(x)
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--min-time", type=float, default=0.3,
                   help="seconds of calls per side and batch size")
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("--engine-batch", type=int, default=32)
    p.add_argument("--engine-tokens", type=int, default=48)
    p.add_argument("--engine-runs", type=int, default=3)
    p.add_argument("--engine-state", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    import custom_ops
    print(f"torch {torch.__version__}, CPU kernel {custom_ops.cpu_isa()}, 1 thread; "
          f"H={H} Hv={HV} K={K} V={V}, bf16 inputs; ours and vLLM's kernel timed interleaved")
    print("| state | B | ours (µs) | vLLM CPU kernel (µs) | speed-up |")
    print("| --- | --- | --- | --- | --- |")
    for dt, B, ours, theirs in per_call(args.batches, args.min_time):
        print(f"| {dt} | {B} | {ours:.0f} | {theirs:.0f} | {theirs / ours:.2f}x |", flush=True)
    if args.no_engine:
        return
    r = engine(args.engine_batch, args.engine_tokens, args.engine_runs, args.engine_state)
    x = r[False][0]
    print(f"\nEngine: random Qwen3-Next, 2 GDN layers H={H} Hv={HV} K=V={K} + 1 attention layer, "
          f"hidden {ENGINE_HIDDEN}; {args.engine_state} state; {args.engine_batch} requests x 8 "
          f"prompt tokens, {args.engine_tokens} generated each, in one batch; {x['threads']} "
          f"threads; "
          f"median of the engine steps that decode all {args.engine_batch} rows "
          f"(vLLM's EngineCore.step, wall clock); plugin off and on alternate, a fresh process "
          f"each")
    print("| run | vLLM alone: ms/step | decode tokens/s | with the plugin: ms/step "
          "| decode tokens/s | speed-up |")
    print("| --- | --- | --- | --- | --- | --- |")
    step = {k: [decode_step(x, args.engine_batch) for x in v] for k, v in r.items()}

    def row(name, off, on):
        b = args.engine_batch
        print(f"| {name} | {off * 1e3:.1f} | {b / off:.0f} | {on * 1e3:.1f} | {b / on:.0f} | "
              f"{off / on:.2f}x |")

    for i, (off, on) in enumerate(zip(step[False], step[True]), 1):
        row(str(i), off, on)
    row("median", statistics.median(step[False]), statistics.median(step[True]))


def decode_step(result, batch):
    """Median seconds of a run's engine steps that decode every one of its rows."""
    full = [sec for tokens, rows, sec in result["steps"] if tokens == rows == batch]
    if len(full) < 5:
        raise RuntimeError(f"only {len(full)} full decode steps: {result['steps']}")
    return statistics.median(full)


if __name__ == "__main__":
    main()
