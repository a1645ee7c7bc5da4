"""The core clock reading that `python -m benchmarks` prints around each line of its per-variant
table (csrc/core_clock.h, custom_ops_internal.core_clock_ghz): a shared VM's cores slow down for
minutes while memory does not, which lowers every ratio to rmw, so a stored run's lines carry the
clock they ran at."""

import platform

import torch

import custom_ops  # noqa: F401  (registers the ops)
from benchmarks.__main__ import format_variants


def test_core_clock_reads_a_core_clock():
    ghz = torch.ops.custom_ops_internal.core_clock_ghz()
    if platform.machine() in ("x86_64", "AMD64"):
        # One dependent add a cycle: any x86-64 core this runs on is between these, even slowed.
        assert 0.2 < ghz < 10.0, ghz
    else:
        assert ghz == 0.0


def _row(variant, clock=None):
    row = {"variant": variant, "state": "bf16", "B": 8, "mode": "dram", "threads": 2,
           "GBps": 40.0, "pct_rmw": 80.0, "ns_per_row": 25.0, "ours_ok": True}
    if clock is not None:
        row["clock_ghz"] = clock
    return row


def test_variant_lines_end_with_the_clock_they_ran_at():
    lines = format_variants([_row("avx2", [3.61, 2.05]), _row("avx512", [3.61, 2.05])])
    line = lines.splitlines()[2]
    assert line.startswith(" bf16    8  dram   2 |")
    assert line.endswith(" ok | clock 3.61-2.05 GHz"), line


def test_variant_lines_without_a_clock_reading_say_nothing_of_it():
    # Rows of a stored run from before the reading, or a CPU where it cannot be read (0).
    for clock in (None, [0.0, 0.0]):
        line = format_variants([_row("avx2", clock)]).splitlines()[2]
        assert line.endswith("| ok"), line
