"""The NPU (PrivateUse1) binding, driven through the real dispatcher without an NPU.

Two test doubles, both built here from sources in tests/:
- tests/fake_npu/fake_npu_device.cpp: a PrivateUse1 device backed by host memory,
  with a device guard that has streams, and a stand-in for torch_npu's exported stream functions;
- tests/fake_acl/fake_opapi.cpp: a fake vendor libcust_opapi.so that computes the op on host
  memory from the aclTensor descriptions alone, records every call and can be told to fail.
The binding finds the fake library the way it finds the real one (ASCEND_CUSTOM_OPP_PATH, then
vendors/config.ini), so the loader's search order is tested too.
"""

import ctypes
import importlib.util
import os
import shutil
import subprocess

import pytest
import torch

from custom_ops.reference import fused_gdn_decode_reference
from custom_ops.testing import (
    ARG_NAMES,
    DTYPE_PAIR_IDS,
    DTYPE_PAIRS,
    OP,
    Case,
    assert_close,
    call,
    clone_inputs,
    make_inputs,
    storage_bytes,
    to_device,
)

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE_SRC = os.path.join(HERE, "fake_acl", "fake_opapi.cpp")
DEVICE_SRC = os.path.join(HERE, "fake_npu", "fake_npu_device.cpp")
NPU = torch.ops.custom_ops_npu

DEV = "privateuseone"  # the PrivateUse1 backend's default name

# The fake device registers itself as the PrivateUse1 backend, which a real one (torch_npu) owns.
_REAL_BACKEND = (importlib.util.find_spec("torch_npu") is not None
                 or torch._C._get_privateuse1_backend_name() != DEV)
pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the fakes"),
    pytest.mark.skipif(_REAL_BACKEND, reason="a real PrivateUse1 backend (torch_npu) is present; "
                       "verify there with python -m benchmarks.npu_vs_cpu (docs/npu.md)"),
]


def _compile_fake(out_path, *defines):
    subprocess.run(
        ["g++", "-std=c++17", "-O2", "-Wall", "-Wno-unused-function", "-shared", "-fPIC",
         *defines, FAKE_SRC, "-o", str(out_path)],
        check=True, capture_output=True, text=True)


@pytest.fixture(scope="session")
def fake_builds(tmp_path_factory):
    """The fake vendor library (and a variant without the op), compiled once per session."""
    d = tmp_path_factory.mktemp("fake_acl_build")
    _compile_fake(d / "with_op.so")
    _compile_fake(d / "without_op.so", "-DFAKE_WITHOUT_OP")
    return d


@pytest.fixture(scope="session")
def device():
    return load_device()


def load_device():
    """Loads the host-memory PrivateUse1 device; returns its library path. The backend keeps its
    default name, "privateuseone" (no rename to "npu" and no torch.npu module, so other test files
    in the same session that look for torch.npu are not misled)."""
    from torch.utils.cpp_extension import load

    path = load(name="custom_ops_fake_npu_device", sources=[DEVICE_SRC], is_python_module=False,
                extra_cflags=["-O1"], verbose=False)
    if not hasattr(torch, DEV):
        torch._register_device_module(DEV, _device_module())
    return path


def _device_module():
    """The few torch.npu functions torch's Python side asks a PrivateUse1 backend for."""
    import types

    m = types.ModuleType("fake_torch_npu")
    m.is_available = lambda: True
    m.device_count = lambda: 1
    m.current_device = lambda: 0
    m.is_initialized = lambda: True
    m._lazy_init = lambda: None
    m._is_in_bad_fork = lambda: False
    m.manual_seed_all = lambda seed: None
    return m


def install(root, builds, variant="with_op.so"):
    """Lays out <root>/op_api/lib/libcust_opapi.so (a copy: each path is its own loaded instance,
    so each has its own counters)."""
    lib_dir = root / "op_api" / "lib"
    lib_dir.mkdir(parents=True)
    shutil.copy(builds / variant, lib_dir / "libcust_opapi.so")
    return str(lib_dir / "libcust_opapi.so")


def open_fake(path):
    lib = ctypes.CDLL(path)  # the same instance the binding loaded (dlopen dedups by path)
    lib.fake_acl_counter.restype = ctypes.c_int64
    lib.fake_acl_counter.argtypes = [ctypes.c_char_p]
    lib.fake_acl_log.restype = ctypes.c_char_p
    lib.fake_acl_last_stream.restype = ctypes.c_size_t
    lib.fake_acl_set_workspace_size.argtypes = [ctypes.c_uint64]
    lib.fake_acl_fail.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p]
    lib.fake_acl_set_live_checker.argtypes = [ctypes.c_void_p]
    lib.fake_acl_set_capture_status.argtypes = [ctypes.c_int]
    lib.count = lambda name: lib.fake_acl_counter(name.encode())
    return lib


@pytest.fixture
def env(monkeypatch):
    """A clean vendor environment; the binding searches again in every test."""
    for var in ("ASCEND_CUSTOM_OPP_PATH", "ASCEND_OPP_PATH", "CUSTOM_OPS_TORCH_NPU_LIB",
                "CUSTOM_OPS_NPU_CHECK_INDICES"):
        monkeypatch.delenv(var, raising=False)
    NPU.reset_vendor()
    yield monkeypatch
    NPU.reset_vendor()


@pytest.fixture
def fake(env, tmp_path, fake_builds, device):
    """The fake vendor library, found through ASCEND_CUSTOM_OPP_PATH, with counters reset and the
    device's liveness check plugged in."""
    path = install(tmp_path / "custom", fake_builds)
    env.setenv("ASCEND_CUSTOM_OPP_PATH", str(tmp_path / "custom"))
    lib = open_fake(path)
    lib.fake_acl_reset()
    lib.fake_acl_set_live_checker(ctypes.c_void_p(torch.ops.fake_npu.live_checker()))
    lib.path = path
    yield lib
    lib.fake_acl_set_live_checker(None)


def npu_inputs(inputs):
    """The inputs on the fake npu, each keeping its exact view (storage size, strides, offset)."""
    return to_device(inputs, DEV)


def state_bytes(inputs):
    """Every byte of the storage behind inputs["state_ref"], on the CPU (storage_bytes's set_ does
    not run on the fake device; as_strided does)."""
    t = inputs["state_ref"]
    whole = t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    return storage_bytes(whole.cpu())


def run_against_reference(inputs, **kw):
    """Runs the reference and the npu binding on copies of the same inputs and checks the
    binding's out and whole state pool against the reference's (per-dtype tolerances); returns
    (npu out, npu state), back on the CPU."""
    ref = clone_inputs(inputs)
    dev = npu_inputs(inputs)
    out_ref = call(fused_gdn_decode_reference, ref, **kw)
    out_npu = call(OP, dev, **kw)
    assert out_npu.device.type == DEV
    assert out_npu.shape == out_ref.shape and out_npu.dtype == out_ref.dtype
    assert out_npu.is_contiguous()
    out_npu, state_npu = out_npu.cpu(), dev["state_ref"].cpu()
    assert_close(out_npu, out_ref, "out")
    assert_close(state_npu, ref["state_ref"], "state")
    return out_npu, state_npu


def assert_balanced(lib):
    assert lib.count("live_tensors") == 0, "aclTensors leaked"
    assert lib.count("tensors_made") == lib.count("aclDestroyTensor")
    assert lib.count("live_executors") == 0, "executor leaked"
    assert lib.count("bad_destroy") == 0, "double or foreign destroy"


# ---- results ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,state_dtype", DTYPE_PAIRS,
                         ids=DTYPE_PAIR_IDS)
def test_matches_reference(fake, dtype, state_dtype):
    case = Case(B=4, H=2, Hv=4, K=64, V=16, dtype=dtype, state_dtype=state_dtype,
                invalid_rows=(1, 2))
    inputs = make_inputs(case)
    state_before = inputs["state_ref"].clone()
    out_npu, state_npu = run_against_reference(inputs, softplus_threshold=2.0)
    assert (out_npu[1:3] == 0).all()  # invalid rows
    assert not torch.equal(state_npu, state_before)  # the state really was updated in place
    assert fake.count("GetWorkspaceSize") == 1 and fake.count("Launch") == 1
    assert_balanced(fake)


def test_gqa_ratio_3_and_k_not_multiple_of_16(fake):
    # Hv/H = 3 and K = 72 with a bf16 state (accepted), B larger than one head group.
    run_against_reference(make_inputs(Case(B=5, H=2, Hv=6, K=72, V=8,
                                           state_dtype=torch.bfloat16)))


def test_non_contiguous_views_and_storage_offsets(fake):
    inputs = make_inputs(Case(B=3, H=1, Hv=2, K=64, V=16, layout="strided"))
    # Every input a view: offsets, row strides wider than the row, a column-major a, every other
    # element of the vectors, a state that does not start its storage.
    for name, t in inputs.items():
        if torch.is_tensor(t) and name != "state_ref":
            assert not t.is_contiguous() or t.storage_offset() > 0, name
    assert inputs["state_ref"].is_contiguous() and inputs["state_ref"].storage_offset() > 0
    assert inputs["a"].stride() == (1, 3) and inputs["mixed_qkv"].storage_offset() > 0

    run_against_reference(inputs)
    assert_balanced(fake)


def test_several_steps_and_stream_of_calls(fake):
    inputs = make_inputs(Case(B=2, H=2, Hv=4, K=64, V=16, dtype=torch.float16))
    ref = clone_inputs(inputs)
    dev = npu_inputs(inputs)
    for step in range(3):
        out_ref = call(fused_gdn_decode_reference, ref)
        out_npu = call(OP, dev)
        assert_close(out_npu.cpu(), out_ref, f"out, step {step}")
        assert_close(dev["state_ref"].cpu(), ref["state_ref"], f"state, step {step}")
    assert fake.count("Launch") == 3
    assert_balanced(fake)


def test_opcheck(fake):
    # Schema (the in-place state write is declared), Meta/fake kernel agreement with this kernel,
    # and AOT dispatch, all on PrivateUse1 tensors.
    x = npu_inputs(make_inputs(Case(B=2)))
    args = (x["mixed_qkv"], x["a"], x["b"], x["a_log"], x["dt_bias"], x["state_ref"],
            x["ssm_state_indices"], x["scale"])
    torch.library.opcheck(OP.default, args, {"softplus_threshold": 15.0})
    assert fake.count("Launch") >= 1  # the vendor path ran, not the CPU fallback
    assert_balanced(fake)


def test_out_overload_writes_caller_buffer(fake):
    """The out overload hands the vendor the caller's tensor as its out (no copy): the results
    equal the default overload's, in the very tensor passed."""
    x = make_inputs(Case(B=3))
    out_default, state_default = run_against_reference(x)
    dev = npu_inputs(x)
    out = torch.full(out_default.shape, 5.0, dtype=out_default.dtype).to(DEV)
    got = call(OP.out, dev, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out.cpu(), out_default)
    assert torch.equal(dev["state_ref"].cpu(), state_default)
    args = (dev["mixed_qkv"], dev["a"], dev["b"], dev["a_log"], dev["dt_bias"], dev["state_ref"],
            dev["ssm_state_indices"], dev["scale"])
    torch.library.opcheck(OP.out, args, {"out": out})
    assert_balanced(fake)


def test_slot_strided_pool_refused(fake):
    """The vendor kernel takes no slot stride: a paged pool is a ValueError naming the stride,
    raised before the vendor is called, the pool untouched."""
    from custom_ops.testing import paged_pool

    x = make_inputs(Case(B=3))
    _, Hv, V, K = x["state_ref"].shape
    view, _ = paged_pool(x["state_ref"].clone(), Hv * V * K + 32, 16)
    dev = npu_inputs(dict(x, state_ref=view))
    before = dev["state_ref"].cpu()
    with pytest.raises(ValueError, match=r"on NPU state_ref must be contiguous .*"
                       rf"state_ref.stride\(0\) must be Hv\*V\*K = {Hv * V * K}"):
        call(OP, dev)
    assert torch.equal(dev["state_ref"].cpu(), before)
    assert fake.count("GetWorkspaceSize") == 0 and fake.count("Launch") == 0


# ---- protocol: order, lifetimes, balance -----------------------------------------------------

def test_two_phase_order_and_destroy_after_launch(fake):
    call(OP, npu_inputs(make_inputs(Case())))
    # 8 aclTensors (7 inputs + out), phase one, the launch, then every tensor destroyed.
    assert fake.fake_acl_log().decode().split() == ["C"] * 8 + ["W", "L"] + ["D"] * 8
    assert fake.count("executors_created") == fake.count("executors_consumed") == 1
    assert_balanced(fake)


@pytest.mark.parametrize("size", [0, 1 << 20])
def test_workspace_from_torch_allocator(fake, size):
    # The fake checks at launch that [workspace, workspace + size) is a live allocation of the
    # device allocator, then writes all of it.
    fake.fake_acl_set_workspace_size(size)
    run_against_reference(make_inputs(Case()))
    assert_balanced(fake)


def test_workspace_allocation_failure_releases_executor(fake):
    fake.fake_acl_set_workspace_size(1 << 50)  # the fake device refuses it
    inputs = npu_inputs(make_inputs(Case()))
    with pytest.raises(torch.OutOfMemoryError):
        call(OP, inputs)
    assert fake.count("Launch") == 0
    assert fake.count("aclDestroyAclOpExecutor") == 1  # made repeatable, then destroyed
    assert_balanced(fake)


# ---- vendor errors ---------------------------------------------------------------------------

@pytest.mark.parametrize("phase,status,meaning,call_name", [
    (1, 161002, "ACLNN_ERR_PARAM_INVALID", "aclnnFusedGdnDecodeGetWorkspaceSize"),
    (1, 161001, "ACLNN_ERR_PARAM_NULLPTR", "aclnnFusedGdnDecodeGetWorkspaceSize"),
    (2, 161002, "ACLNN_ERR_PARAM_INVALID", "aclnnFusedGdnDecode "),
    (2, 161001, "ACLNN_ERR_PARAM_NULLPTR", "aclnnFusedGdnDecode "),
])
def test_vendor_status_becomes_runtime_error(fake, phase, status, meaning, call_name):
    fake.fake_acl_fail(phase, status, b"injected: tiling rejected the shape")
    inputs = npu_inputs(make_inputs(Case()))
    state_before = inputs["state_ref"].cpu()
    with pytest.raises(RuntimeError) as e:
        call(OP, inputs)
    msg = str(e.value)
    assert call_name in msg and f"status {status}" in msg and meaning in msg
    assert "injected: tiling rejected the shape" in msg  # aclGetRecentErrMsg
    assert fake.path in msg
    assert torch.equal(inputs["state_ref"].cpu(), state_before)
    assert_balanced(fake)


@pytest.mark.parametrize("nth", [1, 5, 8])
def test_create_tensor_failure_releases_the_others(fake, nth):
    fake.fake_acl_fail(3, nth, b"injected: out of host memory")
    inputs = npu_inputs(make_inputs(Case()))
    before = state_bytes(inputs)
    names = ["mixed_qkv", "a", "b", "a_log", "dt_bias", "state_ref", "ssm_state_indices", "out"]
    with pytest.raises(RuntimeError, match=f"aclCreateTensor returned null for {names[nth - 1]} "):
        call(OP, inputs)
    assert torch.equal(state_bytes(inputs), before), "a rejected call changed state"
    assert fake.count("GetWorkspaceSize") == 0
    assert fake.count("aclDestroyTensor") == nth - 1
    assert_balanced(fake)


def test_fake_enforces_the_protocol(fake):
    # The double itself must be able to fail: a launch without phase one, a view that overruns
    # its storage, and a destroy of a tensor it never made are all refused.
    fake.aclnnFusedGdnDecode.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p,
                                         ctypes.c_void_p]
    assert fake.aclnnFusedGdnDecode(None, 0, 0x1234, None) == 161002
    fake.aclCreateTensor.restype = ctypes.c_void_p
    fake.aclCreateTensor.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p]
    fake.aclDestroyTensor.argtypes = [ctypes.c_void_p]
    dims = (ctypes.c_int64 * 1)(4)
    strides = (ctypes.c_int64 * 1)(1)
    storage = (ctypes.c_int64 * 1)(3)  # 4 elements claimed over a storage of 3
    buf = (ctypes.c_float * 3)()
    t = fake.aclCreateTensor(dims, 1, 0, strides, 0, 2, storage, 1, buf)
    fake.aclnnFusedGdnDecodeGetWorkspaceSize.argtypes = [ctypes.c_void_p] * 7 + [
        ctypes.c_float, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    ws, ex = ctypes.c_uint64(), ctypes.c_void_p()
    assert fake.aclnnFusedGdnDecodeGetWorkspaceSize(
        t, t, t, t, t, t, t, 1.0, 20.0, t, ctypes.byref(ws), ctypes.byref(ex)) == 161002
    assert fake.aclDestroyTensor(t) == 0
    assert fake.aclDestroyTensor(t) == 161002 and fake.count("bad_destroy") == 1


def test_input_check_runs_before_the_vendor(env, device, fake_builds, tmp_path):
    # No vendor library at all: a bad dtype is still a TypeError from the shared check.
    inputs = npu_inputs(make_inputs(Case()))
    inputs["a_log"] = inputs["a_log"].to(torch.bfloat16)
    before = state_bytes(inputs)
    with pytest.raises(TypeError, match="a_log must have dtype"):
        call(OP, inputs)
    assert torch.equal(state_bytes(inputs), before), "a rejected call changed state"


@pytest.mark.parametrize("name", ["scale", "softplus_threshold"])
def test_floats_beyond_float32_are_rejected(fake, name):
    # The vendor C API takes float: 1e39 would reach it as inf (the check is the shared one).
    inputs = npu_inputs(dict(make_inputs(Case()), **{name: 1e39}))
    thr = inputs.pop("softplus_threshold", 20.0)
    before = state_bytes(inputs)
    with pytest.raises(ValueError, match=rf"{name} must be finite and within float32's range"):
        call(OP, inputs, softplus_threshold=thr)
    assert torch.equal(state_bytes(inputs), before), "a rejected call changed state"
    assert fake.count("GetWorkspaceSize") == 0


def test_debug_index_check(fake, env):
    inputs = make_inputs(Case(B=3))
    inputs["ssm_state_indices"][2] = inputs["ssm_state_indices"][0]
    call(OP, npu_inputs(inputs))  # the vendor leaves duplicates to the caller
    assert fake.count("Launch") == 1
    env.setenv("CUSTOM_OPS_NPU_CHECK_INDICES", "1")
    dev = npu_inputs(inputs)  # a state no call has written
    before = state_bytes(dev)
    with pytest.raises(ValueError, match=r"must not repeat a positive slot, but slot \d+ is "
                       "used by rows 0 and 2"):
        call(OP, dev)
    assert torch.equal(state_bytes(dev), before), "a rejected call changed state"
    assert fake.count("Launch") == 1  # refused before the vendor


# ---- the stream --------------------------------------------------------------------------------

def test_stream_from_device_guard(fake):
    guard_base, _ = torch.ops.fake_npu.handle_bases()
    inputs = npu_inputs(make_inputs(Case()))
    call(OP, inputs)
    assert fake.fake_acl_last_stream() == guard_base + 0
    old = torch.ops.fake_npu.set_stream(3)
    try:
        call(OP, inputs)
    finally:
        torch.ops.fake_npu.set_stream(old)
    assert fake.fake_acl_last_stream() == guard_base + 3
    assert "device guard" in NPU.vendor_info()


def test_stream_from_torch_npu_api(fake, env, device):
    # The device library also defines c10_npu::getCurrentNPUStream / NPUStream::stream as
    # torch_npu declares them; point the binding at it as if it were libtorch_npu.so.
    assert "device guard" in NPU.vendor_info()  # a look before "torch_npu" is loaded...
    env.setenv("CUSTOM_OPS_TORCH_NPU_LIB", device)  # ...is not final
    _, shim_base = torch.ops.fake_npu.handle_bases()
    calls0, flushes0 = torch.ops.fake_npu.stats()[:2]
    inputs = npu_inputs(make_inputs(Case()))
    old = torch.ops.fake_npu.set_stream(5)
    try:
        out = call(OP, inputs)
    finally:
        torch.ops.fake_npu.set_stream(old)
    assert fake.fake_acl_last_stream() == shim_base + 5
    calls, flushes = torch.ops.fake_npu.stats()[:2]
    assert calls == calls0 + 1 and flushes == flushes0 + 1  # stream(need_empty=true)
    assert "c10_npu::getCurrentNPUStream" in NPU.vendor_info()
    assert_close(out.cpu(), call(OP, make_inputs(Case())), "out")


@pytest.fixture
def torch_npu_api(env, device):
    """The binding takes the stream and the storage format from the device library's stand-ins
    of torch_npu's exported functions, as it would from libtorch_npu.so."""
    env.setenv("CUSTOM_OPS_TORCH_NPU_LIB", device)
    NPU.reset_vendor()
    yield
    torch.ops.fake_npu.set_null_stream(False)
    torch.ops.fake_npu.clear_formats()


def test_null_stream_raises_and_launches_nothing(fake, torch_npu_api):
    inputs = npu_inputs(make_inputs(Case()))
    before = inputs["state_ref"].cpu()
    torch.ops.fake_npu.set_null_stream(True)  # torch_npu's answer when its queue flush fails
    with pytest.raises(RuntimeError, match=r"c10_npu::NPUStream::stream\(need_empty=true\) "
                                           r"returned a null aclrtStream"):
        call(OP, inputs)
    assert fake.count("GetWorkspaceSize") == 0 and fake.count("Launch") == 0
    assert torch.equal(inputs["state_ref"].cpu(), before)
    torch.ops.fake_npu.set_null_stream(False)
    call(OP, inputs)  # the same call works once the stream is back
    assert fake.count("Launch") == 1


@pytest.mark.parametrize("name", ARG_NAMES)
@pytest.mark.parametrize("fmt", [29, 3, 1], ids=["FRACTAL_NZ", "NC1HWC0", "NHWC"])
def test_private_storage_format_is_rejected(fake, torch_npu_api, name, fmt):
    inputs = npu_inputs(make_inputs(Case()))
    before = inputs["state_ref"].cpu()
    torch.ops.fake_npu.set_format(inputs[name], fmt)  # as torch_npu.npu_format_cast leaves it
    # torch_npu keeps the format per storage: a and b are views of one (named: a, the first)
    storage = inputs[name].untyped_storage().data_ptr()
    first = next(n for n in ARG_NAMES if inputs[n].untyped_storage().data_ptr() == storage)
    with pytest.raises(ValueError, match=rf"npu_fused_gdn_decode: {first} must be stored in a "
                                         rf"plain NPU format.*aclFormat {fmt}\)"):
        call(OP, inputs)
    assert fake.count("GetWorkspaceSize") == 0
    assert torch.equal(inputs["state_ref"].cpu(), before)


@pytest.mark.parametrize("fmt", [2, 0, 30], ids=["ND", "NCHW", "NCDHW"])
def test_plain_storage_formats_are_accepted(fake, torch_npu_api, fmt):
    inputs = make_inputs(Case())
    dev = npu_inputs(inputs)
    for name in ARG_NAMES:
        torch.ops.fake_npu.set_format(dev[name], fmt)
    out = call(OP, dev)
    assert_close(out.cpu(), call(OP, inputs), "out")
    assert_close(dev["state_ref"].cpu(), inputs["state_ref"], "state")


def test_capture_makes_no_host_copy_or_sync(fake, torch_npu_api, env):
    """While the stream is captured into an ACL graph (reduce-overhead mode), a call copies
    nothing to the host, does not synchronise, and allocates only through torch's allocator (the
    fake checks that workspace and tensors are live allocations of the device)."""
    inputs = npu_inputs(make_inputs(Case(B=3)))
    fake.fake_acl_set_capture_status(1)
    d2h0, syncs0 = torch.ops.fake_npu.stats()[3:5]
    call(OP, inputs)
    assert torch.ops.fake_npu.stats()[3:5] == [d2h0, syncs0]
    assert fake.count("Launch") == 1

    env.setenv("CUSTOM_OPS_NPU_CHECK_INDICES", "1")  # its slot check copies to the host...
    with pytest.raises(RuntimeError, match="not allowed while the stream is being captured"):
        call(OP, inputs)
    assert fake.count("Launch") == 1
    fake.fake_acl_set_capture_status(0)  # ...which is fine outside a capture
    call(OP, inputs)
    assert fake.count("Launch") == 2
    assert torch.ops.fake_npu.stats()[3] > d2h0  # the counter does see host copies


# ---- library search order --------------------------------------------------------------------

def assert_runs_from(path):
    """The binding reports the library at `path` as the one it found and launches through it."""
    assert f"op library: {path}" in NPU.vendor_info()
    lib = open_fake(path)
    lib.fake_acl_reset()
    call(OP, npu_inputs(make_inputs(Case())))
    assert lib.count("Launch") == 1


def test_custom_opp_path_entries_in_order(env, device, fake_builds, tmp_path):
    first = install(tmp_path / "first", fake_builds)
    install(tmp_path / "second", fake_builds)
    env.setenv("ASCEND_CUSTOM_OPP_PATH",
               f"{tmp_path / 'missing'}:{tmp_path / 'first'}:{tmp_path / 'second'}")
    assert_runs_from(first)


def test_vendors_config_ini_priority(env, device, fake_builds, tmp_path):
    opp = tmp_path / "opp"
    install(opp / "vendors" / "alpha", fake_builds)
    beta = install(opp / "vendors" / "beta", fake_builds)
    (opp / "vendors" / "config.ini").write_text("# vendors\nload_priority=beta, alpha\n")
    env.setenv("ASCEND_OPP_PATH", str(opp))
    assert_runs_from(beta)


def test_custom_path_before_vendors(env, device, fake_builds, tmp_path):
    opp = tmp_path / "opp"
    install(opp / "vendors" / "alpha", fake_builds)
    (opp / "vendors" / "config.ini").write_text("load_priority=alpha\n")
    custom = install(tmp_path / "custom", fake_builds)
    env.setenv("ASCEND_OPP_PATH", str(opp))
    env.setenv("ASCEND_CUSTOM_OPP_PATH", str(tmp_path / "custom"))
    assert_runs_from(custom)


def test_library_without_the_op_is_skipped(env, device, fake_builds, tmp_path):
    without = install(tmp_path / "other_ops", fake_builds, "without_op.so")
    opp = tmp_path / "opp"
    alpha = install(opp / "vendors" / "alpha", fake_builds)
    (opp / "vendors" / "config.ini").write_text("load_priority=alpha\n")
    env.setenv("ASCEND_CUSTOM_OPP_PATH", str(tmp_path / "other_ops"))
    env.setenv("ASCEND_OPP_PATH", str(opp))
    assert f"op library: {alpha}" in NPU.vendor_info()
    # ...and when nothing else has it, the error says why that library was passed over.
    env.delenv("ASCEND_OPP_PATH")
    NPU.reset_vendor()
    with pytest.raises(RuntimeError, match="does not export aclnnFusedGdnDecodeGetWorkspaceSize"):
        call(OP, npu_inputs(make_inputs(Case())))
    assert without in NPU.vendor_info()


def test_not_found_error_names_every_place_searched(env, device, tmp_path):
    opp = tmp_path / "opp"
    (opp / "vendors").mkdir(parents=True)
    (opp / "vendors" / "config.ini").write_text("load_priority=nobody\n")
    env.setenv("ASCEND_CUSTOM_OPP_PATH", f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    env.setenv("ASCEND_OPP_PATH", str(opp))
    inputs = npu_inputs(make_inputs(Case()))
    state_before = inputs["state_ref"].cpu()
    with pytest.raises(RuntimeError) as e:
        call(OP, inputs)
    msg = str(e.value)
    expected = [
        f"{tmp_path / 'a'}/op_api/lib/libcust_opapi.so",
        f"{tmp_path / 'b'}/op_api/lib/libcust_opapi.so",
        f"{opp}/vendors/nobody/op_api/lib/libcust_opapi.so",
        "libopapi_transformer.so",
        "libopapi.so",
    ]
    positions = [msg.find(p) for p in expected]
    assert all(p >= 0 for p in positions), msg
    assert positions == sorted(positions), "search order"
    assert "aclnnFusedGdnDecode" in msg and "ASCEND_CUSTOM_OPP_PATH" in msg
    assert torch.equal(inputs["state_ref"].cpu(), state_before)


def test_unset_variables_are_reported(env, device):
    with pytest.raises(RuntimeError) as e:
        call(OP, npu_inputs(make_inputs(Case())))
    assert "ASCEND_CUSTOM_OPP_PATH is not set" in str(e.value)
    assert "ASCEND_OPP_PATH is not set" in str(e.value)


def test_failed_search_is_not_cached(env, device, fake_builds, tmp_path):
    inputs = npu_inputs(make_inputs(Case()))
    with pytest.raises(RuntimeError):
        call(OP, inputs)
    install(tmp_path / "late", fake_builds)
    env.setenv("ASCEND_CUSTOM_OPP_PATH", str(tmp_path / "late"))
    call(OP, inputs)  # found now, without reset_vendor()
