"""What a refused call does under torch.compile: which exception reaches the caller, and whether
state_ref was written before the refusal (docs/bad_input.md, "Under torch.compile")."""

import pathlib

import pytest
import torch

from custom_ops.testing import ARG_NAMES, OP, Case, aot_backend, make_inputs

BAD_INPUT_MD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "bad_input.md"
INFERENCE_MSG = "Inplace update to inference tensor outside InferenceMode"


def step(*args):
    return OP(*args, 0.125)


BACKENDS = {
    "inductor": lambda: "inductor",
    "reinplace_pass": lambda: aot_backend(True),
    "aot_eager": lambda: "aot_eager",
    "aot_autograd": lambda: aot_backend(False),
}
# Where the compiled graph calls the op on state_ref itself, the op's own check refuses before the
# write; where AOT autograd keeps the op functional, the op runs on a copy and AOT autograd's native
# copy_ back into state_ref writes the inference tensor before it refuses it.
WRITES_BEFORE_REFUSING = {"aot_eager", "aot_autograd"}


def compiled(backend):
    torch._dynamo.reset()
    return torch.compile(step, backend=BACKENDS[backend](), fullgraph=True)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_inference_state_outside_inference_mode(backend):
    with torch.inference_mode():
        x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16))
        args = [x[k].clone() for k in ARG_NAMES]
        want_state = args[5].clone()  # one step applied, in eager
        step(*args[:5], want_state, args[6])
    before = args[5].clone()
    with pytest.raises(RuntimeError, match=INFERENCE_MSG):
        compiled(backend)(*args)
    if backend in WRITES_BEFORE_REFUSING:
        # As native in-place ops under these backends (x.add_() too): one step applied.
        assert torch.equal(args[5], want_state)
    else:
        assert torch.equal(args[5], before)


def test_native_inplace_under_aot_eager_also_writes_first():
    # The reference point of the exception above: a native op, the same pipeline.
    with torch.inference_mode():
        t = torch.zeros(4)
    torch._dynamo.reset()
    f = torch.compile(lambda t: t.add_(1), backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match=INFERENCE_MSG):
        f(t)
    assert torch.equal(t, torch.ones(4))


def test_bad_input_md_states_where_compiled_calls_write_first():
    text = BAD_INPUT_MD.read_text()
    section = text[text.index("## Under torch.compile"):]
    for name in ("aot_eager", "reinplace_pass", "Inductor", "TorchRuntimeError", "copy_"):
        assert name in section, name
    # The unconditional promise is gone from the autograd list.
    assert "native ops refuse an inference tensor only after writing it).\n" not in text


def bad(kind, x):
    args = [x[k] for k in ARG_NAMES]
    if kind == "int64 indices":
        args[6] = args[6].long()
    else:  # a of the wrong width
        args[1] = args[1][:, :-1]
    return args


ERRORS = {
    "int64 indices": (TypeError, r"ssm_state_indices.*torch\.int32.*torch\.int64"),
    "a too narrow": (ValueError, r"npu_fused_gdn_decode: a "),
}


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("kind", sorted(ERRORS))
def test_compile_wraps_the_check_in_torch_runtime_error(backend, kind):
    # Dynamo re-raises any exception of fake-tensor propagation as TorchRuntimeError (a
    # RuntimeError), keeping the message; the state is untouched (nothing ran).
    exc_type, pattern = ERRORS[kind]
    x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16))
    args = bad(kind, x)
    before = args[5].clone()
    with pytest.raises(exc_type, match=pattern):
        step(*args)
    torch._dynamo.reset()
    f = torch.compile(step, backend=backend, fullgraph=True)
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match=pattern) as info:
        f(*args)
    assert isinstance(info.value, RuntimeError)
    assert torch.equal(args[5], before)


@pytest.mark.parametrize("kind", sorted(ERRORS))
def test_tracing_without_dynamo_keeps_the_type(kind):
    # Without Dynamo (make_fx, as torch.export's non-strict tracing and aot_function use) the
    # fake kernel's exception reaches the caller as it is.
    from torch.fx.experimental.proxy_tensor import make_fx

    exc_type, pattern = ERRORS[kind]
    args = bad(kind, make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16)))
    before = args[5].clone()
    with pytest.raises(exc_type, match=pattern):
        make_fx(step, tracing_mode="fake")(*args)
    assert torch.equal(args[5], before)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cpu_slot_check_keeps_its_type_when_compiled(backend):
    # Slot values are checked when the compiled code runs the CPU kernel, not while tracing.
    x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16))
    args = [x[k] for k in ARG_NAMES]
    args[6] = torch.tensor([1, args[5].shape[0], 2], dtype=torch.int32)  # slot == BlockNum
    before = args[5].clone()
    with pytest.raises(ValueError, match="ssm_state_indices"):
        compiled(backend)(*args)
    assert torch.equal(args[5], before)


def _bad_out(kind, x):
    B, Hv, V = 3, 4, 16
    if kind == "dtype":
        return torch.zeros(B, 1, Hv, V)
    if kind == "shape":
        return torch.zeros(B, 2, Hv, V, dtype=torch.bfloat16)
    if kind == "strides":
        return torch.zeros(B, 1, V, Hv, dtype=torch.bfloat16).transpose(2, 3)
    # a view of an input's storage: the first B * Hv * V elements
    return x[kind].view(-1)[:B * Hv * V].view(B, 1, Hv, V)


OUT_ERRORS = {
    "dtype": (TypeError, (r"out must have dtype torch.bfloat16 \(the dtype of mixed_qkv\), "
                          r"but got torch.float32")),
    "shape": (ValueError, (r"out must have shape \(B, 1, Hv, V\) = \[3, 1, 4, 16\], "
                           r"but got \[3, 2, 4, 16\]")),
    "strides": (ValueError, r"out must be contiguous, but got strides"),
    "mixed_qkv": (ValueError, r"out must not share memory with mixed_qkv, but"),
    "state_ref": (ValueError, r"out must not share memory with state_ref, but"),
}


def _out_step(*args):
    return OP.out(*args[:-1], 0.125, out=args[-1])


@pytest.mark.parametrize("kind", sorted(OUT_ERRORS))
def test_out_overload_traced_without_dynamo_checks_out(kind):
    # aot_function traces the out overload through its functionalization (composite.py), which
    # runs the default overload; out's own rules must still refuse before anything is written,
    # with eager's exception and message.
    from functorch.compile import aot_function, nop

    exc_type, pattern = OUT_ERRORS[kind]
    x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16, state_dtype=torch.bfloat16))
    args = [x[k] for k in ARG_NAMES] + [_bad_out(kind, x)]
    before = [t.clone() for t in args]
    with pytest.raises(exc_type, match=pattern):
        _out_step(*args)
    with torch.no_grad(), pytest.raises(exc_type, match=pattern):
        aot_function(_out_step, fw_compiler=nop)(*args)
    for t, b in zip(args, before):
        assert torch.equal(t, b)


def test_out_overload_traced_without_dynamo_writes_out():
    from functorch.compile import aot_function, nop

    x = make_inputs(Case(B=3, H=2, Hv=4, K=64, V=16, state_dtype=torch.bfloat16))
    eager = [x[k].clone() for k in ARG_NAMES] + [torch.empty(3, 1, 4, 16, dtype=torch.bfloat16)]
    traced = [x[k].clone() for k in ARG_NAMES] + [torch.empty(3, 1, 4, 16, dtype=torch.bfloat16)]
    _out_step(*eager)
    with torch.no_grad():
        aot_function(_out_step, fw_compiler=nop)(*traced)
    assert torch.equal(traced[-1], eager[-1])  # out
    assert torch.equal(traced[5], eager[5])  # state_ref
    assert not torch.equal(traced[5], x["state_ref"])
