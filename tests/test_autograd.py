"""Autograd around the in-place op: it behaves like a native in-place op without a derivative, in
both overloads (the default one and ``.out``, which also updates ``out`` in place).

The version counters of state_ref (and out) move on every call (a graph that saved them before the
call fails in backward instead of using the new values); a leaf that requires grad and an
inference tensor outside inference_mode are refused with PyTorch's own messages before anything is
written; backward through the result or the updated state raises. Under no_grad /
inference_mode (the normal use) nothing is recorded.
"""

import re

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from custom_ops.testing import OP, Case, call, make_inputs, storage_bytes

NOT_DIFFERENTIABLE = "npu_fused_gdn_decode is not differentiable"
LEAF = "a leaf Variable that requires grad is being used in an in-place operation."
VIEW_OF_LEAF = ("a view of a leaf Variable that requires grad is being used in an in-place "
                "operation.")
INFERENCE = "Inplace update to inference tensor outside InferenceMode is not allowed"

OVERLOADS = ["default", "out"]


def inputs(**kw):
    """The op's arguments, plus "out": a buffer for the out overload, filled with a value no
    call writes."""
    x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16, **kw))
    x["out"] = torch.full((3, 1, 4, 16), 5.0, dtype=x["mixed_qkv"].dtype)
    return x


def run(overload, x):
    """One call of `overload`; the out overload writes x["out"] and returns it."""
    if overload == "out":
        result = call(OP.out, x, out=x["out"])
        assert result is x["out"]
        return result
    return call(OP, x)


def args(x):
    return tuple(x[k] for k in ("mixed_qkv", "a", "b", "a_log", "dt_bias", "state_ref",
                                "ssm_state_indices", "scale"))


def _written(overload):
    return ("state_ref", "out") if overload == "out" else ("state_ref",)


# (overload, a tensor it writes)
WRITTEN = [(overload, name) for overload in OVERLOADS for name in _written(overload)]


@pytest.mark.parametrize("overload", OVERLOADS)
def test_call_bumps_the_versions_of_what_it_writes(overload):
    x = inputs()
    before = {k: x[k]._version for k in ("state_ref", "out")}
    run(overload, x)
    assert x["state_ref"]._version > before["state_ref"]
    if overload == "out":
        assert x["out"]._version > before["out"]
    else:
        assert x["out"]._version == before["out"]


@pytest.mark.parametrize("overload,saved", WRITTEN)
def test_graph_that_saved_a_written_tensor_fails_in_backward(overload, saved):
    x = inputs()
    w = torch.ones_like(x[saved], requires_grad=True)
    y = (w * x[saved]).sum()  # saves x[saved] for backward
    run(overload, x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
        y.backward()
    assert type(info.value) is RuntimeError
    assert w.grad is None


def _assert_refused_unchanged(overload, x, message):
    """The call raises RuntimeError (not a subclass) with `message`, before anything is written:
    every storage byte and the version of state_ref and out stay as they were."""
    tensors = {k: x[k] for k in ("state_ref", "out")}
    before = {k: storage_bytes(t.detach()) for k, t in tensors.items()}
    versions = {k: t._version for k, t in tensors.items() if not t.is_inference()}
    with pytest.raises(RuntimeError, match=re.escape(message)) as info:
        run(overload, x)
    assert type(info.value) is RuntimeError, type(info.value)
    for k, t in tensors.items():
        assert torch.equal(storage_bytes(t.detach()), before[k]), f"a refused call changed {k}"
        if k in versions:
            assert t._version == versions[k], f"a refused call bumped {k}'s version"


# (which tensor, how it is made unfit to be written): each refused by both overloads where the
# overload writes that tensor.
def _leaf(x, name):
    x[name].requires_grad_()


def _view_of_leaf(x, name):
    x[name] = x[name].requires_grad_()[:]


def _inference(x, name):
    with torch.inference_mode():
        x[name] = x[name].clone()


def _inference_all(x, name):
    """Every argument of the op an inference tensor, and out too where it is the one named."""
    with torch.inference_mode():
        made_inside = inputs()
    x.update({k: t for k, t in made_inside.items() if k != "out" or name == "out"})


REFUSALS = [
    ("leaf", _leaf, LEAF),
    ("view-of-leaf", _view_of_leaf, VIEW_OF_LEAF),
    ("inference", _inference, INFERENCE),
    ("inference-all-inputs", _inference_all, INFERENCE),
]


@pytest.mark.parametrize("overload,name", WRITTEN)
@pytest.mark.parametrize("refusal", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_unwritable_tensor_is_refused_before_anything_is_written(overload, name, refusal):
    _, spoil, message = refusal
    x = inputs()
    spoil(x, name)
    _assert_refused_unchanged(overload, x, message)


@pytest.mark.parametrize("overload", OVERLOADS)
def test_inference_tensors_inside_inference_mode_are_updated(overload):
    with torch.inference_mode():
        x = inputs()
        before = {k: x[k].clone() for k in _written(overload)}
        run(overload, x)
        for k, t in before.items():
            assert not torch.equal(x[k], t), k


@pytest.mark.parametrize("overload,requires_grad", [
    (overload, name) for overload in OVERLOADS
    for name in ("a_log", "mixed_qkv", *(f"{w}-non-leaf" for w in _written(overload)))])
def test_backward_raises_not_differentiable(overload, requires_grad):
    x = inputs()
    if requires_grad.endswith("-non-leaf"):
        name = requires_grad[:-len("-non-leaf")]
        leaf = x[name].requires_grad_()
        x[name] = leaf * 1.0  # a non-leaf that requires grad may be updated in place
    else:
        x[requires_grad].requires_grad_()
    result = run(overload, x)
    assert result.requires_grad and x["state_ref"].requires_grad
    for what, t in (("result", result), ("state_ref", x["state_ref"])):
        with pytest.raises(RuntimeError, match=NOT_DIFFERENTIABLE) as info:
            t.sum().backward(retain_graph=True)
        assert type(info.value) is RuntimeError, what


@pytest.mark.parametrize("overload,view", WRITTEN)
def test_backward_through_the_buffer_a_written_view_lives_in_raises(overload, view):
    """state_ref a slot range of a larger pool, out a slice of an engine's buffer: each is a view
    updated in place, and backward through the tensor it views raises."""
    x = inputs()
    buf = torch.zeros((2,) + tuple(x[view].shape), dtype=x[view].dtype)
    buf[1] = x[view]
    x[view] = buf[1]
    x["a_log"].requires_grad_()
    run(overload, x)
    with pytest.raises(RuntimeError, match=NOT_DIFFERENTIABLE) as info:
        buf.sum().backward()
    assert type(info.value) is RuntimeError


@pytest.mark.parametrize("overload,dual", [("default", "a_log"), ("out", "a_log"), *WRITTEN])
def test_forward_ad_raises_before_anything_is_written(overload, dual):
    x = inputs()
    before = {k: storage_bytes(x[k]) for k in ("state_ref", "out")}
    with fwAD.dual_level():
        x[dual] = fwAD.make_dual(x[dual], torch.ones_like(x[dual]))
        with pytest.raises(NotImplementedError, match=re.escape(
                f"{NOT_DIFFERENTIABLE}: it is an inference-only decode step with no backward. "
                "Call it under torch.no_grad() or torch.inference_mode(), or pass inputs that "
                "do not require grad (forward-mode AD)")) as info:
            run(overload, x)
        assert type(info.value) is NotImplementedError
    for k, b in before.items():
        assert torch.equal(storage_bytes(x[k]), b), f"a refused call changed {k}"


@pytest.mark.parametrize("overload", OVERLOADS)
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode_record_nothing(overload, mode):
    """Model parameters (a_log, dt_bias as nn.Parameter) require grad; decoding under no_grad or
    inference_mode records no graph and updates the state as usual."""
    x = inputs()
    for k in ("a_log", "dt_bias"):
        x[k] = torch.nn.Parameter(x[k])
    expected = call(OP, dict(x, state_ref=x["state_ref"].clone(),
                             a_log=x["a_log"].detach(), dt_bias=x["dt_bias"].detach()))
    with mode():
        result = run(overload, x)
    for t in (result, x["state_ref"]):
        assert not t.requires_grad and t.grad_fn is None
    assert torch.equal(result, expected)


@pytest.mark.parametrize("overload", OVERLOADS)
def test_opcheck_autograd_registration(overload):
    """opcheck's autograd check only looks when an input requires grad."""
    x = inputs()
    x["a_log"].requires_grad_()
    kwargs = {"out": x["out"]} if overload == "out" else {}
    torch.library.opcheck(getattr(OP, overload), args(x), kwargs,
                          test_utils=("test_schema", "test_autograd_registration"))


def _compiled_call(overload):
    if overload == "out":
        return lambda *a, out: OP.out(*a, out=out)
    return lambda *a, out: OP(*a)


@pytest.mark.parametrize("overload", OVERLOADS)
def test_compile_with_grad_raises_not_differentiable(overload):
    """As for torch.library.custom_op ops without a backward: AOT autograd traces the backward
    while compiling, so with grad enabled and an input that requires grad the error comes from
    the compiled call, not later from backward()."""
    torch._dynamo.reset()
    x = inputs()
    x["a_log"].requires_grad_()
    fn = torch.compile(_compiled_call(overload), backend="aot_eager")
    with pytest.raises(RuntimeError, match=NOT_DIFFERENTIABLE):
        fn(*args(x), out=x["out"])


class DecodeStep(torch.nn.Module):
    """A model layer's view of the op: a_log and dt_bias are parameters (they require grad)."""

    def __init__(self, a_log, dt_bias):
        super().__init__()
        self.a_log = torch.nn.Parameter(a_log.clone())
        self.dt_bias = torch.nn.Parameter(dt_bias.clone())

    def forward(self, mixed_qkv, a, b, state_ref, ssm_state_indices):
        return torch.ops.custom.npu_fused_gdn_decode(
            mixed_qkv, a, b, self.a_log, self.dt_bias, state_ref, ssm_state_indices, 0.125)


@pytest.mark.parametrize("how", ["export", "jit.trace", "jit.script"])
def test_exported_and_scripted_layer_equals_eager(how):
    x = inputs()
    layer = DecodeStep(x["a_log"], x["dt_bias"])

    def step_args(st):
        return x["mixed_qkv"], x["a"], x["b"], st, x["ssm_state_indices"]

    with torch.no_grad():
        if how == "export":
            graph = torch.export.export(layer, step_args(x["state_ref"].clone())).module()
        elif how == "jit.trace":
            graph = torch.jit.trace(layer, step_args(x["state_ref"].clone()))
        else:
            graph = torch.jit.script(layer)
        st_eager, st_graph = x["state_ref"].clone(), x["state_ref"].clone()
        out_eager = layer(*step_args(st_eager))
        out_graph = graph(*step_args(st_graph))
    assert torch.equal(out_graph, out_eager)
    assert torch.equal(st_graph, st_eager) and not torch.equal(st_eager, x["state_ref"])
