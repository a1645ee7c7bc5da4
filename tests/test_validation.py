"""Every rejection of docs/spec.md "Validation", in one table run against every backend: the CPU op,
the Meta kernel (meta tensors and FakeTensor), the checked reference registered for devices without
a kernel (custom_ops.composite, reached through the XPU key), and the Triton kernel's CUDA entry
(through Triton's interpreter). Each rejected call must raise the documented exception type with a
message naming the argument (the CPU op's message, on every backend) and leave every byte of
state_ref (and of out, for the rows that call the out overload) as it was. Then what rules 12-15
allow, and nested tensors (PyTorch's own error).
"""

import dataclasses
from typing import Callable

import pytest
import torch

from custom_ops import cuda as cuda_backend
from custom_ops import fused_gdn_decode_reference
from custom_ops.testing import (ALL_DTYPES, ARG_NAMES, OP, RANK, Case, assert_close, call,
                                check_against_reference, fake_mode, make_inputs, redispatch,
                                storage_bytes, to_fake, to_meta)

BASE = Case(B=3, H=2, Hv=4, K=64, V=16)  # BlockNum 8, width 2*2*64 + 4*16 = 320
FP16 = dataclasses.replace(BASE, dtype=torch.float16, state_dtype=torch.float16)
U32 = 2**32  # one past UINT32_MAX
INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Rejection:
    id: str
    change: Callable  # valid inputs -> bad ones; a "softplus_threshold" key sets that argument
    exc: type
    fragment: str  # part of the message, naming the argument
    case: Case = BASE
    # "values": needs the index values (Meta/FakeTensor cannot see them);
    # "devices": tensors on two devices (meta tensors and FakeTensor put all on one);
    # "kind": a layout, view bit or address that meta tensors and FakeTensor do not keep.
    needs: str = ""
    # The CPU message gives addresses; meta tensors and FakeTensor give offsets into the storage
    # instead, so there only the words before them are the CPU op's.
    addresses: bool = False


def expanded(shape, dtype):
    """A huge tensor without memory (stride 0): lets every backend see sizes beyond UINT32_MAX."""
    return torch.zeros((1,) * len(shape), dtype=dtype).expand(*shape)


def state(x, shape=None, dtype=None):
    s = x["state_ref"]
    return torch.zeros(shape or s.shape, dtype=dtype or s.dtype)


def replaced(name, make):
    return lambda x: dict(x, **{name: make(x)})


def _rank_rows():
    rows = []
    for name in ARG_NAMES:
        msg = f"{name} must be a {RANK[name]}-D tensor"
        rows.append(Rejection(f"rank-{name}-plus-1", replaced(name, lambda x, n=name: x[n][None]),
                              ValueError, msg))
        rows.append(Rejection(f"rank-{name}-minus-1", replaced(name, lambda x, n=name: x[n][0]),
                              ValueError, msg))
    return rows


def _dtype_rows():
    expected = {
        "mixed_qkv": "mixed_qkv must have dtype torch.bfloat16 or torch.float16",
        "a": "a must have dtype torch.bfloat16 (the dtype of mixed_qkv)",
        "b": "b must have dtype torch.bfloat16 (the dtype of mixed_qkv)",
        "dt_bias": "dt_bias must have dtype torch.bfloat16 (the dtype of mixed_qkv)",
        "a_log": "a_log must have dtype torch.float32",
        "ssm_state_indices": "ssm_state_indices must have dtype torch.int32",
        "state_ref": "state_ref must have dtype torch.float32 or torch.bfloat16 (the dtype of "
                     "mixed_qkv)",
    }
    allowed = {"mixed_qkv": {torch.bfloat16, torch.float16}, "a": {torch.bfloat16},
               "b": {torch.bfloat16}, "dt_bias": {torch.bfloat16}, "a_log": {torch.float32},
               "ssm_state_indices": {torch.int32}, "state_ref": {torch.float32, torch.bfloat16}}
    rows = []
    for name in ARG_NAMES:
        for dt in ALL_DTYPES:
            if dt in allowed[name]:
                continue
            msg = f"{expected[name]}, but got {dt}"  # spelled as Python spells it
            if name == "state_ref":
                change = replaced(name, lambda x, d=dt: state(x, dtype=d))
            else:
                change = replaced(name, lambda x, n=name, d=dt: x[n].to(d))
            rows.append(Rejection(f"dtype-{name}-{str(dt)[6:]}", change, TypeError, msg))
    # float16 inputs: the 16-bit arguments and a 16-bit state must follow mixed_qkv's dtype.
    for name in ("a", "b", "dt_bias"):
        rows.append(Rejection(
            f"dtype-{name}-bfloat16-with-float16",
            replaced(name, lambda x, n=name: x[n].bfloat16()), TypeError,
            f"{name} must have dtype torch.float16 (the dtype of mixed_qkv), but got "
            "torch.bfloat16", case=FP16))
    rows.append(Rejection(
        "dtype-state_ref-bfloat16-with-float16", replaced("state_ref", lambda x: state(
            x, dtype=torch.bfloat16)), TypeError, "state_ref must have dtype torch.float32 or "
        "torch.float16 (the dtype of mixed_qkv), but got torch.bfloat16", case=FP16))
    return rows


def _empty_rows():
    rows = [Rejection("empty-batch", lambda x: dict(x, **{
        k: x[k][:0] for k in ("mixed_qkv", "a", "b", "ssm_state_indices")}), ValueError,
        "mixed_qkv must not be empty")]
    for name in ARG_NAMES:
        for dim in range(RANK[name]):
            rows.append(Rejection(
                f"empty-{name}-dim-{dim}", replaced(name, lambda x, n=name, d=dim: x[n].narrow(
                    d, 0, 0)), ValueError, f"{name} must not be empty"))
    return rows


def _k(K, fragment):
    return Rejection(f"K-{K}", replaced("state_ref", lambda x: state(x, (8, 4, 16, K))),
                     ValueError, fragment)


def _device(name):
    other = "a" if name == "mixed_qkv" else name
    where = "meta" if name == "mixed_qkv" else "cpu"
    return Rejection(f"device-{name}", replaced(name, lambda x: x[name].to("meta")), ValueError,
                     f"all tensors must be on one device: expected {other} on {where}",
                     needs="devices")


def _indices(id, values, fragment):
    return Rejection(id, replaced("ssm_state_indices", lambda x: torch.tensor(
        values, dtype=torch.int32)), ValueError, fragment, needs="values")


def _misaligned(t):
    """A copy of t whose data starts one byte past an element boundary (torch.frombuffer)."""
    buf = bytearray(t.numel() * t.element_size() + 1)
    out = torch.frombuffer(buf, dtype=t.dtype, offset=1, count=t.numel()).view(t.shape)
    out.copy_(t)
    return out


def _tensor_kind_rows():
    """None, layouts other than strided, quantized tensors, negative/conjugate views and
    misaligned data: each named, not a failure deep inside a backend."""
    rows = [Rejection(f"none-{name}", replaced(name, lambda x: None), TypeError,
                      f"{name} must be a tensor, but got None") for name in ARG_NAMES]
    rows.append(Rejection("none-all", lambda x: dict(x, **dict.fromkeys(ARG_NAMES)), TypeError,
                          "mixed_qkv must be a tensor, but got None"))
    dense = "must be a dense (torch.strided) tensor, but got layout"
    for name in ("mixed_qkv", "a_log", "state_ref", "ssm_state_indices"):
        rows.append(Rejection(f"sparse_coo-{name}", replaced(name, lambda x, n=name: x[
            n].to_sparse()), TypeError, f"{name} {dense} torch.sparse_coo", needs="kind"))
    rows.append(Rejection("sparse_csr-a", replaced("a", lambda x: x["a"].to_sparse_csr()),
                          TypeError, f"a {dense} torch.sparse_csr", needs="kind"))
    for name in ("a_log", "state_ref"):  # float32: mkldnn's dtype on every CPU
        rows.append(Rejection(f"mkldnn-{name}", replaced(name, lambda x, n=name: x[
            n].to_mkldnn()), TypeError, f"{name} {dense} torch._mkldnn", needs="kind"))
    for name, expected in (("a_log", "a_log must have dtype torch.float32"),
                           ("state_ref", ("state_ref must have dtype torch.float32 or "
                                          "torch.bfloat16 (the dtype of mixed_qkv)"))):
        rows.append(Rejection(f"quantized-{name}", replaced(name, lambda x, n=name: (
            torch.quantize_per_tensor(x[n].float(), 0.1, 0, torch.qint8))), TypeError,
            f"{expected}, but got torch.qint8", needs="kind"))
    rows.append(Rejection("neg_view-state_ref", replaced("state_ref", lambda x: torch._neg_view(
        x["state_ref"])), ValueError, "state_ref must not be a negative view", needs="kind"))
    rows.append(Rejection("conj_view-state_ref", replaced("state_ref", lambda x: x[
        "state_ref"].to(torch.complex64).conj()), TypeError, "state_ref must have dtype "
        "torch.float32 or torch.bfloat16 (the dtype of mixed_qkv), but got torch.complex64",
        needs="kind"))
    for name in ("mixed_qkv", "a_log", "state_ref", "ssm_state_indices"):
        rows.append(Rejection(f"misaligned-{name}", replaced(name, lambda x, n=name: _misaligned(
            x[n])), ValueError, f"{name} must be aligned to its element size", needs="kind"))
    return rows


OUT_SHAPE, OUT_BYTES = (3, 1, 4, 16), 3 * 4 * 16 * 2  # BASE's out: bf16 (B, 1, Hv, V)


def _out_sharing_memory_with(name):
    """Rule 21: x plus an "out" (the row calls the out overload) that shares bytes with x[name].
    Both are views of one byte buffer holding x[name]'s values: the larger one at its start, the
    smaller one 128 bytes in, inside the larger one's span."""
    def change(x):
        t = x[name]
        size = t.numel() * t.element_size()
        buf = torch.zeros(max(size, OUT_BYTES) + 256, dtype=torch.uint8)
        t_at, out_at = (0, 128) if size > OUT_BYTES else (128, 0)
        moved = buf[t_at:t_at + size].view(t.dtype).view(t.shape)
        moved.copy_(t)
        out = buf[out_at:out_at + OUT_BYTES].view(torch.bfloat16).view(OUT_SHAPE)
        return dict(x, **{name: moved}, out=out)
    return Rejection(f"out-shares-memory-with-{name}", change, ValueError,
                     f"out must not share memory with {name}, but ", addresses=True)


REJECTIONS = _rank_rows() + _dtype_rows() + _empty_rows() + _tensor_kind_rows() + [
    # UINT32 limits (stride-0 tensors: no memory is allocated)
    Rejection("u32-B", lambda x: dict(
        x, mixed_qkv=expanded((U32, 320), torch.bfloat16), a=expanded((U32, 4), torch.bfloat16),
        b=expanded((U32, 4), torch.bfloat16), ssm_state_indices=expanded((U32,), torch.int32)),
        ValueError, "B (mixed_qkv.size(0)) must be at most UINT32_MAX"),
    Rejection("u32-width", replaced("mixed_qkv", lambda x: expanded((3, U32), torch.bfloat16)),
              ValueError, "mixed_qkv.size(1) must be at most UINT32_MAX"),
    Rejection("u32-BlockNum", replaced("state_ref", lambda x: expanded((U32, 4, 16, 64),
                                                                       torch.float32)),
              ValueError, "BlockNum (state_ref.size(0)) must be at most UINT32_MAX"),
    Rejection("u32-Hv", replaced("state_ref", lambda x: expanded((2, U32, 16, 64), torch.float32)),
              ValueError, "Hv (state_ref.size(1)) must be at most UINT32_MAX"),
    Rejection("u32-V", replaced("state_ref", lambda x: expanded((2, 4, U32, 64), torch.float32)),
              ValueError, "V (state_ref.size(2)) must be at most UINT32_MAX"),
    Rejection("u32-K", replaced("state_ref", lambda x: expanded((2, 4, 16, U32), torch.float32)),
              ValueError, "K (state_ref.size(3)) must be at most UINT32_MAX"),
    Rejection("u32-B*Hv", lambda x: dict(
        x, mixed_qkv=expanded((2**17, 2**16 + 128), torch.bfloat16),
        state_ref=expanded((2, 2**16, 1, 64), torch.float32)),
        ValueError, "B*Hv must be at most UINT32_MAX (4294967295), but got 8589934592"),
    # K range and the float32 state's row padding
    _k(1, "K (state_ref.size(3)) must be in [64, 2032], but got 1"),
    _k(48, "K (state_ref.size(3)) must be in [64, 2032], but got 48"),
    _k(63, "K (state_ref.size(3)) must be in [64, 2032], but got 63"),
    _k(2033, "K (state_ref.size(3)) must be in [64, 2032], but got 2033"),
    _k(2048, "K (state_ref.size(3)) must be in [64, 2032], but got 2048"),
    _k(65, "K = 65 is not supported with a float32 state_ref: rows are padded to a multiple of "
       "16 elements and at most 32 bytes of padding are allowed, but K = 65 needs 60 bytes"),
    _k(71, "K = 71 is not supported with a float32 state_ref"),
    _k(129, "K = 129 is not supported with a float32 state_ref"),
    _k(2017, "but K = 2017 needs 60 bytes"),
    # sizes derived from mixed_qkv.size(1)
    Rejection("width-1", replaced("mixed_qkv", lambda x: x["mixed_qkv"][:, :1]), ValueError,
              "mixed_qkv.size(1) must be greater than Hv*V = 64"),
    Rejection("width-HvV", replaced("mixed_qkv", lambda x: x["mixed_qkv"][:, :64]), ValueError,
              "mixed_qkv.size(1) must be greater than Hv*V = 64"),
    Rejection("width-not-multiple-of-2K", replaced("mixed_qkv", lambda x: x["mixed_qkv"][:, 1:]),
              ValueError, "must be a multiple of 2*K = 128"),
    Rejection("Hv-not-multiple-of-H", replaced("mixed_qkv", lambda x: torch.zeros(
        3, 2 * 3 * 64 + 4 * 16, dtype=torch.bfloat16)), ValueError,
        "Hv (state_ref.size(1)) must be a multiple of H = 3"),
    # shapes that disagree with (B, Hv)
    Rejection("shape-a", replaced("a", lambda x: torch.zeros(3, 5, dtype=torch.bfloat16)),
              ValueError, "a must have shape (B, Hv) = [3, 4], but got [3, 5]"),
    Rejection("shape-b", replaced("b", lambda x: torch.zeros(4, 4, dtype=torch.bfloat16)),
              ValueError, "b must have shape (B, Hv) = [3, 4], but got [4, 4]"),
    Rejection("shape-a_log", replaced("a_log", lambda x: torch.zeros(5)), ValueError,
              "a_log must have shape (Hv,) = [4], but got [5]"),
    Rejection("shape-dt_bias", replaced("dt_bias", lambda x: torch.zeros(3, dtype=torch.bfloat16)),
              ValueError, "dt_bias must have shape (Hv,) = [4], but got [3]"),
    Rejection("shape-indices-long", replaced("ssm_state_indices", lambda x: torch.ones(
        4, dtype=torch.int32)), ValueError,
        "ssm_state_indices must have shape (B,) = [3], but got [4]"),
    Rejection("shape-indices-short", replaced("ssm_state_indices", lambda x: x[
        "ssm_state_indices"][:2]), ValueError,
        "ssm_state_indices must have shape (B,) = [3], but got [2]"),
    # a state_ref whose slots are not each contiguous, or overlap (any larger slot stride is fine)
    Rejection("state-transposed", replaced("state_ref", lambda x: torch.zeros(
        8, 4, 64, 16).transpose(2, 3)), ValueError,
        "state_ref must have contiguous slots (it is updated in place): strides of dims 1-3 must "
        "be (V*K, K, 1) = (1024, 64, 1), but got strides [4096, 1024, 1, 16]"),
    Rejection("state-row-padding", replaced("state_ref", lambda x: torch.zeros(
        8, 4, 16, 72)[..., :64]), ValueError, "state_ref must have contiguous slots"),
    Rejection("state-every-other-head", replaced("state_ref", lambda x: torch.zeros(
        8, 8, 16, 64)[:, ::2]), ValueError, "state_ref must have contiguous slots"),
    Rejection("state-permuted", replaced("state_ref", lambda x: torch.zeros(
        64, 16, 4, 8).permute(3, 2, 1, 0)), ValueError, "state_ref must have contiguous slots"),
    Rejection("state-overlapping-slots", replaced("state_ref", lambda x: torch.zeros(
        8 * 4096).as_strided((8, 4, 16, 64), (2048, 1024, 64, 1))), ValueError,
        "state_ref.stride(0) (the slot stride) must be at least Hv*V*K = 4096 so that slots do "
        "not overlap, but got 2048"),
    Rejection("state-slot-stride-0", replaced("state_ref", lambda x: torch.zeros(
        1, 4, 16, 64).expand(8, 4, 16, 64)), ValueError,
        "state_ref.stride(0) (the slot stride) must be at least Hv*V*K = 4096"),
    Rejection("state-slot-stride-one-short", replaced("state_ref", lambda x: torch.zeros(
        8 * 4096).as_strided((8, 4, 16, 64), (4095, 1024, 64, 1))), ValueError,
        "must be at least Hv*V*K = 4096 so that slots do not overlap, but got 4095"),
    # scalars: finite and within float32's range (the kernels and the vendor API take float32)
    *[Rejection(f"{name}={text}", lambda x, name=name, v=v: dict(x, **{name: v}), ValueError,
                f"{name} must be finite and within float32's range (|{name}| <= "
                f"3.4028234663852886e+38), but got {text}")
      for name in ("scale", "softplus_threshold")
      for v, text in [(float("inf"), "inf"), (-float("inf"), "-inf"), (float("nan"), "nan"),
                      (1e39, "1e+39"), (-1e300, "-1e+300"), (3.4028236e38, "3.4028236e+38")]],
    # devices
    *[_device(name) for name in ARG_NAMES],
    # slot values: range and uniqueness (need the values on the host)
    _indices("index-equals-BlockNum", [1, 8, 2],
             "ssm_state_indices[1] = 8 is out of range: valid slots must be < BlockNum = 8"),
    _indices("index-above-BlockNum", [1, 2, 13], "ssm_state_indices[2] = 13 is out of range"),
    _indices("index-int32-max", [INT32_MAX, 1, 2],
             "ssm_state_indices[0] = 2147483647 is out of range"),
    _indices("index-duplicate", [3, 0, 3],
             "ssm_state_indices must not repeat a positive slot, but slot 3 is used by rows 0 "
             "and 2"),
    # the out overload: out written while any input is read
    *[_out_sharing_memory_with(name) for name in ARG_NAMES],
]


def _overload(x):
    """The out overload, writing x["out"], for the rows that give one; else the default one."""
    return (OP.out, {"out": x["out"]}) if "out" in x else (OP.default, {})


def _call(x, thr, key=None):
    op, kw = _overload(x)
    return call(redispatch(op, key) if key else op, x, softplus_threshold=thr, **kw)


def _to_meta(x):
    """Meta tensors with the sizes, strides, storage offsets and dtypes of x's; tensors that view
    one storage (whatever their dtypes) view one meta storage."""
    storages = {}
    meta = {}
    for k, t in x.items():
        if not torch.is_tensor(t):
            meta[k] = t
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in storages:
            storages[storage.data_ptr()] = torch.empty(storage.nbytes(), dtype=torch.uint8,
                                                       device="meta")
        meta[k] = storages[storage.data_ptr()].view(t.dtype).as_strided(
            t.shape, t.stride(), t.storage_offset())
    return meta


def _cpu(x, thr):
    return _call(x, thr)


def _meta(x, thr):
    return _call(_to_meta(x), thr)


def _fake(x, thr):
    with fake_mode() as mode:
        return _call(to_fake(mode, x), thr)


def _composite(x, thr):
    # XPU has no kernel of its own: its calls reach the CompositeExplicitAutograd registration.
    return _call(x, thr, "XPU")


def _triton(x, thr):
    if cuda_backend.KERNEL is not cuda_backend.fused_gdn_decode_cuda:
        pytest.skip("triton is not installed: the CUDA key holds the checked reference")
    old = cuda_backend.set_check_indices(True)  # slot values are checked behind this switch only
    try:
        return _call(x, thr, "CUDA")
    finally:
        cuda_backend.set_check_indices(old)


BACKENDS = {"cpu": _cpu, "meta": _meta, "fake": _fake, "composite": _composite,
            "triton": _triton}


def _applies(row, backend):
    return not (row.needs and backend in ("meta", "fake"))


TABLE = [pytest.param(backend, row, id=f"{backend}-{row.id}")
         for row in REJECTIONS for backend in BACKENDS if _applies(row, backend)]


def _threshold(x):
    return x.get("softplus_threshold", 20.0)


def _state_copy(t):
    """What a rejected call must leave unchanged: every storage byte of a CPU state_ref (its
    values for the tensor kinds without plain storage); None where there is nothing to compare."""
    if not torch.is_tensor(t) or t.device.type != "cpu":
        return None
    if t.is_quantized:
        return t.int_repr()
    if t.layout != torch.strided:
        return t.to_dense()
    return storage_bytes(t)


@pytest.mark.parametrize("backend,row", TABLE)
def test_rejected(backend, row):
    x = row.change(make_inputs(row.case))
    written = [x[k] for k in ("state_ref", "out") if k in x]
    before = [_state_copy(t) for t in written]
    with pytest.raises(row.exc) as info:
        BACKENDS[backend](x, _threshold(x))
    msg = str(info.value)
    assert "npu_fused_gdn_decode" in msg and row.fragment in msg, msg
    for t, b in zip(written, before):
        if b is not None:
            assert torch.equal(_state_copy(t), b), "a rejected call changed state_ref or out"
    if backend != "cpu":  # the same check, so the same words as the CPU op
        with pytest.raises(row.exc) as cpu:
            _cpu(x, _threshold(x))
        if row.addresses and backend in ("meta", "fake"):
            words = str(cpu.value).split(row.fragment)[0] + row.fragment
            assert msg.startswith(words + "both are views of one storage, out spanning its "
                                  "bytes ["), msg
        else:
            assert msg == str(cpu.value)


VALUE_ROWS = [r for r in REJECTIONS if r.needs == "values"]


@pytest.mark.parametrize("backend", ["meta", "fake"])
@pytest.mark.parametrize("row", VALUE_ROWS, ids=[r.id for r in VALUE_ROWS])
def test_meta_accepts_index_values(backend, row):
    """Meta cannot see index values; as on NPU, range and uniqueness are the caller's duty there."""
    out = BACKENDS[backend](row.change(make_inputs(row.case)), 20.0)
    assert out.shape == (3, 1, 4, 16) and out.dtype == torch.bfloat16


def test_low_precision_state_accepts_k129():
    x = make_inputs(Case(B=2, H=1, Hv=2, K=129, V=8, state_dtype=torch.bfloat16))
    check_against_reference(x)  # out (its shape and dtype too) and the state pool


def test_duplicate_invalid_indices_are_fine():
    # Rows with index <= 0 (repeated or not) get zeros and touch no slot, slot 0 included.
    x = make_inputs(BASE)
    x["ssm_state_indices"] = torch.tensor([0, 0, -1], dtype=torch.int32)
    before = storage_bytes(x["state_ref"])
    assert call(OP, x).abs().sum() == 0
    assert torch.equal(storage_bytes(x["state_ref"]), before)


def test_meta_output_matches_cpu_output():
    x = make_inputs(BASE)
    out = call(OP, x)
    meta = call(OP, to_meta(x))
    assert meta.device.type == "meta"
    assert (meta.shape, meta.dtype, meta.stride()) == (out.shape, out.dtype, out.stride())


# What rules 12-15 allow, and nested tensors: each accepted call computes what the plain call does.

def _same_call(x, y, **kw):
    """The op on x and on y (each on its own copy of the state) gives the same bits."""
    sx, sy = x["state_ref"].clone(), y["state_ref"].clone()
    ox = call(OP, dict(x, state_ref=sx), **kw)
    oy = call(OP, dict(y, state_ref=sy), **kw)
    assert torch.equal(ox, oy), "out differs"
    assert torch.equal(sx, sy), "state differs"


@pytest.mark.parametrize("name", ["mixed_qkv", "a", "b", "a_log", "dt_bias"])
def test_read_only_negative_views_are_read_as_their_values(name):
    """Rule 12: a read-only argument may be a negative view; the op reads its values, not the
    negated bytes underneath."""
    x = make_inputs(BASE)
    y = dict(x, **{name: torch._neg_view(-x[name])})
    assert y[name].is_neg() and torch.equal(y[name], x[name])
    _same_call(x, y)


def test_size_one_state_dims_take_any_stride():
    """Rule 13: a dimension of size 1 (here Hv and V) may have any stride."""
    case = Case(B=2, H=1, Hv=1, K=64, V=1, pool=5)
    x = make_inputs(case)
    s = x["state_ref"]
    odd = torch.empty(5 * 64 + 999).as_strided(s.shape, (64, 12345, 777, 1), 999)
    odd.copy_(s)
    assert odd.stride()[1:3] == (12345, 777)
    _same_call(x, dict(x, state_ref=odd))


@pytest.mark.parametrize("slot_stride", [0, 7, 4096])
def test_one_slot_pool_takes_any_slot_stride(slot_stride):
    """Rule 14: with BlockNum = 1 (only the null slot: every row invalid) the slot stride is
    free; outputs are zeros and the state keeps its bytes."""
    x = make_inputs(BASE)
    st = torch.randn(4 * 16 * 64).as_strided((1, 4, 16, 64), (slot_stride, 1024, 64, 1))
    before = st.clone()
    x = dict(x, state_ref=st, ssm_state_indices=torch.tensor([0, -1, 0], dtype=torch.int32))
    out = call(OP, x)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(st, before)


FLT_MAX = 3.4028234663852886e+38


@pytest.mark.parametrize("kw", [{"scale": FLT_MAX}, {"scale": -FLT_MAX},
                                {"softplus_threshold": FLT_MAX},
                                {"softplus_threshold": -FLT_MAX}], ids=str)
def test_float32_extremes_are_accepted(kw):
    """Rule 15's bound is inclusive: float32's largest value is a valid scalar, on every backend
    that computes it, with the reference's results (Inf/NaN where the reference has them)."""
    x = dict(make_inputs(BASE), **{k: v for k, v in kw.items() if k == "scale"})
    extra = {k: v for k, v in kw.items() if k != "scale"}
    ours, ref = x["state_ref"].clone(), x["state_ref"].clone()
    out = call(OP, dict(x, state_ref=ours), **extra)
    out_ref = call(fused_gdn_decode_reference, dict(x, state_ref=ref), **extra)
    assert_close(out, out_ref, "out", equal_nan=True)
    assert_close(ours, ref, "state", equal_nan=True)
    assert call(OP, to_meta(x), **extra).shape == out.shape


@pytest.mark.parametrize("name", ["a", "state_ref"])
def test_nested_tensor_is_pytorchs_not_implemented(name):
    """Nested tensors never reach the check (spec rule 1): PyTorch has no kernel for them."""
    x = make_inputs(BASE)
    t = x[name]
    nested = torch.nested.nested_tensor(list(t.unbind(0)), layout=torch.jagged)
    before = storage_bytes(x["state_ref"])
    with pytest.raises(NotImplementedError):
        call(OP, dict(x, **{name: nested}))
    assert torch.equal(storage_bytes(x["state_ref"]), before)


@pytest.mark.parametrize("indices,error,message", [
    (torch.tensor([1, 2]), TypeError, "indices must have dtype torch.int32, but got torch.int64"),
    (torch.tensor([[1, 2]], dtype=torch.int32), ValueError,
     r"indices must be 1-D, but got shape \[1, 2\]"),
    (torch.tensor([1, 2], dtype=torch.int32, device="meta"), ValueError,
     "indices must be on cpu, but got meta"),
], ids=["int64", "2d", "meta"])
def test_internal_slot_check_checks_its_indices(indices, error, message):
    """The slot check the reference and Triton paths call on host indices (the op's slot rules
    and messages) refuses indices it cannot read, naming its argument."""
    with pytest.raises(error, match="check_slot_indices: " + message):
        torch.ops.custom_ops_internal.check_slot_indices(indices, 4)
    torch.ops.custom_ops_internal.check_slot_indices(torch.tensor([1, 0, 3], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"ssm_state_indices\[1\] = 4 is out of range"):
        torch.ops.custom_ops_internal.check_slot_indices(torch.tensor([1, 4], dtype=torch.int32), 4)
