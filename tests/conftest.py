import os
import pathlib
import sys

import pytest
import torch

# Triton runs interpreted on CPU tensors where there is no CUDA device, compiled where there is
# one; a process cannot do both (tests/triton_mode.py). Chosen before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import custom_ops  # noqa: E402
from custom_ops.cpu import VARIANTS  # noqa: E402
from custom_ops.testing import use_cpu_isa, use_threads  # noqa: E402


def pytest_addoption(parser):
    # --slow: many more hypothesis examples in test_fuzz.py (CUSTOM_OPS_FUZZ_EXAMPLES=N sets the
    # count directly and wins over --slow).
    parser.addoption("--slow", action="store_true", default=False,
                     help="run the fuzz tests with many more examples (minutes)")


def pytest_configure(config):
    if config.getoption("--slow", default=False):
        os.environ.setdefault("CUSTOM_OPS_FUZZ_SLOW", "1")


@pytest.fixture(params=VARIANTS)
def isa(request):
    """Each CPU kernel variant (portable included), selected for the test and restored after it.
    A variant this build or CPU lacks is skipped, and the skip says so: a run on a machine without
    AVX-512 (or a build without it) shows which variants it did not test."""
    if request.param not in custom_ops.cpu_isas():
        pytest.skip(f"CPU kernel variant {request.param!r}: this build or this CPU lacks it")
    with use_cpu_isa(request.param):
        assert custom_ops.cpu_isa() == request.param
        yield request.param


@pytest.fixture(params=[1, 2])
def threads(request):
    """1 and 2 intra-op threads (torch.set_num_threads), restored after the test."""
    with use_threads(request.param):
        yield request.param


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: a small call shared among OpenMP threads on a busy CI
    machine costs more in barriers than it computes (results do not depend on it)."""
    with use_threads(1):
        yield


@pytest.fixture(scope="session")
def torch_npu_wheel():
    """The torch-npu wheels matching torch (x86-64 and aarch64), downloaded once and unpacked,
    never installed, by scripts/fetch_torch_npu.py. Skips only when the package index cannot be
    reached, or when torch-npu has no release for this torch (a torch no Ascend host runs), unless
    CUSTOM_OPS_REQUIRE_TORCH_NPU=1 (.ci/run's second run, whose torch is chosen for its
    torch-npu); any other failure (a changed wheel) is an error."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "scripts"))
    import fetch_torch_npu

    try:
        return fetch_torch_npu.ensure()
    except RuntimeError as e:
        if not fetch_torch_npu.may_skip(e):
            raise
        pytest.skip(f"torch-npu wheel not available for torch {torch.__version__}: {e}")
