"""The public operator: argument validation in one place, then the custom op.

Every malformed input raises `ValueError` / `TypeError` naming the argument, the value given and what
is accepted, before any kernel is imported or launched.
"""
from __future__ import annotations

import math
import numbers
import weakref
from typing import Optional

import torch
from torch import Tensor
from torch.autograd import forward_ad

from .autograd import forward
from .dispatch import UnsupportedError

_QKV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _tensor(name: str, x, ndim: int) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def _flag(name: str, x) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {x!r} ({type(x).__name__})")
    return x


def _float_dtype(name: str, x: Tensor, allowed=None) -> None:
    if allowed is None:
        ok = x.is_floating_point()
        allowed_txt = "a floating-point dtype"
    else:
        ok = x.dtype in allowed
        allowed_txt = "one of " + ", ".join(str(d) for d in allowed)
    if not ok:
        raise TypeError(f"{name} has dtype {x.dtype}; expected {allowed_txt}")


def _can_read_values(x: Tensor) -> bool:
    """True when reading `x` on the host neither breaks a torch.compile trace nor a CUDA-graph capture."""
    if torch.compiler.is_compiling():
        return False
    if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return True


# The last cu_seqlens whose values were read from the device and validated: (weak reference, version counter, T).
# Every layer of a model call passes the same tensor, so only the first pays the device-to-host copy. Inference
# tensors have no version counter (an in-place change could not be seen), so they are never cached.
_validated: list = [None]


def _check_cu_values(host: Tensor, T: int, name: str) -> None:
    """The values of cu_seqlens, read from `host` (a CPU tensor): 0 first, non-decreasing, at most T."""
    if host[0].item() != 0:
        raise ValueError(f"{name}[0] must be 0, got {host[0].item()}")
    steps = host[1:] - host[:-1]
    if (steps < 0).any():
        i = int(torch.nonzero(steps < 0)[0])
        raise ValueError(f"{name} must be non-decreasing; {name}[{i}]={host[i].item()} > "
                         f"{name}[{i + 1}]={host[i + 1].item()}")
    if host[-1].item() > T:
        raise ValueError(f"{name}[-1]={host[-1].item()} exceeds the token count T={T} of q")


def _check_cu_device_values(cu: Tensor, T: int) -> None:
    """Validate cu_seqlens from a host copy of it: one device-to-host copy, skipped when this same tensor, unchanged
    since (same version counter), passed the check for the same T on the previous call (never for an inference
    tensor)."""
    if cu.is_inference():
        _check_cu_values(cu.cpu(), T, "cu_seqlens")
        return
    last = _validated[0]
    if last is not None and last[0]() is cu and last[1] == cu._version and last[2] == T:
        return
    _check_cu_values(cu.cpu(), T, "cu_seqlens")
    _validated[0] = (weakref.ref(cu), cu._version, T)


def _check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B: int, T: int, device: torch.device) -> None:
    cu = _tensor("cu_seqlens", cu_seqlens, 1)
    if cu.dtype not in _INDEX_DTYPES:
        raise TypeError(f"cu_seqlens has dtype {cu.dtype}; expected torch.int32 or torch.int64")
    if B != 1:
        raise ValueError(f"cu_seqlens (varlen input) needs batch size 1, got q with B={B}; "
                         f"pack the sequences along T")
    if cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have N + 1 >= 2 entries (N sequences), got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"cu_seqlens is on {cu.device} but q is on {device}; put all tensors on one device")
    if cu_seqlens_cpu is None:
        if _can_read_values(cu):  # values are validated eagerly, outside torch.compile / CUDA-graph capture
            _check_cu_device_values(cu, T)
        return
    host = _tensor("cu_seqlens_cpu", cu_seqlens_cpu, 1)
    if host.dtype not in _INDEX_DTYPES:
        raise TypeError(f"cu_seqlens_cpu has dtype {host.dtype}; expected torch.int32 or torch.int64")
    if host.shape != cu.shape:
        raise ValueError(f"cu_seqlens_cpu must have cu_seqlens' shape {tuple(cu.shape)}, got {tuple(host.shape)}")
    if host.device.type != "cpu":
        raise ValueError(f"cu_seqlens_cpu must be on the CPU (the host copy of cu_seqlens), got {host.device}")
    if _can_read_values(host):  # a host tensor: readable under CUDA-graph capture too, not inside torch.compile
        _check_cu_values(host, T, "cu_seqlens_cpu")


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    *,
    cu_seqlens_cpu: Optional[Tensor] = None,
    state_v_first: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """Gated DeltaNet, chunked: the FLA-compatible drop-in.

    Per sequence and value head, token by token (state S is [K, V], float32)::

        S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = scale S_t^T q_t

    Args:
        q: ``[B, T, H, K]`` bf16/fp16 (fp32, fp64 accepted): queries.
        k: ``[B, T, H, K]``, same dtype as q: keys.
        v: ``[B, T, HV, V]``, same dtype as q: values. ``HV % H == 0``; value head i uses key head
            ``i // (HV // H)`` (GVA).
        g: ``[B, T, HV]`` float (computed in fp32): per-token log decay (<= 0), natural log.
        beta: ``[B, T, HV]`` float: write strength.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``) float; N = B, or the number
            of sequences with ``cu_seqlens``. None means zeros.
        output_final_state: return the final state ``[N, HV, K, V]`` fp32 (float64 for float64 inputs),
            in the layout of initial_state.
        use_qk_l2norm_in_kernel: normalise q and k per head: ``x * rsqrt(sum(x^2) + 1e-6)``.
        cu_seqlens: ``[N + 1]`` int32/int64 sequence boundaries for varlen input (B must be 1), FlashAttention
            convention. Tokens past ``cu_seqlens[-1]`` are padding: zero output and gradient. Its values are
            checked on the host: without ``cu_seqlens_cpu``, the first call with each new cu_seqlens tensor costs
            one device-to-host copy (a synchronisation; later calls with the same, unmodified tensor reuse the
            check), and every call with an inference tensor (``torch.inference_mode``) costs one.
        cu_seqlens_cpu: ``[N + 1]`` int32/int64 CPU tensor, a host copy of cu_seqlens (FLA's name): the values are
            validated from it, so no device-to-host copy happens. It must hold cu_seqlens' values (not checked
            against the device tensor, which would cost the copy it saves).
        state_v_first: state tensors are ``[.., V, K]`` instead of ``[.., K, V]``.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state fp32 or None.
        Differentiable w.r.t. q, k, v, g, beta and initial_state.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _tensor(name, x, 4)
        _float_dtype(name, x, _QKV_DTYPES)
    _tensor("g", g, 3)
    _tensor("beta", beta, 3)
    _float_dtype("g", g)
    _float_dtype("beta", beta)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape [B, T, H, K]={tuple(q.shape)}, got {tuple(k.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B, T, HV, V] with q's B, T={tuple(q.shape[:2])}, got {tuple(v.shape)}")
    if H == 0 or K == 0 or HV == 0 or V == 0:
        raise ValueError(f"head counts and head dims must be positive, got H={H}, K={K}, HV={HV}, V={V}")
    if HV % H != 0:
        raise ValueError(f"v has HV={HV} heads, which must be a multiple of q/k's H={H} heads (GVA)")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (B, T, HV):
            raise ValueError(f"{name} must be [B, T, HV]={(B, T, HV)}, got {tuple(x.shape)}")
    devices = {x.device for x in (q, k, v, g, beta)}
    if initial_state is not None and isinstance(initial_state, Tensor):
        devices.add(initial_state.device)
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    if scale is None:
        scale = K ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(float(scale)):
        raise TypeError(f"scale must be a finite real number or None, got {scale!r}")
    scale = float(scale)
    output_final_state = _flag("output_final_state", output_final_state)
    use_qk_l2norm_in_kernel = _flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    state_v_first = _flag("state_v_first", state_v_first)

    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T, q.device)
    elif cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens_cpu is given without cu_seqlens; pass both (cu_seqlens_cpu is its host copy)")
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is not None:
        _tensor("initial_state", initial_state, 4)
        _float_dtype("initial_state", initial_state, (torch.float32, torch.bfloat16, torch.float16, torch.float64))
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if tuple(initial_state.shape) != want:
            layout = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
            raise ValueError(f"initial_state must be {layout}={want} (N={N} sequences), "
                             f"got {tuple(initial_state.shape)}")

    if forward_ad._current_level >= 0 and any(
            x is not None and forward_ad.unpack_dual(x).tangent is not None for x in (q, k, v, g, beta, initial_state)):
        # neither the kernels nor the custom op carry tangents: a jvp would silently come back without one
        raise UnsupportedError("chunk_gated_delta_rule: forward-mode AD (dual tensors, jvp) is not supported; "
                               "use reverse mode (backward / torch.autograd.grad)")
    need_bwd = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state))
    o, final_state = forward(q, k, v, g, beta, initial_state, cu_seqlens, scale,
                             use_qk_l2norm_in_kernel, state_v_first, need_bwd)
    return o, (final_state if output_final_state else None)


def warmup(heads, *, head_dim=(128, 128), dtype=torch.bfloat16, beta_dtype=torch.float32, scale=None,
           initial_state=(False, True), state_v_first=(False,), num_sms=None, backward=False,
           progress=True) -> float:
    """Compile the SM90 kernels of the given layer shapes into TileLang's persistent cache: the forward's, and with
    ``backward=True`` the backward's too (training).

    Args:
        heads: iterable of ``(H, HV)`` pairs, e.g. ``[(16, 64)]``.
        head_dim: ``(K, V)``; dtype / beta_dtype: the q/k/v and beta dtypes the model passes;
        scale: the output scale (kernels specialise on it; default ``K ** -0.5``);
        initial_state / state_v_first: which variants to build;
        num_sms: SM count of the GPU the cache is for (default: this machine's GPU, else 132: H100 SXM, H200).
        Needs no GPU. Returns the seconds spent. Bad arguments raise ValueError / TypeError naming them.
    """
    from .precompile import warmup as _warmup  # noqa: PLC0415

    return _warmup(list(heads), head_dim=tuple(head_dim), dtype=dtype, beta_dtype=beta_dtype, scale=scale,
                   initial_state=tuple(initial_state), state_v_first=tuple(state_v_first), num_sms=num_sms,
                   backward=bool(backward), progress=progress)
