"""Registration checks: torch.library.opcheck (schema incl. the declared mutation, fake/meta
kernel, AOT dispatch) and torch.compile(fullgraph=True) against eager."""

import pytest
import torch

from custom_ops.testing import (OP, Case, assert_close, call, clone_inputs, make_inputs,
                                positional_args)

OPCHECK_CASES = [
    Case(B=3, H=2, Hv=4, K=64, V=16),
    Case(B=2, H=1, Hv=3, K=136, V=8, dtype=torch.float16, state_dtype=torch.float16),
    Case(B=4, H=2, Hv=4, K=64, V=8, state_dtype=torch.bfloat16, invalid_rows=(1,)),
]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=Case.id)
def test_opcheck(case):
    x = make_inputs(case)
    torch.library.opcheck(OP.default, positional_args(x), {"softplus_threshold": 15.0})


def test_schema_is_the_vendor_contract():
    schema = str(OP.default._schema)
    assert schema == (
        "custom::npu_fused_gdn_decode(Tensor mixed_qkv, Tensor a, Tensor b, Tensor a_log, "
        "Tensor dt_bias, Tensor(a!) state_ref, Tensor ssm_state_indices, float scale, *, "
        "float softplus_threshold=20.) -> Tensor")


def _two_steps(mixed_qkv, a, b, a_log, dt_bias, state, idx, scale):
    o1 = OP(mixed_qkv, a, b, a_log, dt_bias, state, idx, scale)
    o2 = OP(mixed_qkv * 0.5, a, b, a_log, dt_bias, state, idx, scale, softplus_threshold=10.0)
    return o1 + o2


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_compile_two_calls_on_same_state(state_dtype):
    torch._dynamo.reset()
    x = make_inputs(Case(B=4, H=2, Hv=4, K=64, V=16, state_dtype=state_dtype, invalid_rows=(2,)))
    eager, compiled = clone_inputs(x), clone_inputs(x)
    out_e = _two_steps(*positional_args(eager))
    fn = torch.compile(_two_steps, fullgraph=True, backend="inductor")
    out_c = fn(*positional_args(compiled))
    assert_close(out_c, out_e, "out")
    # The op's arithmetic is the same kernel in both; the state must match exactly.
    assert torch.equal(compiled["state_ref"], eager["state_ref"])
    assert not torch.equal(compiled["state_ref"], x["state_ref"])


def test_fake_tensor_propagation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = make_inputs(Case(B=5, H=2, Hv=6, K=64, V=24))
    with FakeTensorMode() as mode:
        fx = {k: (mode.from_tensor(v) if torch.is_tensor(v) else v) for k, v in x.items()}
        out = call(OP, fx)
    assert out.shape == (5, 1, 6, 24) and out.dtype == torch.bfloat16 and out.is_contiguous()
