"""The op and the backend that ran it are named in torch.profiler traces.

The dispatcher records ``custom::npu_fused_gdn_decode`` itself; each C++ backend adds a child
event (RECORD_FUNCTION) naming the backend and, on CPU, the kernel variant that ran.
"""

from torch.profiler import ProfilerActivity, profile

from custom_ops.testing import OP, Case, call, make_inputs

OP_EVENT = "custom::npu_fused_gdn_decode"


def _events(fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.events()


def _child_of_op(events, name):
    """The event called `name`, checked to run inside the op's dispatcher event."""
    matches = [e for e in events if e.name == name]
    assert len(matches) == 1, [e.name for e in events]
    parent = matches[0].cpu_parent
    while parent is not None and parent.name != OP_EVENT:
        parent = parent.cpu_parent
    assert parent is not None, f"{name} is not inside {OP_EVENT}"
    return matches[0]


def test_cpu_kernel_variant_named_in_trace(isa):
    inputs = make_inputs(Case())
    events = _events(lambda: call(OP, inputs))  # on the kernel variant of the isa fixture
    _child_of_op(events, f"custom_ops::npu_fused_gdn_decode_cpu.{isa}")


def test_meta_kernel_named_in_trace():
    inputs = make_inputs(Case(), device="meta")
    events = _events(lambda: call(OP, inputs))
    _child_of_op(events, "custom_ops::npu_fused_gdn_decode_meta")
