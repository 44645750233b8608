"""The public operator: argument validation in one place, then the custom op.

Every malformed input raises `ValueError` / `TypeError` naming the argument, the value given and what
is accepted, before any kernel is imported or launched.
"""
from __future__ import annotations

import math
import numbers
import warnings
import weakref
from typing import Optional, Union

import torch
from torch import Tensor
from torch.autograd import forward_ad

from . import cp, dispatch
from .autograd import forward
from .dispatch import UnsupportedError
from .gates import beta_act_code

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


# Index tensors whose values were read from the device and validated: name -> (weak reference, version counter,
# key, host copy). Every layer of a model call passes the same tensors, so only the first pays the device-to-host
# copy. Inference tensors have no version counter (an in-place change could not be seen), so they are never cached.
_validated: dict = {}


def _read_validated(name: str, x: Tensor, key, check) -> Tensor:
    """The values of `x` as a CPU tensor, passed through `check(host)`: one device-to-host copy, skipped when this same
    tensor, unchanged since (same version counter), passed the check under an equal `key` on an earlier call (never
    for an inference tensor). `key` is compared with `==`, or `torch.equal` for tensors."""
    if x.is_inference():
        host = x.cpu()
        check(host)
        return host
    last = _validated.get(name)
    if last is not None and last[0]() is x and last[1] == x._version and _same_key(last[2], key):
        return last[3]
    host = x.cpu()
    check(host)
    _validated[name] = (weakref.ref(x), x._version, key, host.clone() if host is x else host)
    return host


def _same_key(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_key(x, y) for x, y in zip(a, b))
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


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


def _check_cu_structure(cu_seqlens, B: int, device: torch.device) -> Tensor:
    """cu_seqlens' type, dtype, shape and device, without reading its values (no device-to-host copy)."""
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
    return cu


def _check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B: int, T: int, device: torch.device) -> Optional[Tensor]:
    """Validate cu_seqlens (and its host copy); returns its values on the host (from cu_seqlens_cpu, the cache, or one
    device-to-host copy), or None where they cannot be read (inside torch.compile or a CUDA-graph capture)."""
    cu = _check_cu_structure(cu_seqlens, B, device)
    if cu_seqlens_cpu is None:
        if not _can_read_values(cu):  # values are validated eagerly, outside torch.compile / CUDA-graph capture
            return None
        return _read_validated("cu_seqlens", cu, T, lambda host: _check_cu_values(host, T, "cu_seqlens"))
    host = _tensor("cu_seqlens_cpu", cu_seqlens_cpu, 1)
    if host.dtype not in _INDEX_DTYPES:
        raise TypeError(f"cu_seqlens_cpu has dtype {host.dtype}; expected torch.int32 or torch.int64")
    if host.shape != cu.shape:
        raise ValueError(f"cu_seqlens_cpu must have cu_seqlens' shape {tuple(cu.shape)}, got {tuple(host.shape)}")
    if host.device.type != "cpu":
        raise ValueError(f"cu_seqlens_cpu must be on the CPU (the host copy of cu_seqlens), got {host.device}")
    if not _can_read_values(host):  # a host tensor: readable under CUDA-graph capture too, not inside torch.compile
        return None
    _check_cu_values(host, T, "cu_seqlens_cpu")
    return host


def chunk_indices_of(cu_host: Tensor, chunk_size: int) -> Tensor:
    """FLA's ``chunk_indices`` of a varlen batch: one ``(sequence, chunk within the sequence)`` row per chunk of
    `chunk_size` tokens, in order (``[NT, 2]`` int64, on the host)."""
    cu_host = cu_host.to(torch.int64)
    counts = (cu_host[1:] - cu_host[:-1] + chunk_size - 1) // chunk_size
    seq = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return torch.stack([seq, torch.arange(seq.shape[0]) - first], 1)


def _check_chunk_indices(chunk_indices, cu: Tensor, cu_host: Optional[Tensor], chunk_size: int,
                         read_values: bool) -> None:
    """chunk_indices must be the chunk list of cu_seqlens at `chunk_size` (flashdelta derives its own chunking, so
    this only catches a caller's stale or mismatched tensor). Its row count is checked whenever cu_seqlens' host
    values are known; its values, with `read_values`, by one read of it (cached like cu_seqlens') where it can be
    read."""
    ci = _tensor("chunk_indices", chunk_indices, 2)
    if ci.dtype not in _INDEX_DTYPES:
        raise TypeError(f"chunk_indices has dtype {ci.dtype}; expected torch.int32 or torch.int64")
    if ci.shape[1] != 2:
        raise ValueError(f"chunk_indices must be [NT, 2] (sequence, chunk within it) rows, got shape "
                         f"{tuple(ci.shape)}")
    if ci.device != cu.device:
        raise ValueError(f"chunk_indices is on {ci.device} but cu_seqlens is on {cu.device}")
    if cu_host is None:
        return
    want = chunk_indices_of(cu_host, chunk_size)
    if ci.shape[0] != want.shape[0]:
        raise ValueError(f"chunk_indices has {ci.shape[0]} rows, but cu_seqlens has NT={want.shape[0]} chunks of "
                         f"chunk_size={chunk_size} tokens; pass the chunk_indices of this cu_seqlens (or None)")
    if not read_values or not _can_read_values(ci):
        return

    def check(host: Tensor) -> None:
        bad = (host.to(torch.int64) != want).any(1)
        if bad.any():
            i = int(torch.nonzero(bad)[0])
            raise ValueError(f"chunk_indices[{i}]={host[i].tolist()} does not match cu_seqlens at "
                             f"chunk_size={chunk_size}, which gives {want[i].tolist()}; pass the chunk_indices of "
                             f"this cu_seqlens (or None)")

    _read_validated("chunk_indices", ci, (cu_host, chunk_size), check)


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
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    cu_seqlens_cpu: Optional[Tensor] = None,
    chunk_indices: Optional[Tensor] = None,
    cp_context=None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    chunk_size: int = 64,
    transpose_state_layout: Optional[bool] = None,
    head_first=None,
    context_parallel: Optional[Union[bool, int]] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    """Gated DeltaNet, chunked: the drop-in for FLA 0.6.0's ``chunk_gated_delta_rule`` (same names, positional
    order and defaults; FLA's keyword arguments are keyword-only here, and an unknown keyword raises TypeError).

    Per sequence and value head, token by token (state S is [K, V], float32)::

        S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = scale S_t^T q_t

    Args:
        q: ``[B, T, H, K]`` bf16/fp16 (fp32, fp64 accepted): queries.
        k: ``[B, T, H, K]``, same dtype as q: keys.
        v: ``[B, T, HV, V]``, same dtype as q: values. ``HV % H == 0``; value head i uses key head
            ``i // (HV // H)`` (GVA).
        g: ``[B, T, HV]`` float (computed in fp32): per-token log decay (<= 0), natural log; with
            ``use_gate_in_kernel``, the raw gate before its activation.
        beta: ``[B, T, HV]`` float: write strength; with ``use_beta_sigmoid_in_kernel``, its logits.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``) float; N = B, or the number
            of sequences with ``cu_seqlens``. None means zeros.
        output_final_state: return the final state ``[N, HV, K, V]`` fp32 (float64 for float64 inputs),
            in the layout of initial_state.
        use_qk_l2norm_in_kernel: normalise q and k per head: ``x * rsqrt(sum(x^2) + 1e-6)``.
        use_beta_sigmoid_in_kernel: beta holds logits; the operator uses ``sigmoid(beta)``, computed in fp32 by the
            prepare stage (the SM90 prepare kernel as it loads beta), and the gradient flows to the logits.
        allow_neg_eigval: with ``use_beta_sigmoid_in_kernel``, use ``2 * sigmoid(beta)`` (in ``(0, 2)``). Without it,
            ValueError (as FLA).
        state_v_first: state tensors are ``[.., V, K]`` instead of ``[.., K, V]``.
        cu_seqlens: ``[N + 1]`` int32/int64 sequence boundaries for varlen input (B must be 1), FlashAttention
            convention. Tokens past ``cu_seqlens[-1]`` are padding: zero output and gradient. Its values are
            checked on the host: without ``cu_seqlens_cpu``, the first call with each new cu_seqlens tensor costs
            one device-to-host copy (a synchronisation; later calls with the same, unmodified tensor reuse the
            check), and every call with an inference tensor (``torch.inference_mode``) costs one.
        cu_seqlens_cpu: ``[N + 1]`` int32/int64 CPU tensor, a host copy of cu_seqlens (FLA's name): the values are
            validated from it, so no device-to-host copy happens. It must hold cu_seqlens' values (not checked
            against the device tensor, which would cost the copy it saves).
        chunk_indices: FLA's ``[NT, 2]`` int32/int64 ``(sequence, chunk within the sequence)`` rows of cu_seqlens
            at ``chunk_size``, on cu_seqlens' device. Not needed: flashdelta derives its chunking on the device. When
            given, it is checked against cu_seqlens (its row count from cu_seqlens' host values; without
            cu_seqlens_cpu also its values, with one read of it, cached like cu_seqlens'), so a stale one raises
            ValueError instead of passing silently. With cu_seqlens_cpu its values are not read (that would cost
            the device-to-host copy the host copy saves); flashdelta does not use them.
        cp_context: FLA's context-parallel context (``FLACPContext``). Not taken here (this function's
            cu_seqlens and state rows are one process's): anything but None raises `UnsupportedError`; context
            parallelism across GPUs is `flashdelta.distributed.chunk_gated_delta_rule_cp(..., cp_context=)`.
        use_gate_in_kernel: g is the raw gate (bf16, fp16 or fp32 go into the kernel as they are); the operator uses
            ``g = -exp(A_log) * softplus(g + dt_bias)`` (softplus(x) = x above 20), computed in fp32 by the prepare
            stage (the SM90 prepare kernel as it loads g; `flashdelta.gates.gdn_gate` on the portable path);
            gradients flow to the raw g, A_log and dt_bias.
        A_log: ``[HV]`` float, required with ``use_gate_in_kernel`` (ignored without it, as in FLA).
        dt_bias: ``[HV]`` float or None, added to g before the softplus with ``use_gate_in_kernel`` (ignored
            without it).
        chunk_size: FLA's chunk length, 16, 32 or 64 (others raise ValueError, as FLA). The result does not
            depend on it: flashdelta always computes in chunks of 64 tokens.
        transpose_state_layout: FLA's deprecated name of state_v_first: DeprecationWarning, same result; with
            ``state_v_first=True`` as well, ValueError (as FLA).
        head_first: removed in FLA; passing it raises FLA's error (``DeprecationWarning`` raised as an exception).
        context_parallel: context parallelism inside one GPU (flashdelta's own; docs/dev/cp.md): long sequences
            are cut into partitions of whole 64-token chunks that run in parallel, each from its start state (an
            fp32 scan of the partitions' transitions), in the forward and, by its own decision, in the backward.
            The start states are exact (o, final_state and the gradients equal the serial result to fp32 rounding)
            except where the forward's gate-driven warm-up applies (docs/algorithm.md §4.4): a value head whose
            gates decay a partition's last chunks to a summed log decay <= -10 (every token of the partition with
            ``0 <= beta ||k||^2 <= 2``) takes the next start state from those chunks alone, dropping at most
            ``exp(-10)`` of the state entering them; the backward's end gradients likewise, from the next
            partition's first such chunks (its start states stay exact). None (default): the
            ``FLASHDELTA_CP`` environment variable (``auto``, ``0``, ``1``, or a partition length in chunks >= 2),
            default ``auto``: a cost model splits each pass where it predicts a gain on a native (GPU) backend, from
            the shapes and the host lengths (cu_seqlens_cpu, or the validated copy of cu_seqlens). False: never.
            True: always, at the cost models' partition lengths. An int >= 1: partitions of that many chunks in both
            passes. CP runs the forward's own kernels (value widths V and K, every SM90 head dim); where the backend
            lacks one, the serial path runs. The warm-up follows the ``FLASHDELTA_CP_WARMUP`` environment variable:
            ``auto`` (default: on for bf16 / fp16 q where the cost model predicts it faster; fp32 and float64 stay
            exact), ``0`` (off: exact), ``1`` (on at -10 for any dtype), or a negative number (on, with that summed
            log decay as the threshold); another value of either variable raises ValueError at the call, whether
            CP runs or not.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state fp32 or None.
        Differentiable w.r.t. q, k, v, g, beta and initial_state (and A_log, dt_bias with
        ``use_gate_in_kernel``).
    """
    if head_first is not None:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    state_v_first = _state_layout(state_v_first, transpose_state_layout)
    if cp_context is not None:
        raise UnsupportedError("cp_context: context parallelism across GPUs (FLA's FLACPContext) runs through "
                               "flashdelta.distributed.chunk_gated_delta_rule_cp(q, k, v, g, beta, cp_context=...) "
                               "(or cp_slice=build_cp_slice(...)), not here; docs/dev/cp_dist.md")
    if isinstance(chunk_size, bool) or chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}.")
    chunk_size = int(chunk_size)
    cp_request = cp.parse_request(context_parallel)
    cp.parse_warmup(None)   # a bad FLASHDELTA_CP_WARMUP raises here, before any kernel runs, with CP off as well
    q, k, v, g, beta, B, T, H, K, HV, V = _check_qkv_g_beta(q, k, v, g, beta)
    _check_devices(q, k, v, g, beta, initial_state)
    scale = _check_scale(scale, K)
    output_final_state = _flag("output_final_state", output_final_state)
    use_qk_l2norm_in_kernel = _flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    state_v_first = _flag("state_v_first", state_v_first)
    use_gate_in_kernel = _flag("use_gate_in_kernel", use_gate_in_kernel)
    use_beta_sigmoid_in_kernel, allow_neg_eigval = _check_beta_flags(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if use_gate_in_kernel:
        _check_gate_params(A_log, dt_bias, HV, q.device)

    cu_host = None                  # the host lengths of varlen input
    if cu_seqlens is not None:
        cu_host = _check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T, q.device)
        if chunk_indices is not None:   # a caller who passes the host copy pays no device read for this either
            _check_chunk_indices(chunk_indices, cu_seqlens, cu_host, chunk_size, read_values=cu_seqlens_cpu is None)
    elif cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens_cpu is given without cu_seqlens; pass both (cu_seqlens_cpu is its host copy)")
    elif chunk_indices is not None:
        raise ValueError("chunk_indices is given without cu_seqlens; it describes varlen input (pass both, or "
                         "neither)")
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    _check_state("initial_state", initial_state, N, HV, K, V, state_v_first)

    if not use_gate_in_kernel:
        A_log = dt_bias = None      # ignored without the in-kernel gate (as in FLA)
    _no_forward_ad("chunk_gated_delta_rule", q, k, v, g, beta, initial_state, A_log, dt_bias)
    need_bwd = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state, A_log, dt_bias))
    lengths = (cu_host[1:] - cu_host[:-1]).tolist() if cu_host is not None else None   # once: both decisions read it
    cp_code = _context_parallel(cp_request, q, B, T, K, HV, V, N, cu_seqlens is not None, lengths)
    if not need_bwd and _wide_forward(cp_code, q, B, T, K, HV, V, N, lengths):
        cp_code = cp.with_wide(cp_code)
    # the in-kernel gate and beta activation are stage prepare_fwd's options (docs/stages.md)
    o, final_state = forward(q, k, v, g, beta, initial_state, cu_seqlens, scale,
                             use_qk_l2norm_in_kernel, state_v_first, need_bwd, cp_code, A_log, dt_bias,
                             beta_act_code(use_beta_sigmoid_in_kernel, allow_neg_eigval))
    return o, (final_state if output_final_state else None)


def _context_parallel(request, q: Tensor, B: int, T: int, K: int, HV: int, V: int, N: int, varlen: bool,
                      lengths: Optional[list]) -> int:
    """The forward's CP code (`cp.decide`) from the request (`cp.parse_request`: the argument or FLASHDELTA_CP) and
    host information only (`lengths`: the varlen input's host lengths; None: dense)."""
    if request == "off" or (request == "auto" and q.device.type != "cuda"):
        return 0
    if torch.compiler.is_compiling():      # settled inside the op, on concrete shapes (`cp.resolve_code`)
        return cp.decide(request, kset=None, device=q.device, dtype=q.dtype, B=B, T=T, HV=HV, K=K, V=V,
                         varlen=varlen, N=N, traced=True)
    kset = dispatch.plan(q.device, K, V, q.dtype, need_bwd=False).kset("chunk_fwd")
    return cp.decide(request, kset=kset, device=q.device, dtype=q.dtype, B=B, T=T, HV=HV, K=K, V=V, varlen=varlen,
                     N=N, lengths=lengths)


def _wide_forward(cp_code: int, q: Tensor, B: int, T: int, K: int, HV: int, V: int, N: int,
                  lengths: Optional[list]) -> bool:
    """Whether an unsplit inference forward runs the wide build (one CTA per (sequence, value head)): on the SM90
    kernels, from the host lengths (`lengths`, or B sequences of T tokens), where `cp_model.wide_pays` predicts it
    faster. Decided on the host only: a traced call (torch.compile) runs the default build."""
    if q.device.type != "cuda" or torch.compiler.is_compiling() or cp_code < 0 or cp.decode(cp_code)[0]:
        return False
    if dispatch.plan(q.device, K, V, q.dtype, need_bwd=False).kset("chunk_fwd").name != "sm90":
        return False
    return cp.wide_pays(T=B * T, N=N, HV=HV, K=K, V=V, sms=cp.num_sms(q.device), lengths=lengths,
                        seq_len=None if lengths is not None else T)


chunk_gdn = chunk_gated_delta_rule


def _state_layout(state_v_first, transpose_state_layout):
    """state_v_first, or FLA's deprecated name for it (a DeprecationWarning at the caller's call; both: FLA's
    ValueError)."""
    if transpose_state_layout is None:
        return state_v_first
    if state_v_first:
        raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
    warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                  stacklevel=3)
    return transpose_state_layout


def _check_qkv_g_beta(q, k, v, g, beta):
    """The shared shape / dtype checks of q, k, v, g, beta; returns them with B, T, H, K, HV, V."""
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
    _check_heads(H, K, HV, V)
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (B, T, HV):
            raise ValueError(f"{name} must be [B, T, HV]={(B, T, HV)}, got {tuple(x.shape)}")
    return q, k, v, g, beta, B, T, H, K, HV, V


def _check_heads(H: int, K: int, HV: int, V: int) -> None:
    if H == 0 or K == 0 or HV == 0 or V == 0:
        raise ValueError(f"head counts and head dims must be positive, got H={H}, K={K}, HV={HV}, V={V}")
    if HV % H != 0:
        raise ValueError(f"v has HV={HV} heads, which must be a multiple of q/k's H={H} heads (GVA)")


def _check_devices(*xs) -> None:
    devices = {x.device for x in xs if isinstance(x, Tensor)}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")


def _check_scale(scale, K: int) -> float:
    if scale is None:
        return K ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(float(scale)):
        raise TypeError(f"scale must be a finite real number or None, got {scale!r}")
    return float(scale)


def _check_beta_flags(use_beta_sigmoid_in_kernel, allow_neg_eigval) -> tuple[bool, bool]:
    use_beta_sigmoid_in_kernel = _flag("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)
    allow_neg_eigval = _flag("allow_neg_eigval", allow_neg_eigval)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    return use_beta_sigmoid_in_kernel, allow_neg_eigval


def _check_gate_params(A_log, dt_bias, HV: int, device: torch.device) -> None:
    """A_log (required) and dt_bias (optional) of ``use_gate_in_kernel``: ``[HV]`` float tensors on q's device."""
    if A_log is None:
        raise ValueError("A_log must be provided when use_gate_in_kernel=True (the [HV] log decay rates)")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x is None:
            continue
        _tensor(name, x, 1)
        _float_dtype(name, x)
        if x.shape[0] != HV:
            raise ValueError(f"{name} must be [HV]=({HV},) (one value per value head), got {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}; put all tensors on one device")


def _check_state(name: str, state, N: int, HV: int, K: int, V: int, state_v_first: bool) -> None:
    if state is None:
        return
    _tensor(name, state, 4)
    _float_dtype(name, state, (torch.float32, torch.bfloat16, torch.float16, torch.float64))
    want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if tuple(state.shape) != want:
        layout = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
        raise ValueError(f"{name} must be {layout}={want} (N={N} sequences), got {tuple(state.shape)}")


def _no_forward_ad(op: str, *xs) -> None:
    if forward_ad._current_level >= 0 and any(
            x is not None and forward_ad.unpack_dual(x).tangent is not None for x in xs):
        # neither the kernels nor the custom op carry tangents: a jvp would silently come back without one
        raise UnsupportedError(f"{op}: forward-mode AD (dual tensors, jvp) is not supported; "
                               "use reverse mode (backward / torch.autograd.grad)")


def warmup(heads, *, head_dim=(128, 128), dtype=torch.bfloat16, beta_dtype=torch.float32, scale=None,
           initial_state=(False, True), state_v_first=(False,), num_sms=None, backward=False, decode=False,
           use_gate_in_kernel=False, g_dtype=torch.float32, a_log_dtype=torch.float32, dt_bias_dtype=torch.float32,
           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, context_parallel=None, progress=True) -> float:
    """Compile the SM90 kernels of the given layer shapes into TileLang's persistent cache: the forward's, with
    ``backward=True`` the backward's too (training), and with ``decode=True`` the decode kernel's
    (`fused_recurrent_gated_delta_rule`: fp32 g, or the raw gate in g_dtype with ``use_gate_in_kernel``, the final
    state written, dense and varlen input, per initial_state and state_v_first variant; generation).

    Args:
        heads: iterable of ``(H, HV)`` pairs, e.g. ``[(16, 64)]``.
        head_dim: ``(K, V)``; dtype / beta_dtype: the q/k/v and beta dtypes the model passes;
        scale: the output scale (kernels specialise on it; default ``K ** -0.5``);
        initial_state / state_v_first: which variants to build;
        num_sms: SM count of the GPU the cache is for (default: this machine's GPU, else 132: H100 SXM, H200).
        use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval: the options the model calls
            `chunk_gated_delta_rule` with (the prepare kernels' in-kernel gate and beta activation; with a beta
            activation the later kernels take the activated beta in fp32). g_dtype, a_log_dtype, dt_bias_dtype:
            with ``use_gate_in_kernel``, the dtypes of the raw gate g, A_log and dt_bias (None: no dt_bias);
            ignored without it (g then goes in as fp32).
        context_parallel: as `chunk_gated_delta_rule` takes it (None: ``FLASHDELTA_CP``, default auto; also
            ``"auto"``): the context-parallel builds (`flashdelta.cp.builds`) of the head configs where CP may split
            a pass (auto: where its cost model splits one sequence of up to 2^20 tokens; True or a partition length:
            wherever CP runs); False: none.
        Needs no GPU. Returns the seconds spent. Bad arguments raise ValueError / TypeError naming them.
    """
    from .precompile import warmup as _warmup  # noqa: PLC0415

    return _warmup(list(heads), head_dim=tuple(head_dim), dtype=dtype, beta_dtype=beta_dtype, scale=scale,
                   initial_state=tuple(initial_state), state_v_first=tuple(state_v_first), num_sms=num_sms,
                   backward=bool(backward), decode=bool(decode), use_gate_in_kernel=use_gate_in_kernel,
                   g_dtype=g_dtype, a_log_dtype=a_log_dtype, dt_bias_dtype=dt_bias_dtype,
                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                   context_parallel=context_parallel, progress=progress)
