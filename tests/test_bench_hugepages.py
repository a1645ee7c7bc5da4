"""benchmarks.hugepages: its two pools get the pages they are advised, and its table has a line
per (state, B, threads) with the ratios its header promises."""

import platform

import pytest
import torch

from benchmarks import hugepages

pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="madvise and smaps: Linux")


def thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


@pytest.mark.parametrize("advice", [hugepages.MADV_NOHUGEPAGE, hugepages.MADV_HUGEPAGE])
def test_pools_get_the_pages_they_are_advised(advice):
    before = hugepages.anon_huge_bytes()
    pool = hugepages.AdvisedPool(32, 128, torch.float32, 8 << 20, "cpu", advice=advice)
    state = pool.ensure(1)
    gained = hugepages.anon_huge_bytes() - before
    assert state.nbytes >= hugepages.POOL_OVER_CACHE * (8 << 20)
    if advice == hugepages.MADV_NOHUGEPAGE or thp_mode() == "never":
        assert gained == 0
    else:  # madvise or always: all of the pool's whole 2 MiB pages, less the ends
        assert gained >= state.nbytes - (4 << 20), (gained, state.nbytes)


def test_table_has_a_line_per_case(capsys):
    assert hugepages.main(["--state-dtype", "bf16", "--batch", "1", "--threads", "1",
                           "--min-time", "0.01", "--cache-bytes", str(4 << 20)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "transparent_hugepage/enabled" in out[0]
    line = next(s for s in out if s.startswith("bf16 ") and "|" in s)
    cells = line.replace("|", " ").split()
    assert cells[:3] == ["bf16", "1", "1"]
    ours4, rmw4, pct4, ours2, rmw2, pct2, gain, rmw_gain = map(float, cells[3:])
    assert pct4 == pytest.approx(100 * rmw4 / ours4, rel=1e-2)
    assert pct2 == pytest.approx(100 * rmw2 / ours2, rel=1e-2)
    assert gain == pytest.approx(ours4 / ours2, rel=1e-2)
    assert rmw_gain == pytest.approx(rmw4 / rmw2, rel=1e-2)
