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

from custom_ops.testing import OP, Case, call, make_inputs

THREADS, STEPS = 4, 12
B, H, HV, K, V = 5, 2, 8, 128, 64
PER_THREAD = 6  # slots owned by each thread
POOL = 1 + THREADS * PER_THREAD + 3  # the null slot, the threads' slots, three never named


def _schedule():
    """The shared pool, and per thread, per step: the call's inputs on it (slots drawn from the
    thread's own slots, with an invalid row most steps)."""
    g = torch.Generator().manual_seed(7)
    state = make_inputs(Case(B=B, H=H, Hv=HV, K=K, V=V, pool=POOL, seed=7))["state_ref"]
    plans = []
    for t in range(THREADS):
        own = torch.arange(1 + t * PER_THREAD, 1 + (t + 1) * PER_THREAD, dtype=torch.int32)
        steps = []
        for step in range(STEPS):
            idx = own[torch.randperm(PER_THREAD, generator=g)[:B]].clone()
            if torch.rand(1, generator=g) < 0.7:
                idx[torch.randint(B, (1,), generator=g)] = 0
            case = Case(B=B, H=H, Hv=HV, K=K, V=V, indices=tuple(idx.tolist()),
                        seed=100 * t + step)
            steps.append(make_inputs(case, state_ref=state))
        plans.append(steps)
    return plans, state


def _run_steps(steps, state, outs):
    for x in steps:
        outs.append(call(OP, dict(x, state_ref=state)))


def test_threads_on_disjoint_slots_match_sequential_calls():
    plans, state0 = _schedule()

    sequential = state0.clone()
    seq_outs = [[] for _ in range(THREADS)]
    for t in range(THREADS):
        _run_steps(plans[t], sequential, seq_outs[t])

    for attempt in range(3):  # different interleavings each time
        shared = state0.clone()
        outs = [[] for _ in range(THREADS)]
        errors = []
        start = threading.Barrier(THREADS)

        def worker(t):
            try:
                start.wait()
                _run_steps(plans[t], shared, outs[t])
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


def _spinner_coverage(fn):
    """Runs `fn` once while a Python thread spins; returns (call seconds, fraction of the call
    during which the spinner kept running). With the GIL held by the call it would be about 0."""
    stamps, stop = [], threading.Event()

    def spin():
        while not stop.is_set():
            stamps.append(time.perf_counter())

    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.02)
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    stop.set()
    th.join()
    inside = [s for s in stamps if t0 <= s <= t1]
    covered = (inside[-1] - inside[0]) if len(inside) > 1 else 0.0
    return t1 - t0, covered / (t1 - t0)


def test_op_releases_the_gil(one_thread):
    """A Python thread keeps running during a long op call (one intra-op thread, a large pool).
    Long: a call of a few ms (B = 24 on AVX-512) fits in one scheduler time slice, so another
    process on the second core could keep the spinner off the CPU for all of it."""
    Bn = 96
    x = make_inputs(Case(B=Bn, H=16, Hv=32, K=128, V=128, pool=Bn + 1,
                         indices=tuple(range(1, Bn + 1))))

    def one_call():
        call(OP, x)

    one_call()  # warm-up
    results = []
    for _ in range(5):  # scheduler noise on a busy machine: one clean run is enough
        results.append(_spinner_coverage(one_call))
        if results[-1][1] > 0.5:
            break
    assert max(cov for _, cov in results) > 0.5, (
        f"a Python thread made no progress during the op call (duration, coverage): {results}")
