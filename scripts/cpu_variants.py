"""The CPU kernel variants of csrc/cpu/variants.def, for Python (setup.py and the tests).

No torch import: setup.py reads it before anything is built.
"""

import dataclasses
import os
import re
import shlex

DEF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "cpu",
                   "variants.def")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str  # "avx2"
    capability: str  # "AVX2": CPU_CAPABILITY of csrc/cpu/kernel_<name>.cpp
    aten: str  # ATen CPU capability from which it may be the default
    flags: tuple  # compiler flags, -DCPU_CAPABILITY=<capability> first
    cpu_features: tuple  # the CPU features it needs (GCC's __builtin_cpu_supports names)
    default_cpus: tuple  # __builtin_cpu_is names where it may be the default; () for every CPU

    @property
    def source(self):
        return os.path.join("csrc", "cpu", f"kernel_{self.name}.cpp")


def _arguments(text, start):
    """The top-level comma-separated arguments of the macro call whose "(" is at text[start]."""
    args, depth, begin = [], 0, start + 1
    for i in range(start, len(text)):
        c = text[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return args + [text[begin:i].strip()]
        elif c == "," and depth == 1:
            args.append(text[begin:i].strip())
            begin = i + 1
    raise ValueError(f"{DEF}: unbalanced parentheses in a CUSTOM_OPS_CPU_VARIANT row")


def variants(path=DEF):
    """Every row of variants.def, in its order."""
    with open(path) as f:
        text = re.sub(r"//[^\n]*", "", f.read())
    rows = []
    for m in re.finditer(r"\bCUSTOM_OPS_CPU_VARIANT\(", text):
        name, capability, aten, flags, test, default_here = _arguments(text, m.end() - 1)
        # Adjacent string literals, as the C++ compiler joins them.
        joined = "".join(re.findall(r'"([^"]*)"', flags))
        cpus = tuple(re.findall(r"CUSTOM_OPS_CPU_IS\((\w+)\)", default_here))
        if default_here != "true" and " || ".join(f"CUSTOM_OPS_CPU_IS({c})" for c in cpus) \
                != default_here:
            raise ValueError(f"{DEF}: {name}'s default_here must be true or CUSTOM_OPS_CPU_IS(..) "
                             f"terms joined by ||, but got {default_here!r}")
        rows.append(Variant(name=name, capability=capability, aten=aten,
                            flags=(f"-DCPU_CAPABILITY={capability}", *shlex.split(joined)),
                            cpu_features=tuple(re.findall(r"CUSTOM_OPS_CPU_HAS\((\w+)\)", test)),
                            default_cpus=cpus))
    if not rows:
        raise ValueError(f"{DEF}: no CUSTOM_OPS_CPU_VARIANT rows")
    return rows


def is_clang(cxx):
    """Whether the C++ compiler command cxx is clang (by its --version); False where it does not
    run. setup.py builds clang's kernel without OpenMP (docs/building.md#compilers)."""
    import subprocess

    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    except OSError:
        return False
    return "clang" in out.stdout
