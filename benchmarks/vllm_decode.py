"""Our op against vLLM's own CPU decode kernel, and vLLM's engine with and without the plugin.

Run in the vLLM venv (scripts/make_vllm_venv.sh):

    .venv-vllm/bin/python -m benchmarks.vllm_decode              # both tables
    .venv-vllm/bin/python -m benchmarks.vllm_decode --no-engine  # per-call table only

Per call: Qwen3-Next GDN shapes (H=16, Hv=32, K=V=128), B = 1..64, fp32 and bf16 state, one
thread, a paged pool in vLLM's page layout for ours (slot stride > Hv*V*K) and vLLM's own
K-major view for its kernel; the median of --reps calls after warm-up. Each side gets the inputs
its engine path gives it (vLLM's: q, k, v split and made contiguous as rearrange_mixed_qkv does;
ours: the packed conv output). Engine: decode tokens/s of tests/vllm_driver.py's tiny random
Qwen3-Next (a few long generations, so decode dominates), plugin off and on, check mode off.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

H, HV, K, V = 16, 32, 128, 128
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _time(fn, reps):
    for _ in range(5):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def per_call(batches, reps):
    import vllm._custom_ops as ops

    import custom_ops  # noqa: F401

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

            def ours():
                torch.ops.custom.npu_fused_gdn_decode.out(x, a, b, a_log, dt_bias, pool, idx,
                                                          K ** -0.5, out=out)

            vpool = pool.view(N, HV, K, V)
            q = x[:, :H * K].reshape(1, B, H, K).contiguous()
            k = x[:, H * K:2 * H * K].reshape(1, B, H, K).contiguous()
            v = x[:, 2 * H * K:].reshape(1, B, HV, V).contiguous()
            ac, bc = a.contiguous(), b.contiguous()
            cu = torch.arange(B + 1, dtype=torch.int32)
            a_log_v = a_log.to(torch.bfloat16)

            def theirs():
                ops.fused_sigmoid_gating_delta_rule_update_cpu(
                    A_log=a_log_v, dt_bias=dt_bias, q=q, k=k, v=v, a=ac, b=bc,
                    initial_state_source=vpool, initial_state_indices=idx, cu_seqlens=cu,
                    use_qk_l2norm_in_kernel=True)

            t_ours, t_theirs = _time(ours, reps), _time(theirs, reps)
            rows.append((str(state_dtype).replace("torch.", ""), B, t_ours, t_theirs))
    return rows


def engine(max_tokens):
    results = {}
    for plugin in (False, True):
        env = {k: v for k, v in os.environ.items()
               if k not in ("CUSTOM_OPS_VLLM", "CUSTOM_OPS_VLLM_CHECK", "PYTHONPATH")}
        if plugin:
            env["CUSTOM_OPS_VLLM"] = "1"
        r = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_driver.py"), "run",
                            "--lengths", "8,8,8,8", "--max-num-seqs", "4",
                            "--max-tokens", str(max_tokens)],
                           capture_output=True, text=True, env=env, cwd="/")
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode or not line:
            raise RuntimeError(f"engine run failed:\n{r.stderr[-4000:]}")
        results[plugin] = json.loads(line[-1][7:])
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("--max-tokens", type=int, default=120)
    args = p.parse_args()
    import custom_ops
    print(f"torch {torch.__version__}, CPU kernel {custom_ops.cpu_isa()}, 1 thread; "
          f"H={H} Hv={HV} K={K} V={V}, bf16 inputs")
    print("| state | B | ours (µs) | vLLM CPU kernel (µs) | speed-up |")
    print("| --- | --- | --- | --- | --- |")
    for dt, B, ours, theirs in per_call(args.batches, args.reps):
        print(f"| {dt} | {B} | {ours:.0f} | {theirs:.0f} | {theirs / ours:.2f}x |", flush=True)
    if not args.no_engine:
        r = engine(args.max_tokens)
        print("\n| engine (tiny Qwen3-Next, 4 requests) | tokens | s | tokens/s |")
        print("| --- | --- | --- | --- |")
        for plugin, name in ((False, "vLLM alone"), (True, "with the plugin")):
            x = r[plugin]
            print(f"| {name} | {x['tokens']} | {x['seconds']:.2f} | "
                  f"{x['tokens'] / x['seconds']:.1f} |")


if __name__ == "__main__":
    main()
