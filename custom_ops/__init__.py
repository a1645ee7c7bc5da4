"""custom_ops: a fused Gated DeltaNet decode step, ``torch.ops.custom.npu_fused_gdn_decode``.

Importing the package loads the C++ extension, which registers the schema and its CPU, NPU
(PrivateUse1) and Meta implementations; on torchair hosts it also registers the graph-mode
converter. See ``fused_gdn_decode`` for the typed wrapper and ``fused_gdn_decode_reference`` for
the pure-torch oracle.
"""

import logging

import torch

from . import _C  # noqa: F401  (loads the C++ library: its TORCH_LIBRARY blocks register the ops)
from . import fallback  # noqa: F401  (CUDA via Triton if installed, reference elsewhere)
from .ops import fused_gdn_decode
from .reference import fused_gdn_decode_reference

log = logging.getLogger(__name__)
_internal = torch.ops.custom_ops_internal  # helper ops registered by _C

__all__ = [
    "fused_gdn_decode",
    "fused_gdn_decode_reference",
    "cpu_isa",
    "set_cpu_isa",
    "cpu_isas",
]


def cpu_isa() -> str:
    """The CPU kernel variant in use: ``"avx512"``, ``"avx2"`` or ``"portable"``."""
    return _internal.cpu_isa()


def cpu_isas() -> list:
    """The CPU kernel variants this build can run on this CPU."""
    return _internal.cpu_isas()


def set_cpu_isa(name: str) -> str:
    """Select the CPU kernel variant (``"auto"``, ``"portable"``, ``"avx2"`` or ``"avx512"``);
    returns the previous one. ``CUSTOM_OPS_CPU_ISA=<name>`` does the same at import time."""
    if not isinstance(name, str):  # the op itself would raise RuntimeError
        raise TypeError(f"set_cpu_isa: name must be a str, but got {type(name).__name__}")
    return _internal.set_cpu_isa(name)


def _register_converter():
    try:
        from .converter import register as _register
    except ImportError as e:  # the converter package is optional
        log.debug("custom_ops: graph-mode converter not loaded: %s", e)
        return
    _register()


_register_converter()
del torch
