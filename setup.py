"""Build script for custom_ops.

One C++ extension, ``custom_ops._C``, holds the schema, the shared input check and one
implementation per dispatch key. The CPU kernel body is compiled once per instruction set
(``*_default.cpp`` portable, ``*_avx2.cpp`` with AVX2+FMA+F16C, ``*_avx512.cpp`` with
AVX-512 F/BW/VL/DQ) and picked at run time, so the
wheel never depends on the build machine's CPU (no tuning for the build host).

Environment switches (all optional):
  CUSTOM_OPS_NO_AVX2=1   build only the portable kernel (no AVX2, no AVX-512 variant)
  CUSTOM_OPS_NO_AVX512=1 build no AVX-512 variant
  CUSTOM_OPS_DEBUG=1     -O0 -g, assertions on
  CUSTOM_OPS_SANITIZE=1  build with AddressSanitizer + UndefinedBehaviorSanitizer
  MAX_JOBS=N             parallel compile jobs (torch's BuildExtension)
"""

import glob
import os
import platform

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))


def _env_flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


IS_X86 = platform.machine().lower() in ("x86_64", "amd64")
WITH_AVX2 = IS_X86 and not _env_flag("CUSTOM_OPS_NO_AVX2")
WITH_AVX512 = WITH_AVX2 and not _env_flag("CUSTOM_OPS_NO_AVX512")
DEBUG = _env_flag("CUSTOM_OPS_DEBUG")
SANITIZE = _env_flag("CUSTOM_OPS_SANITIZE")

# Per-file instruction-set flags, keyed by the file-name suffix. Each kernel variant gets its own
# CPU_CAPABILITY so at::vec's inline namespace keeps the variants' symbols apart (as in ATen).
ISA_FLAGS = {
    "_default.cpp": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"],
    "_avx2.cpp": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "_avx512.cpp": [
        "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512",
        "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
    ],
}


def _isa_of(src):
    for suffix in ISA_FLAGS:
        if src.endswith(suffix):
            return suffix
    return None


class BuildExt(BuildExtension):
    """BuildExtension that adds the ISA flags above to the matching sources only."""

    def build_extension(self, ext):
        compile_all = self.compiler.compile

        def compile_by_isa(sources, *args, extra_postargs=None, **kwargs):
            objects = []
            for isa in [None, *ISA_FLAGS]:
                group = [s for s in sources if _isa_of(s) == isa]
                if not group:
                    continue
                post = extra_postargs
                if isa is not None:
                    if isinstance(post, dict):
                        post = {k: list(v) for k, v in post.items()}
                        post["cxx"] = post.get("cxx", []) + ISA_FLAGS[isa]
                    else:
                        post = list(post or []) + ISA_FLAGS[isa]
                objects += compile_all(group, *args, extra_postargs=post, **kwargs)
            return objects

        self.compiler.compile = compile_by_isa
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = compile_all


def extension():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "meta", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "npu", "*.cpp")))
    cpu = sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    wanted = {None: True, "_default.cpp": True, "_avx2.cpp": WITH_AVX2, "_avx512.cpp": WITH_AVX512}
    sources += [s for s in cpu if wanted[_isa_of(s)]]

    # at::parallel_for is inline OpenMP: without -fopenmp it silently runs on one thread. The
    # libgomp.so.1 we link against resolves at run time to the one torch has already loaded.
    openmp = ["-fopenmp"]
    cxx = ["-O3", "-fvisibility=hidden", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas"]
    define_macros = []
    if WITH_AVX2:
        define_macros.append(("CUSTOM_OPS_WITH_AVX2", "1"))
    if WITH_AVX512:
        define_macros.append(("CUSTOM_OPS_WITH_AVX512", "1"))
    ldflags = ["-ldl"] + openmp
    if DEBUG:
        cxx = ["-O0", "-g", "-Wall", "-Wno-unknown-pragmas"]
    if SANITIZE:
        san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
        cxx = ["-O1", "-g"] + san
        ldflags += san
    return CppExtension(
        name="custom_ops._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx + openmp},
        extra_link_args=ldflags,
    )


print(
    f"custom_ops build: torch {torch.__version__}, CPU kernels: portable"
    + (" + avx2" if WITH_AVX2 else "")
    + (" + avx512" if WITH_AVX512 else "")
    + (", debug" if DEBUG else "")
    + (", ASan+UBSan" if SANITIZE else "")
)

setup(
    name="custom_ops",
    version="0.1.0",
    description="Fused Gated DeltaNet decode step (torch.ops.custom.npu_fused_gdn_decode)",
    packages=find_packages(include=["custom_ops", "custom_ops.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.9",
    # The extension is ABI-bound to the torch it was built against.
    install_requires=[f"torch=={torch.__version__.split('+')[0]}"],
    extras_require={"test": ["pytest", "numpy"], "bench": ["tqdm", "matplotlib"]},
    zip_safe=False,
)
