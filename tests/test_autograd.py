"""Autograd around the in-place op: it behaves like a native in-place op without a derivative.

state_ref's version counter moves on every call (a graph that saved the state before the call
fails in backward instead of using the new values); a leaf that requires grad and an inference
tensor outside inference_mode are refused with PyTorch's own messages before anything is written;
backward through the result or the updated state raises. Under no_grad / inference_mode (the
normal use) nothing is recorded.
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from custom_ops.testing import OP, Case, call, make_inputs

NOT_DIFFERENTIABLE = "npu_fused_gdn_decode is not differentiable"


def inputs(**kw):
    return make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16, **kw))


def args(x):
    return tuple(x[k] for k in ("mixed_qkv", "a", "b", "a_log", "dt_bias", "state_ref",
                                "ssm_state_indices", "scale"))


def test_call_bumps_the_state_version():
    x = inputs()
    before = x["state_ref"]._version
    call(OP, x)
    assert x["state_ref"]._version > before


def test_graph_that_saved_the_state_fails_in_backward():
    x = inputs()
    st = x["state_ref"]
    w = torch.ones_like(st, requires_grad=True)
    y = (w * st).sum()  # saves st for backward
    call(OP, x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    assert w.grad is None


def _assert_refused_unchanged(x, match):
    before = x["state_ref"].detach().clone()
    version = x["state_ref"]._version if not x["state_ref"].is_inference() else None
    with pytest.raises(RuntimeError, match=match):
        call(OP, x)
    assert torch.equal(x["state_ref"].detach(), before), "a refused call changed state_ref"
    if version is not None:
        assert x["state_ref"]._version == version


def test_leaf_state_that_requires_grad_is_refused():
    x = inputs()
    x["state_ref"].requires_grad_()
    _assert_refused_unchanged(x, "a leaf Variable that requires grad is being used in an in-place")


def test_view_of_leaf_state_that_requires_grad_is_refused():
    x = inputs()
    x["state_ref"] = x["state_ref"].requires_grad_()[:]
    _assert_refused_unchanged(x, "a view of a leaf Variable that requires grad")


@pytest.mark.parametrize("which", ["state", "all-inputs"])
def test_inference_tensor_state_outside_inference_mode_is_refused(which):
    with torch.inference_mode():
        made_inside = inputs()
    x = made_inside if which == "all-inputs" else dict(inputs(), state_ref=made_inside["state_ref"])
    _assert_refused_unchanged(x, "Inplace update to inference tensor outside InferenceMode")


def test_inference_tensor_state_inside_inference_mode_is_updated():
    with torch.inference_mode():
        x = inputs()
        before = x["state_ref"].clone()
        call(OP, x)
        assert not torch.equal(x["state_ref"], before)


@pytest.mark.parametrize("requires_grad", ["a_log", "mixed_qkv", "state_ref-non-leaf"])
def test_backward_raises_not_differentiable(requires_grad):
    x = inputs()
    if requires_grad == "state_ref-non-leaf":
        leaf = x["state_ref"].requires_grad_()
        x["state_ref"] = leaf * 1.0  # a non-leaf that requires grad may be updated in place
    else:
        x[requires_grad].requires_grad_()
    out = call(OP, x)
    assert out.requires_grad and x["state_ref"].requires_grad
    with pytest.raises(RuntimeError, match=NOT_DIFFERENTIABLE):
        out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=NOT_DIFFERENTIABLE):
        x["state_ref"].sum().backward()


def test_backward_through_a_view_of_the_pool_raises():
    x = inputs()
    pool = torch.zeros((2,) + tuple(x["state_ref"].shape))
    pool[1] = x["state_ref"]
    x["state_ref"] = pool[1]
    x["a_log"].requires_grad_()
    call(OP, x)
    with pytest.raises(RuntimeError, match=NOT_DIFFERENTIABLE):
        pool.sum().backward()


def test_forward_ad_raises():
    x = inputs()
    with fwAD.dual_level():
        x["a_log"] = fwAD.make_dual(x["a_log"], torch.ones_like(x["a_log"]))
        with pytest.raises(NotImplementedError, match=NOT_DIFFERENTIABLE):
            call(OP, x)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode_record_nothing(mode):
    """Model parameters (a_log, dt_bias as nn.Parameter) require grad; decoding under no_grad or
    inference_mode records no graph and updates the state as usual."""
    x = inputs()
    for k in ("a_log", "dt_bias"):
        x[k] = torch.nn.Parameter(x[k])
    expected = call(OP, dict(x, state_ref=x["state_ref"].clone(),
                             a_log=x["a_log"].detach(), dt_bias=x["dt_bias"].detach()))
    with mode():
        out = call(OP, x)
    assert not out.requires_grad and out.grad_fn is None
    assert not x["state_ref"].requires_grad and x["state_ref"].grad_fn is None
    assert torch.equal(out, expected)


def test_opcheck_autograd_registration():
    """opcheck's autograd check only looks when an input requires grad."""
    x = inputs()
    x["a_log"].requires_grad_()
    torch.library.opcheck(OP.default, args(x),
                          test_utils=("test_schema", "test_autograd_registration"))


def test_compile_with_grad_raises_not_differentiable():
    """As for torch.library.custom_op ops without a backward: AOT autograd traces the backward
    while compiling, so with grad enabled and an input that requires grad the error comes from
    the compiled call, not later from backward()."""
    torch._dynamo.reset()
    x = inputs()
    x["a_log"].requires_grad_()
    fn = torch.compile(lambda *a: OP(*a), backend="aot_eager")
    with pytest.raises(RuntimeError, match=NOT_DIFFERENTIABLE):
        fn(*args(x))


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
