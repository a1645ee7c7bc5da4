"""The CPU kernel's instruction-set variant (thin wrappers over the ``custom_ops_internal`` ops).

At import the variant follows PyTorch's own CPU capability (``torch.backends.cpu.
get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY=default|avx2|avx512`` sets), capped by what
this build and this CPU run; ``CUSTOM_OPS_CPU_ISA=<name>`` overrides it (see ``apply_env``).
"""

import os
import warnings

import torch

# Every variant name (csrc/cpu/variants.def), in order of preference: each runs wherever the
# ones before it do.
VARIANTS = tuple(torch.ops.custom_ops_internal.cpu_variants())
ENV = "CUSTOM_OPS_CPU_ISA"


def cpu_isa() -> str:
    """The CPU kernel variant in use: one of ``VARIANTS``."""
    return torch.ops.custom_ops_internal.cpu_isa()


def cpu_isas() -> list:
    """The CPU kernel variants this build can run on this CPU."""
    return list(torch.ops.custom_ops_internal.cpu_isas())


def set_cpu_isa(name: str) -> str:
    """Select the CPU kernel variant (``"auto"`` for the default, or one of ``VARIANTS``);
    returns the previous one. TypeError for a name that is not a str; ValueError, naming the
    value, for an unknown name or one this build or CPU cannot run."""
    if not isinstance(name, str):
        raise TypeError(f"set_cpu_isa: name must be a str ('auto' or one of {VARIANTS}), but got "
                        f"{type(name).__name__} {name!r}")
    return torch.ops.custom_ops_internal.set_cpu_isa(name)


def apply_env():
    """Applies ``CUSTOM_OPS_CPU_ISA`` (run at import). A name that is no variant at all is a
    mistake to fix: ValueError. A variant this build or CPU lacks (one configuration for a mixed
    fleet) keeps the default, with a RuntimeWarning that says so."""
    name = os.environ.get(ENV)
    if name is None:
        return
    try:
        set_cpu_isa(name)
    except ValueError as e:
        why = str(e).removeprefix("set_cpu_isa: name ")  # the variable was set, not the function
        if name != "auto" and name not in VARIANTS:
            raise ValueError(f"{ENV} {why}") from None
        warnings.warn(f"{ENV}={name!r} ignored: {why}; using {cpu_isa()!r}", RuntimeWarning,
                      stacklevel=2)
