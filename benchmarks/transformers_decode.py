"""Decode tokens/s of a transformers Qwen3-Next model, stock vs through the fused op.

    python -m benchmarks.transformers_decode                 # batch 1 and 8
    python -m benchmarks.transformers_decode --batch 1 4 16 --steps 64 --threads 2

A random bf16 model with Qwen3-Next's Gated DeltaNet shapes (H=16, Hv=32, K=V=128, hidden 2048)
and its layer pattern (three GDN layers, then one attention layer), with a small dense MLP, a small
attention layer and a small vocabulary, so that the GDN layers dominate. No download.

For each batch size: prefill a random prompt (not timed), then time --steps greedy decode steps,
once with stock transformers (its pure-torch ``torch_recurrent_gated_delta_rule``) and once with
``custom_ops.integrations.transformers.patch_gdn_decode``, alternating, --repeat times; the best
run of each counts. The same runs time every call of the GDN recurrence (stock transformers'
``torch_recurrent_gated_delta_rule``, or the op) to give its share of the decode time.

--conv fp32 runs transformers' conv step (``causal_conv1d_update``) in float32 in both variants:
on CPUs without native bf16 convolution, PyTorch's bf16 depthwise conv1d falls back to one small
convolution per channel and can cost far more than the fp32 one, hiding everything else in the
step (docs/bench_transformers.txt has both on the machine it names).
(A benchmark-only substitute, labelled in the output; the integration keeps transformers' own.)

Why not torch.profiler for the share: on CPU, transformers' bf16 depthwise conv step runs as about
25,000 tiny aten calls per decode step (one per channel group and layer); under torch.profiler one
decode step takes many times longer and records hundreds of thousands of events, so the
profiler's shares would mostly measure the profiler; two perf_counter calls around each recurrence
call cost about a microsecond.
"""

import argparse
import inspect
import platform
import sys
import time

import torch

import custom_ops
from custom_ops.integrations import transformers as integ

try:
    import transformers
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen3_next
except ImportError:  # pragma: no cover
    sys.exit("transformers is not installed: pip install -r requirements-test.txt")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.transformers_decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--prompt", type=int, default=16, help="prompt length")
    p.add_argument("--layers", type=int, default=4, help="layers (every 4th is attention)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per variant")
    p.add_argument(
        "--conv", choices=["transformers", "fp32"], default="transformers",
        help="transformers' conv step as it is, or computed in float32 (both variants)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return p.parse_args(argv)


def make_model(layers):
    cfg = transformers.Qwen3NextConfig(
        vocab_size=2048,
        hidden_size=2048,
        num_hidden_layers=layers,
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ],
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        intermediate_size=256,
        mlp_only_layers=list(range(layers)),
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.Qwen3NextForCausalLM(cfg).to(torch.bfloat16).eval()


def conv_update_fp32(hidden_states, conv_state, weight, bias=None, activation=None):
    """transformers' ``causal_conv1d_update`` with the convolution computed in float32."""
    hidden_size, seq_len = hidden_states.shape[1], hidden_states.shape[2]
    window = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
    conv_state.copy_(window[:, :, -conv_state.shape[-1] :])
    out = torch.nn.functional.conv1d(
        window.float(), weight.float().unsqueeze(1), None if bias is None else bias.float(),
        groups=hidden_size,
    )[:, :, -seq_len:]  # fmt: skip
    if activation is not None:
        out = qwen3_next.ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


class Timed:
    """Wraps a function; adds the wall time of its calls to ``seconds``."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


@torch.no_grad()
def decode(model, prompt, steps, timer):
    """Prefill (untimed), then ``steps`` greedy decode steps.
    Returns (seconds, seconds inside ``timer`` during the steps, tokens picked)."""
    kw = (
        "cache"
        if "cache" in inspect.signature(type(model).forward).parameters
        else "past_key_values"
    )
    out = model(input_ids=prompt, use_cache=True)
    cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    picked = [tok]
    timer.seconds = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=tok, use_cache=True, **{kw: cache})
        cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        picked.append(tok)
    return time.perf_counter() - t0, timer.seconds, torch.cat(picked, 1)


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = make_model(args.layers)
    gdn = sum(t == "linear_attention" for t in model.config.layer_types)
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, custom_ops CPU "
        f"kernel {custom_ops.cpu_isa()}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}"
    )
    print(
        f"model: random Qwen3-Next, {args.layers} layers ({gdn} GDN: H=16 Hv=32 K=V=128; "
        f"{args.layers - gdn} attention), hidden 2048, bf16; prompt {args.prompt}, "
        f"{args.steps} decode steps timed, best of {args.repeat}; conv step: "
        + ("transformers'" if args.conv == "transformers" else "float32 (benchmark substitute)")
    )
    # Time transformers' recurrent step where its GDN layers look it up (module globals), and
    # the op through the integration's kernel argument.
    stock_timer = Timed(qwen3_next.torch_recurrent_gated_delta_rule)
    op_timer = Timed(torch.ops.custom.npu_fused_gdn_decode)
    qwen3_next.torch_recurrent_gated_delta_rule = stock_timer
    conv_update = qwen3_next.causal_conv1d_update
    if args.conv == "fp32":  # before patch_gdn_decode, which takes the module's at patch time
        qwen3_next.causal_conv1d_update = conv_update_fp32
    rows = []
    try:
        for B in args.batch:
            prompt = torch.randint(
                1, model.config.vocab_size, (B, args.prompt),
                generator=torch.Generator().manual_seed(B),
            )  # fmt: skip
            best = {}
            for _ in range(args.repeat):
                for variant in ("stock", "op"):
                    if variant == "op":
                        with integ.patch_gdn_decode(model, kernel=op_timer):
                            run = decode(model, prompt, args.steps, op_timer)
                    else:
                        run = decode(model, prompt, args.steps, stock_timer)
                    if variant not in best or run[0] < best[variant][0]:
                        best[variant] = run
            (ts, rs, tok_s), (to, ro, tok_o) = best["stock"], best["op"]
            same = (tok_s == tok_o).float().mean().item()
            rows.append((B, ts, to, rs, ro, same))
    finally:
        qwen3_next.torch_recurrent_gated_delta_rule = stock_timer.fn
        qwen3_next.causal_conv1d_update = conv_update
    n = args.steps
    print()
    print(
        f"{'':5}  {'decode tok/s':^18}  {'':8}  {'recurrence ms/step':^21}  {'share of decode':^17}"
    )
    print(
        f"{'batch':>5}  {'stock':>8}  {'op':>8}  {'speed-up':>8}  {'stock':>11}  {'op':>8}  "
        f"{'stock':>9}  {'op':>6}  {'same tokens':>11}"
    )
    for B, ts, to, rs, ro, same in rows:
        print(
            f"{B:>5}  {B * n / ts:>8.2f}  {B * n / to:>8.2f}  {ts / to:>7.2f}x  "
            f"{1e3 * rs / n:>11.1f}  {1e3 * ro / n:>8.1f}  {rs / ts:>9.0%}  {ro / to:>6.0%}"
            f"  {same:>11.0%}"
        )


if __name__ == "__main__":
    main()
