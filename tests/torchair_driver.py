"""Compiles decode steps with torchair's own Python (from the torch-npu wheel) and records what it
hands to GE. Run by tests/test_torchair.py in a subprocess (torchair installs signal handlers and
patches torch.distributed on import, which must not leak into the test session):

    python tests/torchair_driver.py [--torchair DIR] (--out DIR | --report)

DIR holds the ``torchair`` package unpacked from the wheel (default: the cache of
scripts/fetch_torch_npu.py). Only torchair's native module ``torchair.core._torchair`` (GE
initialisation, the IR registry, graph load/compile/run) is replaced, by the stand-in below: its IR
registry knows FusedGdnDecode as the vendor's op_host/fused_gdn_decode_def.cpp declares it, and its
graph runner executes the GE graph with ``ge_executor`` (torch semantics of each GE op, bytes moved
per node). Everything from ``torch.compile`` to the serialized GE graph is torchair's code.

Writes ``results.json`` (per case: the loaded GE graph's ops, which graph outputs are written into
which inputs, bytes per node, torchair's warnings) and ``tensors.pt`` (inputs and results of every
step, checked against the reference by the tests). ``--report`` prints the traffic table of
docs/graph_mode.md."""

import argparse
import copy
import json
import logging
import signal
import sys
import types
import zlib
from pathlib import Path
from typing import ClassVar

import ge_executor
import torch

GE_INPUTS = ("mixed_qkv", "a", "b", "a_log", "dt_bias", "state", "ssm_state_indices")
ARGS = ("mixed_qkv", "a", "b", "a_log", "dt_bias", "state_ref", "ssm_state_indices")
# The vendor IR (ops-transformer op_host/fused_gdn_decode_def.cpp) in the form torchair's
# get_registered_ir_def returns it.
IR = {
    "FusedGdnDecode": (
        [(n, "required") for n in GE_INPUTS],
        [("out", "required"), ("state_out", "required")],
        [("scale", "VT_FLOAT"), ("softplus_threshold", "VT_FLOAT")],
    )
}


class StandIn:
    """State of the stand-in native module: every graph torchair loads, every run, and the
    arguments of the call being run (to name the graph's inputs)."""

    loaded: ClassVar[list] = []
    runs: ClassVar[list] = []
    current_args: ClassVar[dict] = {}


def kernel(mixed_qkv, a, b, a_log, dt_bias, state, idx, scale, softplus_threshold):
    """FusedGdnDecode as GE runs it with state_out in its own buffer: reads `state`, writes only
    the rows of valid slots into a fresh state_out (other rows NaN). Returns (out, state_out,
    rows moved). The package's CPU kernel stands in for the vendor's, so the tests' comparison
    with the reference crosses two implementations, not one with itself."""

    B, Hv, V = idx.shape[0], state.shape[1], state.shape[2]
    if state.device.type == "meta":
        return mixed_qkv.new_empty(B, 1, Hv, V), torch.empty_like(state), B
    slots = idx.long()
    valid = slots > 0
    n = int(valid.sum())
    local = torch.zeros(n + 1, *state.shape[1:], dtype=state.dtype)  # slot 0 = null slot
    local[1:] = state[slots[valid]]
    local_idx = torch.zeros_like(idx)
    local_idx[valid] = torch.arange(1, n + 1, dtype=idx.dtype)
    out = torch.ops.custom.npu_fused_gdn_decode(mixed_qkv, a, b, a_log, dt_bias, local,
                                                local_idx, scale,
                                                softplus_threshold=softplus_threshold)
    state_out = torch.full_like(state, float("nan"))
    state_out[slots[valid]] = local[1:]
    return out, state_out, n


class TorchNpuGraphBase:
    def __init__(self, name=""):
        self.name = str(name)

    def load(self, serialized, options, input_placements, output_dtypes, executor_type):
        from torchair._ge_concrete_graph.ge_ir_pb2 import ModelDef

        model = ModelDef()
        model.ParseFromString(serialized)
        self.graph = model.graph[0]
        StandIn.loaded.append(self)

    def set_hint_shape(self, *args):
        pass

    def compile(self):
        return None

    def auto_tune(self, *args):
        pass

    def run(self, args):
        from torchair._ge_concrete_graph.ge_ir_pb2 import DataType

        inputs, assigned, _stream = args
        run = ge_executor.Run(self.graph, inputs, kernel, DataType.Name)
        outs = run.run()
        aliases = {}
        for i, target in enumerate(assigned or []):
            if target is None:
                continue
            aliases[i] = next(k for k, x in enumerate(inputs) if x is target)
            if outs[i] is not target:  # GE writes the output into the input's memory
                target.copy_(outs[i])
                run.moved.append(("NetOutput", f"output {i} -> input {aliases[i]}",
                                  ge_executor.nbytes(outs[i]), ge_executor.nbytes(target)))
                outs[i] = target
        data_args = {op.name: arg_of(inputs[op.attr["index"].i])
                     for op in self.graph.op if op.type == "Data"}
        StandIn.runs.append({"graph": self.name, "aliases": aliases, "moved": run.moved,
                             "data_args": data_args})
        return outs


def arg_of(t):
    """The argument of the running call that a graph input holds: the tensor itself, or a copy
    torchair made (it makes non-contiguous inputs contiguous); None for other inputs (sizes)."""
    args = StandIn.current_args.items()
    found = [n for n, v in args if v is t]
    if not found and torch.is_tensor(t) and t.device.type != "meta":
        found = [n for n, v in args if torch.is_tensor(v) and v.shape == t.shape
                 and v.dtype == t.dtype and torch.equal(v, t)]
    return found[0] if len(found) == 1 else None


def stand_in_module():
    m = types.ModuleType("torchair.core._torchair")
    m.TorchNpuGraphBase = TorchNpuGraphBase
    m.InitializeGraphEngine = lambda options: None
    m.FinalizeGraphEngine = lambda: None
    m.get_registered_ir_def = lambda op: ("SUCCESS", *IR[op]) if op in IR else ("ERROR", [], [], [])
    m.check_cann_compat = lambda optype, inputs, attrs: ""
    m.GetSocName = lambda: "Ascend910B1"
    class _Names:  # TorchDataType: read only by llm_datadist, at import
        def __getattr__(self, name):
            return name

    m.TorchDataType = _Names()
    return m


def import_torchair(parent):
    sys.path.insert(0, str(parent))
    sys.modules["torchair.core._torchair"] = stand_in_module()
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    import torchair

    for s, handler in saved.items():  # torchair finalizes GE on SIGINT/SIGTERM
        signal.signal(s, handler)
    return torchair


def describe_graph(graph):
    ops = []
    for op in graph.op:
        attrs = {}
        for k, v in op.attr.items():
            if k.startswith("_"):
                continue
            kind = v.WhichOneof("value")
            val = getattr(v, kind) if kind in ("f", "i", "b") else None
            attrs[k] = [kind, val]
        ops.append({"type": op.type, "name": op.name, "inputs": list(op.input),
                    "input_names": [d.name for d in op.input_desc],
                    "output_names": [d.name for d in op.output_desc], "attrs": attrs,
                    "index": op.attr["index"].i if op.type == "Data" else None})
    return ops


# --- the decode steps --------------------------------------------------------------------------


def step(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices):
    return torch.ops.custom.npu_fused_gdn_decode(mixed_qkv, a, b, a_log, dt_bias, state_ref,
                                                  ssm_state_indices, 0.125,
                                                  softplus_threshold=15.0)


class CacheLayer(torch.nn.Module):
    """The state is layer 1 of a 3-layer cache: a view of a larger tensor."""

    def forward(self, mixed_qkv, a, b, a_log, dt_bias, cache, ssm_state_indices):
        return step(mixed_qkv, a, b, a_log, dt_bias, cache[1], ssm_state_indices)


def step_inputs(name, step, B, pool, dtype, state_dtype, invalid=()):
    """One step's inputs from the shared generator (custom_ops.testing), without the state."""
    from custom_ops.testing import Case, make_inputs

    case = Case(B=B, H=2, Hv=4, K=64, V=32, pool=pool, dtype=dtype, state_dtype=state_dtype,
                invalid_rows=invalid, seed=zlib.crc32(f"{name}-{step}".encode()))
    x = make_inputs(case)
    return {n: x[n] for n in ARGS if n != "state_ref"}


def run_case(torchair, name, fn, state, batches, dtype, config, tensors, dynamic=False,
             state_arg="state_ref"):
    torch._dynamo.reset()
    first = len(StandIn.loaded)
    compiled = torch.compile(fn, backend=torchair.get_npu_backend(compiler_config=config),
                             fullgraph=True)
    pool = state.shape[-4]
    steps = []
    for i, (B, invalid) in enumerate(batches):
        x = step_inputs(name, i, B, pool, dtype, state.dtype, invalid)
        if dynamic:
            for n in ("mixed_qkv", "a", "b", "ssm_state_indices"):
                torch._dynamo.mark_dynamic(x[n], 0)
        before = state.clone()
        args = dict(x, **{state_arg: state})
        StandIn.current_args = args
        out = compiled(*(args[n] for n in ARGS[:5]), args[state_arg], args["ssm_state_indices"])
        steps.append({"inputs": {k: v.clone() for k, v in x.items()}, "state_before": before,
                      "out": out.clone(), "state_after": state.clone()})
    tensors[name] = steps
    graphs = StandIn.loaded[first:]
    return {"graphs_loaded": len(graphs), "graph": graphs[-1].name,
            "ops": describe_graph(graphs[-1].graph), "runs": StandIn.runs[-len(batches):]}


def traffic(torchair, config, B=16, pool=512):
    """One Qwen3-Next layer (H=16, Hv=32, K=V=128, fp32 state) on meta tensors: shapes only."""
    torch._dynamo.reset()
    H, Hv, K, V = 16, 32, 128, 128
    meta = {"device": "meta"}
    args = {"mixed_qkv": torch.empty(B, 2 * H * K + Hv * V, dtype=torch.bfloat16, **meta),
            "a": torch.empty(B, Hv, dtype=torch.bfloat16, **meta),
            "b": torch.empty(B, Hv, dtype=torch.bfloat16, **meta),
            "a_log": torch.empty(Hv, **meta),
            "dt_bias": torch.empty(Hv, dtype=torch.bfloat16, **meta),
            "state_ref": torch.empty(pool, Hv, V, K, **meta),
            "ssm_state_indices": torch.empty(B, dtype=torch.int32, **meta)}
    StandIn.current_args = args
    compiled = torch.compile(step, backend=torchair.get_npu_backend(compiler_config=config),
                             fullgraph=True)
    compiled(*(args[n] for n in ARGS))
    return {"B": B, "pool": pool, "row_bytes": Hv * V * K * 4, "pool_bytes": pool * Hv * V * K * 4,
            "moved": StandIn.runs[-1]["moved"], "aliases": StandIn.runs[-1]["aliases"]}


def report(torchair, config, reinplace_pass):
    """Prints the traffic table of docs/graph_mode.md (MiB read + written per node)."""
    runs = {"default": traffic(torchair, config()),
            "reinplace_pass": traffic(torchair, config(reinplace_pass))}
    t = runs["default"]
    mib = 2.0**20
    print(f"Qwen3-Next layer (H=16, Hv=32, K=V=128), fp32 state, pool {t['pool']} slots "
          f"({t['pool_bytes'] / mib:.0f} MiB), B={t['B']}: MiB read + written per node\n")
    print("| GE node | eager | default | with reinplace_pass |\n| --- | ---: | ---: | ---: |")
    names = list(dict.fromkeys(n for r in runs.values() for _, n, _, _ in r["moved"]))
    kernel = None
    for name in names:
        cells = []
        for r in runs.values():
            moved = [rd + wr for _, n, rd, wr in r["moved"] if n == name]
            cells.append(f"{moved[0] / mib:.1f}" if moved else "–")
        if name == "FusedGdnDecode":
            kernel = cells[0]
        typ = next(tp for r in runs.values() for tp, n, _, _ in r["moved"] if n == name)
        label = name if typ == name or typ == "NetOutput" else f"{name} ({typ})"
        print(f"| {label} | {kernel if name == 'FusedGdnDecode' else '–'} | {' | '.join(cells)} |")
    totals = [sum(rd + wr for _, _, rd, wr in r["moved"]) / mib for r in runs.values()]
    print(f"| **total** | {kernel} | {totals[0]:.1f} | {totals[1]:.1f} |")


def aclgraph_passes(gm, example_inputs, use_reinplace_pass, tensors, name):
    """The FX passes torchair's reduce-overhead mode applies before capturing (fx2acl_converter),
    run on a copy of the graph torchair got; then that graph is run eagerly on CPU."""
    from torch._inductor.fx_passes.post_grad import decompose_auto_functionalized
    from torchair._acl_concrete_graph.graph_pass import (
        _reinplace_inplaceable_ops_pass,
        _reinplace_input_mutated_ops,
    )

    import custom_ops.converter

    gm = copy.deepcopy(gm)
    if use_reinplace_pass:
        custom_ops.converter.reinplace_pass(gm, example_inputs)
    _reinplace_inplaceable_ops_pass(gm, False, *example_inputs)
    _reinplace_input_mutated_ops(gm)
    decompose_auto_functionalized(gm.graph)
    gm.recompile()
    nodes = [{"op": n.op, "target": str(n.target), "args": [str(a) for a in n.args]}
             for n in gm.graph.nodes]
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    x = step_inputs(name, 0, 4, 16, torch.bfloat16, torch.bfloat16, invalid=(2,))
    state = torch.randn(16, 4, 32, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    before = state.clone()
    out = gm(*(x[n] if n != "state_ref" else state for n in ARGS))
    out = out[0] if isinstance(out, (tuple, list)) else out
    tensors[name] = [{"inputs": x, "state_before": before, "out": out, "state_after": state}]
    return {"nodes": nodes, "placeholders": placeholders, "state_placeholder": placeholders[5]}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--torchair", help="directory holding the torchair package (default: the one "
                   "scripts/fetch_torch_npu.py unpacks)")
    p.add_argument("--out", help="directory for results.json and tensors.pt")
    p.add_argument("--report", action="store_true", help="print the traffic table")
    a = p.parse_args(argv)

    if a.torchair is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
        import fetch_torch_npu

        a.torchair = fetch_torch_npu.ensure() / "x86_64" / "torch_npu" / "dynamo"
    torchair = import_torchair(a.torchair)
    warnings = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelname in ("WARNING", "ERROR", "CRITICAL"):
                warnings.append(record.getMessage())

    tlog = logging.getLogger("torchair")
    tlog.setLevel(logging.WARNING)
    tlog.handlers[:] = [Collect()]

    from torchair.configs.compiler_config import CompilerConfig

    import custom_ops.converter as conv_pkg  # custom_ops registers the converter on import
    from custom_ops.converter import fused_gdn_decode as conv

    op = torch.ops.custom.npu_fused_gdn_decode.default
    res = {"registered_by_import": getattr(op, "_ge_converter", None) is not None,
           "register_again": conv_pkg.register()}

    def config(pre_pass=None):
        c = CompilerConfig()
        if pre_pass is not None:
            c.post_grad_custom_pre_pass = pre_pass
        return c

    if a.report:
        report(torchair, config, conv_pkg.reinplace_pass)
        return

    tensors = {}
    cases = {}
    dyn = [(2, ()), (5, (1,)), (9, (0, 4))]
    g = torch.Generator().manual_seed(3)
    cases["fp32_dynamic"] = run_case(torchair, "fp32_dynamic", step,
                                     torch.randn(16, 4, 32, 64, generator=g), dyn,
                                     torch.bfloat16, config(), tensors, dynamic=True)
    grabbed = []  # the graph torchair gets for the bf16 case, for the reduce-overhead passes

    def grab(gm, example_inputs, config):
        grabbed.append((copy.deepcopy(gm), example_inputs))
        return gm

    cases["bf16"] = run_case(torchair, "bf16", step,
                             torch.randn(16, 4, 32, 64, generator=g).bfloat16(),
                             [(4, (3,)), (4, ())], torch.bfloat16, config(grab), tensors)
    cache = torch.randn(3, 16, 4, 32, 64, generator=g)
    cases["view"] = run_case(torchair, "view", CacheLayer(), cache, [(5, (2,)), (5, ())],
                             torch.bfloat16, config(), tensors, state_arg="cache")
    cases["reinplace"] = run_case(torchair, "reinplace", step,
                                  torch.randn(16, 4, 32, 64, generator=g), dyn, torch.bfloat16,
                                  config(conv_pkg.reinplace_pass), tensors, dynamic=True)
    # A slot-strided pool (every other slot of a larger buffer): torchair hands GE a contiguous
    # copy of it, so the pass must leave the call functional for the update to reach the pool.
    paged = torch.randn(16, 2, 4, 32, 64, generator=g)
    cases["reinplace_strided"] = run_case(torchair, "reinplace_strided", step, paged[:, 0],
                                          [(4, (1,)), (4, ())], torch.bfloat16,
                                          config(conv_pkg.reinplace_pass), tensors)

    # Negative control: the vendor's converter (FusedGdnDecode alone) must be seen to lose the
    # update, or the checks above prove nothing.
    from torchair.ge import attr, custom_op

    def vendor_converter(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale,
                         *, softplus_threshold=20.0, meta_outputs=None):
        tensors_in = (mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices)
        out, _ = custom_op("FusedGdnDecode", inputs=dict(zip(GE_INPUTS, tensors_in)),
                           outputs=["out", "state_out"],
                           attrs={"scale": attr.Float(scale),
                                  "softplus_threshold": attr.Float(softplus_threshold)})
        return out

    n_warn = len(warnings)
    torchair.register_fx_node_ge_converter(op)(vendor_converter)
    cases["vendor_converter"] = run_case(torchair, "vendor_converter", step,
                                         torch.randn(16, 4, 32, 64, generator=g), [(4, ())],
                                         torch.bfloat16, config(), tensors)
    cases["vendor_converter"]["warnings"] = warnings[n_warn:]
    torchair.register_fx_node_ge_converter(op)(conv.convert_npu_fused_gdn_decode)

    res["cases"] = cases
    res["traffic"] = {"default": traffic(torchair, config()),
                      "reinplace_pass": traffic(torchair, config(conv_pkg.reinplace_pass))}
    gm, example_inputs = grabbed[0]
    res["aclgraph"] = {
        "torchair_passes": aclgraph_passes(gm, example_inputs, False, tensors, "acl"),
        "with_reinplace_pass": aclgraph_passes(gm, example_inputs, True, tensors, "acl_reinplace")}
    res["warnings"] = warnings
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    torch.save(tensors, out / "tensors.pt")


if __name__ == "__main__":
    main()
