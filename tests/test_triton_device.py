"""The Triton launcher launches on the device of its tensors, not on the current one; and, on a
CUDA host, the CUDA path's checks.

Triton launches on the current CUDA device and its current stream. Without a GPU, two labelled
test doubles stand in: FakeTensorMode tensors on cuda:1 (shapes, dtypes and devices without
memory), and a fake of the CUDA runtime's current device (``torch.cuda.device`` and
``torch.cuda.current_device``) with cuda:0 current. The jitted kernel is replaced by a recorder of
the current device at launch.

The tests after them run the compiled kernel on a CUDA device (skipped without one, and in a
process that runs Triton's interpreter: tests/triton_mode.py; ``python -m pytest
tests/test_triton_device.py`` on a GPU host). What a real second GPU does is checked by
test_multi_gpu_device_guard on a host with two. The NaN/Inf cases are test_triton_interpret.py's,
run compiled.
"""

import contextlib
import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Imported before the tests below patch a fake current device into torch.cuda: Dynamo's CUDA
# interface keeps the torch.cuda functions it finds when first imported, and on a GPU host the
# torch.compile tests later in the session would go on asking the fake for the current device.
import torch._dynamo.device_interface
from torch._subclasses.fake_tensor import FakeTensorMode

from custom_ops.testing import VALUE_PLACES

pytest.importorskip("triton")

from custom_ops import triton_kernel as tk  # noqa: E402


class FakeCurrentDevice:
    """Test double of the CUDA runtime's current-device state."""

    def __init__(self, current):
        self.current = current

    @contextlib.contextmanager
    def device(self, dev):  # stands in for torch.cuda.device(dev)
        old = self.current
        self.current = dev if isinstance(dev, int) else torch.device(dev).index
        try:
            yield
        finally:
            self.current = old

    def current_device(self):
        return self.current


class RecordingKernel:
    """Stands in for the jitted kernel: records the current device and the keyword arguments
    (constexprs and launch options) of each launch."""

    def __init__(self):
        self.launched_on = []
        self.kwargs = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched_on.append(torch.cuda.current_device())
            self.kwargs.append(kwargs)
        return launch


@pytest.mark.parametrize("tensor_device,current", [("cuda:1", 0), ("cuda:0", 1), ("cuda:1", 1)])
def test_launch_on_the_tensors_device(monkeypatch, tensor_device, current):
    index = torch.device(tensor_device).index
    if torch.cuda.is_available() and index >= torch.cuda.device_count():
        # Where CUDA is real, torch.empty checks the index even under FakeTensorMode.
        pytest.skip(f"FakeTensorMode cannot make {tensor_device} tensors on a host with "
                    f"{torch.cuda.device_count()} CUDA device(s); test_multi_gpu_device_guard "
                    "runs the real case on two")
    runtime = FakeCurrentDevice(current)
    monkeypatch.setattr(torch.cuda, "device", runtime.device)
    monkeypatch.setattr(torch.cuda, "current_device", runtime.current_device)
    kernel = RecordingKernel()
    monkeypatch.setattr(tk, "_jitted", lambda interpret: kernel)
    B, H, Hv, K, V = 2, 1, 2, 64, 16

    with FakeTensorMode():
        def empty(*shape, dtype=torch.bfloat16):
            return torch.empty(*shape, dtype=dtype, device=tensor_device)

        out = tk.fused_gdn_decode_triton(
            empty(B, 2 * H * K + Hv * V), empty(B, Hv), empty(B, Hv),
            empty(Hv, dtype=torch.float32), empty(Hv), empty(3, Hv, V, K, dtype=torch.float32),
            empty(B, dtype=torch.int32), K**-0.5)
        assert out.device == torch.device(tensor_device)
    assert kernel.launched_on == [torch.device(tensor_device).index]
    assert runtime.current == current  # restored after the launch


@pytest.mark.parametrize("capability,hip,want", [
    ((8, 0), None, False), ((8, 9), None, False),
    pytest.param((9, 0), None, True, marks=pytest.mark.skipif(
        not tk.HAS_GDC, reason="this triton has no griddepcontrol (3.3 and later have)")),
    pytest.param((10, 0), None, True, marks=pytest.mark.skipif(
        not tk.HAS_GDC, reason="this triton has no griddepcontrol (3.3 and later have)")),
    ((9, 4), "6.2", False),
], ids=["sm80", "sm89", "sm90", "sm100", "rocm-gfx94x"])
def test_programmatic_dependent_launch_only_on_nvidia_sm90_and_later(monkeypatch, capability,
                                                                      hip, want):
    # Doubles of the device query and of the current device (cuda:0), a recording kernel, the
    # launcher in compiled mode: griddepcontrol exists from sm_90 on NVIDIA, never on ROCm
    # (whose MI300 also reports major 9), and the launch must say so in both the constexpr the
    # kernel branches on and Triton's launch option.
    runtime = FakeCurrentDevice(0)
    monkeypatch.setattr(torch.cuda, "device", runtime.device)
    monkeypatch.setattr(torch.cuda, "current_device", runtime.current_device)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    kernel = RecordingKernel()
    monkeypatch.setattr(tk, "_jitted", lambda interpret: kernel)
    monkeypatch.setattr(tk, "_interpret_mode", lambda: False)
    tk.pdl_supported.cache_clear()
    try:
        B, H, Hv, K, V = 2, 1, 2, 64, 16
        with FakeTensorMode():
            def empty(*shape, dtype=torch.bfloat16):
                return torch.empty(*shape, dtype=dtype, device="cuda:0")

            tk.fused_gdn_decode_triton(
                empty(B, 2 * H * K + Hv * V), empty(B, Hv), empty(B, Hv),
                empty(Hv, dtype=torch.float32), empty(Hv), empty(3, Hv, V, K, dtype=torch.float32),
                empty(B, dtype=torch.int32), K**-0.5)
    finally:
        tk.pdl_supported.cache_clear()
    assert len(kernel.kwargs) == 1
    assert kernel.kwargs[0]["PDL"] is want
    assert kernel.kwargs[0].get("launch_pdl", False) is want
    assert kernel.kwargs[0]["CVT_RN"] is True  # compiled: the GPU's cvt.rn


def test_cpu_tensors_enter_no_cuda_device(monkeypatch):
    # The interpreter path (CPU tensors) must not touch the CUDA runtime at all.
    def no_cuda(*args, **kwargs):
        raise AssertionError("torch.cuda.device called for CPU tensors")

    monkeypatch.setattr(torch.cuda, "device", no_cuda)
    kernel = RecordingKernel()
    monkeypatch.setattr(tk, "_jitted", lambda interpret: kernel)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "none")
    B, H, Hv, K, V = 1, 1, 1, 64, 8
    tk.fused_gdn_decode_triton(
        torch.empty(B, 2 * H * K + Hv * V, dtype=torch.bfloat16),
        torch.empty(B, Hv, dtype=torch.bfloat16), torch.empty(B, Hv, dtype=torch.bfloat16),
        torch.empty(Hv), torch.empty(Hv, dtype=torch.bfloat16), torch.empty(2, Hv, V, K),
        torch.ones(B, dtype=torch.int32), K**-0.5)
    assert kernel.launched_on == ["none"]


# ---- On a CUDA device ---------------------------------------------------------------------------

from triton_mode import (  # noqa: E402
    NONFINITE,
    check_nonfinite_case,
    needs_compiled_cuda,
    needs_interpreter,
)


def cuda_test(fn):
    """A test on a CUDA device, of the compiled kernel; skipped without one, and in a process
    that runs Triton's interpreter."""
    return needs_compiled_cuda(fn)

OP = torch.ops.custom.npu_fused_gdn_decode


@pytest.fixture
def no_tf32():
    """The reference's einsum must not use TF32, or it, not the kernel, is the inaccurate side."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _device_cases():
    from custom_ops.testing import DTYPE_PAIRS, Case

    cases = []
    for d, s in DTYPE_PAIRS:
        for ratio in (1, 2, 3, 4):
            H = 4 if ratio < 3 else 2
            cases.append(Case(B=33, H=H, Hv=H * ratio, K=128, V=128, dtype=d, state_dtype=s,
                              pool=80, invalid_rows=(0, 32), seed=ratio))
    # K = 136: padded rows; V = 12 and 48 at K = 64 / 128: partial V tiles with unpadded rows
    # (the masked path without padding).
    for K, V, s in [(136, 48, torch.float32), (136, 8, torch.bfloat16), (64, 8, torch.float32),
                    (64, 48, torch.bfloat16), (128, 12, torch.float32),
                    (2032, 16, torch.float32), (2032, 16, torch.bfloat16),
                    (256, 256, torch.float32)]:
        cases.append(Case(B=5, H=1, Hv=2, K=K, V=V, state_dtype=s, invalid_rows=(2,), seed=K))
    for s in (torch.float32, torch.bfloat16):
        cases.append(Case(B=256, H=16, Hv=32, K=128, V=128, state_dtype=s, pool=300))
    return cases


@cuda_test
def test_cuda_registration():
    from custom_ops import cuda as cuda_backend

    assert cuda_backend.KERNEL is cuda_backend.fused_gdn_decode_cuda
    assert cuda_backend._load_triton() is not None, "triton kernel module failed to import"


@cuda_test
@pytest.mark.parametrize("case", _device_cases(), ids=lambda c: c.id())
def test_matches_reference_on_cuda(no_tf32, case):
    from custom_ops.testing import check_against_reference, make_inputs

    check_against_reference(make_inputs(case, device="cuda"), steps=3, fn=OP)


@cuda_test
@pytest.mark.parametrize("value", NONFINITE, ids=str)
@pytest.mark.parametrize("place", VALUE_PLACES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nan_and_inf_like_the_reference_on_cuda(no_tf32, state_dtype, place, value):
    # The interpreter's cases (test_triton_interpret.py) on the compiled kernel, whose exp, log,
    # min and max are the GPU's, not numpy's.
    check_nonfinite_case(OP, "cuda", state_dtype, place, value)


@cuda_test
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("use_out", [False, True], ids=["default", "out"])
def test_paged_pool_and_out_on_cuda(no_tf32, state_dtype, use_out):
    # An engine's pool (slot stride > Hv*V*K, the page's rest holding other data) and the out
    # overload, compiled: the slot-stride addressing against the reference, and nothing written
    # outside the slots.
    from custom_ops import fused_gdn_decode_reference
    from custom_ops.testing import Case, assert_close, call, make_inputs, paged_pool

    x = make_inputs(Case(B=4, H=2, Hv=4, K=128, V=64, state_dtype=state_dtype,
                         invalid_rows=(1,), pool=9), device="cuda")
    ref_state = x["state_ref"].clone()
    N, Hv, V, K = ref_state.shape
    view, buf = paged_pool(ref_state, Hv * V * K + 40, 24)
    outside = torch.ones(buf.numel(), dtype=torch.bool, device=buf.device)
    for slot in range(N):
        start = view.storage_offset() + slot * view.stride(0)
        outside[start:start + Hv * V * K] = False
    before = buf[outside].clone()
    for step in range(2):  # the second step reads what the first one wrote in the pool
        out_ref = call(fused_gdn_decode_reference, dict(x, state_ref=ref_state))
        if use_out:
            out = torch.full_like(out_ref, 3.0)
            got = call(OP.out, dict(x, state_ref=view), out=out)
            assert got.data_ptr() == out.data_ptr()
        else:
            out = call(OP, dict(x, state_ref=view))
        assert_close(out, out_ref, f"out, step {step}")
        assert_close(view, ref_state, f"state, step {step}")
    assert torch.equal(buf[outside], before), "the kernel wrote outside the slots"


@cuda_test
def test_non_contiguous_inputs_on_cuda(no_tf32):
    from custom_ops.testing import Case, check_against_reference, make_inputs

    x = make_inputs(Case(B=9, H=2, Hv=4, K=128, V=64, invalid_rows=(3,), layout="strided"),
                    device="cuda")
    check_against_reference(x, steps=2, fn=OP)


@cuda_test
def test_checked_reference_on_cuda(no_tf32):
    from custom_ops import composite
    from custom_ops.testing import Case, check_against_reference, make_inputs

    x = make_inputs(Case(B=7, H=2, Hv=4, K=128, V=64, invalid_rows=(1,)), device="cuda")
    check_against_reference(x, steps=2, fn=composite.fused_gdn_decode_checked_reference)


@cuda_test
def test_input_check_and_debug_index_switch_on_cuda():
    from custom_ops import cuda as cuda_backend
    from custom_ops.testing import Case, call, clone_inputs, make_inputs, storage_bytes

    x = make_inputs(Case(B=3, H=1, Hv=2, K=128, V=64), device="cuda")
    pool_bytes = storage_bytes(x["state_ref"])
    with pytest.raises(TypeError, match="a_log must have dtype torch.float32"):
        call(OP, dict(x, a_log=x["a_log"].half()))
    assert torch.equal(storage_bytes(x["state_ref"]), pool_bytes), "a rejected call changed state"
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        call(OP, dict(x, b=x["b"].cpu()))
    assert torch.equal(storage_bytes(x["state_ref"]), pool_bytes), "a rejected call changed state"
    pool = x["state_ref"].shape[0]
    bad = dict(x, ssm_state_indices=torch.tensor([1, pool, 2], dtype=torch.int32, device="cuda"))
    old = cuda_backend.set_check_indices(True)
    try:
        with pytest.raises(ValueError, match=rf"ssm_state_indices\[1\] = {pool} is out of range"):
            call(OP, bad)
    finally:
        cuda_backend.set_check_indices(old)
    assert torch.equal(storage_bytes(x["state_ref"]), pool_bytes), "a rejected call changed state"
    # Switch off: no error, and no access outside the pool: the out-of-range row reads and
    # writes nothing (zero output), the two valid rows update only their own slots.
    cuda_backend.set_check_indices(False)
    try:
        ours = clone_inputs(bad)
        before = ours["state_ref"].clone()
        out = call(OP, ours)
    finally:
        cuda_backend.set_check_indices(old)
    assert torch.count_nonzero(out[1]) == 0
    untouched = [s for s in range(pool) if s not in (1, 2)]
    assert torch.equal(ours["state_ref"][untouched], before[untouched])


@cuda_test
def test_cuda_graph_decode_loop_equals_eager():
    from custom_ops import cuda as cuda_backend
    from custom_ops.testing import Case, call, make_inputs

    steps = 8
    c = Case(B=48, H=4, Hv=8, K=128, V=128, pool=100, invalid_rows=(7,))
    x = make_inputs(c, device="cuda")
    qkvs = [make_inputs(dataclasses.replace(c, seed=1 + t), device="cuda",
                        state_ref=x["state_ref"])["mixed_qkv"] for t in range(steps)]
    eager_state = x["state_ref"].clone()
    graph_state = x["state_ref"].clone()
    eager_outs = [call(OP, dict(x, mixed_qkv=qkvs[t], state_ref=eager_state))
                  for t in range(steps)]
    # The debug switch must not sync (and so break) a capture: it is skipped while capturing.
    old = cuda_backend.set_check_indices(True)
    try:
        warm = graph_state.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            call(OP, dict(x, mixed_qkv=qkvs[0], state_ref=warm))
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_outs = [call(OP, dict(x, mixed_qkv=qkvs[t], state_ref=graph_state))
                          for t in range(steps)]
    finally:
        cuda_backend.set_check_indices(old)
    graph_state.copy_(x["state_ref"])  # capture does not run the kernels; start from scratch
    graph.replay()
    torch.cuda.synchronize()
    for t in range(steps):
        assert torch.equal(graph_outs[t], eager_outs[t]), f"out differs at step {t}"
    assert torch.equal(graph_state, eager_state), "state differs"


@cuda_test
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_multi_gpu_device_guard(no_tf32):
    from custom_ops.testing import Case, check_against_reference, make_inputs

    with torch.cuda.device(0):
        x = make_inputs(Case(B=9, H=2, Hv=4, K=128, V=64, invalid_rows=(3,)), device="cuda:1")
        check_against_reference(x, steps=2, fn=OP)
        assert torch.cuda.current_device() == 0, "the launch changed the current device"


def _step(qkv, a, b, a_log, dt_bias, state, idx, scale):
    out = OP(qkv, a, b, a_log, dt_bias, state, idx, scale)
    return out.float().square().sum(-1)  # some surrounding ops for the compiler to fuse


@cuda_test
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_equals_eager_on_cuda(mode):
    from custom_ops.testing import Case, call, clone_inputs, make_inputs

    x = make_inputs(Case(B=16, H=4, Hv=8, K=128, V=128, pool=40, invalid_rows=(2,)),
                    device="cuda")
    fn = torch.compile(_step, fullgraph=True, mode=mode)
    eager, comp = clone_inputs(x), clone_inputs(x)
    for t in range(3):
        r_e = call(_step, eager)
        r_c = call(fn, comp)
        torch.testing.assert_close(r_c, r_e, atol=1e-4, rtol=1e-4)
        assert torch.equal(comp["state_ref"], eager["state_ref"]), f"state differs, step {t}"


# Where build_and_install.sh --with-test-deps puts fla-core: outside the environment, because with
# fla importable transformers' Qwen3-Next takes FLA's kernels, which need a GPU.
ROOT = Path(__file__).resolve().parent.parent
FLA_CACHE = ROOT / ".cache" / "fla"


@needs_interpreter
def test_fla_agrees_with_reference_in_a_process_of_its_own():
    """test_fla_agrees_with_reference's interpreted cases, where fla is not importable here but
    build_and_install.sh fetched it into .cache/fla: run in a child pytest with that directory on
    its path, which must pass all four."""
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("fla is importable in this process: test_fla_agrees_with_reference runs here")
    if not (FLA_CACHE / "fla").is_dir():
        pytest.skip(f"no fla-core in {FLA_CACHE} (build_and_install.sh --with-test-deps "
                    "fetches it)")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(FLA_CACHE),
                                                      os.environ.get("PYTHONPATH")) if p))
    node = f"tests/{Path(__file__).name}::test_fla_agrees_with_reference"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-k", "interpreter", node], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and summary.startswith("4 passed"), (
        f"child pytest exited {result.returncode}: {summary}\n{result.stdout[-4000:]}"
        f"{result.stderr[-2000:]}")


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla not installed")
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=needs_interpreter),
                                    pytest.param("cuda", marks=needs_compiled_cuda)],
                         ids=["interpreter", "compiled"])
@pytest.mark.parametrize("gather", [False, True], ids=["gathered", "pool"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_agrees_with_reference(no_tf32, device, gather, state_dtype):
    """So that the benchmark's FLA timings are of the same step: its output, and with ``gather``
    the pool's slots after the write-back, against the reference (FLA's Triton kernel runs
    under the interpreter on CPU tensors)."""
    from benchmarks import gpu
    from custom_ops import fused_gdn_decode_reference
    from custom_ops.testing import assert_close, call, clone_inputs, make_inputs

    x = make_inputs(gpu.decode_case(8, 4, 8, 128, 128, state_dtype=state_dtype), device=device)
    ref = clone_inputs(x)
    fn, note = gpu._fla_call(x, 4, 8, 128, 128, gather=gather)
    if fn is None:
        pytest.skip(note)
    o, final = fn()
    out_ref = call(fused_gdn_decode_reference, ref)
    assert_close(o.reshape(out_ref.shape), out_ref, f"fla's out ({note})")
    if gather:  # the slots written back in the pool's dtype, the other slots untouched
        assert_close(x["state_ref"], ref["state_ref"], f"pool after fla+gather ({note})")
    else:  # FLA's final state of each row, rounded to the pool's dtype
        rows = ref["state_ref"][x["ssm_state_indices"].long()]
        assert_close(final.reshape(rows.shape).to(rows.dtype), rows, f"fla's state ({note})")
