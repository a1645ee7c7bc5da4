"""Runs a GE graph (torchair's GraphDef protobuf) with torch, and counts the bytes each node moves.

TEST DOUBLE for GE's executor (only what our graphs contain). Semantics follow the GE IR of each op:
ref ops (ScatterUpdate: output `var` is input `var`) update their input in place, TensorMove and
AsStrided-then-ViewCopy copy, FusedGdnDecode is executed as the vendor kernel behaves when GE gives
`state_out` its own buffer: it reads `state`, leaves it untouched and writes only the rows of valid
slots into a fresh `state_out` whose other rows are NaN (uninitialised memory).
"""

import numpy as np
import torch

# torchair's ge.DataType (ACL numbering) -> torch
GE_DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.int8, 3: torch.int32, 4: torch.uint8,
             6: torch.int16, 9: torch.int64, 11: torch.float64, 12: torch.bool, 27: torch.bfloat16}
# ge_ir.proto DataType names -> torch
PROTO_DTYPES = {"DT_FLOAT": torch.float32, "DT_FLOAT16": torch.float16, "DT_INT8": torch.int8,
                "DT_INT32": torch.int32, "DT_UINT8": torch.uint8, "DT_INT16": torch.int16,
                "DT_INT64": torch.int64, "DT_DOUBLE": torch.float64, "DT_BOOL": torch.bool,
                "DT_BF16": torch.bfloat16}


def nbytes(t):
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _const(op, proto_dtype_name):
    t = op.attr["value"].t
    dtype = PROTO_DTYPES[proto_dtype_name(t.desc.dtype)]
    shape = list(t.desc.shape.dim)
    if dtype is torch.bfloat16:
        arr = np.frombuffer(t.data, dtype=np.int16).copy()
        return torch.from_numpy(arr).view(torch.bfloat16).reshape(shape)
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    return torch.from_numpy(np.frombuffer(t.data, dtype=np_dtype).copy()).reshape(shape)


class Run:
    """One execution: `outputs` (NetOutput order) and `moved` [(op type, name, bytes read,
    bytes written)]."""

    def __init__(self, graph, inputs, kernel, proto_dtype_name):
        self.graph, self.inputs, self.kernel = graph, inputs, kernel
        self.proto_dtype_name = proto_dtype_name
        self.values = {}
        self.moved = []

    def _in(self, op):
        return [self.values[name] for name in op.input if not name.endswith(":-1")]

    def run(self):
        outputs = None
        for op in _topo_order(self.graph):
            fn = getattr(self, "op_" + op.type, None)
            if fn is None:
                raise NotImplementedError(f"GE test executor: no semantics for op type {op.type}")
            res = fn(op, *self._in(op))
            if op.type == "NetOutput":
                outputs = res
                continue
            res = res if isinstance(res, (list, tuple)) else [res]
            for i, r in enumerate(res):
                self.values[f"{op.name}:{i}"] = r
        return outputs

    def _count(self, op, read, written):
        self.moved.append((op.type, op.name, int(read), int(written)))

    def _elementwise(self, op, result, *args):
        self._count(op, sum(nbytes(a) for a in args), nbytes(result))
        return result

    # --- sources and sinks
    def op_Data(self, op):
        return self.inputs[op.attr["index"].i]

    def op_Const(self, op):
        return _const(op, self.proto_dtype_name)

    def op_NetOutput(self, op, *xs):
        return list(xs)

    # --- copies and views
    def op_TensorMove(self, op, x):
        return self._elementwise(op, x.clone(), x)

    def op_Identity(self, op, x):
        return self._elementwise(op, x.clone(), x)

    def op_Reshape(self, op, x, shape):
        return x.reshape([int(v) for v in shape.tolist()])

    def op_AsStrided(self, op, x, size, stride, offset):
        y = torch.as_strided(x, _ints(size), _ints(stride), int(offset))
        # GE materialises the strided view (AsStrided is a kernel); ViewCopy writes it back.
        y = y.clone()
        return self._elementwise(op, y, y)

    def op_ViewCopy(self, op, dst, dst_size, dst_stride, dst_offset, src, src_size, src_stride,
                    src_offset):
        d = torch.as_strided(dst, _ints(dst_size), _ints(dst_stride), int(dst_offset))
        s = torch.as_strided(src, _ints(src_size), _ints(src_stride), int(src_offset))
        d.copy_(s)
        self._count(op, nbytes(s), nbytes(d))
        return dst

    def op_Assign(self, op, ref, value):
        ref.copy_(value)
        self._count(op, nbytes(value), nbytes(ref))
        return ref

    # --- elementwise / shape arithmetic
    def op_Cast(self, op, x):
        return self._elementwise(op, x.to(GE_DTYPES[op.attr["dst_type"].i]), x)

    def op_Muls(self, op, x):
        return self._elementwise(op, x * op.attr["value"].f, x)

    def op_Mul(self, op, x, y):
        return self._elementwise(op, x * y, x, y)

    def op_Add(self, op, x, y):
        return self._elementwise(op, x + y, x, y)

    def op_Maximum(self, op, x, y):
        return self._elementwise(op, torch.maximum(x, y.to(x.dtype)), x, y)

    def op_Greater(self, op, x, y):
        return self._elementwise(op, torch.gt(x, y), x, y)

    def op_SelectV2(self, op, cond, then, other):
        return self._elementwise(op, torch.where(cond, then, other), cond, then, other)

    def op_Pack(self, op, *xs):
        return self._elementwise(op, torch.stack([x.reshape(()) for x in xs]).to(xs[0].dtype), *xs)

    def op_Gather(self, op, x, idx):
        return self._elementwise(op, x[idx.long()], idx)

    def op_GatherV2(self, op, x, idx, axis):
        y = torch.index_select(x, int(axis), idx.long().reshape(-1)).reshape(
            *x.shape[: int(axis)], *idx.shape, *x.shape[int(axis) + 1:])
        self._count(op, nbytes(y) + nbytes(idx), nbytes(y))
        return y

    # --- ref ops
    def op_ScatterUpdate(self, op, var, idx, updates):
        var.index_copy_(0, idx.long(), updates.to(var.dtype))
        self._count(op, nbytes(updates) + nbytes(idx), nbytes(updates))
        return var

    # --- the vendor op
    def op_FusedGdnDecode(self, op, mixed_qkv, a, b, a_log, dt_bias, state, idx):
        attrs = {"scale": op.attr["scale"].f, "softplus_threshold": op.attr["softplus_threshold"].f}
        out, state_out, rows = self.kernel(mixed_qkv, a, b, a_log, dt_bias, state, idx, **attrs)
        row = nbytes(state[0]) if state.shape[0] else 0
        small = sum(nbytes(t) for t in (mixed_qkv, a, b, a_log, dt_bias, idx))
        self._count(op, small + rows * row, nbytes(out) + rows * row)
        return [out, state_out]


def _ints(t):
    return [int(v) for v in (t.tolist() if isinstance(t, torch.Tensor) else t)]


def _topo_order(graph):
    """Data and control edges respected; otherwise the graph's op order."""
    by_name = {op.name: op for op in graph.op}
    done, order = set(), []

    def visit(op, stack=()):
        if op.name in done:
            return
        if op.name in stack:
            raise RuntimeError(f"GE graph has a cycle through {op.name}")
        for name in op.input:
            src = name.rsplit(":", 1)[0]
            if src in by_name:
                visit(by_name[src], stack + (op.name,))
        done.add(op.name)
        order.append(op)

    for op in graph.op:
        visit(op)
    return order
