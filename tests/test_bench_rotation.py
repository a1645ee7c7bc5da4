"""The benchmarks' slot rotation (benchmarks/_harness.py), which needs no GPU to check: disjoint
sets of B valid slots, enough of them that at least 4x the L2 size of other state is read and
written between two calls on one set."""

import pytest
import torch

from benchmarks import _harness as bench
from benchmarks import gpu


@pytest.mark.parametrize("B,slot_bytes,l2_bytes", [
    (1, 2 << 20, 50 << 20),      # Qwen3-Next fp32 slot (2 MiB), H200-sized L2: ~100 sets
    (256, 2 << 20, 50 << 20),    # one call moves 512 MiB > 4x L2: still two sets
    (64, 1 << 20, 60 << 20),     # bf16 slots
    (3, 5000, 40 << 20),         # odd sizes
])
def test_rotation_keeps_each_call_cold(B, slot_bytes, l2_bytes):
    sets = bench.rotation_sets(B, slot_bytes, l2_bytes)
    assert (sets - 1) * B * slot_bytes >= bench.REUSE_L2 * l2_bytes
    assert sets >= 2
    idx = bench.slot_sets(B, sets)
    assert len(idx) == sets and all(t.shape == (B,) and t.dtype == torch.int32 for t in idx)
    every = torch.cat(idx)
    pool = gpu.decode_case(B, 1, 1, 64, 8, sets=sets).pool
    assert every.unique().numel() == sets * B  # disjoint, no repeat within a call
    assert every.min() >= 1 and every.max() < pool  # valid slots of the benchmark's pool
