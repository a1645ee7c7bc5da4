"""torchair fx2ge converter of ``custom::npu_fused_gdn_decode`` (GE op ``FusedGdnDecode``).

Torch schema::

    custom::npu_fused_gdn_decode(Tensor mixed_qkv, Tensor a, Tensor b, Tensor a_log,
        Tensor dt_bias, Tensor(a!) state_ref, Tensor ssm_state_indices, float scale, *,
        float softplus_threshold=20.0) -> Tensor

GE IR of the vendor op (ops-transformer ``op_host/fused_gdn_decode_def.cpp``)::

    FusedGdnDecode(mixed_qkv, a, b, a_log, dt_bias, state, ssm_state_indices)
        attrs: scale: Float, softplus_threshold: Float
        -> (out, state_out)

How the state update survives in a compiled graph
-------------------------------------------------
Functionalization turns the call into ``auto_functionalized_v2``. torchair's GE handler of it
(``_ge_concrete_graph/auto_functionalized_v2.py``) passes ``state_ref`` as a ``TensorMove`` copy of
the graph input, calls this converter by keyword, then looks at the *last* GE op the converter
emitted: the output named like the input that the copy feeds is taken as the updated state and
written back to the graph input (Assign, turned into an output aliased to the input). Without such
a same-name pair torchair warns and falls back to ``Identity(copy)``: the update is lost.

``FusedGdnDecode`` cannot be that op. Its IR pairs ``state`` with ``state_out``, and renaming the
node's output to ``state`` is no way out: GE maps node outputs to IR outputs by name (IR-definition
recovery, ``GetIrOutputDescRange``), so an output not called ``state_out`` no longer matches the
prototype. With two names GE also gives ``state_out`` its own buffer, and the kernel writes only the
rows of valid slots into it; every other row is uninitialised. So neither returning ``state_out``
nor ``Assign(state, state_out)`` is correct.

The converter therefore copies the updated rows back itself and ends with ``ScatterUpdate``, whose
input and output are both named ``var`` (the pair torchair looks for)::

    slots    = max(ssm_state_indices, 0)           # invalid rows address the null slot 0
    null_row = GatherV2(state, [0])                # what those rows write there: its own value
    rows     = SelectV2(ssm_state_indices > 0,     # as (B, 1, 1, 1)
                        GatherV2(state_out, slots), null_row)
    state    = ScatterUpdate(state, slots, rows)

``ScatterUpdate`` depends on ``state_out`` through the gather, so it runs after the kernel has read
``state``; it is marked ``dont_prune_me`` because with ``reinplace_pass`` (reinplace.py) ``state``
is the graph input itself and nothing reads the update. It is used rather than
``ScatterNdUpdate``/``Scatter`` because those two are on the hard-coded list of torchair's
``optimize_reference_op_redundant_copy`` pass, which would rewire only the scatter's input to the
graph input and delete the ``TensorMove`` that the kernel and the gathers also read. Without
``reinplace_pass`` that ``TensorMove`` copies the whole pool on every call (docs/graph_mode.md).
"""

import numbers

import torch

TARGET_NAME = "custom::npu_fused_gdn_decode.default"
OP_TYPE = "FusedGdnDecode"

# Schema argument -> GE input name, in the IR's input order.
INPUTS = {
    "mixed_qkv": "mixed_qkv",
    "a": "a",
    "b": "b",
    "a_log": "a_log",
    "dt_bias": "dt_bias",
    "state_ref": "state",
    "ssm_state_indices": "ssm_state_indices",
}
# Schema argument -> GE attr name; both are GE Float attrs.
ATTRS = {"scale": "scale", "softplus_threshold": "softplus_threshold"}
# GE output names, in IR order.
OUTPUTS = ("out", "state_out")
SOFTPLUS_THRESHOLD_DEFAULT = 20.0


def _float_attr(name, value):
    # Attrs are baked into the GE graph; a value only known at run time cannot be one.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"npu_fused_gdn_decode converter: {name} must be a Python float when the graph is "
            f"built (it becomes the GE Float attr '{ATTRS[name]}'), but got {type(value).__name__}"
        )
    return float(value)


def convert_npu_fused_gdn_decode(
    mixed_qkv,
    a,
    b,
    a_log,
    dt_bias,
    state_ref,
    ssm_state_indices,
    scale,
    *,
    softplus_threshold=SOFTPLUS_THRESHOLD_DEFAULT,
    meta_outputs=None,
):
    """Emits FusedGdnDecode plus the row write-back (module docstring); returns ``out``.
    Parameter names are the schema's: torchair's auto_functionalized_v2 path calls by keyword
    without ``meta_outputs``; the in-place call left by ``reinplace_pass`` comes positionally,
    with them."""
    from torchair._ge_concrete_graph import ge_apis as ge
    from torchair.ge import attr, custom_op

    tensors = {
        "mixed_qkv": mixed_qkv,
        "a": a,
        "b": b,
        "a_log": a_log,
        "dt_bias": dt_bias,
        "state_ref": state_ref,
        "ssm_state_indices": ssm_state_indices,
    }
    floats = {"scale": scale, "softplus_threshold": softplus_threshold}
    out, state_out = custom_op(
        OP_TYPE,
        inputs={INPUTS[arg]: t for arg, t in tensors.items()},
        attrs={ATTRS[arg]: attr.Float(_float_attr(arg, v)) for arg, v in floats.items()},
        outputs=list(OUTPUTS),
    )
    _scatter_rows_back(ge, state_ref, state_out, ssm_state_indices)
    return out


def _scatter_rows_back(ge, state, state_out, indices):
    """Copies rows of valid slots from state_out into state; must stay the last op emitted."""
    from torchair.ge._ge_graph import dont_prune_me

    zero = ge.Const(0, dtype=ge.DataType.DT_INT32)
    axis = ge.Const(0, dtype=ge.DataType.DT_INT32)
    slots = ge.Maximum(indices, zero)
    # (B,) -> (B, 1, 1, 1): SelectV2 broadcasts like numpy, i.e. from the trailing dimension.
    row_shape = ge.Const([-1, 1, 1, 1], dtype=ge.DataType.DT_INT32)
    valid = ge.Reshape(ge.Greater(indices, zero), row_shape)
    new_rows = ge.GatherV2(state_out, slots, axis)
    # Invalid rows all address the null slot 0; they rewrite it with its own value (one row read).
    null_row = ge.GatherV2(state, ge.Const([0], dtype=ge.DataType.DT_INT32), axis)
    update = ge.ScatterUpdate(state, slots, ge.SelectV2(valid, new_rows, null_row))
    # When `state` is the graph input itself (reinplace_pass), nothing consumes the update.
    dont_prune_me(update)
    return update


def register(torchair):
    """Registers the converter on the OpOverload (torchair wants the ``.default`` overload)."""
    op = torch.ops.custom.npu_fused_gdn_decode.default
    torchair.register_fx_node_ge_converter(op)(convert_npu_fused_gdn_decode)
