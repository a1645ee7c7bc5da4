"""A recording fake of the small torchair API surface our converter uses (contract test helper).

CONTRACT FAKE: it mirrors, from torchair's sources (see custom_ops/converter/fused_gdn_decode.py),
how these calls behave, not how GE runs them:
  - ``torchair.register_fx_node_ge_converter(op)(fn)`` records ``fn`` and returns a non-function;
  - ``torchair.ge.custom_op(type, inputs=dict, outputs=list, attrs=dict)`` appends one op with named
    inputs/outputs, asserts value types as torchair does, and returns None, one Tensor or a tuple;
  - ``torchair.ge.attr.Float(v)`` etc. are typed wrappers;
  - ``torchair._ge_concrete_graph.ge_apis``: the few builtin GE ops the converter emits, with the
    input/output names of their GE IR.
``auto_functionalize`` replays torchair's GE handling of ``auto_functionalized_v2`` for a mutated
argument, and ``execute`` runs the recorded graph with torch so the state write-back can be checked
by value. FusedGdnDecode is executed the way GE runs the vendor kernel when ``state_out`` is not an
alias of ``state`` (distinct IR names): it reads ``state``, leaves it untouched, and writes only the
rows of valid slots into a fresh ``state_out`` whose other rows hold garbage (NaN).

Install it only inside a test: ``install(monkeypatch)`` puts the modules into ``sys.modules``.
"""

import dataclasses
import sys
import types
from typing import Any, Dict, List, Optional

import torch

from custom_ops import fused_gdn_decode_reference


# --- graph -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Op:
    type: str
    name: str
    inputs: List[tuple]  # (input name, Tensor or None)
    attrs: Dict[str, Any]
    outputs: List[str]
    value: Any = None  # Const / Data payload

    def input(self, name):
        for n, t in self.inputs:
            if n == name:
                return t
        raise KeyError(f"{self.type} has no input named {name!r}")


class Tensor:
    """Mirrors torchair.ge._ge_graph.Tensor: output ``index`` of ``node``; ``.tensor`` is
    "name:index"."""

    def __init__(self, node: Op, index: int = 0):
        self.node, self.index = node, index

    @property
    def tensor(self):
        return f"{self.node.name}:{self.index}"

    def __repr__(self):
        return f"Tensor({self.tensor})"


class Graph:
    def __init__(self):
        self.op: List[Op] = []
        self._names: Dict[str, int] = {}

    def add(self, op_type, inputs, attrs=None, outputs=("y",), value=None):
        n = self._names.get(op_type, 0)
        self._names[op_type] = n + 1
        name = op_type if n == 0 else f"{op_type}_{n}"
        op = Op(op_type, name, list(inputs), dict(attrs or {}), list(outputs), value)
        self.op.append(op)
        return op


_GRAPH: Optional[Graph] = None


def graph() -> Graph:
    return _GRAPH


# --- torchair.ge.attr ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Attr:
    value: Any
    cls: str

    def __repr__(self):
        return f"ge.attr.{self.cls}({self.value!r})"


def _attr_type(cls, check):
    def make(value):
        if not check(value):
            raise AssertionError(f"ge.attr.{cls} got {type(value).__name__} {value!r}")
        return _Attr(value, cls)

    make.__name__ = cls
    return make


attr = types.SimpleNamespace(
    Float=_attr_type("Float", lambda v: isinstance(v, float)),
    Int=_attr_type("Int", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    Bool=_attr_type("Bool", lambda v: isinstance(v, bool)),
    Str=_attr_type("Str", lambda v: isinstance(v, str)),
)


# --- torchair.ge.custom_op -------------------------------------------------------------------


def custom_op(op_type, *args, inputs=None, outputs=None, attrs=None, node_name=None):
    if args:
        raise AssertionError("fake custom_op supports keyword mode only (the converter's mode)")
    named = []
    for name, v in (inputs or {}).items():
        if v is not None and not isinstance(v, Tensor):
            raise AssertionError(
                f"Invalid input '{name}' type:{type(v).__name__} vs expect one of "
                "[None, ge.Tensor, list[ge.Tensor]]"
            )
        named.append((name, v))
    for name, v in (attrs or {}).items():
        if not isinstance(v, _Attr):
            raise AssertionError(f"Invalid attr '{name}' type:{type(v).__name__}, use ge.attr.*")
    for name in outputs or []:
        if not isinstance(name, str):
            raise AssertionError("fake custom_op supports plain output names only")
    op = _GRAPH.add(op_type, named, attrs, outputs or [])
    results = tuple(Tensor(op, i) for i in range(len(op.outputs)))
    if not results:
        return None
    return results[0] if len(results) == 1 else results


# --- torchair._ge_concrete_graph.ge_apis (builtin GE ops, names from their IR) ---------------


class DataType:
    DT_FLOAT = 0
    DT_INT32 = 3


def _builtin(op_type, in_names, out_name):
    def make(*args, node_name=None, **attrs):
        if len(args) != len(in_names):
            raise AssertionError(f"{op_type} takes inputs {in_names}, got {len(args)}")
        for n, v in zip(in_names, args):
            if not isinstance(v, Tensor):
                raise AssertionError(f"{op_type} input {n} must be a ge Tensor, got {v!r}")
        return Tensor(_GRAPH.add(op_type, zip(in_names, args), attrs, [out_name]))

    make.__name__ = op_type
    return make


def Const(v, dtype=None, node_name=None, readable=True):
    return Tensor(_GRAPH.add("Const", [], {"dtype": dtype}, ["y"], value=v))


def Data(value, name):
    return Tensor(_GRAPH.add("Data", [], {"name": name}, ["y"], value=value))


ge_apis = types.SimpleNamespace(
    Const=Const,
    DataType=DataType,
    TensorMove=_builtin("TensorMove", ["x"], "y"),
    Identity=_builtin("Identity", ["x"], "y"),
    Assign=_builtin("Assign", ["ref", "value"], "ref"),
    Maximum=_builtin("Maximum", ["x1", "x2"], "y"),
    Greater=_builtin("Greater", ["x1", "x2"], "y"),
    GatherV2=_builtin("GatherV2", ["x", "indices", "axis"], "y"),
    Reshape=_builtin("Reshape", ["x", "shape"], "y"),
    SelectV2=_builtin("SelectV2", ["condition", "then", "else"], "result"),
    ScatterUpdate=_builtin("ScatterUpdate", ["var", "indices", "updates"], "var"),
)


# --- torchair.register_fx_node_ge_converter --------------------------------------------------

converters: Dict[Any, Any] = {}


class _Converter:
    def __init__(self, op):
        self._op = op

    def __call__(self, fn):
        converters[self._op] = fn
        return self  # as torchair: the decorated name becomes the Converter, not the function


def register_fx_node_ge_converter(op):
    return _Converter(op)


def install(monkeypatch):
    """Puts the fake torchair modules into sys.modules (undone by monkeypatch) and starts a fresh
    graph. Returns this module."""
    global _GRAPH
    _GRAPH = Graph()
    converters.clear()
    root = types.ModuleType("torchair")
    root.register_fx_node_ge_converter = register_fx_node_ge_converter
    ge = types.ModuleType("torchair.ge")
    attr_mod = types.ModuleType("torchair.ge.attr")
    attr_mod.__dict__.update(vars(attr))
    ge.custom_op, ge.attr, ge.Const, ge.DataType = custom_op, attr_mod, Const, DataType
    concrete = types.ModuleType("torchair._ge_concrete_graph")
    apis = types.ModuleType("torchair._ge_concrete_graph.ge_apis")
    apis.__dict__.update(vars(ge_apis))
    concrete.ge_apis = apis
    root.ge, root._ge_concrete_graph = ge, concrete
    for name, mod in [
        ("torchair", root),
        ("torchair.ge", ge),
        ("torchair.ge.attr", attr_mod),
        ("torchair._ge_concrete_graph", concrete),
        ("torchair._ge_concrete_graph.ge_apis", apis),
    ]:
        monkeypatch.setitem(sys.modules, name, mod)
    return sys.modules[__name__]


# --- torchair's auto_functionalized_v2 handling, replayed ------------------------------------


@dataclasses.dataclass
class Functionalized:
    out: Any  # what the converter returned
    updated: Tensor  # the tensor torchair writes back to the mutated graph input
    found_ref_pair: bool  # False: torchair's Identity fallback (warning, update lost)


def auto_functionalize(converter, kwargs, mutable):
    """As torchair's conveter_auto_functionalize_v2 for one not-a-view mutated argument: the base
    becomes a TensorMove copy, the converter is called by keyword without meta_outputs, and the
    updated value is the output of the last emitted op named like the input the copy feeds."""
    kwargs = dict(kwargs)
    copy = ge_apis.TensorMove(kwargs[mutable])
    kwargs[mutable] = copy
    out = converter(**kwargs)
    last = _GRAPH.op[-1]
    for in_name, t in last.inputs:
        if t is not None and t.tensor == copy.tensor and in_name in last.outputs:
            return Functionalized(out, Tensor(last, last.outputs.index(in_name)), True)
    return Functionalized(out, ge_apis.Identity(copy), False)


# --- execution with torch --------------------------------------------------------------------


def _fused_gdn_decode(op, x):
    state = x["state"]
    work = state.clone()
    out = fused_gdn_decode_reference(
        x["mixed_qkv"], x["a"], x["b"], x["a_log"], x["dt_bias"], work, x["ssm_state_indices"],
        op.attrs["scale"].value, softplus_threshold=op.attrs["softplus_threshold"].value,
    )
    state_out = torch.full_like(state, float("nan"))  # GE-allocated, not an alias of state
    slots = x["ssm_state_indices"].long()
    valid = slots[slots > 0]
    state_out[valid] = work[valid]
    return [out, state_out]


def _scatter_update(var, idx, upd):
    var[idx.long()] = upd  # ref op: output 'var' is the input buffer
    return var


_RUN = {
    "TensorMove": lambda x: x.clone(),
    "Identity": lambda x: x,
    "Assign": lambda ref, value: ref.copy_(value),
    "Maximum": torch.maximum,
    "Greater": torch.gt,
    "GatherV2": lambda x, i, axis: torch.index_select(x, int(axis), i.long()),
    "Reshape": lambda x, shape: x.reshape(shape.tolist()),
    "SelectV2": torch.where,  # numpy broadcasting, as GE SelectV2
    "ScatterUpdate": _scatter_update,
}


def execute(wanted):
    """Runs the recorded graph in emission order; returns the values of the `wanted` Tensors."""
    values = {}
    for op in _GRAPH.op:
        if op.type == "Const":
            res = [torch.tensor(op.value, dtype=torch.int32)]  # the converter's consts are int32
        elif op.type == "Data":
            res = [op.value]
        elif op.type == "FusedGdnDecode":
            res = _fused_gdn_decode(op, {n: values[t.tensor] for n, t in op.inputs})
        else:
            res = [_RUN[op.type](*(values[t.tensor] for _, t in op.inputs))]
        for i, r in enumerate(res):
            values[f"{op.name}:{i}"] = r
    return [values[t.tensor] for t in wanted]
