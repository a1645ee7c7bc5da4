"""An engine's pool and an engine's output buffer.

- A slot-strided state_ref (vLLM's paged pool: each slot [Hv, V, K] contiguous, slots a page
  apart) on every backend that takes one: the CPU op (every variant), the checked reference (XPU
  key), the Triton kernel (interpreter), Meta/FakeTensor. Out and the slots are compared with the
  reference run on a contiguous copy; the rest of every page must keep its bytes.
- The out overload ``npu_fused_gdn_decode.out``: same results as the default overload, written
  into the caller's tensor and returned; its own rejections leave state and out untouched;
  opcheck, FakeTensor and torch.compile.
"""

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from custom_ops import cuda as cuda_backend
from custom_ops import fused_gdn_decode_reference
from custom_ops.testing import (DTYPE_PAIR_IDS, DTYPE_PAIRS, OP, Case, assert_close, call,
                                fake_mode, make_inputs, paged_pool, positional_args, redispatch,
                                storage_bytes, to_device, to_fake, to_meta, use_cpu_isa)
from triton_mode import skip_unless_interpreter

OUT = OP.out


def _triton_or_skip():
    if cuda_backend.KERNEL is not cuda_backend.fused_gdn_decode_cuda:
        pytest.skip("triton is not installed: the CUDA key holds the checked reference")
    skip_unless_interpreter()  # the Triton kernel on CPU tensors


BACKENDS = ["cpu", "cpu-portable", "composite", "triton"]


def _entry(backend, overload):
    if backend == "triton":
        _triton_or_skip()
        return redispatch(overload, "CUDA")
    if backend == "composite":
        return redispatch(overload, "XPU")
    return overload


def _context(backend):
    return use_cpu_isa("portable") if backend == "cpu-portable" else contextlib.nullcontext()


def _paged_case(case, page_extra=40, offset=24):
    x = make_inputs(case)
    contiguous = x["state_ref"].clone()
    _, Hv, V, K = contiguous.shape
    view, buf = paged_pool(contiguous, Hv * V * K + page_extra, offset)
    assert view.stride(0) > Hv * V * K and not view.is_contiguous()
    return x, contiguous, view, buf


def _gaps(buf, view):
    """Every element of buf outside the slots of view (conv state / padding of each page)."""
    mask = torch.ones(buf.numel(), dtype=torch.bool)
    N, Hv, V, K = view.shape
    for s in range(N):
        start = view.storage_offset() + s * view.stride(0)
        mask[start:start + Hv * V * K] = False
    return buf[mask].clone()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,state_dtype", DTYPE_PAIRS, ids=DTYPE_PAIR_IDS)
@pytest.mark.parametrize("use_out", [False, True], ids=["default", "out"])
def test_paged_pool_matches_reference(backend, dtype, state_dtype, use_out, one_thread):
    case = Case(B=4, H=2, Hv=4, K=64, V=16, dtype=dtype, state_dtype=state_dtype,
                invalid_rows=(1, 2), pool=9)
    x, ref_state, view, buf = _paged_case(case)
    gaps = _gaps(buf, view)
    ref = dict(x, state_ref=ref_state)
    ours = dict(x, state_ref=view)
    with _context(backend):
        for step in range(2):  # the second step reads what the first one wrote in the pool
            out_ref = call(fused_gdn_decode_reference, ref)
            if use_out:
                out = torch.full_like(out_ref, 3.0)
                got = call(_entry(backend, OUT), ours, out=out)
                assert got.data_ptr() == out.data_ptr()
            else:
                out = call(_entry(backend, OP.default), ours)
            assert_close(out, out_ref, f"out, step {step}")
            assert_close(view, ref_state, f"state, step {step}")
            assert torch.equal(_gaps(buf, view), gaps), "the op wrote outside the slots"
    assert not torch.equal(ref_state, x["state_ref"])  # the steps did update slots


def test_paged_pool_bits_equal_contiguous_pool():
    """The CPU kernel gives the same bits whatever the slot stride."""
    x, contiguous, view, _ = _paged_case(Case(B=5, H=2, Hv=4, K=128, V=32, pool=12))
    out_c = call(OP, dict(x, state_ref=contiguous))
    out_p = call(OP, dict(x, state_ref=view))
    assert torch.equal(out_c, out_p) and torch.equal(contiguous, view)


def test_vllm_like_pool_shape():
    """vLLM's layout from the issue: ssm (N, 4, 64, 64) with strides (32768, 4096, 64, 1), the
    ssm state after a conv state in each page."""
    x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=64, pool=6))
    view, buf = paged_pool(x["state_ref"].clone(), 32768, 32768 - 4 * 64 * 64)
    assert view.stride() == (32768, 4096, 64, 1)
    ref = x["state_ref"].clone()
    out_ref = call(fused_gdn_decode_reference, dict(x, state_ref=ref))
    assert_close(call(OP, dict(x, state_ref=view)), out_ref, "out")
    assert_close(view, ref, "state")


@pytest.mark.parametrize("mode", ["meta", "fake"])
def test_meta_fake_accept_paged_pool_and_out(mode):
    x, _, view, _ = _paged_case(Case(B=3, H=2, Hv=4, K=64, V=16))
    x = dict(x, state_ref=view)
    out = torch.empty(3, 1, 4, 16, dtype=torch.bfloat16)
    if mode == "meta":
        mx = to_meta(x)
        mout = torch.empty_like(out, device="meta")
        assert call(OP, mx).shape == (3, 1, 4, 16)
        r = call(OUT, mx, out=mout)
        assert r.shape == out.shape and r.data_ptr() == mout.data_ptr()
    else:
        with FakeTensorMode() as fm:
            fx = {k: (fm.from_tensor(v) if torch.is_tensor(v) else v) for k, v in x.items()}
            fout = fm.from_tensor(out)
            assert call(OP, fx).shape == (3, 1, 4, 16)
            r = call(OUT, fx, out=fout)
            assert r.shape == (3, 1, 4, 16) and r.dtype == torch.bfloat16


# The out overload's own rejections: (id, make out from x, exception, message fragment).
def _out_rows():
    bf = torch.bfloat16
    return [
        ("shape", lambda x: torch.zeros(3, 1, 4, 15, dtype=bf), ValueError,
         "out must have shape (B, 1, Hv, V) = [3, 1, 4, 16], but got [3, 1, 4, 15]"),
        ("rank", lambda x: torch.zeros(3, 4, 16, dtype=bf), ValueError,
         "out must be a 4-D tensor (B, 1, Hv, V), but got a 3-D tensor"),
        ("dtype", lambda x: torch.zeros(3, 1, 4, 16), TypeError,
         "out must have dtype torch.bfloat16 (the dtype of mixed_qkv), but got torch.float32"),
        ("non-contiguous", lambda x: torch.zeros(3, 1, 16, 4, dtype=bf).transpose(2, 3),
         ValueError, "out must be contiguous"),
        ("overlaps-state", lambda x: x["state_ref"].view(-1)[:3 * 64].view(torch.bfloat16)[
            :3 * 64].view(3, 1, 4, 16), ValueError, "out must not share memory with state_ref"),
        ("overlaps-mixed_qkv", lambda x: x["mixed_qkv"][:, :64].reshape(3, 1, 4, 16)
         if x["mixed_qkv"][:, :64].is_contiguous() else x["mixed_qkv"].view(-1)[:192].view(
             3, 1, 4, 16), ValueError, "out must not share memory with mixed_qkv"),
        ("device", lambda x: torch.zeros(3, 1, 4, 16, dtype=bf, device="meta"), ValueError,
         "out must be on cpu (the device of mixed_qkv), but got meta"),
        ("negative-view", lambda x: torch._neg_view(torch.zeros(3, 1, 4, 16, dtype=bf)),
         ValueError, "out must not be a negative view"),
        ("none", lambda x: None, TypeError, "out must be a tensor, but got None"),
        ("sparse", lambda x: torch.zeros(3, 1, 4, 16, dtype=bf).to_sparse(), TypeError,
         "out must be a dense (torch.strided) tensor, but got layout torch.sparse_coo"),
        ("misaligned", lambda x: torch.frombuffer(bytearray(3 * 64 * 2 + 1), dtype=bf, offset=1,
                                                  count=3 * 64).view(3, 1, 4, 16),
         ValueError, "out must be aligned to its element size (2 bytes)"),
    ]


def _cpu_bytes(t):
    """What a rejected call must leave as it was: a dense CPU tensor's storage bytes."""
    ok = torch.is_tensor(t) and t.layout == torch.strided and t.device.type == "cpu"
    return storage_bytes(t) if ok else None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row", _out_rows(), ids=[r[0] for r in _out_rows()])
def test_out_rejected(backend, row):
    _, make_out, exc, fragment = row
    x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16))
    out = make_out(x)
    before = storage_bytes(x["state_ref"])
    out_before = _cpu_bytes(out)
    with _context(backend), pytest.raises(exc) as info:
        call(_entry(backend, OUT), x, out=out)
    assert "npu_fused_gdn_decode" in str(info.value) and fragment in str(info.value), info.value
    assert torch.equal(storage_bytes(x["state_ref"]), before), "a rejected call changed state"
    if out_before is not None:
        assert torch.equal(storage_bytes(out), out_before), "a rejected call changed out"


@contextlib.contextmanager
def _meta_or_fake(mode):
    """Converts inputs to meta tensors or FakeTensor; inside, new tensors are of that kind too."""
    if mode == "meta":
        with torch.device("meta"):
            yield lambda x: to_device(x, "meta")  # views of one storage still share one
        return
    with fake_mode() as mode:
        yield lambda x: to_fake(mode, x)


# Rules 16-21 without data: all but the device (one device there) and the layouts and addresses
# meta tensors do not keep.
META_OUT_ROWS = [r for r in _out_rows() if r[0] not in ("device", "sparse", "misaligned")]


@pytest.mark.parametrize("mode", ["meta", "fake"])
@pytest.mark.parametrize("row", META_OUT_ROWS, ids=[r[0] for r in META_OUT_ROWS])
def test_out_rejected_on_meta_and_fake(mode, row):
    _, make_out, exc, fragment = row
    x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16))
    with _meta_or_fake(mode) as convert:
        x = convert(x)
        out = make_out(x)  # views of x's tensors share their storage
        with pytest.raises(exc) as info:
            call(OUT, x, out=out)
    assert "npu_fused_gdn_decode" in str(info.value) and fragment in str(info.value), info.value


def _pool_and_out(shift):
    """Inputs with a bf16 state pool and, under "out", an out in the same buffer, starting `shift`
    elements after the pool's end (0: right after it; -1: on its last element)."""
    x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16, state_dtype=torch.bfloat16))
    n = x["state_ref"].numel()
    buf = torch.zeros(n + 3 * 64 + 8, dtype=torch.bfloat16)
    buf[:n] = x["state_ref"].view(-1)
    return dict(x, state_ref=buf[:n].view(x["state_ref"].shape),
                out=buf[n + shift:][:3 * 64].view(3, 1, 4, 16))


@pytest.mark.parametrize("mode", ["cpu", "meta", "fake"])
def test_out_next_to_state_is_accepted_one_element_into_it_is_not(mode):
    """Rule 21 by bytes: on data by address, on meta tensors and FakeTensor by the offsets of two
    views into their one storage."""
    context = _meta_or_fake(mode) if mode != "cpu" else contextlib.nullcontext(lambda x: x)
    good, bad = _pool_and_out(0), _pool_and_out(-1)
    with context as convert:
        # pool and out converted together, so that they keep one storage
        good, bad = convert(good), convert(bad)
        assert call(OUT, good, out=good["out"]).shape == (3, 1, 4, 16)
        with pytest.raises(ValueError, match="out must not share memory with state_ref") as info:
            call(OUT, bad, out=bad["out"])
    assert ("out spans the bytes [0x" if mode == "cpu" else
            "both are views of one storage, out spanning its bytes [") in str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_in_a_paged_pools_padding_is_rejected(backend):
    """Rule 21 by the bytes a tensor spans: state_ref spans from its first slot to the end of its
    last, so an out in the padding between two slots of a paged pool (bytes no slot holds) is
    rejected, and neither the pool nor out changes."""
    x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16, state_dtype=torch.bfloat16))
    _, Hv, V, K = x["state_ref"].shape
    view, buf = paged_pool(x["state_ref"], Hv * V * K + 3 * 64 + 8, 4)
    gap = view.storage_offset() + Hv * V * K  # right after slot 0, before slot 1
    out = buf[gap:gap + 3 * 64].view(3, 1, 4, 16)
    before = storage_bytes(buf)
    with _context(backend), pytest.raises(ValueError) as info:
        call(_entry(backend, OUT), dict(x, state_ref=view), out=out)
    assert "out must not share memory with state_ref" in str(info.value), info.value
    assert torch.equal(storage_bytes(buf), before), "a rejected call changed the pool or out"


@pytest.mark.parametrize("backend", ["cpu", "composite"])
@pytest.mark.parametrize("indices,fragment", [
    ([3, 0, 3], "must not repeat a positive slot, but slot 3 is used by rows 0 and 2"),
    ([1, 8, 2], "ssm_state_indices[1] = 8 is out of range"),
], ids=["duplicate", "out-of-range"])
def test_out_overload_rejected_indices_leave_state_and_out(backend, indices, fragment):
    x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16))
    x["ssm_state_indices"] = torch.tensor(indices, dtype=torch.int32)
    out = torch.full((3, 1, 4, 16), 5.0, dtype=torch.bfloat16)
    before, out_before = storage_bytes(x["state_ref"]), storage_bytes(out)
    with pytest.raises(ValueError) as info:
        call(_entry(backend, OUT), x, out=out)
    assert fragment in str(info.value), info.value
    assert torch.equal(storage_bytes(x["state_ref"]), before), "a rejected call changed state"
    assert torch.equal(storage_bytes(out), out_before), "a rejected call changed out"


def test_out_overload_schema():
    assert str(OUT._schema) == (
        "custom::npu_fused_gdn_decode.out(Tensor mixed_qkv, Tensor a, Tensor b, Tensor a_log, "
        "Tensor dt_bias, Tensor(a!) state_ref, Tensor ssm_state_indices, float scale, *, "
        "float softplus_threshold=20., Tensor(b!) out) -> Tensor(b!)")
    for key in ("CPU", "Meta", "CUDA", "PrivateUse1", "CompositeExplicitAutograd", "Autograd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(OUT.name(), key), key


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_opcheck_out(paged):
    x, _, view, _ = _paged_case(Case(B=3, H=2, Hv=4, K=64, V=16, invalid_rows=(1,)))
    if paged:
        x = dict(x, state_ref=view)
    out = torch.empty(3, 1, 4, 16, dtype=torch.bfloat16)
    torch.library.opcheck(OUT, positional_args(x), {"softplus_threshold": 15.0, "out": out})
    torch.library.opcheck(OP.default, positional_args(x), {"softplus_threshold": 15.0})


def _two_steps_out(mixed_qkv, a, b, a_log, dt_bias, state, idx, scale, out):
    OUT(mixed_qkv, a, b, a_log, dt_bias, state, idx, scale, out=out)
    o1 = out.clone()
    OUT(mixed_qkv * 0.5, a, b, a_log, dt_bias, state, idx, scale, softplus_threshold=10.0,
        out=out)
    return o1 + out


def test_compile_out_on_paged_pool():
    torch._dynamo.reset()
    x, _, view, _ = _paged_case(Case(B=4, H=2, Hv=4, K=64, V=16, invalid_rows=(2,)))
    _, _, view2, _ = _paged_case(Case(B=4, H=2, Hv=4, K=64, V=16, invalid_rows=(2,)))
    out_e = torch.empty(4, 1, 4, 16, dtype=torch.bfloat16)
    out_c = torch.empty_like(out_e)
    r_e = _two_steps_out(*positional_args(dict(x, state_ref=view)), out_e)
    fn = torch.compile(_two_steps_out, fullgraph=True, backend="inductor")
    r_c = fn(*positional_args(dict(x, state_ref=view2)), out_c)
    assert_close(r_c, r_e, "sum")
    assert torch.equal(out_c, out_e)  # the compiled graph wrote the caller's out
    assert torch.equal(view2, view)   # and the caller's paged pool


@pytest.mark.parametrize("requires_grad", ["mixed_qkv", "out"])
def test_out_requires_grad_refused(requires_grad):
    """With an input (or out) that requires grad the call itself succeeds and writes what the
    default overload computes; the refusal comes from backward through out or the updated state,
    with the op's message (docs/bad_input.md, "Autograd")."""
    x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16))
    expected_state = x["state_ref"].clone()
    expected = call(OP, dict(x, state_ref=expected_state))
    out = torch.empty(3, 1, 4, 16, dtype=torch.bfloat16)
    if requires_grad == "out":
        out = out.requires_grad_() * 1.0  # a non-leaf: a leaf that requires grad is refused
    else:
        x["mixed_qkv"] = x["mixed_qkv"].clone().requires_grad_()
    r = call(OUT, x, out=out)
    assert r is out and torch.equal(r.detach(), expected)
    assert torch.equal(x["state_ref"], expected_state)
    for t in (r, x["state_ref"]):
        assert t.requires_grad
        with pytest.raises(RuntimeError, match="npu_fused_gdn_decode is not differentiable: it "
                           "is an inference-only decode step with no backward") as info:
            t.sum().backward(retain_graph=True)
        assert type(info.value) is RuntimeError
