"""What every benchmark shares: the state bytes a call moves, the slot rotation that keeps each
timed call's state cold in cache, and the timing loops (CPU wall clock; CUDA graph replays and
eager launches)."""

import math
import statistics
import time

import torch

# Bytes of other state read and written between two calls on one slot set, in cache (L2) sizes.
REUSE_L2 = 4


def slot_bytes(Hv, V, K, state_dtype):
    """Bytes of one state slot [Hv, V, K]."""
    return Hv * V * K * torch.empty((), dtype=state_dtype).element_size()


def moved_bytes(B, Hv, V, K, state_dtype):
    """State bytes one call reads and writes: B slots, each read once and written once."""
    return 2 * B * slot_bytes(Hv, V, K, state_dtype)


def rotation_sets(B, slot_nbytes, l2_bytes, reuse=REUSE_L2):
    """Disjoint sets of B slots to rotate over so that between two calls on one set the other
    calls read and write at least ``reuse`` x ``l2_bytes`` of state: (sets - 1) * B * slot_nbytes
    >= reuse * l2_bytes. Each timed call then finds its slots cold in L2."""
    return 1 + max(1, math.ceil(reuse * l2_bytes / (B * slot_nbytes)))


def slot_windows(B, slots, seed=0, device="cpu"):
    """The one slot rotation: slots 1..``slots`` in a random order (seeded) cut into
    ``slots // B`` disjoint int32 index tensors of B distinct slots each."""
    g = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(slots, generator=g) + 1).to(torch.int32)
    return [perm[w * B:(w + 1) * B].to(device) for w in range(slots // B)]


def slot_sets(B, sets, seed=0, device="cpu"):
    """``sets`` disjoint int32 index tensors of B distinct slots each, drawn from [1, sets*B]."""
    return slot_windows(B, sets * B, seed, device)


def time_calls(fns, sync, min_time, rounds=5):
    """Median seconds per call of each of fns (a dict), interleaved: `rounds` rounds in which each
    fn makes its share of calls (at least 5 in all, about min_time each), so that a slow spell of
    a shared machine falls on every fn of a ratio alike instead of on one of them."""
    reps = {}
    for name, fn in fns.items():
        fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        once = max(time.perf_counter() - t0, 1e-7)
        reps[name] = -(-int(min(max(5, min_time / once), 1000)) // rounds)  # per round, rounded up
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(reps[name]):
                t0 = time.perf_counter()
                fn()
                sync()
                samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in samples.items()}


def time_loop(fn, sync, iters, warmup=5):
    """Mean seconds per call of ``iters`` back-to-back calls of fn, after ``warmup`` calls;
    ``sync()`` waits for the device before each clock reading."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def _as_list(fns):
    """A callable or a list/tuple of them, as a list."""
    return list(fns) if isinstance(fns, (list, tuple)) else [fns]


def time_graph(fns, inner=20, reps=20, warmup=3):
    """Microseconds per call from CUDA-graph replays: the graph holds ``inner`` calls (at least
    one per function) that cycle through ``fns`` (a callable or a list of them, no arguments)."""
    fns = _as_list(fns)
    n = len(fns) * math.ceil(inner / len(fns))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for t in range(warmup):
            fns[t % len(fns)]()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for t in range(n):
            fns[t % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * n)


def time_eager(fns, iters=50, warmup=5):
    """Microseconds per call launched from Python (launch overhead included), cycling through
    ``fns`` (a callable or a list of them)."""
    fns = _as_list(fns)
    for t in range(warmup):
        fns[t % len(fns)]()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for t in range(iters):
        fns[t % len(fns)]()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters
