"""conftest.py turns Triton's interpreter on (TRITON_INTERPRET=1) for the CPU-only tests. The
tests on a CUDA device run the compiled kernel: the fixture ``compiled_triton`` turns the
interpreter off for one test (the launcher jits once per mode, so both can run in one session)."""

import pytest


@pytest.fixture
def compiled_triton(monkeypatch):
    import triton

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        monkeypatch.setattr(knobs.runtime, "interpret", False)
