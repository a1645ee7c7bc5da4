"""Graph mode without torchair: the converter's registration hook, ``reinplace_pass`` (the FX pass
for torchair's post-grad pre-pass) on aot_autograd graphs, and torch.compile with Inductor (CPU).

The converter itself is tested against torchair's real code in test_torchair.py.
"""

import logging
import sys

import pytest
import torch

import custom_ops.converter as converter_pkg
from custom_ops import fused_gdn_decode_reference
from custom_ops.testing import ARG_NAMES, OP, Case, aot_backend, assert_close, make_inputs

HOP = torch.ops.higher_order.auto_functionalized_v2


# --- registration ----------------------------------------------------------------------------


def test_register_without_torchair_returns_false(monkeypatch, caplog):
    monkeypatch.setattr(converter_pkg, "_registered", False)
    monkeypatch.setitem(sys.modules, "torchair", None)  # makes `import torchair` raise ImportError
    with caplog.at_level(logging.DEBUG, logger="custom_ops.converter"):
        assert converter_pkg.register() is False
    assert any("torchair" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)


# --- reinplace_pass --------------------------------------------------------------------------


def compile_with(fn, use_pass):
    """torch.compile through aot_autograd with input mutations kept in the graph (as torchair
    does), the forward graph run as is; with `use_pass`, reinplace_pass applied to it first.
    Returns (compiled fn, the forward graphs)."""
    graphs = []
    torch._dynamo.reset()
    return torch.compile(fn, backend=aot_backend(use_pass, graphs), fullgraph=True), graphs


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def step(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices):
    return OP(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, 0.125,
              softplus_threshold=15.0)


@pytest.mark.parametrize("use_pass", [True, False], ids=["pass", "no-pass"])
def test_reinplace_pass_calls_the_op_on_the_input(use_pass):
    compiled, graphs = compile_with(step, use_pass)
    state = make_inputs(Case(pool=24))["state_ref"]
    ref_state = state.clone()
    with torch.no_grad():
        for B in (2, 5, 9):
            x = make_inputs(Case(B=B, pool=24, invalid_rows=(1,) if B > 2 else (), seed=B))
            for n in ("mixed_qkv", "a", "b", "ssm_state_indices"):
                torch._dynamo.mark_dynamic(x[n], 0)
            args = [x[n] if n != "state_ref" else state for n in ARG_NAMES]
            out = compiled(*args)
            out_ref = fused_gdn_decode_reference(*(x[n] for n in ARG_NAMES[:5]), ref_state,
                                                 x["ssm_state_indices"], 0.125,
                                                 softplus_threshold=15.0)
            assert_close(out, out_ref, f"out, B={B}")
            assert_close(state, ref_state, f"state, B={B}")
    (gm,) = graphs
    if use_pass:
        assert HOP not in targets(gm) and torch.ops.aten.copy_.default not in targets(gm)
        (call,) = [n for n in gm.graph.nodes if n.target is OP.default]
        assert call.args[5].op == "placeholder" and call.kwargs == {"softplus_threshold": 15.0}
    else:  # what the pass removes
        assert HOP in targets(gm) and torch.ops.aten.copy_.default in targets(gm)


def read_before(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices):
    s = state_ref.sum()
    return step(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices), s


def used_after(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices):
    return step(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices), state_ref * 2


def layer_of_cache(mixed_qkv, a, b, a_log, dt_bias, cache, ssm_state_indices):
    return step(mixed_qkv, a, b, a_log, dt_bias, cache[1], ssm_state_indices)


def strided_pool(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices):
    return step(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices)


@pytest.mark.parametrize("fn", [read_before, used_after, layer_of_cache, strided_pool])
def test_reinplace_pass_leaves_unsafe_calls_functional(fn):
    """The input is read elsewhere in the graph, the state is a view of a larger input, or a
    slot-strided (non-contiguous) pool, which torchair hands GE as a contiguous copy: the call
    stays functional, and results equal eager mode."""
    compiled, graphs = compile_with(fn, True)
    x = make_inputs(Case(B=4, pool=12, invalid_rows=(2,)))
    state = x["state_ref"]
    if fn is layer_of_cache:
        state = torch.stack([state + 1, state, state - 1])
    if fn is strided_pool:  # every other slot of a buffer twice the size (a paged pool)
        state = torch.stack([state, state - 1], dim=1)[:, 0]
        assert not state.is_contiguous()
    eager_state = state.clone()
    with torch.no_grad():
        got = compiled(*(x[n] for n in ARG_NAMES[:5]), state, x["ssm_state_indices"])
        want = fn(*(x[n] for n in ARG_NAMES[:5]), eager_state, x["ssm_state_indices"])
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        assert_close(g, w, "result")
    assert_close(state, eager_state, "state")
    assert HOP in targets(graphs[0])


# --- torch.compile (Inductor, CPU) -----------------------------------------------------------


class GdnDecodeLayer(torch.nn.Module):
    """A GDN layer's decode step: one projection whose output is split into column views
    mixed_qkv | a | b, the fused op, and the output projection."""

    def __init__(self, hidden, H, Hv, K, V, dtype, op=OP):
        super().__init__()
        self.Hv, self.qkv_dim, self.scale, self.op = Hv, 2 * H * K + Hv * V, K**-0.5, op
        self.in_proj = torch.nn.Linear(hidden, self.qkv_dim + 2 * Hv, bias=False, dtype=dtype)
        self.out_proj = torch.nn.Linear(Hv * V, hidden, bias=False, dtype=dtype)
        self.a_log = torch.nn.Parameter(torch.randn(Hv) * 0.5)
        self.dt_bias = torch.nn.Parameter((torch.randn(Hv) * 0.5).to(dtype))

    def forward(self, x, state, ssm_state_indices):
        proj = self.in_proj(x)
        w, hv = self.qkv_dim, self.Hv
        mixed_qkv, a, b = proj[:, :w], proj[:, w:w + hv], proj[:, w + hv:]
        out = self.op(mixed_qkv, a, b, self.a_log, self.dt_bias, state, ssm_state_indices,
                      self.scale)
        return self.out_proj(out.reshape(out.shape[0], -1))


def _steps(pool, hidden, dtype):
    """Decode steps with batch sizes 2, 5 and 9 (two steps each) over one slot pool."""
    g = torch.Generator().manual_seed(1)
    steps = []
    for B in (2, 5, 9):
        for _ in range(2):
            x = torch.randn(B, hidden, generator=g).to(dtype)
            idx = (torch.randperm(pool - 1, generator=g)[:B] + 1).to(torch.int32)
            if B == 9:
                idx[4] = 0  # an invalid row
            steps.append((x, idx))
    return steps


def test_compile_decode_step_dynamic_batch():
    torch._dynamo.reset()
    from torch._inductor.compile_fx import compile_fx

    dtype, state_dtype, pool, hidden = torch.bfloat16, torch.float32, 24, 64
    torch.manual_seed(0)
    layer = GdnDecodeLayer(hidden, H=2, Hv=4, K=64, V=32, dtype=dtype).eval()
    ref_layer = GdnDecodeLayer(hidden, H=2, Hv=4, K=64, V=32, dtype=dtype,
                               op=fused_gdn_decode_reference).eval()
    ref_layer.load_state_dict(layer.state_dict())

    graphs = []

    def counting_inductor(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    compiled = torch.compile(layer, backend=counting_inductor, fullgraph=True)
    state0 = (torch.randn(pool, 4, 32, 64) * 0.5).to(state_dtype)
    s_eager, s_comp, s_ref = state0.clone(), state0.clone(), state0.clone()

    with torch.no_grad():
        for step, (x, idx) in enumerate(_steps(pool, hidden, dtype)):
            x_c, idx_c = x.clone(), idx.clone()
            torch._dynamo.mark_dynamic(x_c, 0)
            torch._dynamo.mark_dynamic(idx_c, 0)
            y_comp = compiled(x_c, s_comp, idx_c)
            y_eager = layer(x, s_eager, idx)
            y_ref = ref_layer(x, s_ref, idx)
            assert y_comp.shape == (x.shape[0], hidden) and y_comp.dtype == dtype
            assert_close(y_comp, y_eager, f"compiled vs eager output, step {step}")
            assert_close(y_comp, y_ref, f"compiled vs reference output, step {step}")
            assert_close(s_comp, s_eager, f"compiled vs eager state, step {step}")
            assert_close(s_comp, s_ref, f"compiled vs reference state, step {step}")

    assert len(graphs) == 1, f"expected one graph for B = 2, 5, 9, got {len(graphs)}"
    assert not torch.equal(s_comp, state0)  # the write-back happened
