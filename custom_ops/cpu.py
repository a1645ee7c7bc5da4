"""The CPU kernel's instruction-set variant (thin wrappers over the ``custom_ops_internal`` ops)."""

import torch


def cpu_isa() -> str:
    """The CPU kernel variant in use: ``"avx512"``, ``"avx2"`` or ``"portable"``."""
    return torch.ops.custom_ops_internal.cpu_isa()


def cpu_isas() -> list:
    """The CPU kernel variants this build can run on this CPU."""
    return list(torch.ops.custom_ops_internal.cpu_isas())


def set_cpu_isa(name: str) -> str:
    """Select the CPU kernel variant (``"auto"``, ``"portable"``, ``"avx2"`` or ``"avx512"``);
    returns the previous one. ValueError, naming the value, for an unknown name or one this build
    or CPU cannot run; TypeError for a name that is not a str. ``CUSTOM_OPS_CPU_ISA=<name>`` does
    the same at import time."""
    if not isinstance(name, str):  # the op itself would raise RuntimeError
        raise TypeError(f"set_cpu_isa: name must be a str, but got {type(name).__name__}")
    return torch.ops.custom_ops_internal.set_cpu_isa(name)
