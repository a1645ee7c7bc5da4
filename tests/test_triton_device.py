"""The Triton launcher launches on the device of its tensors, not on the current one.

Triton launches on the current CUDA device and its current stream. This machine has no GPU, so
two labelled test doubles stand in: FakeTensorMode tensors on cuda:1 (shapes, dtypes and devices
without memory), and a fake of the CUDA runtime's current device (``torch.cuda.device`` and
``torch.cuda.current_device``) with cuda:0 current. The jitted kernel is replaced by a recorder of
the current device at launch. What a real second GPU does is checked by benchmarks/gpu_check.py
("multi-gpu-device-guard") on a host with two.
"""

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

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
    """Stands in for the jitted kernel: records the current device at each launch."""

    def __init__(self):
        self.launched_on = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched_on.append(torch.cuda.current_device())


@pytest.mark.parametrize("tensor_device,current", [("cuda:1", 0), ("cuda:0", 1), ("cuda:1", 1)])
def test_launch_on_the_tensors_device(monkeypatch, tensor_device, current):
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
