"""Graph mode: the torchair fx2ge converter and torch.compile (Inductor, CPU).

The converter tests are CONTRACT TESTS: torchair is not installed here, so they run the converter
against ``fake_torchair``, a recording fake of the torchair calls it makes (installed into
``sys.modules`` only inside each test). They pin the GE op we emit (type, input names and order,
attr types and values, outputs) and, by executing the recorded graph, that the tensor torchair
writes back to ``state_ref`` holds the reference's updated state. What GE itself does on an Ascend
host is not tested here; ``test_real_torchair_*`` runs only where torchair imports.
"""

import logging
import sys

import pytest
import torch

import custom_ops
import custom_ops.converter as converter_pkg
from custom_ops import fused_gdn_decode_reference
from custom_ops.converter import fused_gdn_decode as conv_mod
from custom_ops.testing import OP, Case, assert_close, call, clone_inputs, make_inputs

ARGS = ("mixed_qkv", "a", "b", "a_log", "dt_bias", "state_ref", "ssm_state_indices")
GE_INPUTS = ["mixed_qkv", "a", "b", "a_log", "dt_bias", "state", "ssm_state_indices"]


@pytest.fixture
def fake(monkeypatch):
    import fake_torchair

    monkeypatch.setattr(converter_pkg, "_registered", False)
    return fake_torchair.install(monkeypatch)


def _build(fake, inputs, converter=conv_mod.convert_npu_fused_gdn_decode, **kw):
    """Feeds `inputs` as GE Data ops and converts one call the way torchair's
    auto_functionalized_v2 handler does. Returns (Data tensors by arg, Functionalized)."""
    data = {name: fake.Data(inputs[name], name) for name in ARGS}
    kwargs = dict(data, scale=inputs["scale"], **kw)
    return data, fake.auto_functionalize(converter, kwargs, mutable="state_ref")


def _only_op(fake, op_type):
    ops = [op for op in fake.graph().op if op.type == op_type]
    assert len(ops) == 1, f"expected one {op_type}, got {[op.type for op in fake.graph().op]}"
    return ops[0]


# --- registration ----------------------------------------------------------------------------


def test_register_without_torchair_returns_false(monkeypatch, caplog):
    monkeypatch.setattr(converter_pkg, "_registered", False)
    monkeypatch.setitem(sys.modules, "torchair", None)  # makes `import torchair` raise ImportError
    with caplog.at_level(logging.DEBUG, logger="custom_ops.converter"):
        assert converter_pkg.register() is False
    assert any("torchair" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)


def test_register_with_torchair_is_idempotent(fake):
    target = torch.ops.custom.npu_fused_gdn_decode.default
    assert converter_pkg.register() is True
    assert fake.converters == {target: conv_mod.convert_npu_fused_gdn_decode}
    fake.converters.clear()
    assert converter_pkg.register() is True
    assert fake.converters == {}  # second call registered nothing


def test_import_hook_registers(fake):
    custom_ops._register_converter()  # what `import custom_ops` runs
    assert torch.ops.custom.npu_fused_gdn_decode.default in fake.converters


# --- the emitted GE op -----------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [None, 15.0], ids=["default-threshold", "threshold-15"])
def test_converter_emits_fused_gdn_decode(fake, threshold):
    inputs = make_inputs(Case())
    kw = {} if threshold is None else {"softplus_threshold": threshold}
    data, res = _build(fake, inputs, **kw)
    op = _only_op(fake, "FusedGdnDecode")

    assert [name for name, _ in op.inputs] == GE_INPUTS
    fed = dict(op.inputs)
    for arg, ge_name in conv_mod.INPUTS.items():
        if arg == "state_ref":  # torchair hands the converter a TensorMove copy of the input
            assert fed["state"].node.type == "TensorMove"
            assert fed["state"].node.input("x") is data["state_ref"]
        else:
            assert fed[ge_name] is data[arg], ge_name

    assert set(op.attrs) == {"scale", "softplus_threshold"}
    for name, expected in [("scale", inputs["scale"]), ("softplus_threshold", threshold or 20.0)]:
        a = op.attrs[name]
        assert a.cls == "Float" and type(a.value) is float, (name, a)
        assert a.value == expected, name
    assert op.outputs == ["out", "state_out"]
    assert res.out.node is op and res.out.index == 0  # the op's only torch return


def test_converter_positional_call_and_meta_outputs(fake):
    # The non-functionalized path calls with positional tensors and meta_outputs.
    inputs = make_inputs(Case())
    data = [fake.Data(inputs[n], n) for n in ARGS]
    out = conv_mod.convert_npu_fused_gdn_decode(*data, inputs["scale"], meta_outputs=object())
    op = _only_op(fake, "FusedGdnDecode")
    assert out.node is op and op.attrs["softplus_threshold"].value == 20.0


def test_converter_rejects_non_constant_scale(fake):
    inputs = make_inputs(Case())
    data = {n: fake.Data(inputs[n], n) for n in ARGS}
    with pytest.raises(TypeError, match=r"scale must be a Python float.*got Tensor"):
        conv_mod.convert_npu_fused_gdn_decode(**data, scale=fake.Data(torch.tensor(0.1), "s"))


# --- the state write-back --------------------------------------------------------------------

WRITE_BACK_CASES = [
    Case(B=3, dtype=torch.bfloat16, state_dtype=torch.float32),
    Case(B=4, H=2, Hv=4, K=64, V=32, dtype=torch.float16, state_dtype=torch.float16,
         invalid_rows=(0, 3)),
    Case(B=5, dtype=torch.bfloat16, state_dtype=torch.bfloat16, invalid_rows=(2,), pool=16),
]


@pytest.mark.parametrize("case", WRITE_BACK_CASES, ids=[c.id() for c in WRITE_BACK_CASES])
def test_state_write_back(fake, case):
    inputs = make_inputs(case)
    original = inputs["state_ref"].clone()
    _, res = _build(fake, inputs, softplus_threshold=15.0)

    # torchair's name rule must find the updated state on the last op we emitted.
    assert res.found_ref_pair, [op.type for op in fake.graph().op]
    last = fake.graph().op[-1]
    assert last.type == "ScatterUpdate" and res.updated.node is last

    out, updated = fake.execute([res.out, res.updated])
    ref = clone_inputs(inputs)
    out_ref = call(fused_gdn_decode_reference, ref, softplus_threshold=15.0)
    assert_close(out, out_ref, "out")
    assert_close(updated, ref["state_ref"], "state written back")
    assert torch.equal(inputs["state_ref"], original)  # the graph input itself is not mutated


def _vendor_style(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale, *,
                  softplus_threshold=20.0):
    from torchair.ge import attr, custom_op

    names = dict(zip(GE_INPUTS, (mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices)))
    out, _ = custom_op("FusedGdnDecode", inputs=names, outputs=["out", "state_out"],
                       attrs={"scale": attr.Float(scale),
                              "softplus_threshold": attr.Float(softplus_threshold)})
    return out


def _assign_state_out(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale, *,
                      softplus_threshold=20.0):
    from torchair._ge_concrete_graph import ge_apis as ge
    from torchair.ge import attr, custom_op

    names = dict(zip(GE_INPUTS, (mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices)))
    out, state_out = custom_op("FusedGdnDecode", inputs=names, outputs=["out", "state_out"],
                               attrs={"scale": attr.Float(scale),
                                      "softplus_threshold": attr.Float(softplus_threshold)})
    ge.Assign(state_ref, state_out)
    return out


@pytest.mark.parametrize("wrong", [_vendor_style, _assign_state_out], ids=["out-only", "assign"])
def test_write_back_check_catches_lost_update(fake, wrong):
    """Negative control: the harness above must reject converters that lose the update."""
    inputs = make_inputs(Case(B=3))
    _, res = _build(fake, inputs, converter=wrong)
    _, updated = fake.execute([res.out, res.updated])
    ref = clone_inputs(inputs)
    call(fused_gdn_decode_reference, ref)
    with pytest.raises(AssertionError):
        assert_close(updated, ref["state_ref"], "state written back")


# --- real torchair (Ascend hosts only) -------------------------------------------------------


def test_real_torchair_registers_converter(monkeypatch):
    pytest.importorskip("torchair")
    from torchair._ge_concrete_graph import fx2ge_converter

    monkeypatch.setattr(converter_pkg, "_registered", False)
    assert converter_pkg.register() is True
    target = torch.ops.custom.npu_fused_gdn_decode.default
    assert getattr(target, "_ge_converter", None) or fx2ge_converter._CONVERTERS[target]


def test_real_torchair_graph(monkeypatch):
    pytest.importorskip("torchair")
    from torchair._ge_concrete_graph import ge_apis as ge
    from torchair.core import _torchair
    from torchair.ge._ge_graph import GeGraph

    try:
        status = _torchair.get_registered_ir_def("FusedGdnDecode")[0]
    except Exception as e:  # no CANN runtime here
        pytest.skip(f"GE IR registry not available: {e!r}")
    if status != "SUCCESS":
        pytest.skip("FusedGdnDecode IR not registered (vendor custom op package not installed)")

    dtypes = [ge.DataType.DT_BF16, ge.DataType.DT_BF16, ge.DataType.DT_BF16, ge.DataType.DT_FLOAT,
              ge.DataType.DT_BF16, ge.DataType.DT_FLOAT, ge.DataType.DT_INT32]
    graph = GeGraph()
    with graph:
        data = [ge.Data(index=i, dtype=dt, placement="NPU", node_name=n)
                for i, (n, dt) in enumerate(zip(ARGS, dtypes))]
        out = conv_mod.convert_npu_fused_gdn_decode(*data, 0.125, softplus_threshold=15.0)
    ops = list(graph.op)
    fused = [op for op in ops if op.type == "FusedGdnDecode"]
    assert len(fused) == 1
    op = fused[0]
    assert [d.name for d in op.input_desc] == GE_INPUTS
    assert [d.name for d in op.output_desc] == ["out", "state_out"]
    assert op.attr["scale"].f == pytest.approx(0.125)
    assert op.attr["softplus_threshold"].f == pytest.approx(15.0)
    assert out.tensor == f"{op.name}:0"
    last = ops[-1]
    assert last.type == "ScatterUpdate"
    assert last.input[0] == data[5].tensor
    assert last.input_desc[0].name == last.output_desc[0].name == "var"


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
