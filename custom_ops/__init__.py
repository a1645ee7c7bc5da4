"""custom_ops: a fused Gated DeltaNet decode step, ``torch.ops.custom.npu_fused_gdn_decode``.

Importing the package loads the C++ extension, which registers the schema and its CPU, NPU
(PrivateUse1) and Meta kernels, then the Python registrations (``cuda``: the Triton kernel;
``composite``: the checked reference for every other device); on torchair hosts it also registers
the graph-mode converter. See ``fused_gdn_decode`` for the typed wrapper and
``fused_gdn_decode_reference`` for the pure-torch oracle.
"""

import logging

import torch

try:
    from . import _C  # noqa: F401  (an empty module: loading it runs the C++ registrations)
except ImportError as e:
    raise ImportError(
        f"custom_ops: cannot load the C++ extension custom_ops._C ({e}). It must be built against "
        f"the installed torch ({torch.__version__}): run `bash build_and_install.sh`, or "
        "`python setup.py build_ext --inplace` in a checkout.") from e

from . import composite, cuda  # noqa: E402,F401  (register the Python kernels)
from .cpu import apply_env as _apply_cpu_isa_env  # noqa: E402
from .cpu import cpu_isa, cpu_isas, set_cpu_isa  # noqa: E402
from .ops import fused_gdn_decode  # noqa: E402
from .reference import fused_gdn_decode_reference  # noqa: E402

log = logging.getLogger(__name__)

__all__ = [
    "fused_gdn_decode",
    "fused_gdn_decode_reference",
    "cpu_isa",
    "set_cpu_isa",
    "cpu_isas",
]


def _register_converter():
    try:
        from .converter import register as _register
    except ImportError as e:  # the converter package is optional
        log.debug("custom_ops: graph-mode converter not loaded: %s", e)
        return
    _register()


_register_converter()
_apply_cpu_isa_env()
del torch
