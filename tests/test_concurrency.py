"""Concurrent callers: several Python threads calling the op at once on disjoint slots of one shared
pool get exactly (bit for bit) the results of calling it one after another; and the call releases
the GIL while the kernel runs, so those threads really do run in parallel.

torch.ops calls reach C++ through torch's invokeOperatorFromPython, which converts the arguments
with the GIL held, releases it (pybind11::gil_scoped_release) around the dispatcher call, and
takes it back for the result; the op itself never touches Python objects.
"""

import threading
import time

import torch

from utils import OP

THREADS, STEPS = 4, 12
B, H, HV, K, V = 5, 2, 8, 128, 64
PER_THREAD = 6  # slots owned by each thread
POOL = 1 + THREADS * PER_THREAD + 3  # the null slot, the threads' slots, three never named


def _schedule():
    """Per thread, per step: the call's inputs (slots drawn from the thread's own slots, with an
    invalid row most steps)."""
    g = torch.Generator().manual_seed(7)
    W = 2 * H * K + HV * V
    plans = []
    for t in range(THREADS):
        own = torch.arange(1 + t * PER_THREAD, 1 + (t + 1) * PER_THREAD, dtype=torch.int32)
        steps = []
        for _ in range(STEPS):
            idx = own[torch.randperm(PER_THREAD, generator=g)[:B]].clone()
            if torch.rand(1, generator=g) < 0.7:
                idx[torch.randint(B, (1,), generator=g)] = 0
            ab = torch.randn(B, 2 * HV, generator=g).bfloat16()
            steps.append((torch.randn(B, W, generator=g).bfloat16(), ab[:, :HV], ab[:, HV:], idx))
        plans.append(steps)
    a_log = torch.randn(HV, generator=g) * 0.5
    dt_bias = (torch.randn(HV, generator=g) * 0.5).bfloat16()
    state = torch.randn(POOL, HV, V, K, generator=g) * 0.5
    return plans, a_log, dt_bias, state


def _run_steps(steps, a_log, dt_bias, state, outs):
    for qkv, a, b, idx in steps:
        outs.append(OP(qkv, a, b, a_log, dt_bias, state, idx, K**-0.5))


def test_threads_on_disjoint_slots_match_sequential_calls():
    plans, a_log, dt_bias, state0 = _schedule()

    sequential = state0.clone()
    seq_outs = [[] for _ in range(THREADS)]
    for t in range(THREADS):
        _run_steps(plans[t], a_log, dt_bias, sequential, seq_outs[t])

    for attempt in range(3):  # different interleavings each time
        shared = state0.clone()
        outs = [[] for _ in range(THREADS)]
        errors = []
        start = threading.Barrier(THREADS)

        def worker(t):
            try:
                start.wait()
                _run_steps(plans[t], a_log, dt_bias, shared, outs[t])
            except BaseException as e:  # surfaced below; a thread's exception is otherwise lost
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        for t in range(THREADS):
            for step, (got, want) in enumerate(zip(outs[t], seq_outs[t])):
                assert torch.equal(got, want), f"attempt {attempt}: thread {t} step {step} out"
        assert torch.equal(shared, sequential), f"attempt {attempt}: shared pool differs"
        # The null slot and the slots no thread owns are untouched.
        assert torch.equal(shared[0], state0[0]) and torch.equal(shared[-3:], state0[-3:])


def _spinner_coverage(call):
    """Runs `call` once while a Python thread spins; returns (call seconds, fraction of the call
    during which the spinner kept running). With the GIL held by the call it would be about 0."""
    stamps, stop = [], threading.Event()

    def spin():
        while not stop.is_set():
            stamps.append(time.perf_counter())

    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.02)
    t0 = time.perf_counter()
    call()
    t1 = time.perf_counter()
    stop.set()
    th.join()
    inside = [s for s in stamps if t0 <= s <= t1]
    covered = (inside[-1] - inside[0]) if len(inside) > 1 else 0.0
    return t1 - t0, covered / (t1 - t0)


def test_op_releases_the_gil():
    """A Python thread keeps running during a long op call (one intra-op thread, a large pool)."""
    g = torch.Generator().manual_seed(0)
    Bn, Hn, Hvn, Kn, Vn = 24, 16, 32, 128, 128
    W = 2 * Hn * Kn + Hvn * Vn
    qkv = torch.randn(Bn, W, generator=g).bfloat16()
    ab = torch.randn(Bn, 2 * Hvn, generator=g).bfloat16()
    state = torch.randn(Bn + 1, Hvn, Vn, Kn, generator=g)
    idx = torch.arange(1, Bn + 1, dtype=torch.int32)
    a_log, dt_bias = torch.zeros(Hvn), torch.zeros(Hvn, dtype=torch.bfloat16)

    def call():
        OP(qkv, ab[:, :Hvn], ab[:, Hvn:], a_log, dt_bias, state, idx, Kn**-0.5)

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        call()  # warm-up
        results = []
        for _ in range(3):  # scheduler noise on a busy machine: one clean run is enough
            results.append(_spinner_coverage(call))
            if results[-1][1] > 0.5:
                break
    finally:
        torch.set_num_threads(old)
    assert max(cov for _, cov in results) > 0.5, (
        f"a Python thread made no progress during the op call (duration, coverage): {results}")
