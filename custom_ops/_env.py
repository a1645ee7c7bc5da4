"""The package's environment switches: one reading of "on" for all of them."""

import os

# The values that turn a switch on (any case); the C++ side reads its switches the same way
# (custom_ops::env_flag, csrc/ops.cpp).
TRUE_VALUES = ("1", "true", "on", "yes")


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to one of TRUE_VALUES (any case)."""
    return os.environ.get(name, "0").lower() in TRUE_VALUES
