"""Typed Python entry point of the op, and the op's argument names."""

import collections

import torch

# The op's arguments in schema order (docs/spec.md, "Schema"); softplus_threshold is keyword-only
# in the op. The Python backends take them as one OpArgs; the typed signatures of
# fused_gdn_decode, fused_gdn_decode_reference and fused_gdn_decode_triton spell them out for
# readers and are kept equal to this tuple by tests/test_signatures.py.
ARG_NAMES = ("mixed_qkv", "a", "b", "a_log", "dt_bias", "state_ref", "ssm_state_indices", "scale",
             "softplus_threshold")
DEFAULT_SOFTPLUS_THRESHOLD = 20.0


class OpArgs(collections.namedtuple("OpArgs", ARG_NAMES,
                                    defaults=(DEFAULT_SOFTPLUS_THRESHOLD,))):
    """One call's arguments by name; ``*args`` passes them positionally in schema order (as the
    internal check ops take them)."""

    __slots__ = ()

    def call(self, fn, **kwargs):
        """fn(the positional arguments, softplus_threshold=..., **kwargs): the op's own way."""
        return fn(*self[:-1], softplus_threshold=self.softplus_threshold, **kwargs)


def fused_gdn_decode(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_ref: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    scale: float,
    *,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """One fused Gated DeltaNet decode step for a batch of sequences.

    Calls ``torch.ops.custom.npu_fused_gdn_decode``; the inputs' device picks the kernel: the CPU
    kernel, the Ascend NPU kernel, the Triton kernel on CUDA, the checked reference on other
    devices, or the Meta kernel under FakeTensor/torch.compile.

    Args:
        mixed_qkv: [B, 2*H*K + Hv*V] bf16/fp16: q of H heads, then k of H heads, then v of Hv heads.
        a, b: [B, Hv], mixed_qkv's dtype (may be column slices of one projection).
        a_log: [Hv] float32.
        dt_bias: [Hv], mixed_qkv's dtype.
        state_ref: [BlockNum, Hv, V, K], float32 or mixed_qkv's dtype; each slot contiguous,
            slots any stride >= Hv*V*K apart (a paged pool; contiguous on NPU); rows
            ``state_ref[ssm_state_indices[i]]`` are updated in place.
        ssm_state_indices: [B] int32 slot per batch row; a value <= 0 marks an invalid row
            (zero output, no state access). Positive slots must be distinct and < BlockNum.
        scale: query scale, usually K ** -0.5.
        softplus_threshold: softplus input clamp (default 20.0).

    Returns:
        out: [B, 1, Hv, V], contiguous, mixed_qkv's dtype.

    Raises:
        TypeError: None for a tensor, a sparse/mkldnn tensor, or a dtype outside the table.
        ValueError: a bad shape, size, device, stride, alignment or index, or a scale or
            softplus_threshold that is not a finite float32, naming the argument.
        RuntimeError: autograd misuse, as for a native in-place op (docs/bad_input.md): the op is
            not differentiable; call it under torch.no_grad() or torch.inference_mode().

    Example:
        >>> import torch, custom_ops
        >>> B, H, Hv, K, V = 2, 2, 4, 64, 64
        >>> qkv = torch.randn(B, 2 * H * K + Hv * V, dtype=torch.bfloat16)
        >>> ab = torch.randn(B, 2 * Hv, dtype=torch.bfloat16)
        >>> state = torch.zeros(8, Hv, V, K)
        >>> out = custom_ops.fused_gdn_decode(
        ...     qkv, ab[:, :Hv], ab[:, Hv:], torch.zeros(Hv), torch.zeros(Hv, dtype=torch.bfloat16),
        ...     state, torch.tensor([3, 5], dtype=torch.int32), K ** -0.5)
        >>> out.shape
        torch.Size([2, 1, 4, 64])
    """
    return torch.ops.custom.npu_fused_gdn_decode(
        mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale,
        softplus_threshold=softplus_threshold,
    )
