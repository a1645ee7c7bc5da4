"""Runs vLLM's CPU engine in-process on a tiny random model, made here, with or without the
custom_ops plugin; prints one JSON line (``RESULT {...}``). Runs in the vLLM venv
(scripts/make_vllm_venv.sh), called by tests/test_integration_vllm.py.

    python tests/vllm_driver.py run --family qwen3_next --state-dtype float32
    python tests/vllm_driver.py refuse
"""

import argparse
import json
import os
import sys
import tempfile
import time

# In-process engine core and model runner: the plugin's counters live in this process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def make_model(family, path, seed=0):
    """3 layers (GDN, attention, GDN), hidden 64, K = V = 64, Hv/H = 2 (Qwen3-Next) or 3."""
    import torch
    import transformers

    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, linear_key_head_dim=64,
                  linear_value_head_dim=64, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "full_attention", "linear_attention"],
                  max_position_embeddings=512, pad_token_id=0, eos_token_id=None,
                  bos_token_id=None)
    if family == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(**common, intermediate_size=96, linear_num_key_heads=2,
                                           linear_num_value_heads=4, num_experts=2,
                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=32,
                                           decoder_sparse_step=2)
        cls = transformers.Qwen3NextForCausalLM
    else:
        cfg = transformers.Qwen3_5TextConfig(**common, intermediate_size=96,
                                             linear_num_key_heads=2, linear_num_value_heads=6)
        cls = transformers.Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "A_log"):
                m.A_log.uniform_(-2.0, 1.0)
                m.dt_bias.normal_(0.0, 0.5)
    model.to(torch.bfloat16).save_pretrained(path)


def run(args):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory() as d:
        make_model(args.family, d)
        llm = LLM(model=d, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=32,
                  enable_chunked_prefill=True, enable_prefix_caching=False, enforce_eager=True,
                  mamba_ssm_cache_dtype=args.state_dtype, seed=0)
        from vllm.model_executor.custom_op import op_registry_oot

        lengths = [int(n) for n in args.lengths.split(",")]
        prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 3 * j) % 250 + 1 for j in range(n)])
                   for i, n in enumerate(lengths)]
        params = [SamplingParams(max_tokens=args.max_tokens + 3 * i, temperature=0.0,
                                 ignore_eos=True) for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    from custom_ops.integrations import vllm as plugin

    result = dict(plugin.STATS, tokens=tokens, seconds=dt,
                  oot_registered="QwenGatedDeltaNetAttention" in op_registry_oot,
                  lengths=lengths, expected_tokens=sum(args.max_tokens + 3 * i
                                                       for i in range(len(prompts))))
    print("RESULT " + json.dumps(result), flush=True)


def refuse(_args):
    import vllm

    from custom_ops.integrations import vllm as plugin

    errors = []
    for version in ("0.31.2", "0.33.0", "1.0.0"):
        vllm.__version__ = version
        try:
            plugin.register()
        except RuntimeError as e:
            errors.append(str(e))
    print("RESULT " + json.dumps({"errors": errors, "installed": plugin._installed}), flush=True)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--family", default="qwen3_next", choices=["qwen3_next", "qwen3_5"])
    r.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"])
    r.add_argument("--lengths", default="5,40,70,12,90,3")
    r.add_argument("--max-tokens", type=int, default=12)
    r.add_argument("--max-num-seqs", type=int, default=3)
    r.set_defaults(fn=run)
    sub.add_parser("refuse").set_defaults(fn=refuse)
    args = p.parse_args()
    args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
