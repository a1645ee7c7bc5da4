"""How the CPU op reads ssm_state_indices: once, into a snapshot that both the slot check and the
kernel use, and with memory for the duplicate search that follows the valid rows, not B."""

import os
import subprocess
import sys
import textwrap

import torch

from custom_ops import fused_gdn_decode_reference
from custom_ops.testing import OP, Case, assert_close, call, clone_inputs, make_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_indices_stored_in_an_updated_slot_are_read_once(one_thread):
    """The indices live inside the slot that row 0 updates (aliasing is the caller's mistake, but
    it must not steer the kernel). Row 0's update makes that slot negative, so a kernel that
    re-read the indices would see rows 1.. as invalid (or, with other values, wild slots)."""
    B, K = 12, 64
    x = make_inputs(Case(B=B, H=1, Hv=1, K=K, V=16, pool=B + 2))
    slots = torch.arange(1, B + 1, dtype=torch.int32)
    first = int(slots[0])
    st = x["state_ref"]
    st[first] = 0.0
    qkv = x["mixed_qkv"]
    qkv[0, K:2 * K] = 1.0   # k > 0 and v < 0 with an empty state: row 0 writes negative values
    qkv[0, 2 * K:] = -1.0
    region = st[first].view(-1).view(torch.int32)[:B]
    region.copy_(slots)
    ref = clone_inputs(x)
    ref["ssm_state_indices"] = slots.clone()
    x["ssm_state_indices"] = region
    out = call(OP, x)
    out_ref = call(fused_gdn_decode_reference, ref)
    assert_close(out, out_ref, "out")
    assert_close(x["state_ref"], ref["state_ref"], "state")


_ALL_INVALID_CHILD = textwrap.dedent("""
    import resource, sys, torch
    import custom_ops
    torch.set_num_threads(1)
    B, K = int(sys.argv[1]), 64

    def inputs(B):
        # H = Hv = V = 1; every per-row input is expanded (stride 0), so only out costs memory.
        z = lambda *s, dt=torch.bfloat16: torch.zeros((1,) * len(s), dtype=dt).expand(*s)
        return (z(B, 2 * K + 1), z(B, 1), z(B, 1), torch.zeros(1),
                torch.zeros(1, dtype=torch.bfloat16), torch.zeros(2, 1, 1, K),
                torch.full((1,), -1, dtype=torch.int32).expand(B), K ** -0.5)

    torch.ops.custom.npu_fused_gdn_decode(*inputs(4))  # thread pools, arenas: allocated by now
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    # Address space for out (2 bytes a row) and the index snapshot (4 bytes a row), twice over.
    resource.setrlimit(resource.RLIMIT_AS, (vm + 12 * B, resource.RLIM_INFINITY))
    out = torch.ops.custom.npu_fused_gdn_decode(*inputs(B))
    assert out.shape == (B, 1, 1, 1) and not out.any()
""")


def test_all_invalid_batch_needs_no_memory_per_row_for_the_slot_check():
    """An all-invalid batch is valid at any B; the call may need memory for its output and the
    index snapshot (6 bytes a row here), not 16 bytes a row reserved for the duplicate search.
    Run in a child process under an address-space limit of 12 bytes a row."""
    B = 2**25
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
        "PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", _ALL_INVALID_CHILD, str(B)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
