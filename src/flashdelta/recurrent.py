"""Token-by-token Gated DeltaNet for decode and short multi-token steps: the drop-in for FLA 0.6.0's
``fused_recurrent_gated_delta_rule``.

The recurrence runs in PyTorch on any device: a loop over the token positions, each step batched over every sequence
and value head, in fp32 (float64 for float64 inputs). There is no SM90 kernel for it yet, so on a GPU each token costs
a handful of PyTorch launches; decode (one token per sequence) is one step. Autograd runs through the PyTorch ops, so
it is differentiable. Its float64 twin is `flashdelta.reference.recurrent`.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .api import (_QKV_DTYPES, _check_beta_flags, _check_cu_seqlens, _check_devices, _check_gate_params, _check_heads,
                  _check_scale, _check_state, _flag, _float_dtype, _no_forward_ad, _state_layout, _tensor)
from .gates import beta_sigmoid, gdn_gate

__all__ = ["fused_recurrent_gated_delta_rule", "fused_recurrent_gdn"]

L2NORM_EPS = 1e-6


def fused_recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor] = None,
    gk: Optional[Tensor] = None,
    gv: Optional[Tensor] = None,
    beta: Optional[Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    *,
    transpose_state_layout: Optional[bool] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """Gated DeltaNet, token by token (decode: T = 1; multi-token verification: small T), FLA 0.6.0's signature.

    Per sequence and value head, for each token (state S is [K, V], fp32)::

        S = exp(g_t) S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = scale S^T q_t

    Runs in PyTorch on every device (no SM90 kernel yet); on the host it reads cu_seqlens (one device-to-host copy
    per call with cu_seqlens, none without).

    Args:
        q: ``[B, T, H, K]`` float: queries.
        k: ``[B, T, H, K]``, q's dtype: keys.
        v: ``[B, T, HV, V]`` float (its own dtype, which o takes): values. ``HV % H == 0``; value head i uses key
            head ``i // (HV // H)`` (GVA).
        g: ``[B, T, HV]`` float or None (no decay): per-token log decay, natural log; with ``use_gate_in_kernel``,
            the raw gate.
        gk: ``[B, T, HV, K]`` float or None: per-key-channel log decay of the state's rows, after g.
        gv: ``[B, T, HV, V]`` float or None: per-value-channel log decay of the state's columns, after g.
        beta: ``[B, T, HV]`` (or ``[B, T, HV, V]``, one per value channel) float; None means ones. With
            ``use_beta_sigmoid_in_kernel``, logits.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``) float; N = B, or the number of
            sequences with cu_seqlens. None means zeros.
        output_final_state: return the final state, fp32 (float64 for float64 inputs), in initial_state's layout.
        use_qk_l2norm_in_kernel: normalise q and k per head: ``x * rsqrt(sum(x^2) + 1e-6)``.
        use_gate_in_kernel: g is the raw gate; the recurrence uses ``-exp(A_log) * softplus(g + dt_bias)``
            (fp32, `flashdelta.gates.gdn_gate`).
        A_log: ``[HV]`` float, required with ``use_gate_in_kernel`` (ignored without it, as in FLA).
        dt_bias: ``[HV]`` float or None, with ``use_gate_in_kernel`` (ignored without it).
        use_beta_sigmoid_in_kernel: beta holds logits; the recurrence uses ``sigmoid(beta)``.
        allow_neg_eigval: with ``use_beta_sigmoid_in_kernel``, ``2 * sigmoid(beta)``; without it, ValueError.
        state_v_first: state tensors are ``[.., V, K]`` instead of ``[.., K, V]``.
        cu_seqlens: ``[N + 1]`` int32/int64 sequence boundaries (B must be 1); tokens past ``cu_seqlens[-1]`` get a
            zero output.
        transpose_state_layout: FLA's deprecated name of state_v_first: DeprecationWarning, same result; with
            ``state_v_first=True`` as well, ValueError (as FLA).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state or None. Differentiable w.r.t. every
        float input.
    """
    state_v_first = _state_layout(state_v_first, transpose_state_layout)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _tensor(name, x, 4)
        _float_dtype(name, x, _QKV_DTYPES)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape [B, T, H, K]={tuple(q.shape)}, got {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"q and k must share one dtype, got q={q.dtype}, k={k.dtype}")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B, T, HV, V] with q's B, T={tuple(q.shape[:2])}, got {tuple(v.shape)}")
    _check_heads(H, K, HV, V)
    use_gate_in_kernel = _flag("use_gate_in_kernel", use_gate_in_kernel)
    if use_gate_in_kernel and g is None:
        raise ValueError("g (the raw gate) must be provided when use_gate_in_kernel=True")
    shapes = {"g": (B, T, HV), "gk": (B, T, HV, K), "gv": (B, T, HV, V), "beta": (B, T, HV)}
    for name, x in (("g", g), ("gk", gk), ("gv", gv), ("beta", beta)):
        if x is None:
            continue
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
        _float_dtype(name, x)
        want = [shapes[name]] + ([(B, T, HV, V)] if name == "beta" else [])
        if tuple(x.shape) not in want:
            raise ValueError(f"{name} must be {' or '.join(_dims(name, w) for w in want)}, got {tuple(x.shape)}")
    _check_devices(q, k, v, g, gk, gv, beta, initial_state)
    scale = _check_scale(scale, K)
    output_final_state = _flag("output_final_state", output_final_state)
    use_qk_l2norm_in_kernel = _flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    state_v_first = _flag("state_v_first", state_v_first)
    use_beta_sigmoid_in_kernel, allow_neg_eigval = _check_beta_flags(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if use_gate_in_kernel:
        _check_gate_params(A_log, dt_bias, HV, q.device)
    cu_host = None
    if cu_seqlens is not None:
        cu_host = _check_cu_seqlens(cu_seqlens, None, B, T, q.device)
        if cu_host is None:          # inside torch.compile: the loop needs the lengths on the host all the same
            cu_host = cu_seqlens.cpu()
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    _check_state("initial_state", initial_state, N, HV, K, V, state_v_first)
    _no_forward_ad("fused_recurrent_gated_delta_rule", q, k, v, g, gk, gv, beta, initial_state,
                   *((A_log, dt_bias) if use_gate_in_kernel else ()))

    cd = torch.float64 if torch.float64 in (q.dtype, v.dtype) else torch.float32
    if use_gate_in_kernel:
        g = gdn_gate(g, A_log, dt_bias)
    if beta is not None and use_beta_sigmoid_in_kernel:
        beta = beta_sigmoid(beta, allow_neg_eigval)
    o, ht = _recurrence(q, k, v, g, gk, gv, beta, initial_state, cu_host, scale=scale,
                        use_qk_l2norm=use_qk_l2norm_in_kernel, state_v_first=state_v_first, compute_dtype=cd)
    return o.to(v.dtype), (ht if output_final_state else None)


fused_recurrent_gdn = fused_recurrent_gated_delta_rule


def _dims(name: str, shape: tuple) -> str:
    labels = {3: "[B, T, HV]", 4: "[B, T, HV, K]" if name == "gk" else "[B, T, HV, V]"}
    return f"{labels[len(shape)]}={shape}"


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _recurrence(q, k, v, g, gk, gv, beta, h0, cu_host, *, scale, use_qk_l2norm, state_v_first, compute_dtype):
    """The batched token loop: returns o ``[B, T, HV, V]`` and the final state, both in `compute_dtype`.

    Sequence n's tokens are rows ``bos[n] .. bos[n] + len[n]`` of the flattened ``[B * T]`` tokens (dense input:
    ``bos = n * T``, every length T). Step t advances every sequence with more than t tokens by its token
    ``bos + t``; the others keep their state (masked where the lengths differ).
    """
    cd = compute_dtype
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    hmap = torch.arange(HV, device=dev) // (HV // H)

    def flat(x):
        return None if x is None else x.reshape((B * T,) + tuple(x.shape[2:])).to(cd)

    qf, kf, vf, gf, gkf, gvf, bf = map(flat, (q, k, v, g, gk, gv, beta))
    if use_qk_l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf = qf * scale
    if cu_host is None:
        N, steps = B, T
        bos = torch.arange(B, device=dev) * T
        lens, ragged = None, False
    else:
        cu = cu_host.to(torch.int64)
        lens_host = cu[1:] - cu[:-1]
        N, steps = lens_host.shape[0], int(lens_host.max()) if lens_host.numel() else 0
        bos = cu[:-1].to(dev)
        lens = lens_host.to(dev)
        ragged = bool((lens_host != steps).any())
    if h0 is None:
        S = torch.zeros(N, HV, K, V, dtype=cd, device=dev)
    else:
        S = h0.to(cd)
        S = S.transpose(-1, -2) if state_v_first else S
    outs, rows = [], []
    for t in range(steps):
        idx = bos + t
        if ragged:
            active = t < lens
            idx = torch.where(active, idx, torch.zeros_like(idx))
        qt, kt, vt = qf[idx][:, hmap], kf[idx][:, hmap], vf[idx]            # [N, HV, K], [N, HV, V]
        S_new = S
        if gf is not None:
            S_new = S_new * torch.exp(gf[idx])[..., None, None]
        if gkf is not None:
            S_new = S_new * torch.exp(gkf[idx])[..., :, None]
        if gvf is not None:
            S_new = S_new * torch.exp(gvf[idx])[..., None, :]
        pred = torch.einsum("nhkv,nhk->nhv", S_new, kt)
        u = vt - pred
        if bf is not None:
            bt = bf[idx]
            u = u * (bt if bt.dim() == 3 else bt[..., None])
        S_new = S_new + kt[..., :, None] * u[..., None, :]
        ot = torch.einsum("nhkv,nhk->nhv", S_new, qt)
        if ragged:
            S = torch.where(active[:, None, None, None], S_new, S)
            outs.append(ot[active])
            rows.append(idx[active])
        else:
            S = S_new
            outs.append(ot)
            rows.append(idx)
    o = torch.zeros(B * T, HV, V, dtype=cd, device=dev)
    if outs:
        if cu_host is None:                       # dense: step t holds token t of every sequence
            o = torch.stack(outs, 1).reshape(B * T, HV, V)
        else:
            o = o.index_put((torch.cat(rows),), torch.cat(outs))
    ht = S.transpose(-1, -2).contiguous() if state_v_first else S
    if ht is h0:                                  # no step ran: the caller's tensor, which must not be aliased
        ht = ht.clone()
    return o.reshape(B, T, HV, V), ht
