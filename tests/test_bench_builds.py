"""`python -m benchmarks.builds` (two builds of the extension timed in one run, e.g. GCC against
clang: docs/building.md#compilers) runs, names what it timed and prints a ratio per state dtype;
here on this checkout against itself, so its lines are checked for form, not for speed."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_builds_benchmark_times_each_checkout():
    r = subprocess.run([sys.executable, "-m", "benchmarks.builds", str(ROOT), str(ROOT),
                        "--threads", "1", "--batch", "1", "--rounds", "1", "--reps", "1",
                        "--states", "float32,bfloat16"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    named = [re.fullmatch(rf"build (\d): {re.escape(str(ROOT))} \(commit \w+(\+changes)?\)", ln)
             for ln in lines if ln.startswith("build ")]
    assert [m and m.group(1) for m in named] == ["0", "1"], r.stdout
    rows = [ln for ln in lines if ln.startswith("threads=1 B=1")]
    assert len(rows) == 2, r.stdout
    cell = r"(float32|bfloat16) +(\d+\.\d) +(\d+\.\d\d)x"
    first = re.findall(cell, rows[0])
    assert [(s, x) for s, _, x in first] == [("float32", "1.00"), ("bfloat16", "1.00")], rows[0]
    second = re.findall(cell, rows[1])
    assert [s for s, _, _ in second] == ["float32", "bfloat16"], rows[1]
    for (_, t0, _), (_, t1, x) in zip(first, second, strict=True):
        assert float(t0) > 0 and abs(float(x) - float(t1) / float(t0)) < 0.01
