"""custom_ops.integrations.transformers: real transformers models decoding through the op.

Tiny random-config models of each supported family, built here (no download). Key and value
head counts differ (Hv/H = 2 and 3) so a wrong value-head -> key-head rule shows. The oracle for
"close to transformers" is the same model (same bf16/fp16-rounded weights) run by stock
transformers in float32: the op's error against it must stay within twice stock transformers' own
16-bit error (the rule flash-attention's tests use), step by step, for logits and states.
"""

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import custom_ops  # noqa: E402  (after the importorskip)
from custom_ops.integrations import transformers as integ  # noqa: E402

try:
    integ._version_check()
    OUT_OF_RANGE = ""
except RuntimeError as e:
    OUT_OF_RANGE = str(e)
needs_tested = pytest.mark.skipif(bool(OUT_OF_RANGE), reason=OUT_OF_RANGE or "-")

# One bf16/fp16 rounding of the largest logit or state entry: the floor under the 2x rule, for
# steps where stock's own error happens to be near zero.
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

VOCAB = 256

# Op against reference state pools after a generate: 10x the largest difference measured (5.8e-6,
# over ATen's avx512, avx2 and default CPU kernels: qwen3_5 bf16's second GDN layer, fed the
# first's 16-bit outputs). The states stay below 1e-2, so 2e-2 would pass any pool.
POOL_ATOL = 6e-5


def cache_kw():
    # transformers 5.24 renamed the models' `past_key_values` argument to `cache`. (Looked up when
    # a test runs, not at collection: importing a model module imports torch._dynamo.)
    params = inspect.signature(transformers.Qwen3NextForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def make_model(family, dtype, seed=0, key_dim=64):
    """A tiny model: 3 layers (GDN, attention, GDN), hidden 64, K = V = key_dim. MoE blocks use
    every expert: with top-k routing a near-tie in the router turns a last-bit difference into a
    different expert, which would make the comparisons below test the router, not the op."""
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "linear_key_head_dim": key_dim,
        "linear_value_head_dim": key_dim,
        "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "pad_token_id": 0,
        "eos_token_id": None,
        "bos_token_id": None,
    }
    if family == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(
            **common,
            intermediate_size=96,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=2,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            decoder_sparse_step=2,
        )
        cls = transformers.Qwen3NextForCausalLM
    elif family == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(
            **common, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=6
        )
        cls = transformers.Qwen3_5ForCausalLM
    else:
        cfg = transformers.Qwen3_5MoeTextConfig(
            **common,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            num_experts=2,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
        cls = transformers.Qwen3_5MoeForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    # Varied decay rates and a non-trivial dt_bias so the gates differ between heads.
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "A_log"):
                m.A_log.uniform_(-2.0, 1.0)
                m.dt_bias.normal_(0.0, 0.5)
    model.generation_config.pad_token_id = 0
    return model.to(dtype)


FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]


def gdn_layer_indices(model):
    return [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]


@torch.no_grad()
def decode_logits(model, prompt, mask, tokens, reorder_at=None, perm=None):
    """Prefill ``prompt`` (left padded per ``mask``), then feed ``tokens`` [steps, B] one step at
    a time (teacher forcing: every model sees the same inputs). Returns (per-step last logits in
    float32, the cache). With ``reorder_at``, the cache's batch is permuted by ``perm`` (as beam
    search does) before that step."""
    pos = (mask.long().cumsum(-1) - 1).clamp_(min=0)
    out = model(input_ids=prompt, attention_mask=mask, position_ids=pos, use_cache=True)
    cache, logits = out.past_key_values, [out.logits[:, -1].float()]
    for step, tok in enumerate(tokens):
        if step == reorder_at:
            cache.reorder_cache(perm)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        pos = pos[:, -1:] + 1
        out = model(
            input_ids=tok[:, None],
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            **{cache_kw(): cache},
        )
        cache, logits = out.past_key_values, logits + [out.logits[:, -1].float()]
    return torch.stack(logits), cache


def gdn_states(model, cache):
    """Each GDN layer's recurrent state as transformers sees it, [B, Hv, K, V] float32."""
    return [cache.layers[i].recurrent_states[0].float() for i in gdn_layer_indices(model)]


def assert_within_2x_stock(got, stock, oracle, dtype, what):
    """|got - oracle| <= 2 |stock - oracle| + one 16-bit rounding of the largest |oracle| entry;
    then got and stock are also within the sum of their errors of each other."""
    floor = EPS[dtype] * oracle.abs().max().item()
    err_got = (got - oracle).abs().max().item()
    err_stock = (stock - oracle).abs().max().item()
    assert err_got <= 2 * err_stock + floor, (
        f"{what}: op error {err_got:.3g} vs stock transformers' {err_stock:.3g} (floor {floor:.3g})"
    )
    diff = (got - stock).abs().max().item()
    assert diff <= 3 * err_stock + floor, f"{what}: op vs stock {diff:.3g}"


def left_padded_batch(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    prompt = torch.randint(1, VOCAB, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, T - n :] = 1
    return prompt.masked_fill(mask == 0, 0), mask


# (1) generate through the op == generate through the op's pure-torch reference, token for token.
@needs_tested
@pytest.mark.parametrize(
    "family,dtype",
    [
        ("qwen3_next", torch.bfloat16),
        ("qwen3_5", torch.bfloat16),
        ("qwen3_5_moe", torch.bfloat16),
        ("qwen3_next", torch.float16),
    ],
)
def test_generate_op_equals_reference(family, dtype):
    model = make_model(family, dtype)
    prompt = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    runs = {}
    for name, kernel in [("op", None), ("reference", custom_ops.fused_gdn_decode_reference)]:
        with integ.patch_gdn_decode(model, kernel=kernel):
            out = model.generate(
                prompt, max_new_tokens=32, do_sample=False, return_dict_in_generate=True
            )
        runs[name] = out
    op, ref = runs["op"], runs["reference"]
    assert op.sequences.shape == (2, 9 + 32)
    assert torch.equal(op.sequences, ref.sequences)
    # The decode steps ran in the pool: both caches hold their states there, slot 0 untouched.
    for i in gdn_layer_indices(model):
        pool = integ.state_pool(op.past_key_values, i)
        assert pool is not None and pool.shape[0] == 2 + 1
        assert not pool[0].any()
        ref_pool = integ.state_pool(ref.past_key_values, i)
        torch.testing.assert_close(pool, ref_pool, atol=POOL_ATOL, rtol=0)


# (2) against stock transformers: logits of every decode step and the states after N steps; the
# state is converted once at the end of prefill and then updated in place by the op.
@needs_tested
@pytest.mark.parametrize(
    "family,dtype",
    [
        ("qwen3_next", torch.bfloat16),
        ("qwen3_5", torch.bfloat16),
        ("qwen3_5_moe", torch.bfloat16),
        ("qwen3_next", torch.float16),
    ],
)
def test_close_to_stock_transformers(family, dtype):
    model = make_model(family, dtype)
    oracle = copy.deepcopy(model).float()
    g = torch.Generator().manual_seed(2)
    B, steps = 2, 16
    prompt, mask = (
        torch.randint(1, VOCAB, (B, 11), generator=g),
        torch.ones(B, 11, dtype=torch.long),
    )
    tokens = torch.randint(1, VOCAB, (steps, B), generator=g)

    stock_logits, stock_cache = decode_logits(model, prompt, mask, tokens)
    oracle_logits, oracle_cache = decode_logits(oracle, prompt, mask, tokens)
    with integ.patch_gdn_decode(model):
        logits, cache = decode_logits(model, prompt, mask, tokens)
    for step in range(steps + 1):
        assert_within_2x_stock(
            logits[step],
            stock_logits[step],
            oracle_logits[step],
            dtype,
            f"{family} logits, step {step}",
        )
    for layer, (got, stock, ref) in enumerate(
        zip(
            gdn_states(model, cache),
            gdn_states(model, stock_cache),
            gdn_states(oracle, oracle_cache),
        )
    ):
        assert_within_2x_stock(got, stock, ref, dtype, f"{family} state, GDN layer {layer}")
    # Converted once at the end of prefill: the same tensor, in the op's layout ([B, Hv, K, V] to
    # transformers, stored as [.., V, K]), is the state of every later step.
    with integ.patch_gdn_decode(model):
        _, c = decode_logits(model, prompt, mask, tokens[:0])
        held = [c.layers[i].recurrent_states[0] for i in gdn_layer_indices(model)]
        for i in range(3):
            model(input_ids=tokens[i][:, None], **{cache_kw(): c})
        now = [c.layers[i].recurrent_states[0] for i in gdn_layer_indices(model)]
    assert all(a is b for a, b in zip(held, now))
    assert all(s.stride(-2) == 1 and s.stride(-1) == s.shape[-2] for s in now)


def cache_lengths(cache):
    """Each cache layer's get_seq_length, or the error it raises (transformers < 5.25 has no length
    for a linear-attention layer but the first)."""
    lengths = []
    for i in range(len(cache.layers)):
        try:
            lengths.append(int(cache.get_seq_length(i)))
        except ValueError as e:
            lengths.append(type(e).__name__)
    return lengths


@needs_tested
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_cache_lengths_match_stock(family):
    # transformers >= 5.25 counts the tokens of a linear-attention layer in its conv step
    # (get_seq_length(0) is then a GDN layer's count, which generate() continues from): the
    # patched decode step must count them as stock does.
    model = make_model(family, torch.bfloat16)
    prompt = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(1, VOCAB, (4, 2), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompt)
    _, stock = decode_logits(model, prompt, mask, tokens)
    with integ.patch_gdn_decode(model):
        _, ours = decode_logits(model, prompt, mask, tokens)
    assert all(integ.state_pool(ours, i) is not None for i in gdn_layer_indices(model))
    assert cache_lengths(ours) == cache_lengths(stock), (cache_lengths(ours), cache_lengths(stock))


def assisted_run(model, prompt, patched):
    """Greedy prompt-lookup decoding: (tokens, cache lengths), or the error generate() raises."""
    kw = dict(max_new_tokens=16, do_sample=False, prompt_lookup_num_tokens=3,
              return_dict_in_generate=True)
    try:
        if patched:
            with integ.patch_gdn_decode(model):
                out = model.generate(prompt, **kw)
        else:
            out = model.generate(prompt, **kw)
    except ValueError as e:  # transformers < 5.25: "not supported with stateful models"
        return str(e)
    return out.sequences.tolist(), cache_lengths(out.past_key_values)


@needs_tested
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_assisted_generation_as_stock(family):
    # transformers 5.25 allows assisted (prompt-lookup) decoding for these models; its steps verify
    # several tokens while the cache records past states, which stay transformers' own code: the
    # patched model gives stock's tokens and cache lengths (or, before 5.25, stock's refusal).
    model = make_model(family, torch.bfloat16)
    base = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    prompt = base.repeat(1, 3)  # repetitive, so that prompt lookup finds drafts
    assert assisted_run(model, prompt, patched=True) == assisted_run(model, prompt, patched=False)


# (3) a batch of 4 prompts of different lengths, left padded.
@needs_tested
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_left_padded_batch(family):
    dtype = torch.bfloat16
    model = make_model(family, dtype, seed=3)
    oracle = copy.deepcopy(model).float()
    prompt, mask = left_padded_batch([3, 12, 7, 1], seed=4)
    tokens = torch.randint(1, VOCAB, (8, 4), generator=torch.Generator().manual_seed(5))
    stock_logits, stock_cache = decode_logits(model, prompt, mask, tokens)
    oracle_logits, oracle_cache = decode_logits(oracle, prompt, mask, tokens)
    with integ.patch_gdn_decode(model):
        logits, cache = decode_logits(model, prompt, mask, tokens)
    for step in range(len(tokens) + 1):
        for row in range(4):
            assert_within_2x_stock(
                logits[step, row],
                stock_logits[step, row],
                oracle_logits[step, row],
                dtype,
                f"step {step}, row {row}",
            )
    for got, stock, ref in zip(
        gdn_states(model, cache), gdn_states(model, stock_cache), gdn_states(oracle, oracle_cache)
    ):
        assert_within_2x_stock(got, stock, ref, dtype, "state")
    # generate with the same padded batch: op and reference agree token for token.
    seqs = []
    for kernel in (None, custom_ops.fused_gdn_decode_reference):
        with integ.patch_gdn_decode(model, kernel=kernel):
            seqs.append(
                model.generate(prompt, attention_mask=mask, max_new_tokens=12, do_sample=False)
            )
    assert torch.equal(seqs[0], seqs[1])


# Beam search reorders the cache: the next decode step adopts the reordered state.
@needs_tested
def test_cache_reorder_then_decode():
    dtype = torch.bfloat16
    model = make_model("qwen3_5", dtype, seed=6)
    oracle = copy.deepcopy(model).float()
    g = torch.Generator().manual_seed(7)
    prompt, mask = torch.randint(1, VOCAB, (3, 6), generator=g), torch.ones(3, 6, dtype=torch.long)
    tokens = torch.randint(1, VOCAB, (6, 3), generator=g)
    perm = torch.tensor([2, 0, 0])
    kw = {"reorder_at": 3, "perm": perm}
    stock_logits, _ = decode_logits(model, prompt, mask, tokens, **kw)
    oracle_logits, _ = decode_logits(oracle, prompt, mask, tokens, **kw)
    with integ.patch_gdn_decode(model):
        logits, _ = decode_logits(model, prompt, mask, tokens, **kw)
        beams = model.generate(prompt, num_beams=2, max_new_tokens=6, do_sample=False)
    with integ.patch_gdn_decode(model, kernel=custom_ops.fused_gdn_decode_reference):
        beams_ref = model.generate(prompt, num_beams=2, max_new_tokens=6, do_sample=False)
    for step in range(len(tokens) + 1):
        assert_within_2x_stock(
            logits[step], stock_logits[step], oracle_logits[step], dtype, f"step {step}"
        )
    assert torch.equal(beams, beams_ref)


@needs_tested
def test_past_recording_and_reset_go_through_the_pool_view():
    """After decode steps through the op, transformers' own code works on the state through the
    pool's view: with past-state recording on, a step runs transformers' forward (not the op) and
    equals, bit for bit, the unpatched model's step from a copy of that cache; reset zeroes it."""
    model = make_model("qwen3_next", torch.bfloat16, seed=9)
    g = torch.Generator().manual_seed(9)
    prompt, mask = torch.randint(1, VOCAB, (2, 7), generator=g), torch.ones(2, 7, dtype=torch.long)
    tokens = torch.randint(1, VOCAB, (4, 2), generator=g)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return custom_ops.fused_gdn_decode_reference(*args, **kwargs)

    step = {"input_ids": tokens[3][:, None], "position_ids": torch.full((2, 1), 10)}
    with torch.no_grad(), integ.patch_gdn_decode(model, kernel=counted):
        _, cache = decode_logits(model, prompt, mask, tokens[:3])
        assert len(calls) == 3 * len(gdn_layer_indices(model))
        assert all(integ.state_pool(cache, i) is not None for i in gdn_layer_indices(model))
        cache.activate_past_recording()
        twin = copy.deepcopy(cache)
        got = model(**step, **{cache_kw(): cache}).logits
        assert len(calls) == 3 * len(gdn_layer_indices(model))
    with torch.no_grad():
        want = model(**step, **{cache_kw(): twin}).logits
    assert torch.equal(got, want)
    for i in gdn_layer_indices(model):
        assert torch.equal(cache.layers[i].recurrent_states[0], twin.layers[i].recurrent_states[0])
    pools = [integ.state_pool(cache, i) for i in gdn_layer_indices(model)]
    cache.reset()
    assert all(not p[1:].any() for p in pools)


# (4) refused at patch time, with the supported dtypes named; the model stays unpatched.
@needs_tested
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_model_refused(family):
    model = make_model(family, torch.float32)
    with pytest.raises(TypeError, match=r"torch\.bfloat16 or torch\.float16"):
        integ.patch_gdn_decode(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert integ.unpatch_gdn_decode(model) == 0


@needs_tested
def test_cast_to_fp32_after_patch_refused_at_the_layer():
    model = make_model("qwen3_next", torch.bfloat16)
    prompt = torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(8))
    with integ.patch_gdn_decode(model):
        model.float()
        with pytest.raises(TypeError, match=r"torch\.bfloat16 or torch\.float16"):
            model.generate(prompt, max_new_tokens=2, do_sample=False)


@needs_tested
def test_shapes_outside_contract_refused():
    model = make_model("qwen3_next", torch.bfloat16, key_dim=32)  # the op needs K >= 64
    with pytest.raises(ValueError, match="K"):
        integ.patch_gdn_decode(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


class Fp8WeightLinear(torch.nn.Module):
    """A stand-in for a weight-quantized projection (transformers' FP8Linear, which needs a GPU
    kernel): the weight stored as float8_e4m3fn with a per-row scale, dequantized per call; the
    activations' dtype in and out."""

    def __init__(self, linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        self.weight = torch.nn.Parameter((w / scale).to(torch.float8_e4m3fn), requires_grad=False)
        self.scale = torch.nn.Parameter(scale, requires_grad=False)

    def forward(self, x):
        return x @ (self.weight.float() * self.scale).to(x.dtype).t()


class PackedWeightLinear(torch.nn.Module):
    """A stand-in for a GPTQ/AWQ-style projection: int8 codes in `qweight` with a per-row scale,
    and no `weight` attribute at all."""

    def __init__(self, linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
        self.register_buffer("qweight", torch.round(w / scale).to(torch.int8))
        self.register_buffer("scales", scale)

    def forward(self, x):
        return x @ (self.qweight.float() * self.scales).to(x.dtype).t()


@needs_tested
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("quantized", [Fp8WeightLinear, PackedWeightLinear],
                         ids=["fp8", "packed"])
def test_weight_quantized_projections(family, quantized):
    """FP8 and GPTQ/AWQ-style checkpoints quantize the GDN layers' big projections (Qwen's own:
    in_proj_qkv(z), in_proj_z, out_proj) and keep dt_bias, A_log, conv1d and in_proj_a/b in bf16:
    the patch takes the activations' dtype from dt_bias, and the op matches the reference on
    such a model."""
    model = make_model(family, torch.bfloat16)
    for i in gdn_layer_indices(model):
        layer = model.model.layers[i].linear_attn
        for name in ("in_proj_qkvz", "in_proj_qkv", "in_proj_z", "out_proj"):
            if hasattr(layer, name):
                setattr(layer, name, quantized(getattr(layer, name)))
    prompt = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    runs = {}
    for name, kernel in [("op", None), ("reference", custom_ops.fused_gdn_decode_reference)]:
        with integ.patch_gdn_decode(model, kernel=kernel):
            runs[name] = model.generate(prompt, max_new_tokens=12, do_sample=False,
                                        return_dict_in_generate=True)
    assert torch.equal(runs["op"].sequences, runs["reference"].sequences)
    for i in gdn_layer_indices(model):
        pool = integ.state_pool(runs["op"].past_key_values, i)
        ref_pool = integ.state_pool(runs["reference"].past_key_values, i)
        assert pool is not None and pool[1:].any()
        torch.testing.assert_close(pool, ref_pool, atol=POOL_ATOL, rtol=0)


@needs_tested
def test_unpatch_restores_stock_and_refuses_double_patch():
    model = make_model("qwen3_next", torch.bfloat16)
    prompt = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(9))
    stock = model.generate(prompt, max_new_tokens=6, do_sample=False)
    handle = integ.patch_gdn_decode(model)
    with pytest.raises(ValueError, match="already patched"):
        integ.patch_gdn_decode(model)
    assert integ.unpatch_gdn_decode(model) == len(gdn_layer_indices(model))
    handle.unpatch()  # no-op now
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), stock)
    with pytest.raises(ValueError, match="no Gated DeltaNet layer"):
        integ.patch_gdn_decode(torch.nn.Linear(2, 2))


@needs_tested
def test_static_cache_refused():
    """A static cache (generate's cache_implementation="static", or a StaticCache passed in) is
    refused at the first layer call, before anything has run; the default cache still works."""
    model = make_model("qwen3_next", torch.bfloat16)
    prompt = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(10))
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return custom_ops.fused_gdn_decode_reference(*args, **kwargs)

    with integ.patch_gdn_decode(model, kernel=counted):
        with pytest.raises(ValueError, match="does not support static caches; got StaticCache"):
            model.generate(prompt, max_new_tokens=4, do_sample=False,
                           cache_implementation="static")
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        with pytest.raises(ValueError, match="does not support static caches; got StaticCache"):
            model(input_ids=prompt, use_cache=True, **{cache_kw(): cache})
        assert calls == []
        assert all(integ.state_pool(cache, i) is None for i in gdn_layer_indices(model))
        model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert len(calls) == 3 * len(gdn_layer_indices(model))


@needs_tested
def test_torch_compile_traces_transformers_own_forward():
    """Where torch.compile traces a patched layer, the layer runs transformers' own forward: no op
    call and no pool inside compiled code; the logits equal stock transformers' bit for bit
    (backend "eager": dynamo's graphs run by eager torch, so the same arithmetic)."""
    model = make_model("qwen3_next", torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(3)
    prompt, mask = torch.randint(1, VOCAB, (2, 6), generator=g), torch.ones(2, 6, dtype=torch.long)
    tokens = torch.randint(1, VOCAB, (3, 2), generator=g)
    stock, _ = decode_logits(model, prompt, mask, tokens)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return custom_ops.fused_gdn_decode_reference(*args, **kwargs)

    torch._dynamo.reset()
    with integ.patch_gdn_decode(model, kernel=counted):
        logits, cache = decode_logits(torch.compile(model, backend="eager"), prompt, mask, tokens)
    torch._dynamo.reset()
    assert calls == []
    assert all(integ.state_pool(cache, i) is None for i in gdn_layer_indices(model))
    assert all(torch.equal(a, b) for a, b in zip(logits, stock))


@pytest.mark.parametrize("version", ["5.22.1", "5.26.0", "5.26.0.dev0", "4.57.1"])
def test_untested_transformers_refused(monkeypatch, version):
    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(integ.transformers, "__version__", version)
    with pytest.raises(RuntimeError, match=version.replace(".", r"\.")):
        integ.patch_gdn_decode(model)


@pytest.mark.parametrize(
    "version", ["5.22.2rc1", "5.22.2.dev0", "5.22.2a1", "5.24.0rc1", "5.25.0rc1", "5.26.0rc1"]
)
def test_pre_releases_refused(monkeypatch, version):
    # The range >=5.22.2,<5.26 holds no pre-release: 5.22.2rc1 is before the tested 5.22.2.
    monkeypatch.setattr(integ.transformers, "__version__", version)
    with pytest.raises(RuntimeError, match=version.replace(".", r"\.")):
        integ._version_check()


@pytest.mark.parametrize(
    "version", ["5.22.2", "5.22.2.post1", "5.23.0", "5.24.0+local", "5.25.0"]
)
def test_tested_releases_accepted(monkeypatch, version):
    monkeypatch.setattr(integ.transformers, "__version__", version)
    integ._version_check()


def perturb_gdn(model):
    """Change what the op reads in every GDN layer (gates, projections, output) in place."""
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "A_log"):
                m.A_log.mul_(-0.5)
                m.dt_bias.add_(0.75)
                m.out_proj.weight.mul_(2.0)
                for p in m.conv1d.parameters():
                    p.mul_(0.5)


def pooled(model, cache, each=False):
    """Whether every GDN layer's state in ``cache`` is held in a pool (the op decoded it)."""
    held = [integ.state_pool(cache, i) is not None for i in gdn_layer_indices(model)]
    return held if each else all(held)


def gdn_layers(model):
    return [m for m in model.modules() if hasattr(m, "A_log")]


# A deep copy of a patched model is a patched model of its own: it computes with its own weights
# (prefill and decode) and unpatches on its own.
@needs_tested
def test_deepcopy_of_patched_model_is_independent():
    dtype = torch.bfloat16
    model = make_model("qwen3_next", dtype, seed=10)
    g = torch.Generator().manual_seed(11)
    prompt, mask = torch.randint(1, VOCAB, (2, 7), generator=g), torch.ones(2, 7, dtype=torch.long)
    tokens = torch.randint(1, VOCAB, (4, 2), generator=g)
    integ.patch_gdn_decode(model)
    before, _ = decode_logits(model, prompt, mask, tokens)

    clone = copy.deepcopy(model)
    perturb_gdn(clone)
    # The expected result: the same perturbed weights in a model patched from scratch.
    fresh = make_model("qwen3_next", dtype, seed=10)
    perturb_gdn(fresh)
    integ.patch_gdn_decode(fresh)
    want, want_cache = decode_logits(fresh, prompt, mask, tokens)

    got, cache = decode_logits(clone, prompt, mask, tokens)
    assert torch.equal(got, want)
    for a, b in zip(gdn_states(clone, cache), gdn_states(fresh, want_cache)):
        assert torch.equal(a, b)
    assert not torch.equal(got, before)
    # The original still computes with its own weights, and is still patched.
    assert torch.equal(decode_logits(model, prompt, mask, tokens)[0], before)
    n = len(gdn_layer_indices(model))
    assert integ.state_pool(cache, gdn_layer_indices(model)[0]) is not None
    assert integ.unpatch_gdn_decode(clone) == n
    assert not any("forward" in m.__dict__ for m in clone.modules())
    assert integ.unpatch_gdn_decode(model) == n


# torch.save / torch.load of a patched model: the loaded model is patched, decodes like the
# original, and unpatches.
@needs_tested
def test_torch_save_load_patched_model(tmp_path):
    dtype = torch.bfloat16
    model = make_model("qwen3_5", dtype, seed=12)
    prompt = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(13))
    handle = integ.patch_gdn_decode(model)
    want = model.generate(prompt, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    got = loaded.generate(prompt, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    # The decode steps ran through the op in the loaded model (its states are in a pool).
    assert pooled(model, got.past_key_values)
    got_states = gdn_states(loaded, got.past_key_values)
    for a, b in zip(got_states, gdn_states(model, want.past_key_values)):
        assert torch.equal(a, b)
    assert integ.unpatch_gdn_decode(loaded) == len(gdn_layer_indices(loaded))
    assert not any("forward" in m.__dict__ for m in loaded.modules())
    handle.unpatch()


def offload(model):
    # In requirements-test.txt (CI runs this); skipped only where it is not installed.
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    # Offloaded: the GDN parameters live on the meta device between calls.
    assert all(m.A_log.device.type == "meta" for m in gdn_layers(model))
    return model


# accelerate's offload hooks keep working in either order: patch then offload, offload then patch;
# unpatch leaves the offloaded model decoding with stock transformers.
@needs_tested
@pytest.mark.parametrize("order", ["offload_then_patch", "patch_then_offload"])
def test_accelerate_cpu_offload(order):
    dtype = torch.bfloat16
    model = make_model("qwen3_next", dtype, seed=14)
    prompt = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(15))
    gen = {"max_new_tokens": 8, "do_sample": False, "return_dict_in_generate": True}
    stock = model.generate(prompt, **gen).sequences
    with integ.patch_gdn_decode(model):
        want = model.generate(prompt, **gen).sequences

    if order == "offload_then_patch":
        offload(model)
        handle = integ.patch_gdn_decode(model)
    else:
        handle = integ.patch_gdn_decode(model)
        offload(model)
    got = model.generate(prompt, **gen)
    assert torch.equal(got.sequences, want)
    assert pooled(model, got.past_key_values)
    # accelerate's wrapper is still in place, calling the patched forward.
    for m in gdn_layers(model):
        assert "_hf_hook" in m.__dict__
        assert isinstance(m.__dict__["_old_forward"], integ._GdnForward)
    handle.unpatch()
    for m in gdn_layers(model):
        assert "_hf_hook" in m.__dict__ and not isinstance(
            m.__dict__["_old_forward"], integ._GdnForward
        )
    after = model.generate(prompt, **gen)
    assert torch.equal(after.sequences, stock)
    assert not any(pooled(model, after.past_key_values, each=True))
