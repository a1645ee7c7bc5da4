"""Ahead-of-time compile of the op's Triton kernel for NVIDIA GPUs, on a machine without one.

Triton's real compiler (its front end, MLIR and LLVM passes, and the ptxas it bundles) builds the
kernel for a GPU named by compute capability; nothing is launched, so no GPU or driver is needed.
The launch arguments come from the launcher's own ``launch_config`` on CPU tensors with the op's
dtypes and layout (a and b column views of one projection), specialised by the JIT's own binder, so
what is compiled is what a launch on that GPU compiles for the same layout.

    python -m benchmarks.triton_compile [--arch 80 90]   # the registers/spills table, docs/gpu.md

tests/test_triton_compile.py compiles every configuration with it and fails on any error.

Triton is imported inside the functions, not at the top: a compiler process must drop
TRITON_INTERPRET before its first import of triton (see compiler_processes).
"""

import argparse
import concurrent.futures
import contextlib
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile

import torch

from custom_ops.testing import DTYPE_PAIRS, Case, make_inputs, short

ARCHS = (80, 90)  # A100; H100/H200
KS = (64, 128, 136, 2032)  # smallest, Qwen3-Next, not a power of two (padded lanes), largest
V_REALISTIC = 128


def configurations(ks=KS, pairs=DTYPE_PAIRS):
    """Every (dtype, state_dtype, K, V, TileConfig) the launcher can pick for these K.

    tile_config's tile grows with V up to its register budget and then stays, so the powers of two
    up to 4096 reach every tile; each tile is compiled once, with V = 128 where that picks it (the
    realistic shape), else with the smallest V that does.
    """
    from custom_ops import triton_kernel as tk

    for dtype, sdt in pairs:
        for K in ks:
            vs = {1 << e for e in range(13)}
            picks = {}
            for V in sorted(vs):
                picks.setdefault(tk.tile_config(K, V, sdt), V)
            picks[tk.tile_config(K, V_REALISTIC, sdt)] = V_REALISTIC
            for cfg, V in picks.items():
                yield dtype, sdt, K, V, cfg


def config_id(dtype, state_dtype, K, V, cfg):
    return f"{short(dtype)}-{short(state_dtype)}-K{K}-V{V}-BV{cfg.BV}-w{cfg.num_warps}"


def launch_for(dtype, state_dtype, K, V, H=16, Hv=32, config=None, pdl=False):
    """(grid, args, kwargs) of the launch for these sizes (Qwen3-Next heads by default), built by
    the launcher's own launch_config from the shared input generator's "projection" layout.

    The state pool is torch.empty and never written: only its dtype and shape count here.
    """
    from custom_ops import triton_kernel as tk

    B = 2
    state = torch.empty(B + 1, Hv, V, K, dtype=state_dtype)
    x = make_inputs(Case(B=B, H=H, Hv=Hv, K=K, V=V, dtype=dtype, state_dtype=state_dtype,
                         layout="projection"), state_ref=state)
    out = torch.empty(B, 1, Hv, V, dtype=dtype)
    return tk.launch_config(x["mixed_qkv"], x["a"], x["b"], x["a_log"], x["dt_bias"], state,
                            x["ssm_state_indices"], out, x["scale"], 20.0, config, pdl=pdl)


def compile_launch(fn, arch, args, kwargs):
    """Compiles ``fn`` (a kernel function, jitted here) for sm_<arch> with the specialisation a
    launch with ``args``/``kwargs`` gets; returns Triton's CompiledKernel or raises its error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    # JITFunction, not triton.jit: under TRITON_INTERPRET=1 that returns the interpreter.
    fn = fn if isinstance(fn, JITFunction) else JITFunction(fn)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs, debug=False)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization,
                                                          options)
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def compile_config(arch, dtype, state_dtype, K, V, config=None):
    """The op's kernel compiled for sm_<arch> as the launcher launches it for these sizes."""
    from custom_ops import triton_kernel as tk

    # The launcher makes every launch on sm_90 and later a programmatic dependent one.
    _, args, kwargs = launch_for(dtype, state_dtype, K, V, config=config, pdl=arch >= 90)
    return compile_launch(tk._kernel_body, arch, args, kwargs)


# A SASS instruction in cuobjdump -sass's listing: "        /*0a30*/  FFMA R4, R5, R6, R4 ;"
_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def resources(kernel):
    """{"n_regs", "n_spills", "shared", "sass"} of a compiled kernel, read from its cubin by the
    cuobjdump Triton bundles: the attributes Triton's driver reports as n_regs and n_spills
    (local bytes / 4) when it loads the kernel on a GPU, and the kernel's static count of SASS
    instructions, NOPs left out (each thread runs each of them at most once: no loops)."""
    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        cuobjdump = triton.knobs.nvidia.cuobjdump.path
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], check=True, capture_output=True,
                              text=True).stdout
    instructions = [m.group(1) for m in map(_SASS_LINE.match, sass.splitlines()) if m]
    fields = {}
    for line in text.splitlines():
        if "REG:" in line:
            fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    if not fields:
        raise RuntimeError(f"no resource line in the cuobjdump output:\n{text}")
    return dict(n_regs=int(fields["REG"]), n_spills=int(fields["LOCAL"]) // 4,
                shared=int(fields["SHARED"]),
                sass=sum(not i.startswith("NOP") for i in instructions))


@contextlib.contextmanager
def fresh_compiler(cache_dir):
    """Compiles from scratch into ``cache_dir`` with Triton's strict settings.

    Triton's cache key leaves out TRITON_ALLOW_NON_CONSTEXPR_GLOBALS: an entry built with it set
    would be found and hide the error. Hence a new directory, no cache reads, and the switch off.
    """
    import triton

    knobs = triton.knobs
    with knobs.cache.scope(), knobs.compilation.scope():
        knobs.cache.dir = cache_dir
        knobs.compilation.always_compile = True
        knobs.compilation.allow_non_constexpr_globals = False
        yield


def compile_task(arch, dtype, state_dtype, K, V, config, cache_dir):
    """compile_config and resources in a fresh compiler: (resources, None), or (None, the error as
    text), since Triton's exceptions need not pickle out of a worker process."""
    try:
        with fresh_compiler(cache_dir):
            return resources(compile_config(arch, dtype, state_dtype, K, V, config)), None
    except Exception as e:  # the caller reports it
        return None, f"{type(e).__name__}: {e}"


def _start_compiler_process():
    """Initializer of a compiler process, run before anything there imports triton."""
    # Imported with TRITON_INTERPRET=1 (the test suite sets it), triton decorates its own library
    # functions for the interpreter, and a kernel calling them cannot be compiled.
    os.environ.pop("TRITON_INTERPRET", None)
    if "triton" in sys.modules:
        import triton.language.standard as std

        if type(std.cdiv).__name__ == "InterpretedFunction":
            raise RuntimeError("triton was imported with TRITON_INTERPRET set before the compiler "
                               "process could drop it")


@contextlib.contextmanager
def compiler_processes(workers=None):
    """A pool of ``workers`` new processes (default: one per CPU) for compile_task and the like.

    Processes of their own because a Triton imported with TRITON_INTERPRET=1 cannot compile; they
    drop it before importing triton (_start_compiler_process), and the caller's environment is left
    alone. Spawned, not forked: no copy of a process running torch's threads.
    """
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers or os.cpu_count() or 1, mp_context=ctx,
                                                initializer=_start_compiler_process) as pool:
        yield pool


def compile_all(tasks, cache_dir, pool=None):
    """{task: compile_task(*task, cache_dir)} for tasks (arch, dtype, state_dtype, K, V, config),
    compiled in ``pool`` (a compiler_processes pool; a new one if None)."""
    if pool is None:
        with compiler_processes() as pool:
            return compile_all(tasks, cache_dir, pool)
    futures = {t: pool.submit(compile_task, *t, cache_dir) for t in tasks}
    return {t: f.result() for t, f in futures.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, nargs="+", default=list(ARCHS))
    p.add_argument("--workers", type=int, default=None, help="compile processes (default: CPUs)")
    args = p.parse_args(argv)
    configs = list(configurations())
    tasks = [(arch, *c) for c in configs for arch in args.arch]
    with tempfile.TemporaryDirectory() as d, compiler_processes(args.workers) as pool:
        results = compile_all(tasks, d, pool)
    import triton

    print(f"triton {triton.__version__}, H=16, Hv=32: registers per thread, spills "
          f"(4-byte words of local memory per thread) and SASS instructions (static count, "
          f"NOPs left out)\n")
    head = ["mixed_qkv", "state", "K", "V", "BK", "BV", "warps"]
    head += [f"sm_{a} {c}" for a in args.arch for c in ("regs", "spills", "sass")]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    errors = []
    for dtype, sdt, K, V, cfg in configs:
        cells = [short(dtype), short(sdt), K, V, cfg.BK, cfg.BV, cfg.num_warps]
        for arch in args.arch:
            res, err = results[(arch, dtype, sdt, K, V, cfg)]
            cells += ["FAIL", "-", "-"] if err else [res["n_regs"], res["n_spills"], res["sass"]]
            if err:
                errors.append(f"sm_{arch} {config_id(dtype, sdt, K, V, cfg)}: {err}")
        print("| " + " | ".join(str(c) for c in cells) + " |")
    for e in errors:
        print(e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
