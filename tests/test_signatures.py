"""The op's argument names are written once (custom_ops.ops.ARG_NAMES): the C++ schema and the
typed Python signatures that spell them out for readers must match that tuple."""

import importlib.util
import inspect

import pytest
import torch

import custom_ops  # noqa: F401  (registers the op)
from custom_ops.ops import ARG_NAMES, DEFAULT_SOFTPLUS_THRESHOLD, fused_gdn_decode
from custom_ops.reference import fused_gdn_decode_reference


def test_schema_matches_arg_names():
    default = torch.ops.custom.npu_fused_gdn_decode.default._schema
    assert tuple(a.name for a in default.arguments) == ARG_NAMES
    assert [a.kwarg_only for a in default.arguments] == [False] * 8 + [True]
    assert default.arguments[-1].default_value == DEFAULT_SOFTPLUS_THRESHOLD
    out = torch.ops.custom.npu_fused_gdn_decode.out._schema
    assert tuple(a.name for a in out.arguments) == ARG_NAMES + ("out",)


@pytest.mark.parametrize("fn", [fused_gdn_decode, fused_gdn_decode_reference],
                         ids=["ops", "reference"])
def test_python_signatures_match_arg_names(fn):
    params = inspect.signature(fn).parameters
    assert tuple(params)[:len(ARG_NAMES)] == ARG_NAMES
    assert params["softplus_threshold"].default == DEFAULT_SOFTPLUS_THRESHOLD


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_launcher_signature_matches_arg_names():
    from custom_ops.triton_kernel import fused_gdn_decode_triton

    params = inspect.signature(fused_gdn_decode_triton).parameters
    assert tuple(params)[:len(ARG_NAMES)] == ARG_NAMES
    assert params["softplus_threshold"].default == DEFAULT_SOFTPLUS_THRESHOLD
