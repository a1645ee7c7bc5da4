"""The Triton kernel compiled for real, for NVIDIA sm_80 and sm_90, here without a GPU.

Triton's interpreter (test_triton_interpret.py) is more lenient than its compiler: it runs kernels
the compiler refuses (one reading a plain module global). Here Triton's own compiler and the ptxas
it bundles build every tile configuration the launcher can pick (benchmarks/triton_compile.py),
from scratch into a cache directory new to this session: Triton's cache key ignores
TRITON_ALLOW_NON_CONSTEXPR_GLOBALS, so a warm cache could hide the error. The compiles run in one
process per CPU (about 75 s of CPU time for the whole matrix).
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

from benchmarks import triton_compile as tc  # noqa: E402
from custom_ops import triton_kernel as tk  # noqa: E402
from custom_ops.testing import DTYPE_PAIRS  # noqa: E402

CONFIGS = list(tc.configurations())
TASKS = [(arch, *c) for arch in tc.ARCHS for c in CONFIGS]
IDS = [f"sm_{arch}-{tc.config_id(*c)}" for arch, *c in TASKS]


@pytest.fixture(scope="session")
def pool():
    """Compiler processes for this session (Triton here runs interpreted: conftest.py)."""
    with tc.compiler_processes() as p:
        yield p


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A Triton cache directory new to this session."""
    return str(tmp_path_factory.mktemp("triton-cache"))


@pytest.fixture(scope="session")
def compiled(request, pool, cache_dir):
    """{task: (resources, error)} for the tasks of the tests selected in this session, compiled
    once, in parallel."""
    wanted = [item.callspec.params["task"] for item in request.session.items
              if "compiled" in getattr(item, "fixturenames", ())
              and "task" in getattr(getattr(item, "callspec", None), "params", {})]
    return tc.compile_all(wanted, cache_dir, pool)


@pytest.mark.parametrize("task", TASKS, ids=IDS)
def test_compiles(compiled, task):
    resources, error = compiled[task]
    assert error is None, f"Triton's compiler failed: {error}"
    assert resources["n_regs"] > 0 and resources["sass"] > 0


def test_matrix_covers_every_choice():
    # Every accepted dtype pair x K in {64, 128, 136, 2032} x every tile tile_config picks for
    # some V (it grows with V up to its budget: a larger V picks the same tile).
    for dtype, sdt in DTYPE_PAIRS:
        for K in (64, 128, 136, 2032):
            want = {tk.tile_config(K, V, sdt) for V in range(1, 4097)}
            got = {cfg for d, s, k, _, cfg in CONFIGS if (d, s, k) == (dtype, sdt, K)}
            assert got == want, (dtype, sdt, K)


# Run in the compiler processes (so defined at module level: they are imported there by name).
_SCRATCH_EPS = 1e-6  # a plain global: the compiler must refuse it inside a kernel


def _scratch_kernel(x_ptr, N: triton.language.constexpr):
    offs = triton.language.arange(0, N)
    x = triton.language.load(x_ptr + offs)
    triton.language.store(x_ptr + offs, x + _SCRATCH_EPS)


def _compile_scratch_kernel(arch, cache_dir):
    # Triton's escape hatch set in the environment must not let the kernel through either.
    old = os.environ.get("TRITON_ALLOW_NON_CONSTEXPR_GLOBALS")
    os.environ["TRITON_ALLOW_NON_CONSTEXPR_GLOBALS"] = "1"
    x = torch.empty(16, dtype=torch.float32)
    try:
        with tc.fresh_compiler(cache_dir):
            tc.compile_launch(_scratch_kernel, arch, (x,), {"N": 16, "enable_fp_fusion": True})
    except triton.compiler.errors.CompilationError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        if old is None:
            del os.environ["TRITON_ALLOW_NON_CONSTEXPR_GLOBALS"]
        else:
            os.environ["TRITON_ALLOW_NON_CONSTEXPR_GLOBALS"] = old
    return None


def _compile_with_plain_norm_eps(cache_dir):
    old, tk.NORM_EPS = tk.NORM_EPS, 1e-6  # the op's kernel with NORM_EPS a plain float
    try:
        return tc.compile_task(90, *CONFIGS[0], cache_dir)
    finally:
        tk.NORM_EPS = old


@pytest.mark.parametrize("arch", tc.ARCHS)
def test_the_compile_check_can_fail(pool, cache_dir, arch):
    error = pool.submit(_compile_scratch_kernel, arch, cache_dir).result()
    assert error is not None and "NameError" in error and "_SCRATCH_EPS" in error


def test_a_plain_global_in_the_kernel_fails(pool, cache_dir):
    resources, error = pool.submit(_compile_with_plain_norm_eps, cache_dir).result()
    assert resources is None and "NameError" in error and "NORM_EPS" in error
