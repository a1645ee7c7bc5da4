"""Pure-torch reference of ``custom::npu_fused_gdn_decode``: the operator contract
(docs/spec.md) written as code.

Written for clarity, not speed; the tests use it as the oracle. It follows the spec step by step
(all arithmetic in ``compute_dtype``, float32 by default) and updates ``state_ref`` in place like
the op. It does not validate its inputs: call it only with inputs the op accepts (or through the
op's registrations in ``custom_ops.composite``, which check first).
"""

import torch

NORM_EPS = 1e-6


def l2_norm(x: torch.Tensor) -> torch.Tensor:
    """sqrt(sum(x^2) + eps) over the last dimension, keepdim (step 2: eps inside the root); the
    square root correctly rounded, as IEEE sqrt in the kernels."""
    s = (x * x).sum(-1, keepdim=True) + NORM_EPS
    if s.dtype == torch.float32 and s.device.type != "mps":  # MPS has no float64
        # torch.sqrt of a large CPU tensor is a vectorised approximation (1 ulp off for about a
        # sixth of float32 inputs). A float64 root within 1 ulp, rounded to float32, is the
        # correctly rounded float32 root: a float's root is never that close to a midpoint.
        return torch.sqrt(s.double()).to(s.dtype)
    return torch.sqrt(s)


def gates(a, b, a_log, dt_bias, softplus_threshold=20.0, compute_dtype=torch.float32):
    """Step 3: (g, beta) of shape [B, Hv] in compute_dtype: g = -exp(a_log) * softplus(a +
    dt_bias), with the softplus input clamped at softplus_threshold, and beta = sigmoid(b)."""
    f = compute_dtype
    xg = a.to(f) + dt_bias.to(f)
    softplus = torch.maximum(xg, torch.log(1 + torch.exp(torch.clamp(xg, max=softplus_threshold))))
    g = -torch.exp(a_log.to(f)) * softplus
    beta = torch.sigmoid(b.to(f))
    return g, beta


def fused_gdn_decode_reference(
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
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One GDN decode step; same signature and semantics as the op.

    Shapes: mixed_qkv [B, 2*H*K + Hv*V]; a, b [B, Hv]; a_log, dt_bias [Hv];
    state_ref [BlockNum, Hv, V, K] (updated in place for rows with index > 0);
    ssm_state_indices [B]. Returns out [B, 1, Hv, V] in mixed_qkv's dtype.
    """
    f = compute_dtype
    B = mixed_qkv.shape[0]
    _, Hv, V, K = state_ref.shape
    H = (mixed_qkv.shape[1] - Hv * V) // (2 * K)

    # 1. Split the packed row and widen.
    x = mixed_qkv.to(f)
    q = x[:, : H * K].reshape(B, H, K)
    k = x[:, H * K : 2 * H * K].reshape(B, H, K)
    v = x[:, 2 * H * K :].reshape(B, Hv, V)

    # 2. L2-normalise q and k (eps inside the root); scale q.
    q = scale * q / l2_norm(q)
    k = k / l2_norm(k)
    # Value head j reads key head j // (Hv / H).
    q = q.repeat_interleave(Hv // H, dim=1)  # [B, Hv, K]
    k = k.repeat_interleave(Hv // H, dim=1)

    # 3. Gates.
    g, beta = gates(a, b, a_log, dt_bias, softplus_threshold, f)  # [B, Hv]

    # Only rows with a positive slot read or write state.
    valid = ssm_state_indices > 0
    slots = ssm_state_indices[valid].long()
    out = torch.zeros(B, 1, Hv, V, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if slots.numel() == 0:
        return out
    q, k, v, g, beta = q[valid], k[valid], v[valid], g[valid], beta[valid]

    # 4. Decay, delta rule, rank-one update.
    S = state_ref[slots].to(f)  # [n, Hv, V, K]
    S = torch.exp(g)[..., None, None] * S
    u = torch.einsum("nhvk,nhk->nhv", S, k)
    delta = beta[..., None] * (v - u)
    S = S + delta[..., None] * k[:, :, None, :]

    # 5. Read-out from the updated state, then 6. write the state back (round to nearest even).
    out[valid, 0] = torch.einsum("nhvk,nhk->nhv", S, q).to(mixed_qkv.dtype)
    state_ref[slots] = S.to(state_ref.dtype)
    return out
