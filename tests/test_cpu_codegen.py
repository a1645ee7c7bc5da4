"""A static check of the SIMD kernels' machine code, for the CPUs the test machine may not be.

The AVX-512 variants run only on CPUs that have AVX-512; where the tests run without it, their
speed cannot be seen. One property decides much of it and can be read from the built library: a
row group's dot-product accumulators must stay in registers (AVX-512 has 32). A compiler that keeps
them on the stack makes every FMA of a dot product wait for a store and a reload (GCC 12 does, given
a plain row loop or one step left out of line: docs/cpu_kernel.md) yet changes no bit, so no other
test sees it. Another is where the prefetches go: next to the loads they serve, not moved to a
group's top in one burst (as GCC schedules __builtin_prefetch). These tests disassemble the
library's K-specialised AVX-512 row kernels with objdump and fail where an accumulator lives on the
stack, the prefetches come in bursts or go into L1 rather than L2 (on AMD Zen 4 prefetches into L1
held the fp32 kernel at 25-56 % of rmw from DRAM, into L2 74-99 %: docs/cpu_kernel.md; a 16-bit
state's kernel adds one into L1, nearer, for each into L2), or a prefetch's address is computed
into a register instead of being a displacement from the rows' base (on Zen 4 an fp32 row took
18 % fewer ns in L1 without the moves and reloads). The avx2 variant's row kernels are held to the
same prefetches (into L2 only) and the same placement. They read the code the compiler made; they
do not time it.
"""

import importlib.util
import re
import shutil
import subprocess

import pytest

from custom_ops.testing import built_by_clang

FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")
INSTRUCTION = re.compile(r"^\s*[0-9a-f]+:\s+(.*)$")
ZMM_STACK = re.compile(r"%zmm\d+.*\(%r[sb]p\)|\(%r[sb]p\).*%zmm\d+")
SLOT = re.compile(r"(-?(?:0x[0-9a-f]+)?\(%r[sb]p\))")
FMA = re.compile(r"^vfn?m(?:add|sub)")
PREFETCH = re.compile(r"^prefetch")
needs_objdump = pytest.mark.skipif(shutil.which("objdump") is None,
                                   reason="objdump (binutils) is not installed")

# The row kernels specialised on K: their block loops are unrolled, so the whole function is the
# loop over row groups. (The generic one parks its accumulators around the last partial block,
# outside its block loops, which costs little.)
def _row_kernel(isa):
    return re.compile(
        isa + r"::\(anonymous namespace\)::RowGroups<[^,]+, \d+, (64|128|256),[^>]*>::update\(")


# The AVX-512 variants' row kernels (avx512, avx512bf16) and the avx2 variant's.
ROW_KERNELS = {"AVX-512": _row_kernel(r"AVX512\w*"), "AVX2": _row_kernel("AVX2")}


# A row kernel of a 16-bit state: RowGroups' first template argument.
STATE_16BIT = re.compile(r"RowGroups<c10::(?:BFloat16|Half),")


def _library():
    return importlib.util.find_spec("custom_ops._C").origin


def _functions(lib, pattern):
    """(name, [instruction]) for every function of lib whose name matches pattern."""
    text = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", lib], check=True,
                          capture_output=True, text=True).stdout
    found, name, body = [], None, []
    for line in text.splitlines() + ["0 <end>:"]:
        m = FUNCTION.match(line)
        if m:
            if name is not None and pattern.search(name):
                found.append((name, body))
            name, body = m.group(1), []
        elif name is not None and (m := INSTRUCTION.match(line)):
            body.append(m.group(1).strip())
    return found


# A call of the row kernel's cold path (RowGroups::store_pairs_again): no vector register lives
# across a call, so the live ones are saved and restored around it, on that path only.
COLD_CALL = re.compile(r"^call\s.*::store_pairs_again<")


def _outside_cold_calls(body):
    """body without the straight-line stretches (from one jump to the next) that call the cold
    path."""
    kept, stretch = [], []
    for n, ins in enumerate(body):
        stretch.append(ins)
        if ins.startswith(("j", "ret")) or n == len(body) - 1:
            if not any(COLD_CALL.match(i) for i in stretch):
                kept.extend(stretch)
            stretch = []
    return kept


def accumulators_on_the_stack(body):
    """Instructions that keep a zmm accumulator on the stack: an FMA reading its addend from a
    stack slot, or a stack slot that a zmm register goes to and comes back from more than once
    (once is a value parked across a branch). Registers saved around a call of the cold path do
    not count."""
    found, stores, loads, moves = [], {}, {}, {}
    for ins in _outside_cold_calls(body):
        if not ZMM_STACK.search(ins):
            continue
        if FMA.match(ins):
            found.append(ins)
            continue
        slot = SLOT.search(ins).group(1)
        operands = ins.split(None, 1)[1]
        counts = stores if operands.index(slot) > operands.index("%zmm") else loads
        counts[slot] = counts.get(slot, 0) + 1
        moves.setdefault(slot, []).append(ins)
    return found + [ins for slot, slot_moves in moves.items()
                    if min(stores.get(slot, 0), loads.get(slot, 0)) >= 2 for ins in slot_moves]


def test_the_check_finds_a_spilled_accumulator():
    """The negative control: accumulators kept on the stack are found, a value parked once and
    ymm registers (AVX2 has only 16) are not."""
    direct = ["vmovups (%rax),%zmm1", "vfmadd213ps 0x40(%rsp),%zmm2,%zmm1",
              "vmovaps %zmm1,0x40(%rsp)"]
    assert accumulators_on_the_stack(direct) == ["vfmadd213ps 0x40(%rsp),%zmm2,%zmm1"]
    through = ["vmovaps 0x40(%rsp),%zmm1", "vfmadd231ps (%rax),%zmm2,%zmm1",
               "vmovaps %zmm1,0x40(%rsp)", "vmovaps 0x40(%rsp),%zmm1",
               "vfmadd231ps 0x40(%rax),%zmm2,%zmm1", "vmovaps %zmm1,0x40(%rsp)"]
    assert len(accumulators_on_the_stack(through)) == 4
    assert accumulators_on_the_stack(through[:3]) == []
    assert accumulators_on_the_stack(["vmovaps %ymm1,0x40(%rsp)",
                                      "vfmadd213ps 0x40(%rsp),%ymm2,%ymm1"]) == []
    # Saved around two calls of the cold path: not counted; the same moves around another call
    # are.
    cold = "call 10fe6 <void RowGroups<c10::BFloat16, 4, 128>::store_pairs_again<0, 4>"
    saves = ["jne 1762de", "vmovaps %zmm9,0x80(%rsp)", cold, "vmovaps 0x80(%rsp),%zmm9",
             "jmp 1738a6"] * 2
    assert accumulators_on_the_stack(saves) == []
    other = [ins.replace("store_pairs_again", "update") for ins in saves]
    assert len(accumulators_on_the_stack(other)) == 4
    assert accumulators_on_the_stack(saves[:-1]) == []  # the function's last stretch
    assert accumulators_on_the_stack(other[:-1]) == other[1:4:2] + other[6:9:2]


def prefetch_bursts(body, window=8, most=4):
    """The first instruction of every run of `window` consecutive instructions that holds more
    than `most` prefetches: prefetches moved together to a group's top instead of staying next to
    the loads they were written with (one per row and block in pass one)."""
    flags = [bool(PREFETCH.match(ins)) for ins in body]
    return [body[i] for i in range(max(len(body) - window + 1, 0))
            if sum(flags[i:i + window]) > most]


def test_the_burst_check_finds_hoisted_prefetches():
    load = "vmovups 0x40(%rcx),%zmm0"
    fma = "vfmadd231ps (%rdx),%zmm0,%zmm1"
    prefetches = [f"prefetcht0 0x{0x1000 + 64 * r:x}(%rcx)" for r in range(8)]
    spread = [ins for p in prefetches for ins in (p, load, fma)]
    assert prefetch_bursts(spread) == []
    hoisted = prefetches + [load, fma] * 8
    assert prefetch_bursts(hoisted) == hoisted[:4]  # windows from the first four hold 8, 7, 6, 5


# How much nearer a 16-bit state's prefetch into L1 is than its prefetch into L2 of the same line
# (csrc/cpu/kernel_impl.h: kPrefetchBytes - kNearPrefetchBytes).
NEAR_BEHIND = 8192 - 3072
OPERAND = re.compile(r"^prefetcht[01]\s+(-?0x[0-9a-f]+)\((%r\w+)\)$")


def prefetches_off_plan(body, state_16bit=False):
    """Prefetches other than the kernel's: prefetcht1 (into L2), and for a 16-bit state a
    prefetcht0 (into L1) NEAR_BEHIND bytes before each, from the same base register; for a 16-bit
    state, also every prefetcht1 without its prefetcht0 and every prefetcht0 without its
    prefetcht1."""
    def operand(ins):
        m = OPERAND.match(ins)
        return (int(m.group(1), 16), m.group(2)) if m else None

    into_l2 = [ins for ins in body if ins.startswith("prefetcht1 ")]
    into_l1 = [ins for ins in body if ins.startswith("prefetcht0 ")] if state_16bit else []
    other = [ins for ins in body
             if PREFETCH.match(ins) and ins not in into_l2 and ins not in into_l1]
    if not state_16bit:
        return other
    far = {operand(ins) for ins in into_l2}
    near = {operand(ins) for ins in into_l1}
    lone_l1 = [ins for ins in into_l1 if (o := operand(ins)) is None
               or (o[0] + NEAR_BEHIND, o[1]) not in far]
    lone_l2 = [ins for ins in into_l2 if (o := operand(ins)) is None
               or (o[0] - NEAR_BEHIND, o[1]) not in near]
    return other + lone_l1 + lone_l2


def test_the_prefetch_check_finds_other_prefetches():
    body = ["prefetcht1 0x2000(%rcx)", "vmovups 0x40(%rcx),%zmm0", "prefetcht0 0x2040(%rcx)",
            "prefetchw 0x2080(%rcx)", "prefetchnta 0x20c0(%rcx)"]
    assert prefetches_off_plan(body) == body[2:]
    # 16-bit: 0x2040 has no prefetcht1 at 0x3440, 0x2000 no prefetcht0 at 0xc00
    assert prefetches_off_plan(body, state_16bit=True) == body[3:] + body[2:3] + body[:1]
    paired = ["prefetcht1 0x2000(%rcx)", "prefetcht0 0xc00(%rcx)", "vmovups (%rcx),%ymm0",
              "prefetcht1 0x2100(%rcx)", "prefetcht0 0xd00(%rcx)"]
    assert prefetches_off_plan(paired, state_16bit=True) == []
    assert prefetches_off_plan(paired) == [paired[1], paired[4]]
    wrong = ["prefetcht1 0x2000(%rcx)", "prefetcht0 0x1800(%rcx)",  # 2 KiB nearer, not 5
             "prefetcht1 0x2100(%rcx)", "prefetcht0 0xd00(%rdx)"]  # another base register
    assert prefetches_off_plan(wrong, state_16bit=True) == [wrong[1], wrong[3], wrong[0], wrong[2]]


# A prefetch's address as a displacement from a base register alone, as the state loads' are.
DISPLACEMENT = re.compile(r"^prefetch\w+\s+-?0x[0-9a-f]+\(%r\w+\)$")


def prefetches_at_computed_addresses(body):
    """Prefetches whose address is not a constant displacement from one base register: addresses
    computed ahead into registers (or reloaded from the stack), a move or a reload per prefetch."""
    return [ins for ins in body if PREFETCH.match(ins) and not DISPLACEMENT.match(ins)]


def test_the_address_check_finds_computed_addresses():
    body = ["prefetcht1 0x2000(%rdi)", "vmovq %xmm9,%rcx", "prefetcht1 (%rcx)",
            "prefetcht1 0x2040(%rdi,%rax,1)", "prefetcht1 0x2440(%r15)"]
    assert prefetches_at_computed_addresses(body) == [body[2], body[3]]


def _offenders(check, isa="AVX-512", by_state=False):
    """(kernels where check(body) finds something, how many kernels, a listing of them);
    by_state: check(body, state_16bit) with whether the kernel's state is 16-bit."""
    lib = _library()
    kernels = _functions(lib, ROW_KERNELS[isa])
    if not kernels:
        pytest.skip(f"no {isa} row kernel symbols in {lib} (a build without that variant, or "
                    "stripped)")
    found = {}
    for name, body in kernels:
        hits = check(body, STATE_16BIT.search(name) is not None) if by_state else check(body)
        if hits:
            found[name] = hits
    listing = "\n".join(f"{len(h)}x in {n}: at {h[0]}" for n, h in found.items())
    return found, len(kernels), listing


# The avx2 variant prefetches as AVX-512 does, without the second prefetch into L1 of a 16-bit
# state (kNearPrefetchBytes is 0 there), and its rows run their loops one after another, so its
# accumulators are not checked: with 16 registers a row's live ones are few.
ISAS = pytest.mark.parametrize("isa", list(ROW_KERNELS))


@needs_objdump
@ISAS
def test_row_kernels_keep_their_prefetches_next_to_their_loads(isa):
    bursts, kernels, listing = _offenders(prefetch_bursts, isa)
    assert not bursts, (f"{len(bursts)} of {kernels} {isa} row kernels issue their prefetches "
                        f"in bursts:\n{listing}")


@needs_objdump
def test_avx512_row_kernels_keep_their_accumulators_in_registers():
    if built_by_clang():
        pytest.skip("the check holds GCC's register allocation; clang 14 keeps AVX-512 "
                    "accumulators on the stack (docs/building.md: clang builds are slower)")
    spilled, kernels, listing = _offenders(accumulators_on_the_stack)
    assert not spilled, (f"{len(spilled)} of {kernels} AVX-512 row kernels keep accumulators on "
                         f"the stack:\n{listing}")


@needs_objdump
def test_avx512_row_kernels_prefetch_into_l2_and_16bit_states_also_into_l1():
    other, kernels, listing = _offenders(prefetches_off_plan, by_state=True)
    assert not other, (f"{len(other)} of {kernels} AVX-512 row kernels prefetch other than into "
                       f"L2 (prefetcht1), and for a 16-bit state one into L1 (prefetcht0) per "
                       f"prefetch into L2:\n{listing}")


@needs_objdump
def test_avx2_row_kernels_prefetch_into_l2_only():
    other, kernels, listing = _offenders(prefetches_off_plan, "AVX2")
    assert not other, (f"{len(other)} of {kernels} AVX2 row kernels prefetch other than into L2 "
                       f"(prefetcht1):\n{listing}")


@needs_objdump
@ISAS
def test_row_kernels_prefetch_at_a_displacement_from_their_rows(isa):
    computed, kernels, listing = _offenders(prefetches_at_computed_addresses, isa)
    assert not computed, (f"{len(computed)} of {kernels} {isa} row kernels prefetch at addresses "
                          f"computed into registers:\n{listing}")
