"""Hugging Face ``transformers``: decode the Gated DeltaNet layers through the fused op.

``patch_gdn_decode(model)`` makes every Gated DeltaNet (GDN) layer of a loaded Qwen3-Next, Qwen3.5
or Qwen3.5-MoE model run its decode steps (one new token, recurrent state present) through
``torch.ops.custom.npu_fused_gdn_decode`` on whatever device the model is on. Prefill, multi-token
steps and anything with autograd stay transformers' own code.

The state. transformers keeps each layer's recurrent state as ``[B, Hv, K, V]`` in
``cache.layers[i].recurrent_states[0]``. At the end of prefill it is copied once into a slot pool in
the op's layout, ``[B + 1, Hv, V, K]`` (slot 0 the null slot, row ``i`` in slot ``i + 1``), and the
cache entry is replaced by the transposed view ``pool[1:].transpose(-1, -2)``: the same memory,
still ``[B, Hv, K, V]`` to transformers. So the op updates the pool in place with no per-step
conversion, and transformers' own code (chunked prefill, ``reset``, past-state recording, continuing
after ``unpatch``) keeps reading and writing the right numbers through the view. Code that replaces
the cache tensor (``reorder_cache`` in beam search, ``offload``) leaves a plain tensor behind; the
next decode step adopts it into a new pool (one copy, as transformers' own reorder makes one).

The patch lives on each layer: its ``forward`` becomes a ``_GdnForward`` holding that layer, so
``copy.deepcopy`` gives a copy patched with its own weights and ``torch.save`` pickles a patched
model. Under an accelerate hook (``cpu_offload``, ``dispatch_model``) the patch replaces the
``_old_forward`` the hook's wrapper calls, so the hook still loads the layer's weights; unpatching
puts back what was there.

Static caches (fixed-address state tensors, for compiled and CUDA graphs) are refused at the
layer's first call; where torch.compile traces a patched layer it runs transformers' own forward.

Only the transformers versions in ``TESTED_TRANSFORMERS`` are accepted: the decode step rewrites
the layer's forward for one token, so a release that changes that forward must be tested first.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Callable

import torch
import transformers
from packaging.specifiers import SpecifierSet

__all__ = [
    "SUPPORTED_DTYPES",
    "TESTED_TRANSFORMERS",
    "GdnDecodePatch",
    "patch_gdn_decode",
    "state_pool",
    "unpatch_gdn_decode",
]

# [lowest, first untested) release of transformers; the tests were run on 5.22.2, 5.23.0, 5.24.0
# and 5.25.0.
# Widen only after running tests/test_integration_transformers.py on the new release.
TESTED_TRANSFORMERS = ("5.22.2", "5.26")

# The op's contract takes 16-bit activations (its state may be fp32).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)

# The GDN layer classes by module; each module also provides the helpers its forward calls.
_LAYER_CLASSES = {
    "transformers.models.qwen3_next.modeling_qwen3_next": "Qwen3NextGatedDeltaNet",
    "transformers.models.qwen3_5.modeling_qwen3_5": "Qwen3_5GatedDeltaNet",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": "Qwen3_5MoeGatedDeltaNet",
}

_POOLS = weakref.WeakKeyDictionary()  # transformers cache layer -> its _Pool


class _Pool:
    """A cache layer's state in the op's layout, and the view transformers sees."""

    __slots__ = ("indices", "pool", "view")

    def __init__(self, pool, view, indices):
        self.pool = pool  # [B + 1, Hv, V, K], slot 0 the null slot
        self.view = view  # pool[1:].transpose(-1, -2): [B, Hv, K, V]
        self.indices = indices  # int32 1..B: batch row i uses slot i + 1


def _version_check():
    lo, hi = TESTED_TRANSFORMERS
    # PEP 440's reading of the range: pre-releases (rc, dev) of its versions are outside it, as
    # untested as any other (5.22.2rc1 < 5.22.2; 5.25.0.dev0, a source install, < 5.25 but
    # excluded). Post-releases and local versions of a version in the range are in it.
    if not SpecifierSet(f">={lo},<{hi}").contains(
        transformers.__version__, prereleases=False
    ):
        raise RuntimeError(
            f"custom_ops.integrations.transformers: transformers {transformers.__version__} is "
            f"outside the tested range >={lo},<{hi} (pre-releases excluded); its Gated DeltaNet "
            f"decode path may differ from the one this integration reproduces. Install a tested "
            f"release, e.g. pip install 'transformers>={lo},<{hi}'."
        )


def _gdn_classes():
    classes = []
    for module_name, class_name in _LAYER_CLASSES.items():
        try:
            module = __import__(module_name, fromlist=[class_name])
        except ImportError:
            continue
        cls = getattr(module, class_name, None)
        if cls is not None:
            classes.append(cls)
    return tuple(classes)


def _adopt_state(layer_cache) -> _Pool:
    """The layer's pool; converts transformers' state into a new one unless it is already ours."""
    state = layer_cache.recurrent_states[0]
    entry = _POOLS.get(layer_cache)
    if entry is not None and entry.view is state:
        return entry
    B, Hv, K, V = state.shape
    # A view made under no_grad may not be written in place later with grad on, as transformers'
    # own code does in a differentiable forward; make it as if grad were on.
    with torch.enable_grad():
        pool = torch.empty(B + 1, Hv, V, K, dtype=state.dtype, device=state.device)
        view = pool[1:].transpose(-1, -2)
    with torch.no_grad():
        pool[0].zero_()
        view.copy_(state)
    layer_cache.recurrent_states[0] = view
    indices = torch.arange(1, B + 1, dtype=torch.int32, device=state.device)
    entry = _Pool(pool, view, indices)
    _POOLS[layer_cache] = entry
    return entry


def state_pool(cache, layer_idx: int) -> torch.Tensor | None:
    """The slot pool ``[B + 1, Hv, V, K]`` holding layer ``layer_idx``'s recurrent state in
    ``cache`` (batch row ``i`` in slot ``i + 1``, slot 0 the null slot), or None when that state is
    not (or no longer) held in a pool."""
    layer_cache = cache.layers[layer_idx]
    entry = _POOLS.get(layer_cache)
    states = getattr(layer_cache, "recurrent_states", None)
    if entry is None or not states or entry.view is not states[0]:
        return None
    return entry.pool


def _is_decode_step(layer, hidden_states, cache) -> bool:
    # The same conditions under which transformers takes its single-token recurrent path.
    if cache is None or hidden_states.shape[1] != 1:
        return False
    idx = layer.layer_idx
    if cache.get_conv_state(idx, state_idx=0) is None:
        return False
    if cache.get_recurrent_state(idx, state_idx=0) is None or cache.is_recording_past(idx):
        return False
    # The op has no backward: leave differentiable calls to transformers.
    return not torch.is_grad_enabled() or not (
        hidden_states.requires_grad or any(p.requires_grad for p in layer.parameters())
    )


def _dtype_error(where: str, dtype) -> TypeError:
    return TypeError(
        f"{where}: activations are {dtype}; torch.ops.custom.npu_fused_gdn_decode takes "
        f"torch.bfloat16 or torch.float16 activations. Load the model with "
        f"dtype=torch.bfloat16 (or torch.float16), or call model.to(torch.bfloat16) first."
    )


def _decode(layer, patch, hidden_states, cache, attention_mask):
    """One token through the layer, with the op in place of transformers' recurrent step."""
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        raise _dtype_error(f"Gated DeltaNet layer {layer.layer_idx}", hidden_states.dtype)
    helpers = sys.modules[type(layer).__module__]
    hidden_states = helpers.apply_mask_to_padding_states(hidden_states, attention_mask)
    B = hidden_states.shape[0]
    if patch.qkvz:  # Qwen3-Next: q, k, v, z grouped per key head in one projection
        query, key, value, z, b, a = layer.fix_query_key_value_ordering(
            layer.in_proj_qkvz(hidden_states), layer.in_proj_ba(hidden_states)
        )
        mixed_qkv = torch.cat([x.reshape(B, 1, -1) for x in (query, key, value)], dim=-1)
    else:  # Qwen3.5: one projection per tensor
        mixed_qkv = layer.in_proj_qkv(hidden_states)
        z = layer.in_proj_z(hidden_states)
        b = layer.in_proj_b(hidden_states)
        a = layer.in_proj_a(hidden_states)
    # transformers' conv step (updates its conv state in place); its output is the op's mixed_qkv:
    # q of H heads, k of H heads, v of Hv heads, value head j reading key head j // (Hv / H).
    conv_forward = getattr(helpers, "causal_conv1d_forward", None)
    if conv_forward is not None:
        # transformers >= 5.25: the layer's conv step, which also counts the token in the cache
        # layer's length (get_seq_length); for one token it is causal_conv1d_update, as below.
        mixed_qkv = conv_forward(
            layer.conv1d,
            mixed_qkv.transpose(1, 2),
            cache,
            layer.layer_idx,
            activation=layer.activation,
        )
    else:
        mixed_qkv = helpers.causal_conv1d_update(
            mixed_qkv.transpose(1, 2),
            cache.get_conv_state(layer.layer_idx, state_idx=0),
            layer.conv1d.weight.squeeze(1),
            layer.conv1d.bias,
            layer.activation,
        )
    entry = _adopt_state(cache.layers[layer.layer_idx])
    kernel = torch.ops.custom.npu_fused_gdn_decode if patch.kernel is None else patch.kernel
    out = kernel(
        mixed_qkv[:, :, 0],
        a.reshape(B, layer.num_v_heads),
        b.reshape(B, layer.num_v_heads),
        layer.A_log.float(),
        layer.dt_bias,
        entry.pool,
        entry.indices,
        layer.head_k_dim**-0.5,
    )  # [B, 1, Hv, V]
    out = layer.norm(out.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(out.reshape(B, 1, -1))


_decode_with_hooks = None


def _hooked_decode():
    # transformers' helper: fires the conv1d's accelerate hook (offloading), whose weight the
    # conv step reads without calling the module.
    global _decode_with_hooks
    if _decode_with_hooks is None:
        from transformers.integrations.accelerate import force_accelerate_hooks

        _decode_with_hooks = force_accelerate_hooks("conv1d")(_decode)
    return _decode_with_hooks


class _GdnForward:
    """A patched layer's forward, stored on the layer itself (as ``forward``, or as accelerate's
    ``_old_forward`` under an accelerate hook).

    A module-level class holding its own layer: ``copy.deepcopy`` of the model gives the copy's
    layer its own ``_GdnForward`` bound to the copy, and pickling (``torch.save``) works. ``prev``
    is the forward it replaced in that slot (None: the class's own), put back by unpatch."""

    __slots__ = ("cache_kw", "kernel", "layer", "prev", "qkvz")

    def __init__(self, layer, kernel, prev, qkvz):
        self.layer = layer
        self.kernel = kernel  # None: torch.ops.custom.npu_fused_gdn_decode
        self.prev = prev
        self.qkvz = qkvz  # Qwen3-Next's grouped q/k/v/z projection
        params = inspect.signature(type(layer).forward).parameters
        self.cache_kw = "cache" if "cache" in params else "cache_params"

    def __call__(self, hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
        # Decoder layers pass the cache as `cache=` (transformers >= 5.24) or `cache_params=`.
        layer = self.layer
        if cache is None:
            cache = cache_params
        _refuse_static_cache(layer, cache)
        inner = self.prev if self.prev is not None else type(layer).forward.__get__(layer)
        if torch.compiler.is_compiling():
            # Traced by torch.compile: transformers' own forward. The pool (a Python-side
            # replacement of the cache's tensor) and the op stay out of compiled graphs.
            return inner(
                hidden_states, attention_mask=attention_mask, **{self.cache_kw: cache}, **kwargs
            )
        if _is_decode_step(layer, hidden_states, cache):
            return _hooked_decode()(layer, self, hidden_states, cache, attention_mask)
        out = inner(
            hidden_states, attention_mask=attention_mask, **{self.cache_kw: cache}, **kwargs
        )
        # End of prefill (or any cached step transformers ran): hold the state in the op's layout.
        if (
            cache is not None
            and cache.get_recurrent_state(layer.layer_idx, state_idx=0) is not None
        ):
            _adopt_state(cache.layers[layer.layer_idx])
        return out


def _refuse_static_cache(layer, cache) -> None:
    """The pool replaces the cache's recurrent-state tensor, whose fixed address a static cache
    exists to keep (compiled graphs, CUDA graphs): refused at every call, prefill included, so
    nothing has run when it raises, in eager code and in code torch.compile falls back from."""
    # transformers' own criterion for compiling generate()'s forward unasked (on CUDA): a
    # compileable cache that is not a DynamicCache.
    if (
        cache is not None
        and type(cache) is not transformers.DynamicCache
        and getattr(cache, "is_compileable", False)
    ):
        raise ValueError(
            f"Gated DeltaNet layer {layer.layer_idx} is patched by patch_gdn_decode, which does "
            f"not support static caches; got {type(cache).__name__} (cache_implementation="
            f"'static' or a compileable cache). Use a DynamicCache (generate()'s default), or "
            f"unpatch the model first."
        )


def _hooked(layer) -> bool:
    # accelerate's add_hook_to_module: the hook's wrapper in `forward` calls `_old_forward`.
    return "_hf_hook" in layer.__dict__ and "_old_forward" in layer.__dict__


def _patch_of(layer):
    """The layer's _GdnForward and the attribute holding it, or (None, None)."""
    for slot in ("_old_forward", "forward"):
        f = layer.__dict__.get(slot)
        if isinstance(f, _GdnForward):
            return f, slot
    return None, None


def _check_layer(name, layer):
    """Refuse at patch time what the op would refuse inside the layer."""
    qkvz = hasattr(layer, "in_proj_qkvz")
    proj = layer.in_proj_qkvz if qkvz else layer.in_proj_qkv
    weight = getattr(proj, "weight", None)
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else None
    if dtype is None or not dtype.is_floating_point or dtype.itemsize < 2:
        # A quantized projection (fp8, int8, 4-bit packed, or GPTQ/AWQ-style with a packed
        # `qweight` and no `weight`) returns the model's compute dtype, which dt_bias, never
        # quantized, holds.
        dtype = layer.dt_bias.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise _dtype_error(f"patch_gdn_decode: Gated DeltaNet layer {name!r}", dtype)
    if layer.dt_bias.dtype != dtype:
        raise TypeError(
            f"patch_gdn_decode: layer {name!r}: dt_bias is {layer.dt_bias.dtype}, the activations "
            f"{dtype}; the op takes dt_bias in the activation dtype."
        )
    # Shapes, through the op's own check (its Meta kernel reads no data). transformers keeps the
    # recurrent state in float32.
    Hv, K, V = layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    meta = {"device": "meta"}
    try:
        torch.ops.custom.npu_fused_gdn_decode(
            torch.empty(1, layer.conv_dim, dtype=dtype, **meta),
            torch.empty(1, Hv, dtype=dtype, **meta),
            torch.empty(1, Hv, dtype=dtype, **meta),
            torch.empty(Hv, dtype=torch.float32, **meta),
            torch.empty(Hv, dtype=dtype, **meta),
            torch.empty(2, Hv, V, K, dtype=torch.float32, **meta),
            torch.empty(1, dtype=torch.int32, **meta),
            K**-0.5,
        )
    except (TypeError, ValueError) as e:
        raise type(e)(
            f"patch_gdn_decode: layer {name!r} (H={layer.num_k_heads}, Hv={Hv}, K={K}, V={V}) is "
            f"outside the op's contract: {e}"
        ) from e
    return qkvz


class GdnDecodePatch:
    """The layers one ``patch_gdn_decode`` call patched; ``unpatch()`` (or leaving the ``with``
    block) restores their own forward."""

    def __init__(self, layers: list[tuple[str, torch.nn.Module]]):
        self.layers = layers

    def unpatch(self) -> None:
        for _, layer in self.layers:
            _restore(layer)
        self.layers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unpatch()
        return False

    def __repr__(self):
        return f"GdnDecodePatch({len(self.layers)} Gated DeltaNet layers)"


def _restore(layer) -> bool:
    f, slot = _patch_of(layer)
    if f is None:
        return False
    if f.prev is not None:
        layer.__dict__[slot] = f.prev
    elif slot == "forward":
        del layer.__dict__["forward"]
    else:  # accelerate's wrapper calls _old_forward: give it the class's forward again
        layer.__dict__[slot] = type(layer).forward.__get__(layer)
    return True


def patch_gdn_decode(model: torch.nn.Module, *, kernel: Callable | None = None) -> GdnDecodePatch:
    """Run the decode steps of ``model``'s Gated DeltaNet layers through the fused op.

    Args:
        model: a loaded transformers model (or any module) containing Qwen3-Next, Qwen3.5 or
            Qwen3.5-MoE Gated DeltaNet layers, in bfloat16 or float16.
        kernel: a callable with the op's signature to call instead of
            ``torch.ops.custom.npu_fused_gdn_decode``, e.g.
            ``custom_ops.fused_gdn_decode_reference`` to check the op inside a model.

    Returns:
        A ``GdnDecodePatch``: call ``unpatch()`` or use it as a context manager to undo.

    Raises:
        RuntimeError: the installed transformers is outside ``TESTED_TRANSFORMERS``.
        TypeError: the layers compute in a dtype other than bfloat16/float16.
        ValueError: no Gated DeltaNet layer in ``model``, a layer already patched, or layer shapes
            the op does not accept (e.g. a key head dim below 64).

    Example:
        >>> from custom_ops.integrations.transformers import patch_gdn_decode
        >>> model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16)
        >>> with patch_gdn_decode(model):
        ...     out = model.generate(**inputs, max_new_tokens=64)
    """
    _version_check()
    classes = _gdn_classes()
    found = [(n, m) for n, m in model.named_modules() if classes and isinstance(m, classes)]
    if not found:
        raise ValueError(
            f"patch_gdn_decode: model ({type(model).__name__}) has no Gated DeltaNet layer; "
            f"expected one of {', '.join(_LAYER_CLASSES.values())}."
        )
    for name, layer in found:
        if _patch_of(layer)[0] is not None:
            raise ValueError(f"patch_gdn_decode: layer {name!r} is already patched; unpatch first.")
    checked = [(name, layer, _check_layer(name, layer)) for name, layer in found]

    for name, layer, qkvz in checked:
        # Under an accelerate hook, replace the forward its wrapper calls, so that the hook (which
        # loads offloaded weights) still runs around the patched forward.
        slot = "_old_forward" if _hooked(layer) else "forward"
        prev = layer.__dict__.get(slot)
        if getattr(prev, "__self__", None) is layer and (
            getattr(prev, "__func__", None) is type(layer).forward
        ):
            prev = None  # the class's own forward, bound: kept as None so the patch pickles
        layer.__dict__[slot] = _GdnForward(layer, kernel, prev, qkvz)
    return GdnDecodePatch([(name, layer) for name, layer, _ in checked])


def unpatch_gdn_decode(model: torch.nn.Module) -> int:
    """Restore the own forward of every patched Gated DeltaNet layer in ``model``; returns how many.
    States already in a pool stay there: transformers reads them through the same view."""
    return sum(_restore(m) for m in model.modules())
