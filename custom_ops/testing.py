"""Sample inputs and result checks of ``custom::npu_fused_gdn_decode``, shared by the tests, the
benchmarks and the device scripts.

- ``make_inputs(Case(...))``: the inputs of one decode call, as a model produces them;
- ``TOLERANCES`` / ``tolerances``: how close a kernel must come to the reference, per result
  dtype (and, for ``assert_close``, per result magnitude);
- ``assert_close`` / ``check_against_reference``: the comparison with those tolerances;
- ``fake_mode`` / ``to_fake``: FakeTensor inputs, kernel errors not logged;
- ``use_cpu_isa`` / ``use_threads``: run a block on one CPU kernel variant / intra-op thread count;
- ``call`` / ``redispatch``: call the op (or one dispatch key's kernel of it) on those inputs.
"""

import contextlib
import dataclasses

import torch

from .ops import ARG_NAMES as _OP_ARG_NAMES
from .reference import fused_gdn_decode_reference

OP = torch.ops.custom.npu_fused_gdn_decode

# The op's tensor arguments, in order (ops.ARG_NAMES up to scale), and the rank the op requires
# of each.
ARG_NAMES = _OP_ARG_NAMES[:_OP_ARG_NAMES.index("scale")]
RANK = {"mixed_qkv": 2, "a": 2, "b": 2, "a_log": 1, "dt_bias": 1, "state_ref": 4,
        "ssm_state_indices": 1}

# Dtypes the rejection tests give each argument: the accepted ones and a spread of the others.
ALL_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64]

# (mixed_qkv dtype, state dtype) pairs the op accepts.
DTYPE_PAIRS = [
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
]

# How close a kernel must come to the reference, per result dtype: (atol, rtol). Kernels compute in
# fp32 like the reference and differ only in summation order, so fp32 results agree to a few ulps
# and 16-bit results to one rounding step: a 16-bit rtol is one step relative to a value at the
# bottom of its binade, where a step is largest relative to the value (2^-7 for bf16's 8-bit
# significand, 2^-10 for fp16's 11-bit one).
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (1e-2, 2.0 ** -7),
    torch.float16: (1e-3, 2.0 ** -10),
}
# assert_close's atol is also at most this fraction of the largest finite |expected| (one rounding
# step of the largest element for 16-bit results): outputs are often ~1e-2, where TOLERANCES' atol
# alone would let a kernel off by 5 % of every value pass.
ATOL_OF_MAX = {
    torch.float32: 2e-5,
    torch.bfloat16: 2.0 ** -8,
    torch.float16: 2.0 ** -11,
}

_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def short(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"`` (test ids, tables)."""
    return _SHORT[dtype]


# Test ids of DTYPE_PAIRS: "bf16-fp32", ...
DTYPE_PAIR_IDS = [f"{short(d)}-{short(s)}" for d, s in DTYPE_PAIRS]



# Memory layouts of make_inputs (the values are the same in all of them):
#   "split"      mixed_qkv contiguous; a and b column slices of one (B, 2*Hv) projection;
#   "projection" mixed_qkv, a and b column slices of one (B, W + 2*Hv) projection, as a model's
#                input projection produces them (the benchmarks' layout);
#   "strided"    a view of every input: mixed_qkv a column window of a wider buffer (storage
#                offset, row stride > width), a column-major, b a column slice, a_log, dt_bias and
#                ssm_state_indices every other element, state_ref (when drawn here) contiguous at a
#                storage offset.
LAYOUTS = ("split", "projection", "strided")


@dataclasses.dataclass(frozen=True)
class Case:
    """One call's sizes and dtypes; ``make_inputs`` turns it into tensors."""

    B: int = 3
    H: int = 2
    Hv: int = 4
    K: int = 64
    V: int = 16
    dtype: torch.dtype = torch.bfloat16
    state_dtype: torch.dtype = torch.float32
    pool: int = 0  # BlockNum; 0 means 2*B + 2
    invalid_rows: tuple = ()  # rows given an index <= 0 (-1 for odd rows, 0 for even ones)
    indices: tuple = None  # explicit ssm_state_indices (then invalid_rows is not applied)
    layout: str = "split"
    seed: int = 0

    @property
    def width(self) -> int:
        """mixed_qkv.size(1) = 2*H*K + Hv*V."""
        return 2 * self.H * self.K + self.Hv * self.V

    def id(self) -> str:
        layout = "" if self.layout == "split" else f"-{self.layout}"
        return (f"B{self.B}-H{self.H}-HV{self.Hv}-K{self.K}-V{self.V}-"
                f"{short(self.dtype)}-{short(self.state_dtype)}{layout}")


def make_inputs(case: Case, device="cpu", *, state_ref: torch.Tensor = None) -> dict:
    """The op's arguments for one call, as a dict keyed by argument name (``call`` unpacks it).

    Values are scaled so gates and state stay in a realistic range; slots are distinct, drawn from
    [1, pool). ``state_ref`` given: the call works on that pool (the next step of a decode loop, or
    another caller on a shared pool) and none is drawn. Built on the CPU from ``case.seed``, so
    every device gets the same values; views keep their strides and offsets on ``device``.
    """
    if case.layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, but got {case.layout!r}")
    g = torch.Generator().manual_seed(case.seed)
    B, Hv, K, V = case.B, case.Hv, case.K, case.V
    W = case.width
    dt = case.dtype

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    mixed_qkv = randn(B, W, dtype=dt)
    ab = randn(B, 2 * Hv, dtype=dt)  # one projection; a and b are its column slices
    a_log = randn(Hv, scale=0.5)
    dt_bias = randn(Hv, scale=0.5, dtype=dt)
    drawn_state = state_ref is None
    if drawn_state:
        pool = case.pool or 2 * B + 2
        state_ref = randn(pool, Hv, V, K, scale=0.5, dtype=case.state_dtype)
    else:
        pool = state_ref.shape[0]
    if case.indices is not None:
        idx = torch.tensor(list(case.indices), dtype=torch.int32)
    else:
        idx = (torch.randperm(pool - 1, generator=g)[:B] + 1).to(torch.int32)
        for r in case.invalid_rows:
            idx[r] = -1 if r % 2 else 0
    x = dict(mixed_qkv=mixed_qkv, a=ab[:, :Hv], b=ab[:, Hv:], a_log=a_log, dt_bias=dt_bias,
             state_ref=state_ref, ssm_state_indices=idx, scale=K**-0.5)

    if case.layout == "projection":
        proj = torch.cat([mixed_qkv, ab], dim=1)
        x.update(mixed_qkv=proj[:, :W], a=proj[:, W:W + Hv], b=proj[:, W + Hv:])
    elif case.layout == "strided":
        wide = torch.zeros(B, W + 8, dtype=dt)
        wide[:, 5:5 + W] = mixed_qkv
        x.update(mixed_qkv=wide[:, 5:5 + W], a=x["a"].t().contiguous().t())
        for name in ("a_log", "dt_bias", "ssm_state_indices"):
            t = x[name]
            every_other = torch.zeros(2 * t.numel() + 1, dtype=t.dtype)
            every_other[1::2] = t
            x[name] = every_other[1::2]
        if drawn_state:
            padded = torch.zeros((1 + pool,) + tuple(state_ref.shape[1:]), dtype=state_ref.dtype)
            padded[1:] = state_ref
            x["state_ref"] = padded[1:]
    return to_device(x, device)


# Where with_value_at writes: one element of q, k or v in row 0 of mixed_qkv, a or b at
# (0, 0), a_log or dt_bias of head 0, or the state of row 0's slot.
VALUE_PLACES = ("q", "k", "v", "a", "b", "a_log", "dt_bias", "state")


def with_value_at(inputs: dict, place: str, value: float) -> dict:
    """A copy of ``inputs`` with ``value`` (NaN, +-Inf, ...) at one element of ``place`` that row 0
    reads (row 0 must be a valid row; element 5 of the head's vector, or (5, 5) of its state, so
    K and V must exceed 5). The tensors written are copies; the others are shared."""
    x = dict(inputs)
    Hv, V, K = x["state_ref"].shape[1:]
    H = (x["mixed_qkv"].shape[1] - Hv * V) // (2 * K)
    if place in ("q", "k", "v"):
        x["mixed_qkv"] = x["mixed_qkv"].clone()
        x["mixed_qkv"][0, {"q": 5, "k": H * K + 5, "v": 2 * H * K + 5}[place]] = value
    elif place in ("a", "b"):
        x[place] = x[place].clone()
        x[place][0, 0] = value
    elif place in ("a_log", "dt_bias"):
        x[place] = x[place].clone()
        x[place][0] = value
    elif place == "state":
        slot = int(x["ssm_state_indices"][0])
        if slot <= 0:
            raise ValueError(f"row 0 must be a valid row, but its slot is {slot}")
        x["state_ref"] = x["state_ref"].clone()
        x["state_ref"][slot, 0, 5, 5] = value
    else:
        raise ValueError(f"place must be one of {VALUE_PLACES}, but got {place!r}")
    return x


def to_device(inputs: dict, device) -> dict:
    """The tensors of ``inputs`` on ``device`` with the same sizes, strides and storage offsets
    (``.to()`` would make views contiguous); views of one storage still share one there."""
    device = torch.device(device)
    copies = {}
    out = {}
    for name, t in inputs.items():
        if not torch.is_tensor(t) or t.device == device:
            out[name] = t
            continue
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in copies:
            n = t.untyped_storage().nbytes() // t.element_size()
            flat = t.new_empty(0).set_(t.untyped_storage(), 0, (n,), (1,))
            copies[key] = flat.to(device)
        out[name] = copies[key].as_strided(t.size(), t.stride(), t.storage_offset())
    return out


def to_meta(inputs: dict) -> dict:
    """Meta tensors with the sizes, strides and dtypes of ``inputs`` (no data)."""
    return {k: (torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                if torch.is_tensor(v) else v) for k, v in inputs.items()}


def call(fn, inputs: dict, **kw):
    """``fn(*the op's positional arguments from inputs, **kw)``."""
    return fn(*positional_args(inputs), **kw)


def positional_args(inputs: dict) -> tuple:
    """The op's positional arguments from ``inputs``: its tensors in order, then ``scale``."""
    return tuple(inputs[k] for k in ARG_NAMES) + (inputs["scale"],)


def redispatch(overload, key: str):
    """``overload`` (e.g. ``OP.default``) as dispatched to dispatch key ``key``'s kernel, whatever
    the inputs' device: on a CPU-only machine, CPU tensors reach the kernel registered for CUDA or
    XPU."""
    keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    return lambda *args, **kw: overload.redispatch(keyset, *args, **kw)


def paged_pool(state: torch.Tensor, page: int, offset: int, fill: float = 7.0):
    """``state``'s values in an engine-style paged pool: slot s is contiguous at element
    ``s * page + offset`` of one buffer (vLLM keeps a block's conv state and padding there), so
    ``stride(0) == page``. The rest of every page holds ``fill``. Returns (view, buffer)."""
    N, Hv, V, K = state.shape
    if page < offset + Hv * V * K:
        raise ValueError(f"page {page} too small for offset {offset} + a slot of {Hv * V * K}")
    buf = torch.full((N * page,), fill, dtype=state.dtype, device=state.device)
    view = buf.as_strided(state.shape, (page, V * K, K, 1), offset)
    view.copy_(state)
    return view, buf


def aot_backend(use_pass: bool, graphs: list | None = None):
    """A torch.compile backend that compiles as torchair does: aot_autograd with input mutations
    kept in the graph, the forward graph run as is; with ``use_pass``,
    ``custom_ops.converter.reinplace_pass`` applied to it first. Each forward graph is appended to
    ``graphs`` when given."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

    from .converter import reinplace_pass

    def forward(gm, example_inputs):
        if use_pass:
            reinplace_pass(gm, example_inputs)
        if graphs is not None:
            graphs.append(gm)
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=forward,
                                     keep_inference_input_mutations=True)

    return backend


def clone_inputs(inputs: dict) -> dict:
    """The same inputs with a copy of state_ref, the only argument the op writes."""
    return dict(inputs, state_ref=inputs["state_ref"].clone())


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of the storage behind ``t`` (also for stride-0 views of huge shapes):
    what a rejected call must leave unchanged."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).clone()


def tolerances(expected: torch.Tensor) -> tuple:
    """(atol, rtol) for results like ``expected``: ``TOLERANCES[expected.dtype]``, the atol no
    more than ``ATOL_OF_MAX`` of the largest finite |expected|."""
    atol, rtol = TOLERANCES[expected.dtype]
    finite = expected[torch.isfinite(expected)]
    if finite.numel():
        atol = min(atol, ATOL_OF_MAX[expected.dtype] * finite.abs().max().item())
    return atol, rtol


def assert_close(actual, expected, what="", *, equal_nan=False):
    """``actual`` within ``tolerances(expected)`` of ``expected`` (AssertionError if not)."""
    atol, rtol = tolerances(expected)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=equal_nan,
                               msg=lambda m: f"{what}: {m}")


def check_against_reference(inputs: dict, steps=1, fn=OP, **kw):
    """Runs ``fn`` and the reference side by side for ``steps`` decode steps on their own copies
    of the state; checks out and the whole state pool after every step (AssertionError if they
    differ). Returns the (fn, reference) inputs with their updated states."""
    ours, ref = clone_inputs(inputs), clone_inputs(inputs)
    for step in range(steps):
        out = call(fn, ours, **kw)
        out_ref = call(fused_gdn_decode_reference, ref, **kw)
        assert out.shape == out_ref.shape and out.dtype == out_ref.dtype, (
            f"out, step {step}: {out.dtype} {tuple(out.shape)}, reference {out_ref.dtype} "
            f"{tuple(out_ref.shape)}")
        assert out.is_contiguous(), f"out, step {step}: not contiguous"
        assert_close(out, out_ref, f"out, step {step}")
        assert_close(ours["state_ref"], ref["state_ref"], f"state, step {step}")
    return ours, ref


def agrees_with_reference(fn, inputs: dict, **kw) -> bool:
    """One step of ``fn`` against the reference (as ``check_against_reference``), as a bool."""
    try:
        check_against_reference(inputs, fn=fn, **kw)
    except AssertionError:
        return False
    return True


@contextlib.contextmanager
def fake_mode():
    """A FakeTensorMode (yielded) that does not log the errors its kernels raise: the rejection
    tests expect them, and FakeTensor would log each with its traceback."""
    import logging

    from torch._subclasses.fake_tensor import FakeTensorMode

    log = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, log.disabled = log.disabled, True
    try:
        with FakeTensorMode() as mode:
            yield mode
    finally:
        log.disabled = disabled


def to_fake(mode, inputs: dict) -> dict:
    """The tensors of ``inputs`` as FakeTensor of ``mode`` (views of one storage share one)."""
    return {k: (mode.from_tensor(v) if torch.is_tensor(v) else v) for k, v in inputs.items()}


@contextlib.contextmanager
def use_cpu_isa(name: str):
    """Runs the block on CPU kernel variant ``name``; restores the previous one after it."""
    import custom_ops

    old = custom_ops.set_cpu_isa(name)
    try:
        yield name
    finally:
        custom_ops.set_cpu_isa(old)


@contextlib.contextmanager
def use_threads(n: int):
    """Runs the block with ``torch.set_num_threads(n)``; restores the previous count after it."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(old)


def built_by_clang() -> bool:
    """Whether clang compiled the loaded custom_ops._C (its .comment section names the compilers;
    readelf from binutils), for the tests whose expectations hold GCC's machine code or build."""
    import importlib.util
    import subprocess

    lib = importlib.util.find_spec("custom_ops._C").origin
    comment = subprocess.run(["readelf", "-p", ".comment", lib], capture_output=True, text=True,
                             check=True).stdout
    return "clang" in comment
