"""Graph-mode (torchair fx2ge) converters of the custom ops.

``register()`` is called by ``import custom_ops``. It imports torchair lazily: on hosts without
torchair (or with a torchair that cannot load) it logs at debug level and returns False, so eager
use never depends on it. It returns True once the converters are registered; calling it again is a
no-op.
"""

import logging

from .reinplace import reinplace_pass

log = logging.getLogger(__name__)

_registered = False


def register() -> bool:
    """Register every fx2ge converter of this package with torchair. Returns True when registered
    (now or before), False when torchair is not importable. Idempotent."""
    global _registered
    if _registered:
        return True
    try:
        import torchair  # noqa: F401
    except ImportError as e:
        log.debug("custom_ops: torchair not importable, graph-mode converters skipped: %s", e)
        return False
    except Exception as e:  # a broken torchair install must not break eager use
        log.debug("custom_ops: torchair failed to import, graph-mode converters skipped: %r", e)
        return False

    from . import fused_gdn_decode

    fused_gdn_decode.register(torchair)
    _registered = True
    log.debug("custom_ops: registered torchair converter for %s", fused_gdn_decode.TARGET_NAME)
    return True


__all__ = ["register", "reinplace_pass"]
