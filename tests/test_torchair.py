"""Graph mode against torchair's real Python (from the torch-npu wheel).

tests/torchair_driver.py runs, in a subprocess,
``torch.compile(backend=torchair.get_npu_backend())`` of decode steps through torchair's own code
down to the GE graph it hands to its loader; only torchair's native module is a stand-in, whose
loader executes the GE graph with torch (tests/ge_executor.py, a labelled double of GE). These tests
check what came out: the ``FusedGdnDecode`` node, the write-back torchair finds, the graph output
aliased to the state input, the results of every step against the reference, and the bytes each node
moves.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from custom_ops import fused_gdn_decode_reference
from custom_ops.testing import assert_close

HERE = Path(__file__).resolve().parent
GE_INPUTS = ["mixed_qkv", "a", "b", "a_log", "dt_bias", "state", "ssm_state_indices"]
ARGS = ["mixed_qkv", "a", "b", "a_log", "dt_bias", "state_ref", "ssm_state_indices"]
CASES = ["fp32_dynamic", "bf16", "view", "reinplace", "reinplace_strided"]


@pytest.fixture(scope="module")
def driven(torch_npu_wheel, tmp_path_factory):
    out = tmp_path_factory.mktemp("torchair")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
    torchair_dir = torch_npu_wheel / "x86_64" / "torch_npu" / "dynamo"
    res = subprocess.run([sys.executable, str(HERE / "torchair_driver.py"), "--torchair",
                          str(torchair_dir), "--out", str(out)], env=env, capture_output=True,
                         text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-6000:]
    return (json.loads((out / "results.json").read_text()),
            torch.load(out / "tensors.pt", weights_only=True))


def ops_of(case, op_type):
    return [op for op in case["ops"] if op["type"] == op_type]


def producer(case, tensor):
    name = tensor.rsplit(":", 1)[0]
    return next(op for op in case["ops"] if op["name"] == name)


def graph_outputs(case):
    """The NetOutput's data inputs, in output order (control inputs end in ":-1")."""
    (net,) = ops_of(case, "NetOutput")
    return [t for t in net["inputs"] if not t.endswith(":-1")]


def runs_of_graph(case):
    """The runs of the graph described in case["ops"] (the last one torchair loaded)."""
    return [r for r in case["runs"] if r["graph"] == case["graph"]]


def data_arg(case, op):
    """The user argument a Data op feeds (recorded by the loader from the tensors it ran with)."""
    assert op["type"] == "Data", op
    return runs_of_graph(case)[0]["data_args"][op["name"]]


def check_step(step, state_view=lambda s: s):
    x = step["inputs"]
    state = step["state_before"].clone()
    out_ref = fused_gdn_decode_reference(*(x[n] for n in ARGS[:5]), state_view(state),
                                         x["ssm_state_indices"], 0.125, softplus_threshold=15.0)
    assert_close(step["out"], out_ref, "compiled out")
    assert_close(step["state_after"], state, "state after the compiled step")
    assert not torch.equal(step["state_after"], step["state_before"])


# --- registration ------------------------------------------------------------------------------


def test_import_registers_the_converter(driven):
    res, _ = driven
    assert res["registered_by_import"] and res["register_again"]


# --- the emitted node --------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_fused_gdn_decode_node(driven, name):
    case = driven[0]["cases"][name]
    (node,) = ops_of(case, "FusedGdnDecode")
    assert node["input_names"] == GE_INPUTS
    assert node["output_names"] == ["out", "state_out"]
    assert node["attrs"] == {"scale": ["f", 0.125], "softplus_threshold": ["f", 15.0]}
    for ge_name, tensor, arg in zip(GE_INPUTS, node["inputs"], ARGS):
        src = producer(case, tensor)
        if ge_name != "state":
            assert data_arg(case, src) == arg, ge_name
    assert graph_outputs(case)[0] == f"{node['name']}:0"  # the step returns the op's `out`


# --- the write-back -----------------------------------------------------------------------------


def state_source(case, node):
    """Follows `state` of the node back to the graph input: (ops on the way, the Data op)."""
    chain, op = [], producer(case, node["inputs"][GE_INPUTS.index("state")])
    while op["type"] != "Data":
        chain.append(op["type"])
        op = producer(case, op["inputs"][0])
    return chain, op


@pytest.mark.parametrize("name", ["fp32_dynamic", "bf16", "view"])
def test_functional_write_back_is_found(driven, name):
    """torchair's auto_functionalized_v2 handler found the updated state on our last op: the
    graph output written into the state input comes from ScatterUpdate (no Identity fallback)."""
    case = driven[0]["cases"][name]
    (node,) = ops_of(case, "FusedGdnDecode")
    chain, data = state_source(case, node)
    assert chain[0] == "TensorMove" or chain[:2] == ["AsStrided", "TensorMove"]
    assert not ops_of(case, "Identity")
    (scatter,) = ops_of(case, "ScatterUpdate")
    assert scatter["input_names"][0] == scatter["output_names"][0] == "var"
    for run in runs_of_graph(case):
        ((out_idx, in_idx),) = run["aliases"].items()  # one graph output aliases one input
        assert in_idx == data["index"]
        written = producer(case, graph_outputs(case)[int(out_idx)])
        assert written["name"] == scatter["name"] or (
            written["type"] == "ViewCopy" and f"{scatter['name']}:-1" in written["inputs"])


def test_reinplace_pass_writes_into_the_input(driven):
    case = driven[0]["cases"]["reinplace"]
    (node,) = ops_of(case, "FusedGdnDecode")
    chain, data = state_source(case, node)
    assert chain == [] and data_arg(case, data) == "state_ref"
    assert not ops_of(case, "TensorMove") and not ops_of(case, "Assign")
    (scatter,) = ops_of(case, "ScatterUpdate")
    assert producer(case, scatter["inputs"][0])["name"] == data["name"]
    (net,) = ops_of(case, "NetOutput")
    assert f"{scatter['name']}:-1" in net["inputs"]  # kept alive though nothing reads it
    assert all(run["aliases"] == {} for run in case["runs"])


def test_reinplace_pass_leaves_a_strided_pool_functional(driven):
    """A slot-strided pool reaches GE as torchair's contiguous copy, written back only through the
    functional write-back: the pass keeps it (TensorMove, ScatterUpdate, the aliased output)."""
    case = driven[0]["cases"]["reinplace_strided"]
    (node,) = ops_of(case, "FusedGdnDecode")
    chain, _ = state_source(case, node)
    assert chain == ["TensorMove"]
    (scatter,) = ops_of(case, "ScatterUpdate")
    for run in runs_of_graph(case):
        ((out_idx, in_idx),) = run["aliases"].items()
        assert in_idx == ARGS.index("state_ref")
        assert producer(case, graph_outputs(case)[int(out_idx)])["name"] == scatter["name"]


# --- numbers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp32_dynamic", "bf16", "reinplace", "reinplace_strided"])
def test_steps_match_the_reference(driven, name):
    for step in driven[1][name]:
        check_step(step)


@pytest.mark.parametrize("name", ["fp32_dynamic", "reinplace"])
def test_dynamic_batch_is_one_graph(driven, name):
    case = driven[0]["cases"][name]
    assert case["graphs_loaded"] == 1
    assert [len(s["inputs"]["ssm_state_indices"]) for s in driven[1][name]] == [2, 5, 9]


def test_state_as_a_view_of_a_larger_cache(driven):
    for step in driven[1]["view"]:
        check_step(step, state_view=lambda cache: cache[1])
        before, after = step["state_before"], step["state_after"]
        assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])


def test_lost_update_is_detected(driven):
    """Negative control: the vendor's converter (FusedGdnDecode alone) loses the update, and the
    same checks say so."""
    res, tensors = driven
    case = res["cases"]["vendor_converter"]
    assert ops_of(case, "Identity")  # torchair's fallback when it finds no updated state
    (step,) = tensors["vendor_converter"]
    assert torch.equal(step["state_after"], step["state_before"])
    with pytest.raises(AssertionError):
        check_step(step)


# --- traffic -------------------------------------------------------------------------------------


def test_default_graph_copies_the_pool(driven):
    t = driven[0]["traffic"]["default"]
    pool = t["pool_bytes"]
    big = [(typ, r + w) for typ, _, r, w in t["moved"] if r + w >= pool]
    assert ("TensorMove", 2 * pool) in big


def test_reinplace_pass_moves_o_of_b_bytes(driven):
    t = driven[0]["traffic"]["reinplace_pass"]
    moved = [r + w for _, _, r, w in t["moved"]]
    assert max(moved) < t["pool_bytes"] / 8
    # the kernel reads and writes B rows; the write-back moves each row a few more times
    assert sum(moved) <= 10 * t["B"] * t["row_bytes"]


# --- reduce-overhead (ACL graph) -----------------------------------------------------------------


def calls(graph):
    return [n for n in graph["nodes"] if n["op"] == "call_function"]


@pytest.mark.parametrize("variant", ["torchair_passes", "with_reinplace_pass"])
def test_aclgraph_passes_call_the_op_in_place(driven, variant):
    g = driven[0]["aclgraph"][variant]
    targets = [n["target"] for n in calls(g)]
    assert "aten.clone.default" not in targets
    (op,) = [n for n in calls(g) if n["target"] == "custom.npu_fused_gdn_decode.default"]
    assert op["args"][5] == g["state_placeholder"]
    copies = [n for n in calls(g) if n["target"] == "aten.copy_.default"]
    # torchair alone leaves a copy of the state onto itself; the pass removes it
    assert copies == ([] if variant == "with_reinplace_pass"
                      else [{"op": "call_function", "target": "aten.copy_.default",
                             "args": [g["state_placeholder"]] * 2}])
    name = "acl" if variant == "torchair_passes" else "acl_reinplace"
    for step in driven[1][name]:
        check_step(step)
