"""benchmarks/micro/*.cpp build with the command their header gives (they are not part of the
extension's build, so nothing else would notice one that stopped compiling). Compiled, not run:
three of them need AVX-512, and none checks anything of the kernel's."""

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

MICRO = Path(__file__).resolve().parent.parent / "benchmarks" / "micro"
SOURCES = sorted(MICRO.glob("*.cpp"))


def header_command(source: Path) -> list:
    """The g++ command of the source's header comment (continuation lines joined), up to `&&`."""
    lines = [line[2:].strip() for line in source.read_text().splitlines() if line.startswith("//")]
    text = " ".join(lines).replace("\\ ", " ")
    m = re.search(r"(g\+\+ .*?) &&", text)
    assert m, f"{source.name}: no 'g++ ... &&' command in its header"
    return shlex.split(m.group(1))


def test_every_micro_benchmark_is_found():
    assert {s.name for s in SOURCES} == {"avx2_ops.cpp", "avx512_ops.cpp", "bf16_blocks.cpp",
                                         "stream_patterns.cpp"}


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_micro_benchmark_builds_with_its_header_command(source, tmp_path):
    cmd = header_command(source)
    assert cmd[0] == "g++" and f"benchmarks/micro/{source.name}" in cmd, cmd
    out = cmd.index("-o") + 1
    cmd[out] = str(tmp_path / source.stem)
    result = subprocess.run(cmd, cwd=MICRO.parent.parent,
                            capture_output=True, text=True)
    if result.returncode != 0 and "unrecognized command-line option" in result.stderr:
        pytest.skip(f"this g++ lacks a flag of the command: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / source.stem).exists()
