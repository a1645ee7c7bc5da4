"""benchmarks.hugepages: its two pools get the pages they are advised, and its table has a line
per (state, B, threads) with the ratios its header promises."""

import platform

import pytest
import torch

from benchmarks import hugepages

pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="madvise and smaps: Linux")


@pytest.fixture
def thp_on():
    mode = hugepages.thp_mode()
    if mode not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {mode!r} here: no pool can get them")
    return mode


@pytest.mark.parametrize("advice", [hugepages.MADV_NOHUGEPAGE, hugepages.MADV_HUGEPAGE])
def test_pools_get_the_pages_they_are_advised(advice, thp_on):
    before = hugepages.anon_huge_bytes()
    pool = hugepages.AdvisedPool(32, 128, torch.float32, 8 << 20, "cpu", advice=advice)
    state = pool.ensure(1)
    gained = hugepages.anon_huge_bytes() - before
    assert state.nbytes >= hugepages.POOL_OVER_CACHE * (8 << 20)
    if advice == hugepages.MADV_NOHUGEPAGE:  # none, even where THP is "always"
        assert gained == 0
    else:  # all of the pool's whole 2 MiB pages, less the ends
        assert gained >= state.nbytes - (4 << 20), (gained, state.nbytes)
    assert pool.huge_bytes == gained
    # grown for a larger B: the count is the new pool's, the old one freed before it
    grown = pool.ensure(hugepages.math.ceil(2 * state.shape[0] / hugepages.POOL_OVER_CACHE))
    assert grown.shape[0] > state.shape[0]
    if advice == hugepages.MADV_NOHUGEPAGE:
        assert pool.huge_bytes == 0
    else:
        assert pool.huge_bytes >= grown.nbytes - (4 << 20), (pool.huge_bytes, grown.nbytes)


def test_table_has_a_line_per_case(capsys, thp_on):
    assert hugepages.main(["--state-dtype", "bf16", "--batch", "1", "--threads", "1",
                           "--min-time", "0.01", "--cache-bytes", str(4 << 20)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "transparent_hugepage/enabled" in out[0]
    # the pools the columns are named for got those pages (17 MiB each: 7 whole 2 MiB pages
    # at least)
    pools = next(s for s in out if s.startswith("bf16 pools:"))
    assert "4k pool 0 MiB" in pools
    huge = int(pools.split("2m pool ")[1].split()[0])
    assert huge >= 12, pools
    line = next(s for s in out if s.startswith("bf16 ") and "|" in s)
    cells = line.replace("|", " ").split()
    assert cells[:3] == ["bf16", "1", "1"]
    ours4, rmw4, pct4, ours2, rmw2, pct2, gain, rmw_gain = map(float, cells[3:])
    assert pct4 == pytest.approx(100 * rmw4 / ours4, rel=1e-2)
    assert pct2 == pytest.approx(100 * rmw2 / ours2, rel=1e-2)
    assert gain == pytest.approx(ours4 / ours2, rel=1e-2)
    assert rmw_gain == pytest.approx(rmw4 / rmw2, rel=1e-2)
