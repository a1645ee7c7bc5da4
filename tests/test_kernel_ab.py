"""benchmarks/kernel_ab.py, the A/B of kernel sources: it builds, times, and refuses a source whose
bits differ from the first one's unless told to time it anyway.

The second source is a labelled test double: a copy of csrc whose AVX2 fp16 stores round toward
zero instead of to nearest even, so its fp16 states differ while its bf16 ones do not.
"""

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="builds the avx2 variant")

NEAREST = "static constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;"
TOWARD_ZERO = "static constexpr int kRound = _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC;"


def _fp16_rounding_toward_zero(tmp_path):
    """A copy of csrc whose AVX2 fp16 stores round toward zero."""
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    vec = tmp_path / "csrc" / "cpu" / "vec.h"
    text = vec.read_text()
    avx2 = text.index("#elif defined(CPU_CAPABILITY_AVX2)\n// Partial blocks")
    assert text.count(NEAREST, avx2) == 1, "vec.h's AVX2 fp16 rounding moved: update the double"
    vec.write_text(text[:avx2] + text[avx2:].replace(NEAREST, TOWARD_ZERO))
    return tmp_path


def test_kernel_ab_times_equal_bits_and_refuses_different_ones(tmp_path):
    other = _fp16_rounding_toward_zero(tmp_path / "other")
    env = dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_ab", str(ROOT), str(other), "--isa", "avx2",
         "--mode", "l1,l1only,cache", "--states", "bf16,fp16", "--threads", "1", "--batch", "2",
         "--reps", "3", "--build-dir", str(tmp_path / "build")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    out = r.stdout
    assert r.returncode == 1, out + r.stderr
    lines = out.splitlines()
    # bf16: the same bits, so both builds are timed in every mode.
    timed = [ln for ln in lines if ln.startswith("bf16 ")]
    assert len(timed) == 3, out
    l1, l1only, cache = timed
    for line, mode in ((l1, "l1   "), (l1only, "l1only")):
        assert line.startswith(f"bf16  {mode} 1 thread, ns per row:"), out
        assert "AB0" in line and "AB1" in line and "rmw" in line, out
    assert cache.startswith("bf16  cache B=2") and cache.count("%") == 2, out
    for line in timed:  # each line ends with the clock read around it
        m = re.search(r"  \| clock (\d+\.\d\d)-(\d+\.\d\d) GHz$", line)
        assert m and all(0.3 < float(g) < 10 for g in m.groups()), line
    # fp16: refused before any timing, in every mode, saying how far apart the builds are.
    assert out.count("build 1: bits differ from build 0") == 3, out
    distances = re.findall(r"state (\d+) of (\d+) elements, largest difference (\S+) of max", out)
    assert len(distances) == 3, out
    for differing, total, worst in distances:
        # Rounding toward zero moves a stored element by less than one fp16 step (2^-10 of its
        # magnitude) per call, three calls here, and leaves some alone (the exact ones, and those
        # whose nearest value lay toward zero).
        assert 0 < int(differing) < int(total) and 0 < float(worst) < 2.0**-7, out
    assert not [ln for ln in lines if ln.startswith("fp16 ")], out

    # --no-bit-check: said, and timed anyway.
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_ab", str(ROOT), str(other), "--isa", "avx2",
         "--mode", "l1", "--states", "fp16", "--reps", "3", "--no-bit-check",
         "--build-dir", str(tmp_path / "build")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "build 1: bits differ from build 0 (timed anyway)" in r.stdout, r.stdout
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("fp16  l1")], r.stdout


def test_kernel_ab_rejects_unknown_source():
    r = subprocess.run([sys.executable, "-m", "benchmarks.kernel_ab", "no-such-revision-xyz"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "neither a directory nor a git revision" in r.stderr


def test_kernel_ab_compiles_with_the_extensions_kernel_flags():
    """kernel_ab times the kernel as the extension builds it: every flag setup.py gives the kernel
    files (CXX_FLAGS of a release build, the C++ standard, -ffp-contract=off) is in its list."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    lists = {}
    for node in tree.body:  # the first, release-build assignment of each name
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.List)):
            lists.setdefault(node.targets[0].id, [e.value for e in node.value.elts
                                                  if isinstance(e, ast.Constant)])
    wanted = lists["CXX_FLAGS"] + lists["OPENMP"] + ["-std=c++20", "-ffp-contract=off"]
    assert "-fvisibility=hidden" in wanted
    sys.path.insert(0, str(ROOT))
    from benchmarks import kernel_ab

    assert [f for f in wanted if f not in kernel_ab.BASE_FLAGS] == []
