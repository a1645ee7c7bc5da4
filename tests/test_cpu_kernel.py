"""The CPU kernel's fast paths and its variant choice: row kernels specialised on K against the
generic one, and every kernel variant against the others, bit for bit (NaN, Inf and denormal values
included); state values near float32's maximum; which variant runs by default and how a wrong
choice is reported."""

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import custom_ops
from custom_ops.cpu import VARIANTS
from custom_ops.testing import (
    OP,
    Case,
    built_by_clang,
    call,
    check_against_reference,
    clone_inputs,
    make_inputs,
    short,
    use_cpu_isa,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import cpu_variants  # noqa: E402  (csrc/cpu/variants.def)

TABLE = {v.name: v for v in cpu_variants.variants()}
STATE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bits(t):
    """The tensor's bytes as integers: equal bits, NaN payloads included."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _assert_same_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    differ = (_bits(a) != _bits(b)).sum().item()
    assert differ == 0, f"{what}: {differ} of {a.numel()} elements differ in their bits"


def _special_inputs(K, state_dtype, V=13):
    """Inputs whose call meets every kind of value: NaN and Inf in the state, an Inf in v, a NaN
    gate, fp32 denormals (state and updated state) and values that round to the 16-bit maximum.
    V = 13 leaves rows outside the kernel's row groups."""
    dtype = torch.float16 if state_dtype == torch.float16 else torch.bfloat16
    x = make_inputs(Case(B=4, H=2, Hv=4, K=K, V=V, dtype=dtype, state_dtype=state_dtype,
                         pool=9, invalid_rows=(2,)))
    state, idx = x["state_ref"], x["ssm_state_indices"]
    s0, s1, s3 = idx[0].item(), idx[1].item(), idx[3].item()
    tiny = 1e-39 if state_dtype != torch.float16 else 3e-7  # a denormal of the state dtype
    big = torch.finfo(state_dtype).max / 2
    state[s0, 0, 1, 3] = float("nan")
    state[s0, 1, 4, 0] = float("inf")
    state[s0, 2, 7, :] = big
    state[s1, 0] = tiny  # with v = 0 below: u, delta and the updated state are denormal too
    state[s3, 3, 0, K - 1] = -float("inf")
    qkv = x["mixed_qkv"]
    H = 2
    v0 = 2 * H * K
    qkv[1, v0:v0 + V] = 0  # row 1, value head 0
    qkv[0, v0 + 2 * V + 5] = float("inf")  # row 0, value head 2, v[5]
    x["a"][3, 1] = float("nan")
    return x


@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=short)
def test_k_specialised_kernels_match_the_generic_one(isa, K, state_dtype):
    """K = 64, 128, 256 have row kernels of their own; they give the generic kernel's bits."""
    x = _special_inputs(K, state_dtype)
    fast, generic = clone_inputs(x), clone_inputs(x)
    out_fast = call(OP, fast)
    old = torch.ops.custom_ops_internal.set_cpu_k_specialization(False)
    try:
        out_generic = call(OP, generic)
    finally:
        torch.ops.custom_ops_internal.set_cpu_k_specialization(old)
    _assert_same_bits(out_fast, out_generic, "out")
    _assert_same_bits(fast["state_ref"], generic["state_ref"], "state")
    # The special values did reach the state (the test would prove little otherwise).
    assert fast["state_ref"].isnan().any() and fast["state_ref"].isinf().any()


def _runnable_variants():
    """The kernel variants this build and CPU run; fewer than two leave nothing to compare."""
    isas = custom_ops.cpu_isas()
    if len(isas) < 2:
        pytest.skip(f"only {isas} runs here: no second variant to compare with")
    return isas


def _per_variant(x, isas, steps=1):
    """(out, state) of `steps` calls from the same inputs with each variant."""
    results = {}
    for name in isas:
        mine = clone_inputs(x)
        with use_cpu_isa(name):
            for _ in range(steps):
                out = call(OP, mine)
        results[name] = (out, mine["state_ref"])
    return results


def _assert_variants_agree(results):
    first, *others = results
    for name in others:
        _assert_same_bits(results[name][0], results[first][0], f"out of {name} vs {first}")
        _assert_same_bits(results[name][1], results[first][1], f"state of {name} vs {first}")


@pytest.mark.parametrize("K", [64, 88, 128, 136, 256])
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=short)
def test_every_variant_gives_the_same_bits(K, state_dtype):
    """Portable, AVX2, AVX-512 and AVX512-BF16 (those that run here) give the same bits for every
    input: NaN, Inf, denormals, values that round to the 16-bit maximum, partial blocks (K = 88:
    an odd number of full blocks, the last of which AVX-512's paired bf16 stores store alone)."""
    isas = _runnable_variants()
    x = _special_inputs(K, state_dtype)
    results = _per_variant(x, isas)
    _assert_variants_agree(results)
    state = results[isas[0]][1]
    assert state.isnan().any() and state.isinf().any()


@pytest.mark.parametrize("case", [
    Case(B=5, H=2, Hv=4, K=128, V=128),
    Case(B=4, H=2, Hv=4, K=136, V=32),
    Case(B=3, H=1, Hv=3, K=96, V=17),
    Case(B=2, H=2, Hv=2, K=2032, V=5),
    Case(B=4, H=4, Hv=8, K=64, V=9, layout="strided", invalid_rows=(1,)),
], ids=lambda c: c.id().replace("-bf16-fp32", ""))
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=short)
def test_every_variant_gives_the_same_bits_over_a_decode(case, state_dtype):
    """Four decode steps of random inputs: the variants' states never drift apart by a bit."""
    isas = _runnable_variants()
    dtype = torch.float16 if state_dtype == torch.float16 else torch.bfloat16
    x = make_inputs(dataclasses.replace(case, dtype=dtype, state_dtype=state_dtype))
    _assert_variants_agree(_per_variant(x, isas, steps=4))


CPP = ROOT / "tests" / "cpp"


def _build_and_run(tmp_path, units, *, flags=(), link_torch=False, timeout=900, cxx=None,
                   link=(), runner=(), args=()):
    """Compiles each of `units` ({object name: compiler arguments}, two at a time) with `cxx`
    (default $CXX or c++), the kernel's include paths and `flags`, links them (with torch's
    libraries if `link_torch`, and `link`) and runs the program with `args`, under `runner` if
    given; its CompletedProcess."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils.cpp_extension import include_paths, library_paths

    cxx = cxx or os.environ.get("CXX", "c++")
    common = ["-O2", "-std=c++20", *flags, f"-I{ROOT / 'csrc'}",
              *[f"-I{p}" for p in include_paths()]]

    def compile_unit(item):
        obj, unit_args = item
        subprocess.run([cxx, *common, "-c", *unit_args, "-o", str(tmp_path / obj)], check=True)

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(compile_unit, units.items()))
    link = list(link)
    if link_torch:  # at::parallel_for is OpenMP
        libs = library_paths()
        link += ["-fopenmp", *[f"-L{p}" for p in libs], *[f"-Wl,-rpath,{p}" for p in libs],
                 "-lc10", "-ltorch_cpu"]
    exe = tmp_path / "program"
    subprocess.run([cxx, *[str(tmp_path / o) for o in units], *link, "-o", str(exe)], check=True)
    return subprocess.run([*runner, str(exe), *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_portable_fused_multiply_add_is_exact(tmp_path):
    """The portable variant's fused multiply-add without an FMA instruction (vec.h: fma_exact, a
    round-to-odd double sum) gives the hardware FMA's bits (tests/cpp/fma_exact.cpp, built with
    the portable variant's flags): 32 million cases, 12 million of them built where plain double
    rounding is wrong."""
    result = _build_and_run(
        tmp_path, {"fma_exact.o": [str(CPP / "fma_exact.cpp")]},
        flags=["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT", "-ffp-contract=off"])
    if result.returncode == 77:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout + result.stderr


def test_avx512_code_matches_avx2_on_intrinsic_stand_ins(tmp_path):
    """Where the CPU has no AVX-512 (so the real avx512 and avx512bf16 variants cannot run), their
    kernel code runs on a labelled test double instead: scalar stand-ins for the AVX-512
    intrinsics (tests/cpp/avx512_standin/standin.h), compiled with the AVX2 flags, against the real
    AVX2 kernel, bit for bit (tests/cpp/avx512_standin/compare.cpp). This checks the code's logic
    (lane orders, masks, the bf16 guard and permute), not the instructions."""
    isas = custom_ops.cpu_isas()
    if "avx512" in isas:
        pytest.skip("the real AVX-512 variants run here (test_every_variant_gives_the_same_bits)")
    if "avx2" not in isas:
        pytest.skip("no AVX2 on this CPU or build: the comparison needs the AVX2 kernel")
    here = CPP / "avx512_standin"
    avx2 = TABLE["avx2"].flags
    isa_flags = [f for f in avx2 if f.startswith("-m")]
    flags = ["-fopenmp", "-ffp-contract=off", "-Wno-psabi",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *isa_flags]

    def standin_defines(v):
        # The variant's defines, and the one macro of its -m flags that vec.h tests.
        return [f for f in v.flags if f.startswith("-D")] + (
            ["-D__AVX512BF16__"] if "-mavx512bf16" in v.flags else [])

    units = {
        "avx2.o": [*avx2, str(ROOT / TABLE["avx2"].source)],
        "avx512.o": [*standin_defines(TABLE["avx512"]), str(here / "kernel_standin.cpp")],
        "avx512bf16.o": [*standin_defines(TABLE["avx512bf16"]), str(here / "kernel_standin.cpp")],
        "compare.o": [str(here / "compare.cpp")],
    }
    result = _build_and_run(tmp_path, units, flags=flags, link_torch=True)
    assert result.returncode == 0, result.stdout + result.stderr


DIGEST_CASES = 240  # the lines tests/cpp/portable_digest.cpp prints


def _digest_units(avx2):
    """portable_digest.cpp's units: the portable kernel (and the avx2 one), the program, and a
    labelled double for ATen's threading (tests/cpp/aten_serial.cpp), so nothing links torch."""
    digest = str(CPP / "portable_digest.cpp")
    units = {"portable.o": [*TABLE["portable"].flags, str(ROOT / TABLE["portable"].source)],
             "digest.o": [digest], "serial.o": [str(CPP / "aten_serial.cpp")]}
    if avx2:
        units["avx2.o"] = [*TABLE["avx2"].flags, str(ROOT / TABLE["avx2"].source)]
        units["digest.o"] = ["-DDIGEST_AVX2", digest]
    return units


def _digests(path, cxx=None, *, avx2, link=(), runner=()):
    """{variant: the digest's lines} of a build by `cxx` in `path`, run under `runner`."""
    names = ["portable", "avx2"] if avx2 else ["portable"]
    first = _build_and_run(path, _digest_units(avx2), flags=["-O3", "-ffp-contract=off"],
                           cxx=cxx, link=link, runner=runner, args=[names[0]], timeout=600)
    runs = [first] + [subprocess.run([*runner, str(path / "program"), name], capture_output=True,
                                     text=True, timeout=600, check=False) for name in names[1:]]
    for name, run in zip(names, runs, strict=True):
        assert run.returncode == 0, f"{name}: {run.stdout}{run.stderr}"
    return {name: run.stdout.splitlines() for name, run in zip(names, runs, strict=True)}


def _assert_same_digests(mine, what, native):
    lines = mine["portable"]
    assert len(lines) == DIGEST_CASES and len({ln.split(" out=")[1] for ln in lines}) == (
        DIGEST_CASES // 2), "each case once, the specialised and generic kernels alike:\n" + (
        "\n".join(lines))
    for name, theirs in mine.items():
        for native_name, ours in native.items():
            differ = [f"{native_name} here: {a}\n{what} {name}: {b}"
                      for a, b in zip(ours, theirs, strict=True) if a != b]
            assert not differ, f"{len(differ)} of {DIGEST_CASES} cases differ:\n" + "\n".join(
                differ[:10])


@pytest.fixture(scope="module")
def native_digests(tmp_path_factory):
    """The digest of this machine's portable and (where it runs) avx2 variants, built by $CXX."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip(f"compares with an x86-64 build; this is {platform.machine()}")
    return _digests(tmp_path_factory.mktemp("native"), avx2="avx2" in custom_ops.cpu_isas())


def test_portable_variant_gives_the_same_bits_on_aarch64(native_digests, tmp_path):
    """The portable variant built for AArch64 (the host CPU of many Ascend servers), where its
    fused multiply-add is the FMA instruction (std::fma) and c10's fp16 conversions are the
    hardware's, gives the bits of this machine's portable and avx2 variants:
    tests/cpp/portable_digest.cpp hashes out and state after three steps of 240 cases (every dtype
    pair, K with partial blocks, the specialised and generic row kernels, NaN, Inf, denormal and
    near-maximal values), built here and with a cross compiler (statically), the latter run under
    qemu's user-mode emulator: the bits, not the speed. Skips where the tools are missing
    (Debian: apt install g++-aarch64-linux-gnu qemu-user-static)."""
    import shutil

    cross = os.environ.get("CUSTOM_OPS_AARCH64_CXX") or shutil.which("aarch64-linux-gnu-g++")
    qemu = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
    missing = [n for n, t in (("aarch64-linux-gnu-g++", cross), ("qemu-aarch64", qemu)) if not t]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} "
                    "(apt install g++-aarch64-linux-gnu qemu-user-static)")
    arm = _digests(tmp_path, cross, avx2=False, link=["-static"], runner=[qemu])
    _assert_same_digests(arm, "aarch64", native_digests)


def test_clang_build_gives_the_same_bits(native_digests, tmp_path):
    """The portable and avx2 variants built by clang++ give the bits of the same variants built
    by $CXX (GCC in CI): nothing in the kernel's bits may depend on a compiler's choices (the
    kernel files are built with -ffp-contract=off). Skips where clang++ is not installed."""
    import shutil

    clang = shutil.which("clang++")
    if clang is None:
        pytest.skip("not installed: clang++")
    cxx = os.environ.get("CXX", "c++")
    if cpu_variants.is_clang(cxx):
        pytest.skip(f"$CXX ({cxx}) is clang already")
    mine = _digests(tmp_path, clang, avx2="avx2" in native_digests)
    _assert_same_digests(mine, "clang++", native_digests)


def test_avx512bf16_narrowing_is_exact_for_every_fp32(tmp_path):
    """The AVX512-BF16 variant's bf16 narrowing gives the integer rounding's bits for all 2^32
    fp32 inputs (tests/cpp/bf16_narrow_exhaustive.cpp, built with that variant's flags)."""
    if "avx512bf16" not in custom_ops.cpu_isas():
        pytest.skip("this build or CPU has no avx512bf16 variant")
    result = _build_and_run(
        tmp_path, {"bf16_narrow_exhaustive.o": [str(CPP / "bf16_narrow_exhaustive.cpp")]},
        flags=TABLE["avx512bf16"].flags)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=short)
@pytest.mark.parametrize("gate", ["decay0", "a4.6"])
def test_state_near_float32_max(isa, state_dtype, gate):
    """A state of 3e38: with decay 0 the state is forgotten (the reference's small output, not
    NaN); with a = 4.6 the decayed state is ~1e36 (not -Inf). S k alone overflows; exp(g) S k
    does not."""
    x = make_inputs(Case(B=1, H=1, Hv=1, K=64, V=8, state_dtype=state_dtype, pool=3))
    slot = x["ssm_state_indices"][0].item()
    x["state_ref"][slot] = 3e38
    x["mixed_qkv"][:, 64:128] = 1.0  # k = 1/8 everywhere: S k = 8 * 3e38 overflows
    if gate == "decay0":
        x["a_log"].fill_(10.0)  # g = -e^10 softplus(..) -> exp(g) = 0
    else:
        x["a_log"].zero_()
        x["dt_bias"].zero_()
        x["a"].fill_(4.6)  # exp(g) = 1 / (1 + e^4.6) ~ 0.01
    ours, ref = check_against_reference(x)
    assert ours["state_ref"][slot].float().isfinite().all()
    if gate == "a4.6":
        assert ref["state_ref"][slot].float().abs().max() > 1e35


def test_the_variant_table_reads_the_same_in_cpp_and_python():
    """csrc/cpu/variants.def as the extension compiled it and as scripts/cpu_variants.py (setup.py,
    these tests) parses it."""
    assert VARIANTS == tuple(TABLE)
    assert TABLE["portable"].flags[0] == "-DCPU_CAPABILITY=DEFAULT"
    assert set(custom_ops.cpu_isas()) <= set(VARIANTS)


def test_cpu_features_agree_with_proc_cpuinfo():
    """cpu_has (CPUID and XGETBV, csrc/cpu/fused_gdn_decode_cpu.cpp), which decides where a
    variant runs, against the flags Linux lists in /proc/cpuinfo, for every feature it knows
    (variants.def's among them); every runnable variant has its features; a name cpu_has does not
    know is a ValueError naming it and the names it knows."""
    import platform

    has = torch.ops.custom_ops_internal.cpu_has
    features = sorted({f for v in TABLE.values() for f in v.cpu_features})
    assert features, "variants.def names no CPU feature"
    with pytest.raises(ValueError, match=r"feature must be one of avx2, .*; got 'avx9000'") as e:
        has("avx9000")
    known = str(e.value).split("one of ", 1)[1].split(";", 1)[0].split(", ")
    assert set(features) <= set(known), "variants.def names a feature cpu_has does not know"
    if platform.machine() != "x86_64":
        assert not any(has(f) for f in known)
        return
    info = pathlib.Path("/proc/cpuinfo").read_text()
    flags = set(re.search(r"^flags\s*:(.*)$", info, re.MULTILINE).group(1).split())
    linux_name = {"avx512bf16": "avx512_bf16"}  # where /proc/cpuinfo spells it differently
    for feature in known:
        assert has(feature) == (linux_name.get(feature, feature) in flags), feature
    for variant in custom_ops.cpu_isas():
        assert all(has(f) for f in TABLE[variant].cpu_features), variant


_THREADS_CODE = """
import os, torch, custom_ops
from custom_ops.testing import OP, Case, call, make_inputs
torch.set_num_threads(2)
x = make_inputs(Case(B=8, H=2, Hv=4, K=128, V=64))
torch.ones(1 << 22).add_(1)  # torch's own intra-op threads start
before = len(os.listdir("/proc/self/task"))
for _ in range(3):
    call(OP, x)
print(before, len(os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not pathlib.Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_the_kernel_runs_on_torchs_intra_op_threads():
    """The kernel's at::parallel_for runs on torch's OpenMP threads (libgomp.so.1, the one torch
    loaded), so torch.set_num_threads governs it: calls start no threads of their own (clang's
    -fopenmp would bring LLVM's libomp, a second pool beside torch's). A GCC build is threaded
    (it imports GOMP_parallel); a clang build runs the kernel on one thread (setup.py)."""
    import importlib.util
    import shutil

    result = subprocess.run([sys.executable, "-c", _THREADS_CODE], capture_output=True, text=True,
                            timeout=300, check=False, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    before, after = map(int, result.stdout.split())
    assert after == before, f"the op's calls started {after - before} thread(s) of their own"
    if shutil.which("nm") is None or shutil.which("readelf") is None:
        pytest.skip("nm and readelf (binutils) are not installed: the imports are not checked")
    lib = importlib.util.find_spec("custom_ops._C").origin
    imports = subprocess.run(["nm", "-D", "--undefined-only", lib], capture_output=True,
                             text=True, check=True).stdout
    assert "__kmpc_" not in imports, "the library calls LLVM's OpenMP runtime"
    threaded = torch.ops.custom_ops_internal.cpu_threaded()
    assert threaded == ("GOMP_parallel" in imports)
    assert threaded or built_by_clang(), "a GCC build without OpenMP: the kernel runs serially"


def _isa_in_subprocess(env, code="import custom_ops; print(custom_ops.cpu_isa())"):
    full = {k: v for k, v in os.environ.items()
            if k not in ("CUSTOM_OPS_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    full.update(env)
    return subprocess.run([sys.executable, "-W", "default", "-c", code], env=full, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)


def _cpu_is(name):
    """__builtin_cpu_is(name) read from /proc/cpuinfo, for the names variants.def uses."""
    info = pathlib.Path("/proc/cpuinfo").read_text()
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", info, re.M).group(1)
    family = int(re.search(r"^cpu family\s*:\s*(\d+)", info, re.M).group(1))
    known = {"amdfam19h": vendor == "AuthenticAMD" and family == 0x19}
    return known[name]  # a KeyError for a name new to the table: add it above


def _expected_default(capability):
    """The variant expected at import for torch's CPU capability: the last row this build and
    CPU run, not above the capability's, and that may be the default on this CPU."""
    rank = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}
    limit = rank.get(capability, 0)
    runnable = custom_ops.cpu_isas()
    return [v for v in VARIANTS
            if rank[TABLE[v].aten] <= limit and v in runnable
            and (not TABLE[v].default_cpus or any(map(_cpu_is, TABLE[v].default_cpus)))][-1]


_DEFAULT_CODE = ("import torch, custom_ops; print(custom_ops.cpu_isa()); "
                 "print(torch.backends.cpu.get_cpu_capability())")


@pytest.mark.parametrize("aten", ["default", "avx2", "avx512", None])
def test_default_variant_follows_aten_cpu_capability(aten):
    """With no CUSTOM_OPS_CPU_ISA the variant follows PyTorch's own CPU capability
    (ATEN_CPU_CAPABILITY included), capped by what this build and CPU run."""
    result = _isa_in_subprocess({} if aten is None else {"ATEN_CPU_CAPABILITY": aten},
                                code=_DEFAULT_CODE)
    assert result.returncode == 0, result.stderr
    chosen, capability = result.stdout.split()
    assert chosen == _expected_default(capability)
    if aten == "default":
        assert chosen == "portable"
    if aten == "avx2":
        assert chosen == ("avx2" if "avx2" in custom_ops.cpu_isas() else "portable")
    if aten is None and "avx512bf16" in custom_ops.cpu_isas():
        # Its row's default_here: measured the fastest on AMD family 19h (Zen 4) only.
        assert (chosen == "avx512bf16") == _cpu_is("amdfam19h")


def test_env_variable_overrides_the_default():
    result = _isa_in_subprocess({"ATEN_CPU_CAPABILITY": "default",
                                 "CUSTOM_OPS_CPU_ISA": custom_ops.cpu_isas()[-1]})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == custom_ops.cpu_isas()[-1]


def test_env_variable_with_an_unknown_variant_fails_the_import():
    result = _isa_in_subprocess({"CUSTOM_OPS_CPU_ISA": "avx9000"})
    assert result.returncode != 0
    assert ("ValueError: CUSTOM_OPS_CPU_ISA must be 'auto', 'portable'," in result.stderr
            and "(a CPU kernel variant), but got 'avx9000'" in result.stderr), result.stderr


def test_env_variable_with_a_variant_this_machine_lacks_warns():
    missing = [v for v in ("avx512bf16", "avx512", "avx2") if v not in custom_ops.cpu_isas()]
    if not missing:
        pytest.skip("this build and CPU run every variant")
    result = _isa_in_subprocess({"CUSTOM_OPS_CPU_ISA": missing[0]}, code=_DEFAULT_CODE)
    assert result.returncode == 0, result.stderr
    assert "RuntimeWarning" in result.stderr and f"'{missing[0]}'" in result.stderr
    assert (f"CUSTOM_OPS_CPU_ISA='{missing[0]}' ignored: '{missing[0]}' is a CPU kernel variant "
            "this build or this CPU lacks" in result.stderr), result.stderr
    chosen, capability = result.stdout.split()
    assert chosen == _expected_default(capability)


@pytest.fixture
def non_default_isa():
    """A variant other than the default selected for the test, so that a refusal which fell back
    to the default ("auto") would show."""
    previous = custom_ops.set_cpu_isa("auto")
    default = custom_ops.cpu_isa()
    custom_ops.set_cpu_isa(previous)
    other = [v for v in custom_ops.cpu_isas() if v != default]
    if not other:
        pytest.skip("this build and CPU run only the default variant")
    with use_cpu_isa(other[0]):
        yield other[0]


def test_set_cpu_isa_rejects_unknown(non_default_isa):
    names = ", ".join(repr(v) for v in ["auto", *VARIANTS[:-1]])
    expected = (f"set_cpu_isa: name must be {names} or {VARIANTS[-1]!r} (a CPU kernel "
                f"variant), but got 'sse9'")
    with pytest.raises(ValueError, match=re.escape(expected)):
        custom_ops.set_cpu_isa("sse9")
    assert custom_ops.cpu_isa() == non_default_isa


def test_set_cpu_isa_rejects_a_variant_this_machine_lacks(non_default_isa):
    missing = [v for v in VARIANTS if v not in custom_ops.cpu_isas()]
    if not missing:
        pytest.skip("this build and CPU run every variant")
    with pytest.raises(ValueError, match=re.escape(
            f"set_cpu_isa: name {missing[0]!r} is a CPU kernel variant this build or this CPU "
            f"lacks (available here: ")):
        custom_ops.set_cpu_isa(missing[0])
    assert custom_ops.cpu_isa() == non_default_isa


def test_set_cpu_isa_returns_the_previous_variant(isa):
    assert custom_ops.set_cpu_isa("portable") == isa
    assert custom_ops.cpu_isa() == "portable"
    assert custom_ops.set_cpu_isa(isa) == "portable"
    assert "portable" in custom_ops.cpu_isas()


@pytest.mark.parametrize("name", ["portable\x00junk", "Portable", " avx2", ""])
def test_set_cpu_isa_rejects_near_misses(name, non_default_isa):
    with pytest.raises(ValueError, match=r"set_cpu_isa: name must be 'auto', .* but got "):
        custom_ops.set_cpu_isa(name)
    assert custom_ops.cpu_isa() == non_default_isa


@pytest.mark.parametrize("name", [None, 2, b"avx2"])
def test_set_cpu_isa_rejects_non_strings(name, non_default_isa):
    with pytest.raises(TypeError, match="set_cpu_isa: name must be a str"):
        custom_ops.set_cpu_isa(name)
    assert custom_ops.cpu_isa() == non_default_isa
