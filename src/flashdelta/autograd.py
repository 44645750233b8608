"""The operator as two `torch.library` custom ops with registered fake kernels and autograd (`forward` calls the
forward's body directly where neither autograd nor torch.compile is involved).

`flashdelta::chunk_gdn_fwd` returns (o, final_state); `flashdelta::chunk_gdn_bwd` returns every input
gradient. Both take user-shaped tensors (dense `[B, T, ...]` or varlen `[1, T, ...]` + cu_seqlens) and turn
them into the flat varlen form of docs/stages.md internally. The backward recomputes the gate cumsum and
the WY inverse A instead of saving them (they are cheap next to the backward, and A would hold 128 B per
token and value head between the passes).

Neither op reads device data on the host (no `.item()`, `.tolist()`), so `torch.compile(fullgraph=True)`
traces through them and CUDA graphs can capture the Hopper path. The portable backend itself reads
`cu_seqlens` on the host (its loop over sequences is in Python).
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Optional

import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor

from . import dispatch
from .portable import l2norm_bwd, l2norm_fwd


def _num_seqs(q: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _state_shape(N: int, HV: int, K: int, V: int, state_v_first: bool) -> tuple:
    return (N, HV, V, K) if state_v_first else (N, HV, K, V)


def _flat(x: Tensor) -> Tensor:
    """[B, T, ...] -> [1, B*T, ...], contiguous."""
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def _cu(q: Tensor, cu_seqlens: Optional[Tensor]) -> Tensor:
    if cu_seqlens is None:
        B, T = q.shape[:2]
        return torch.arange(B + 1, device=q.device, dtype=torch.int32) * T
    return cu_seqlens.to(torch.int32).contiguous()


def _param(x: Tensor, kset: dispatch.KernelSet) -> Tensor:
    """beta or the initial state as the kernel set takes it: a dtype its launchers lack (float64 into the fp32
    kernels) goes in as float32, the precision they compute in."""
    if kset.param_dtypes is None or x.dtype in kset.param_dtypes:
        return x
    return x.float()


def _gate_dtype(q: Tensor) -> torch.dtype:
    """The gate is fp32 end to end; float64 inputs (gradcheck, references) keep float64."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _l2norm(x: Tensor, kset: dispatch.KernelSet):
    """Normalised x (and rstd). Kernels take it in x's dtype (their GEMM operand precision); the portable
    path keeps it in its float32/float64 compute precision."""
    return kset.l2norm_fwd(x)


_warned: set = set()
_INTERNAL = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))


def _caller_stacklevel() -> int:
    """The `warnings.warn` stacklevel of the first frame outside flashdelta and torch (the user's call), counted
    from the caller of this function; torch's custom-op dispatch puts a varying number of frames in between."""
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def _backends(q: Tensor, v: Tensor, need_bwd: bool) -> tuple:
    K, V = q.shape[-1], v.shape[-1]
    fwd, bwd = dispatch.resolve(q.device, K, V, q.dtype, need_bwd=need_bwd)
    used = (fwd, bwd) if need_bwd else (fwd,)
    if "torch" not in used or dispatch.requested_backend() != "auto":
        return fwd, bwd
    native = dispatch.native_backend(q.device)
    if native:  # auto chose the portable path on a GPU that has native kernels: say why, once
        key = (native, K, V, q.dtype, fwd, bwd if need_bwd else None)
        if key not in _warned:
            _warned.add(key)
            why = dispatch.load(native).unsupported(K, V, q.dtype) or "the kernels for that pass do not exist yet"
            warnings.warn(f"flashdelta: running the portable PyTorch path on {q.device} "
                          f"(forward: {fwd}, backward: {bwd if need_bwd else '-'}): {why}",
                          stacklevel=_caller_stacklevel())
    return fwd, bwd


def forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
            cu_seqlens: Optional[Tensor], scale: float, use_qk_l2norm: bool, state_v_first: bool,
            need_bwd: bool) -> tuple[Tensor, Tensor]:
    """(o, final_state) through the custom op where autograd, torch.compile or a tensor subclass (fake tensors,
    DTensor, ...) needs it; otherwise (plain tensors, no gradient, eager) the same function called directly. The
    custom op's eager dispatch imports torch._dynamo on its first call (1.4 s on the CPU machine, ~4 s on the GPU
    machine, NOTES-gpu.md session 5) and adds per-call Python overhead; inference does not need either."""
    tensors = (q, k, v, g, beta, initial_state, cu_seqlens)
    # (functorch's vmap/grad wrappers are of type Tensor too; the op runs them through torch's batching fallback)
    if need_bwd or torch.compiler.is_compiling() or not all(
            x is None or (type(x) is Tensor and not is_functorch_wrapped_tensor(x)) for x in tensors):
        return chunk_gdn_fwd(*tensors, scale, use_qk_l2norm, state_v_first, need_bwd)
    return _chunk_gdn_fwd(*tensors, scale, use_qk_l2norm, state_v_first, need_bwd)


def _chunk_gdn_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                   cu_seqlens: Optional[Tensor], scale: float, use_qk_l2norm: bool, state_v_first: bool,
                   need_bwd: bool) -> tuple[Tensor, Tensor]:
    """The forward's body (`chunk_gdn_fwd` and the direct path of `forward`)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = _num_seqs(q, cu_seqlens)
    if B * T == 0:
        o = q.new_zeros(B, T, HV, V)
        ht = (initial_state.to(_gate_dtype(q)).clone() if initial_state is not None
              else q.new_zeros(_state_shape(N, HV, K, V, state_v_first), dtype=_gate_dtype(q)))
        return o, ht
    fwd, _ = _backends(q, v, need_bwd)
    kset = dispatch.load(fwd)
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    if use_qk_l2norm:
        qf, kf = _l2norm(qf, kset)[0], _l2norm(kf, kset)[0]
    gf, bf, cu = _flat(g).to(_gate_dtype(q)), _param(_flat(beta), kset), _cu(q, cu_seqlens)
    h0 = _param(initial_state, kset).contiguous() if initial_state is not None else None
    g_cumsum, A = kset.prepare_fwd(kf, gf, bf, cu)
    o, ht = kset.chunk_fwd(qf, kf, vf, g_cumsum, bf, A, h0, cu, scale=scale, state_v_first=state_v_first)
    return o.reshape(B, T, HV, V).to(q.dtype), ht.to(_gate_dtype(q))


@torch.library.custom_op("flashdelta::chunk_gdn_fwd", mutates_args=())
def chunk_gdn_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                  cu_seqlens: Optional[Tensor], scale: float, use_qk_l2norm: bool, state_v_first: bool,
                  need_bwd: bool) -> tuple[Tensor, Tensor]:
    return _chunk_gdn_fwd(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, state_v_first,
                          need_bwd)


@chunk_gdn_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, state_v_first, need_bwd):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = _num_seqs(q, cu_seqlens)
    return q.new_empty(B, T, HV, V), q.new_empty(_state_shape(N, HV, K, V, state_v_first), dtype=_gate_dtype(q))


@torch.library.custom_op("flashdelta::chunk_gdn_bwd", mutates_args=())
def chunk_gdn_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                  cu_seqlens: Optional[Tensor], do: Tensor, dht: Optional[Tensor], scale: float,
                  use_qk_l2norm: bool, state_v_first: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dh0_empty = q.new_empty(0, dtype=torch.float32)
    if B * T == 0:
        dh0 = dh0_empty if initial_state is None else (
            dht.to(initial_state.dtype).clone() if dht is not None else torch.zeros_like(initial_state))
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(g),
                torch.zeros_like(beta), dh0)
    _, bwd = _backends(q, v, True)
    kset = dispatch.load(bwd)
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    if use_qk_l2norm:
        (qf, rq), (kf, rk) = _l2norm(qf, kset), _l2norm(kf, kset)
    gf, bf, cu = _flat(g).to(_gate_dtype(q)), _param(_flat(beta), kset), _cu(q, cu_seqlens)
    h0 = _param(initial_state, kset).contiguous() if initial_state is not None else None
    dht = dht.to(_gate_dtype(q)).contiguous() if dht is not None else None
    g_cumsum, A = kset.prepare_fwd(kf, gf, bf, cu)
    h = kset.state_recompute(kf, vf, g_cumsum, bf, A, h0, cu, state_v_first=state_v_first)
    dq, dk, dv, dbeta, dG, dh0 = kset.chunk_bwd(qf, kf, vf, g_cumsum, bf, A, h, _flat(do), dht, cu,
                                                scale=scale, state_v_first=state_v_first)
    dq, dk = kset.group_sum(dq, H), kset.group_sum(dk, H)
    dg = kset.prepare_bwd(dG, cu)
    if use_qk_l2norm:
        dq, dk = l2norm_bwd(qf, rq, dq), l2norm_bwd(kf, rk, dk)
    dh0 = dh0.to(initial_state.dtype) if initial_state is not None else dh0_empty
    return (dq.reshape(q.shape).to(q.dtype), dk.reshape(k.shape).to(k.dtype), dv.reshape(v.shape).to(v.dtype),
            dg.reshape(g.shape).to(g.dtype), dbeta.reshape(beta.shape).to(beta.dtype), dh0)


@chunk_gdn_bwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, do, dht, scale, use_qk_l2norm, state_v_first):
    dh0 = torch.empty_like(initial_state) if initial_state is not None else q.new_empty(0, dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, state_v_first, _ = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.opts = (scale, use_qk_l2norm, state_v_first)


def _backward(ctx, do, dht):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    scale, use_qk_l2norm, state_v_first = ctx.opts
    if do is None:
        do = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
    dq, dk, dv, dg, dbeta, dh0 = chunk_gdn_bwd(q, k, v, g, beta, initial_state, cu_seqlens, do, dht,
                                               scale, use_qk_l2norm, state_v_first)
    # one entry per forward input: q, k, v, g, beta, initial_state, cu_seqlens, scale, l2norm, layout, need_bwd
    return dq, dk, dv, dg, dbeta, (dh0 if initial_state is not None else None), None, None, None, None, None


torch.library.register_autograd("flashdelta::chunk_gdn_fwd", _backward, setup_context=_setup_context)
