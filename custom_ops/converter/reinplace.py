"""FX pass that lets compiled graphs update the state pool in place (O(B) traffic, not O(pool)).

Functionalization turns every call into ``auto_functionalized_v2`` plus a ``copy_`` of the new
state back into the graph input. torchair's GE lowering gives the op a ``TensorMove`` copy of the
whole pool and writes the whole pool back; its pass ``optimize_reference_op_redundant_copy``
removes that copy only for the ops on its hard-coded list, and only when the ref op is the copy's
sole reader, which an op that must read the pool before its write-back never is. In
reduce-overhead mode torchair re-inplaces the call but keeps ``copy_(state, state)``.

This pass undoes the functionalization of ``custom::npu_fused_gdn_decode`` where that is safe:
when the mutated base is a contiguous graph input read by nothing but this call and its
``copy_`` epilogue, the call is turned back into the in-place op on the input, and the epilogue
is dropped. The converter then writes the updated rows straight into the input
(``ScatterUpdate`` on the ``Data``), and the eager binding captured in an ACL graph updates it in
place. Calls on a view of a larger input, on a non-contiguous input, or whose input has other
readers, are left functional (correct, with the pool copy). A non-contiguous input (a
slot-strided pool) reaches GE as a contiguous copy that torchair writes back only for inputs an
``Assign`` writes, so without the epilogue the update would land in the copy and be lost.

Use it as torchair's post-grad pre-pass::

    config = torchair.CompilerConfig()
    config.post_grad_custom_pre_pass = custom_ops.converter.reinplace_pass
"""

import operator

import torch

_MUTATED = "state_ref"
_TENSOR_ARGS = ("mixed_qkv", "a", "b", "a_log", "dt_bias")


def _reinplace_one(graph, node, op):
    kw = node.kwargs
    bases = kw.get("_all_bases")
    if not bases or len(bases) != 1 or bases[0].op != "placeholder":
        return False
    # Only a call on the whole input: a view carries _state_ref_{size,stride,...} entries.
    view_keys = [k for k in kw if k.startswith(f"_{_MUTATED}_") and k != f"_{_MUTATED}_base_index"]
    if kw.get(f"_{_MUTATED}_base_index") != 0 or view_keys:
        return False
    # torchair hands GE a contiguous copy of a non-contiguous input and copies it back only
    # where the graph Assigns to it, which the epilogue dropped here would have done.
    val = bases[0].meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.is_contiguous():
        return False
    items = {}
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] in items:
            return False
        items[user.args[1]] = user
    new_state = items.get(1)
    if new_state is None or set(items) - {0, 1}:
        return False
    (epilogue,) = new_state.users if len(new_state.users) == 1 else (None,)
    base = bases[0]
    if (epilogue is None or epilogue.target is not torch.ops.aten.copy_.default
            or epilogue.args[0] is not base or epilogue.args[1] is not new_state
            or epilogue.users or set(base.users) != {node, epilogue}):
        return False
    args = tuple(kw[n] for n in _TENSOR_ARGS) + (base, kw["ssm_state_indices"], kw["scale"])
    with graph.inserting_before(node):
        call = graph.call_function(op, args, {"softplus_threshold": kw["softplus_threshold"]})
    out = items.get(0)
    if out is not None:
        call.meta = dict(out.meta)
        out.replace_all_uses_with(call)
        graph.erase_node(out)
    graph.erase_node(epilogue)
    graph.erase_node(new_state)
    graph.erase_node(node)
    return True


def reinplace_pass(gm, example_inputs=None, config=None):
    """Rewrites, in ``gm``, each safe functionalized call of ``custom::npu_fused_gdn_decode`` into
    the in-place call on its graph input (module docstring). Returns ``gm``. The signature is the
    one torchair calls its ``post_grad_custom_pre_pass`` with."""
    hop = getattr(torch.ops.higher_order, "auto_functionalized_v2", None)
    op = torch.ops.custom.npu_fused_gdn_decode.default
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is hop and node.args[0] is op:
            changed |= _reinplace_one(gm.graph, node, op)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
