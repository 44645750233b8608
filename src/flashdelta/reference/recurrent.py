"""Token-by-token float64 Gated DeltaNet recurrence: the ground truth (docs/algorithm.md §1).

Written with out-of-place differentiable torch ops only, so ``torch.autograd`` through it gives the
ground-truth gradients for q, k, v, g, beta and initial_state. Meant for small shapes.
"""
from __future__ import annotations

import torch

__all__ = ["recurrent_gated_delta_rule"]

L2NORM_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, state_v_first=False, gk=None,
                               gv=None):
    """Reference GDN forward, token by token in float64.

    Same contract as the public ``chunk_gated_delta_rule`` (q, k ``[B,T,H,K]``; v ``[B,T,HV,V]``; g, beta
    ``[B,T,HV]``; states ``[N,HV,K,V]`` or ``[N,HV,V,K]`` with ``state_v_first``; value head i uses key head
    ``i // (HV // H)``; varlen via ``cu_seqlens`` with B = 1, padding tokens past ``cu_seqlens[-1]`` give 0).
    Per token and value head::

        S = exp(g_t) S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = scale S^T q_t

    The options of the public ``fused_recurrent_gated_delta_rule`` are here too: g may be None (no decay), beta
    ``[B,T,HV,V]`` (one strength per value channel), and the per-channel log decays ``gk [B,T,HV,K]`` (rows of S)
    and ``gv [B,T,HV,V]`` (columns of S), applied after g.

    Returns ``(o [B,T,HV,V], final_state [N,HV,K,V] or None)``, both **float64** whatever the input dtype
    (this is the ground truth; gradients flow back to the inputs in their own dtypes).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"v: HV={HV} must be a multiple of H={H}")
    f64 = torch.float64
    q, k, v, beta = q.to(f64), k.to(f64), v.to(f64), beta.to(f64)
    g, gk, gv = (None if x is None else x.to(f64) for x in (g, gk, gv))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    rep = HV // H
    if rep > 1:
        q = q.repeat_interleave(rep, dim=2)
        k = k.repeat_interleave(rep, dim=2)
    scale = K ** -0.5 if scale is None else float(scale)

    if cu_seqlens is None:
        segs = [(b, 0, T) for b in range(B)]
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens: varlen input needs B == 1, got B={B}")
        cu = [int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > T:
            raise ValueError(f"cu_seqlens: must start at 0, be non-decreasing and end <= T={T}; got {cu}")
        segs = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    N = len(segs)
    if initial_state is not None:
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state: shape {tuple(initial_state.shape)}, expected {want}")
        h0 = initial_state.to(f64)
        if state_v_first:
            h0 = h0.transpose(-1, -2)

    rows = [[] for _ in range(B)]        # per batch row: list of [L, HV, V] pieces in token order
    finals = []
    for n, (b, bos, eos) in enumerate(segs):
        S = h0[n] if initial_state is not None else torch.zeros(HV, K, V, dtype=f64, device=q.device)
        outs = []
        for t in range(bos, eos):
            if g is not None:
                S = torch.exp(g[b, t])[:, None, None] * S
            if gk is not None:
                S = torch.exp(gk[b, t])[:, :, None] * S
            if gv is not None:
                S = torch.exp(gv[b, t])[:, None, :] * S
            kt = k[b, t]                                              # [HV, K]
            pred = torch.einsum("hkv,hk->hv", S, kt)
            bt = beta[b, t] if beta.dim() == 4 else beta[b, t][:, None]
            u = bt * (v[b, t] - pred)                                 # [HV, V]
            S = S + kt[:, :, None] * u[:, None, :]
            outs.append(scale * torch.einsum("hkv,hk->hv", S, q[b, t]))
        if outs:
            rows[b].append(torch.stack(outs))
        finals.append(S)
    o_rows = []
    for b in range(B):
        used = sum(x.shape[0] for x in rows[b])
        if used < T or not rows[b]:
            rows[b].append(torch.zeros(T - used, HV, V, dtype=f64, device=q.device))
        o_rows.append(torch.cat(rows[b], 0))
    o = torch.stack(o_rows)
    final = None
    if output_final_state:
        final = torch.stack(finals) if finals else torch.zeros(0, HV, K, V, dtype=f64, device=q.device)
        if state_v_first:
            final = final.transpose(-1, -2)
    return o, final
