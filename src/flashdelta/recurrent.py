"""Token-by-token Gated DeltaNet for decode and short multi-token steps: the drop-in for FLA 0.6.0's
``fused_recurrent_gated_delta_rule``.

Two paths compute it:

- On an SM90 (Hopper) GPU, the TileLang kernel `flashdelta.kernels.decode`: one launch per call, the state read
  once and written once (decode is memory-bound), cu_seqlens read on the device (no host synchronisation, so a call
  can be captured in a CUDA graph). It is forward only: a call where an input requires grad (under
  ``torch.is_grad_enabled()``) runs the PyTorch path, and so does a call with tensor subclasses, or with head dims /
  dtypes the kernel lacks (`kernels.decode.unsupported`; a warning says so once).
- Inside torch.compile, a forward-only call on a CUDA device is one node of the graph, the custom op
  ``flashdelta::fused_recurrent_fwd`` (with a fake implementation for tracing): at run time it takes the kernel where
  the rules above allow and the PyTorch loop otherwise, so a compiled model's decode step launches the kernel. Calls
  on other devices, or with an input that requires grad, trace the PyTorch loop (with cu_seqlens it reads their
  lengths on the host: a graph break).
- Everywhere else, the portable PyTorch path: a loop over the token positions, each step batched over every sequence
  and value head, in fp32 (float64 for float64 inputs); it reads cu_seqlens on the host. Autograd runs through its
  PyTorch ops, so it is differentiable.

``FLASHDELTA_BACKEND=torch`` forces the PyTorch path; ``=sm90`` forces the kernel and raises `UnsupportedError`
where it cannot run (see `flashdelta.dispatch`). The float64 twin of both is `flashdelta.reference.recurrent`.
"""
from __future__ import annotations

from typing import Optional

import warnings

import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor

from . import dispatch
from .api import (_QKV_DTYPES, _check_beta_flags, _check_cu_seqlens, _check_cu_structure, _check_devices,
                  _check_gate_params, _check_heads, _check_scale, _check_state, _flag, _float_dtype, _no_forward_ad,
                  _state_layout, _tensor)
from .autograd import _caller_stacklevel
from .dispatch import UnsupportedError
from .numerics import accum_dtype
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

    On an SM90 GPU it runs the decode kernel (one launch, no host synchronisation; cu_seqlens' values are read on the
    device only and are not validated there); where an input requires grad, and on other devices, the
    differentiable PyTorch loop, which validates cu_seqlens on the host (one device-to-host copy per call with
    cu_seqlens, none without). The module docstring has the rules.

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
            zero output. The kernel path does not check its values (0 first, non-decreasing, at most T: that would
            cost a device-to-host copy per call); it clamps them to ``[0, T]``, so bad values give wrong outputs but
            no out-of-bounds access.
        transpose_state_layout: FLA's deprecated name of state_v_first: DeprecationWarning, same result; with
            ``state_v_first=True`` as well, ValueError (as FLA).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state or None. Differentiable w.r.t. every
        float input (through the PyTorch path, which any call with an input that requires grad takes).
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
    gate = (A_log, dt_bias) if use_gate_in_kernel else ()
    tensors = (q, k, v, g, gk, gv, beta, initial_state, *gate)
    need_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)
    traced_op = torch.compiler.is_compiling() and _compiled_op(q.device, need_grad)
    kernel = traced_op or _kernel_path(q, v, need_grad, tensors + (cu_seqlens,))
    cu_host = None
    if cu_seqlens is not None:
        if kernel:
            _check_cu_structure(cu_seqlens, B, q.device)
        else:
            cu_host = _check_cu_seqlens(cu_seqlens, None, B, T, q.device)
            if cu_host is None:      # inside torch.compile: the loop needs the lengths on the host all the same
                cu_host = cu_seqlens.cpu()
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    _check_state("initial_state", initial_state, N, HV, K, V, state_v_first)
    _no_forward_ad("fused_recurrent_gated_delta_rule", *tensors)

    beta_act = (2 if allow_neg_eigval else 1) if use_beta_sigmoid_in_kernel and beta is not None else 0
    opts = dict(scale=scale, output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm_in_kernel,
                A_log=gate[0] if gate else None, dt_bias=gate[1] if gate else None, beta_act=beta_act,
                state_v_first=state_v_first)
    if traced_op:
        A_log, dt_bias = opts.pop("A_log"), opts.pop("dt_bias")
        o, ht = fused_recurrent_fwd(q, k, v, g, gk, gv, beta, initial_state, cu_seqlens, A_log, dt_bias, **opts)
        return o, (ht if output_final_state else None)
    if kernel:
        from .kernels import decode  # noqa: PLC0415  (imports tilelang: only on the kernel path)

        return decode.fused_recurrent_fwd(q, k, v, g, gk, gv, beta, initial_state, cu_seqlens, **opts)
    return _portable(q, k, v, g, gk, gv, beta, initial_state, cu_host, **opts)


fused_recurrent_gdn = fused_recurrent_gated_delta_rule


def _portable(q, k, v, g, gk, gv, beta, initial_state, cu_host, *, scale, output_final_state, use_qk_l2norm, A_log,
              dt_bias, beta_act, state_v_first):
    """The PyTorch path: the gate and beta transforms, then the token loop; (o in v's dtype, final state or None)."""
    cd = accum_dtype(q.dtype, v.dtype)
    if A_log is not None:
        g = gdn_gate(g, A_log, dt_bias)
    if beta_act:
        beta = beta_sigmoid(beta, beta_act == 2)
    o, ht = _recurrence(q, k, v, g, gk, gv, beta, initial_state, cu_host, scale=scale, use_qk_l2norm=use_qk_l2norm,
                        state_v_first=state_v_first, compute_dtype=cd)
    return o.to(v.dtype), (ht if output_final_state else None)


def _compiled_op(device: torch.device, need_grad: bool) -> bool:
    """Inside torch.compile: whether the call becomes the custom op (forward only, on CUDA, the PyTorch path not
    forced); the op makes the kernel-or-loop decision at run time, on the real tensors (`_kernel_path`). Reads no
    device properties, so tracing does not break on them."""
    forced = dispatch.requested_backend()
    if forced == "sm90" and device.type != "cuda":
        _kernel_path_error(device)
    return device.type == "cuda" and not need_grad and forced != dispatch.PORTABLE


@torch.library.custom_op("flashdelta::fused_recurrent_fwd", mutates_args=())
def fused_recurrent_fwd(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], gk: Optional[Tensor],
                        gv: Optional[Tensor], beta: Optional[Tensor], initial_state: Optional[Tensor],
                        cu_seqlens: Optional[Tensor], A_log: Optional[Tensor], dt_bias: Optional[Tensor], *,
                        scale: float, output_final_state: bool, use_qk_l2norm: bool, beta_act: int,
                        state_v_first: bool) -> tuple[Tensor, Tensor]:
    """The forward of `fused_recurrent_gated_delta_rule` as one graph node for torch.compile (arguments validated by
    it): the decode kernel where `_kernel_path` allows, else the PyTorch loop. Returns (o, final state); the state is
    empty (0 elements) without output_final_state, as an op returns tensors only."""
    opts = dict(scale=scale, output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm, A_log=A_log,
                dt_bias=dt_bias, beta_act=beta_act, state_v_first=state_v_first)
    tensors = (q, k, v, g, gk, gv, beta, initial_state, A_log, dt_bias, cu_seqlens)
    if _kernel_path(q, v, False, tensors):
        from .kernels import decode  # noqa: PLC0415  (imports tilelang: only on the kernel path)

        o, ht = decode.fused_recurrent_fwd(q, k, v, g, gk, gv, beta, initial_state, cu_seqlens, **opts)
    else:
        cu_host = None
        if cu_seqlens is not None:
            cu_host = _check_cu_seqlens(cu_seqlens, None, q.shape[0], q.shape[1], q.device)
            if cu_host is None:      # under CUDA-graph capture: the loop needs the lengths on the host all the same
                cu_host = cu_seqlens.cpu()
        o, ht = _portable(q, k, v, g, gk, gv, beta, initial_state, cu_host, **opts)
    if ht is None:
        ht = q.new_empty(0, dtype=accum_dtype(q.dtype, v.dtype))
    elif ht is initial_state:
        ht = ht.clone()
    return o, ht


@fused_recurrent_fwd.register_fake
def _(q, k, v, g, gk, gv, beta, initial_state, cu_seqlens, A_log, dt_bias, *, scale, output_final_state,
      use_qk_l2norm, beta_act, state_v_first):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    shape = ((N, HV, V, K) if state_v_first else (N, HV, K, V)) if output_final_state else (0,)
    return v.new_empty(B, T, HV, V), q.new_empty(shape, dtype=accum_dtype(q.dtype, v.dtype))


_warned: set = set()


def _kernel_path(q: Tensor, v: Tensor, need_grad: bool, tensors: tuple) -> bool:
    """Whether this call runs the SM90 decode kernel (`kernels.decode`), per the module docstring's rules; raises
    `UnsupportedError` where ``FLASHDELTA_BACKEND=sm90`` forces it and it cannot run."""
    forced = dispatch.requested_backend()
    if forced == dispatch.PORTABLE:
        return False
    device = q.device
    if forced == "auto" and dispatch.native_backend(device) != "sm90":
        return False
    if forced == "sm90" and (device.type != "cuda" or dispatch.current_arch(device) != (9, 0)):
        _kernel_path_error(device)
    if need_grad:
        reason = ("the SM90 decode kernel is forward only and an input requires grad (the differentiable PyTorch "
                  "path runs such calls)")
    elif not all(type(x) is Tensor and not is_functorch_wrapped_tensor(x) for x in tensors if isinstance(x, Tensor)):
        reason = "the SM90 decode kernel takes plain tensors (no tensor subclasses or functorch transforms)"
    else:
        from .kernels import decode  # noqa: PLC0415  (imports tilelang: only on an SM90 device)

        reason = decode.unsupported(q.shape[-1], v.shape[-1], q.dtype, v.dtype)
        if reason is not None and forced == "auto":
            key = (q.shape[-1], v.shape[-1], q.dtype, v.dtype)
            if key not in _warned:
                _warned.add(key)
                warnings.warn(f"flashdelta: running fused_recurrent_gated_delta_rule on the portable PyTorch path on "
                              f"{device}: {reason}", stacklevel=_caller_stacklevel())
    if reason is not None and forced == "sm90":
        raise UnsupportedError(f"{dispatch.ENV_BACKEND}=sm90: {reason}")
    return reason is None


def _kernel_path_error(device: torch.device):
    raise UnsupportedError(f"{dispatch.ENV_BACKEND}=sm90 needs CUDA tensors on an SM90 (Hopper) GPU; got device "
                           f"{device} (arch {dispatch.current_arch(device)})")


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
