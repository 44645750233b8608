"""The operator as two `torch.library` custom ops with registered fake kernels and autograd (`forward` calls the
forward's body directly where neither autograd nor torch.compile is involved).

`flashdelta::chunk_gdn_fwd` returns (o, final_state, the `_SAVED` tensors); `flashdelta::chunk_gdn_bwd` returns
every input gradient. Both take user-shaped tensors (dense `[B, T, ...]` or varlen `[1, T, ...]` + cu_seqlens) and
turn them into the flat varlen form of docs/stages.md internally. Where the forward will be differentiated (need_bwd)
it also returns what its stages computed and the backward needs again: the gate cumsum, the WY inverse A (128 B per
token and value head in bf16, the same tensor FLA and FlashQLA keep), the activated beta, and with the q/k l2norm
the normalised q and k and their rstd; autograd saves them, so the backward runs neither prepare_fwd nor
l2norm_fwd (`_SAVED`). The backward op takes them as optional inputs and recomputes what it is not given.

Neither op reads device data on the host (no `.item()`, `.tolist()`), so `torch.compile(fullgraph=True)`
traces through them and CUDA graphs can capture the Hopper path. The portable backend itself reads
`cu_seqlens` on the host (its loop over sequences is in Python).

The ops' A_log, dt_bias and beta_act are the in-kernel gate and beta activation, passed to stage prepare_fwd (the
forward and the backward's recompute); the backward computes their gradients explicitly (`gates.gdn_gate_bwd`,
`gates.beta_activation_bwd`) from prepare_bwd's dg and chunk_bwd's dbeta.

The forward op's context_parallel argument is the code from `cp.decide`: both passes' partition lengths
(`cp.encode`; 0: serial), or `cp.CP_AUTO` / `cp.CP_ON` (decided in each op from the concrete shapes). The backward
op gets the same code through autograd's context and runs `cp.cp_chunk_bwd` (docs/dev/cp.md) where the backward's
part of it splits; the forward's part decides the forward alone, so either pass may split without the other (a
serial forward saves the start states of the backward's partitions, `chunk_fwd(partition_starts=...)`). A code may
also carry `cp.with_wide`'s flag: the unsplit inference forward then runs the wide build (`chunk_fwd(wide=True)`).
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Optional

import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor

from . import cp, dispatch
from .cp_model import ENV_SAVE_STATES, save_states_enabled
from .gates import beta_activation_bwd, gdn_gate_bwd
from .numerics import accum_dtype
from .stages import KernelSet, aligned


def _num_seqs(q: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _state_shape(N: int, HV: int, K: int, V: int, state_v_first: bool) -> tuple:
    return (N, HV, V, K) if state_v_first else (N, HV, K, V)


def _flat(x: Tensor) -> Tensor:
    """[B, T, ...] -> [1, B*T, ...], contiguous and 16-byte aligned."""
    return aligned(x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:]))


def _cu(q: Tensor, cu_seqlens: Optional[Tensor]) -> Tensor:
    if cu_seqlens is None:
        B, T = q.shape[:2]
        return torch.arange(B + 1, device=q.device, dtype=torch.int32) * T
    return aligned(cu_seqlens.to(torch.int32))


def _param(x: Optional[Tensor], kset: KernelSet) -> Optional[Tensor]:
    """beta or the initial state as the kernel set takes it: a dtype its launchers lack (float64 into the fp32
    kernels) goes in as float32, the precision they compute in."""
    if x is None:
        return None
    return aligned(x.to(kset.param_dtype(x.dtype)))


# the forward op's outputs after (o, final_state): saved for the backward where need_bwd, else empty tensors
_SAVED = ("g_cumsum", "A", "beta_act_out", "q_l2", "k_l2", "q_rstd", "k_rstd", "cp_starts", "states", "k_norm2")


def _saves_states(context_parallel: int, plan: dispatch.Plan) -> bool:
    """Whether the training forward saves the state entering every chunk (`_SAVED` ``states``) for the backward's
    chunk_bwd, which then runs no state_recompute, serial or split by context parallelism (`cp.cp_chunk_bwd`'s
    `states`): where `ENV_SAVE_STATES` allows it, one native backend runs chunk_fwd and chunk_bwd (the states are
    private to it, `stages.COUPLED`) and the CP code, if any, was decided on the host (a traced code, `cp.CP_AUTO`
    / `cp.CP_ON`, is settled inside each op, so the forward cannot know the backward's needs and saves none). A
    forward split by CP saves them from its output pass, over the whole sequences (`cp.cp_chunk_fwd`'s
    `save_states`), so either pass may split without the other. The fused forward then writes 512 B per token and
    value head (K = V = 128, bf16) that live until the backward; the recompute costs about a forward (split: the
    backward's M and E passes, its forward scan and the recompute over its partitions)."""
    if not save_states_enabled() or context_parallel < 0:
        return False
    backend = plan.backends["chunk_fwd"]
    return backend != dispatch.PORTABLE and plan.backends["chunk_bwd"] == backend


def _host_split(context_parallel: int, N: int, q: Tensor, v: Tensor, varlen: bool) -> tuple:
    """(forward L, backward L) of a CP code decided on the host (0: serial; (0, 0) for code 0 and for traced
    codes, which each op settles itself)."""
    if context_parallel <= 0:
        return 0, 0
    B, T, _, K = q.shape
    kw = dict(device=q.device, dtype=q.dtype, B=B, T=T, HV=v.shape[2], K=K, V=v.shape[3], N=N, varlen=varlen,
              kset=dispatch.plan(q.device, K, v.shape[3], q.dtype, need_bwd=True).kset("chunk_fwd"))
    return cp.resolve_code(context_parallel, **kw), cp.resolve_code(context_parallel, backward=True, **kw)


def _starts_every(context_parallel: int, N: int, q: Tensor, v: Tensor, varlen: bool) -> int:
    """The partition length (chunks) of the backward whose partition start states the forward saves (`_SAVED`
    ``cp_starts``; 0: none): where the call's CP code (decided on the host, > 0) splits the backward but not the
    forward, the unsplit forward walks every partition boundary anyway, and its fp32 states there replace the CP
    backward's E pass and forward scan (`cp.cp_chunk_bwd`'s `starts`). Traced calls (`cp.CP_AUTO`, `cp.CP_ON`,
    settled inside each op) save none, and neither does a forward that saves every chunk state (`_saves_states`),
    which the split backward reads instead."""
    fwd, bwd = _host_split(context_parallel, N, q, v, varlen)
    return 0 if fwd else bwd


def _starts(context_parallel: int, N: int, q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]) -> tuple:
    """(`_starts_every`, the backward plan's partition slots P: `cp.bounds`), (0, 0) where none are saved."""
    B, T = q.shape[:2]
    L = _starts_every(context_parallel, N, q, v, cu_seqlens is not None)
    return (L, cp.bounds(B * T, N, L, None if cu_seqlens is not None else T)[0]) if L else (0, 0)


def _saves_norms(context_parallel: int, N: int, q: Tensor, v: Tensor, varlen: bool, use_qk_l2norm: bool) -> bool:
    """Whether the training forward saves prepare's squared key norms (`_SAVED` ``k_norm2``) for the backward's
    warm-up condition (`cp.grad_windows` reads them instead of k): where the call's CP code, decided on the host,
    splits the backward and the keys are not l2-normalised in the kernel (then beta alone is read)."""
    return not use_qk_l2norm and _host_split(context_parallel, N, q, v, varlen)[1] > 0


def _saved_meta(q: Tensor, k: Tensor, v: Tensor, use_qk_l2norm: bool, need_bwd: bool, beta_act: int,
                plan: Optional[dispatch.Plan] = None, starts: tuple = (0, 0), states: int = -1,
                norms: bool = False) -> list:
    """(shape, dtype) of each `_SAVED` output, None where it is empty (a 1-D placeholder: saved tensors have 3 or 4
    dims); the real op converts to these dtypes, so the fake kernel declares what the op returns. `plan`: the call's
    (need_bwd) plan where the caller has it. A is in q's dtype from a native prepare_fwd, in the compute dtype from
    the portable one (docs/stages.md). The normalised q and k are saved only from a native l2norm_fwd (in q's dtype,
    what the backward's native stages read); the portable one's (compute dtype) are recomputed. `starts`: (the
    backward's partition length `_starts_every`, its partition slots P): the saved partition start states, K-first,
    in the state dtype. `states`: the number of sequences N where the forward saves the chunk states
    (`_saves_states`; -1: none), in the native layout of `state_recompute` (docs/stages.md). `norms`: the squared
    key norms ``[1, B T, H]`` in the state dtype (`_saves_norms`)."""
    if not need_bwd:
        return [None] * len(_SAVED)
    B, T, H, K = q.shape
    HV = v.shape[2]
    plan = plan or dispatch.plan(q.device, K, v.shape[3], q.dtype, need_bwd=True)
    gd = accum_dtype(q.dtype)
    a_dtype = gd if plan.backends["prepare_fwd"] == dispatch.PORTABLE else q.dtype
    l2 = use_qk_l2norm and plan.backends["l2norm_fwd"] != dispatch.PORTABLE
    return [((1, B * T, HV), gd), ((1, B * T, HV, cp.BT), a_dtype), ((1, B * T, HV), gd) if beta_act else None,
            (tuple(q.shape), q.dtype) if l2 else None, (tuple(k.shape), k.dtype) if l2 else None,
            ((1, B * T, H, 1), torch.float32) if l2 else None, ((1, B * T, H, 1), torch.float32) if l2 else None,
            ((starts[1], HV, K, v.shape[3]), gd) if starts[0] else None,
            ((B * T // cp.BT + states + 1, HV, v.shape[3], K), q.dtype) if states >= 0 else None,
            ((1, B * T, H), gd) if norms else None]


def _prepare(plan: dispatch.Plan, q: Tensor, kf: Tensor, g: Tensor, beta: Tensor, cu: Tensor,
             A_log: Optional[Tensor], dt_bias: Optional[Tensor], beta_act: int, norms: bool = False) -> tuple:
    """Stage prepare_fwd on the flat inputs, with the in-kernel gate (A_log: g is the raw gate, in a dtype the
    backend takes) and beta activation (beta_act: beta holds logits). Returns (g_cumsum, A, beta as the later stages
    take it: the activated beta with beta_act, else the flat input), and with `norms` the squared key norms fourth
    (context parallelism's warm-up condition)."""
    ks = plan.kset("prepare_fwd")
    gf, bf = _flat(g), _flat(beta)
    gf = _param(gf, ks) if A_log is not None else gf.to(accum_dtype(q.dtype))
    out = ks.prepare_fwd(kf, gf, _param(bf, ks), cu, A_log=A_log, dt_bias=dt_bias, beta_act=beta_act, norms=norms)
    head = (out[0], out[1], (out[2] if beta_act else bf))
    return head + (out[-1],) if norms else head


_warned: set = set()
_INTERNAL = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))


def _caller_stacklevel() -> int:
    """The `warnings.warn` stacklevel of the first frame outside flashdelta and torch (the user's call), counted
    from the caller of this function; torch's custom-op dispatch puts a varying number of frames in between."""
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def _plan(q: Tensor, v: Tensor, need_bwd: bool) -> dispatch.Plan:
    """The backend of each stage for this call; under auto, says once (per shape and set of stages) which stages run
    on the portable path on a GPU that has native kernels, and why."""
    K, V = q.shape[-1], v.shape[-1]
    plan = dispatch.plan(q.device, K, V, q.dtype, need_bwd=need_bwd)
    if plan.fallback:
        key = (plan.native, K, V, q.dtype, tuple(plan.fallback))
        if key not in _warned:
            _warned.add(key)
            why = "; ".join(dict.fromkeys(plan.fallback.values()))
            warnings.warn(f"flashdelta: running the portable PyTorch path on {q.device} for "
                          f"{', '.join(plan.fallback)}: {why}", stacklevel=_caller_stacklevel())
    return plan


def forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
            cu_seqlens: Optional[Tensor], scale: float, use_qk_l2norm: bool, state_v_first: bool,
            need_bwd: bool, context_parallel: int = 0, A_log: Optional[Tensor] = None,
            dt_bias: Optional[Tensor] = None, beta_act: int = 0) -> tuple[Tensor, Tensor]:
    """(o, final_state) through the custom op where autograd, torch.compile or a tensor subclass (fake tensors,
    DTensor, ...) needs it; otherwise (plain tensors, no gradient, eager) the same function called directly. The
    custom op's eager dispatch imports torch._dynamo on its first call (1.4 s on the CPU machine, ~4 s on the GPU
    machine) and adds per-call Python overhead; inference does not need either. A_log, dt_bias, beta_act: the
    in-kernel gate and beta activation of stage prepare_fwd (docs/stages.md)."""
    tensors = (q, k, v, g, beta, initial_state, cu_seqlens)
    gate = (A_log, dt_bias, beta_act)
    # (functorch's vmap/grad wrappers are of type Tensor too; the op runs them through torch's batching fallback)
    if need_bwd or torch.compiler.is_compiling() or not all(
            x is None or (type(x) is Tensor and not is_functorch_wrapped_tensor(x)) for x in tensors + gate[:2]):
        return chunk_gdn_fwd(*tensors, scale, use_qk_l2norm, state_v_first, need_bwd, context_parallel, *gate)[:2]
    return _chunk_gdn_fwd(*tensors, scale, use_qk_l2norm, state_v_first, need_bwd, context_parallel, *gate)[:2]


def _chunk_gdn_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                   cu_seqlens: Optional[Tensor], scale: float, use_qk_l2norm: bool, state_v_first: bool,
                   need_bwd: bool, context_parallel: int = 0, A_log: Optional[Tensor] = None,
                   dt_bias: Optional[Tensor] = None, beta_act: int = 0) -> tuple:
    """The forward's body (`chunk_gdn_fwd` and the direct path of `forward`): (o, final_state, *`_SAVED`)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = _num_seqs(q, cu_seqlens)
    plan = _plan(q, v, need_bwd)
    states = N if need_bwd and _saves_states(context_parallel, plan) else -1
    starts = _starts(context_parallel, N, q, v, cu_seqlens) if need_bwd and states < 0 else (0, 0)
    norms = need_bwd and _saves_norms(context_parallel, N, q, v, cu_seqlens is not None, use_qk_l2norm)
    if B * T == 0:
        o = q.new_zeros(B, T, HV, V)
        ht = (initial_state.to(accum_dtype(q.dtype)).clone() if initial_state is not None
              else q.new_zeros(_state_shape(N, HV, K, V, state_v_first), dtype=accum_dtype(q.dtype)))
        meta = _saved_meta(q, k, v, use_qk_l2norm, need_bwd, beta_act, plan, starts, states, norms)
        return (o, ht, *(q.new_empty(0) if m is None else q.new_zeros(m[0], dtype=m[1]) for m in meta))
    meta = _saved_meta(q, k, v, use_qk_l2norm, need_bwd, beta_act, plan, starts, states, norms)
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    rq = rk = None
    if use_qk_l2norm:
        l2norm = plan.fn("l2norm_fwd")
        (qf, rq), (kf, rk) = l2norm(qf), l2norm(kf)
    cu = _cu(q, cu_seqlens)
    ks = plan.kset("chunk_fwd")
    L = cp.resolve_code(context_parallel, kset=ks, device=q.device, dtype=q.dtype, B=B, T=T, HV=HV, K=K, V=V, N=N,
                        varlen=cu_seqlens is not None)
    # the squared key norms from prepare (K K^T's diagonal) where a split pass's warm-up condition reads them in
    # place of k: this split forward, or the split backward they are saved for
    k_norm2 = None
    if norms or (L and not use_qk_l2norm):
        g_cumsum, A, bf, k_norm2 = _prepare(plan, q, kf, g, beta, cu, A_log, dt_bias, beta_act, norms=True)
    else:
        g_cumsum, A, bf = _prepare(plan, q, kf, g, beta, cu, A_log, dt_bias, beta_act)
    if L:
        parts = cp.make_plan(cu, B * T, L, seq_len=None if cu_seqlens is not None else T, kset=ks)
        # l2-normalised keys: the warm-up's condition reads beta alone (`cp.windows`)
        o, ht, *third = cp.cp_chunk_fwd(qf, kf, vf, g_cumsum, _param(bf, ks), A, _param(initial_state, ks), cu,
                                        scale=scale, state_v_first=state_v_first, plan=parts, backends=plan,
                                        keys_normalized=use_qk_l2norm, save_states=states >= 0, k_norm2=k_norm2)
    else:
        # the unsplit forward, saving what the backward reads where it needs it: its partition start states
        # (`_starts_every`) or the chunk states (`_saves_states`), returned third
        extra = {}
        if starts[0]:
            parts = cp.make_plan(cu, B * T, starts[0], seq_len=None if cu_seqlens is not None else T,
                                 kset=plan.kset("chunk_bwd"))
            extra = dict(partition_starts=(starts[0], parts.first_index, parts.P))
        elif states >= 0:
            extra = dict(save_states=True)
        elif cp.wide(context_parallel) and not need_bwd and ks.name == "sm90":
            extra = dict(wide=True)     # one CTA per (sequence, value head): the API's pick (`cp_model.wide_pays`)
        o, ht, *third = ks.chunk_fwd(qf, kf, vf, g_cumsum, _param(bf, ks), A, _param(initial_state, ks), cu,
                                     scale=scale, state_v_first=state_v_first, **extra)
    # what the backward would recompute (`_SAVED`), in the dtypes the fake kernel declares, or a placeholder
    got = (g_cumsum, A, bf, qf.reshape(q.shape), kf.reshape(k.shape), rq, rk, third[0] if starts[0] else None,
           third[0] if states >= 0 else None, k_norm2)
    saved = [q.new_empty(0) if m is None else x.to(m[1]) for x, m in zip(got, meta)]
    return (o.reshape(B, T, HV, V).to(q.dtype), ht.to(accum_dtype(q.dtype)), *saved)


@torch.library.custom_op("flashdelta::chunk_gdn_fwd", mutates_args=())
def chunk_gdn_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                  cu_seqlens: Optional[Tensor], scale: float, use_qk_l2norm: bool, state_v_first: bool,
                  need_bwd: bool, context_parallel: int = 0, A_log: Optional[Tensor] = None,
                  dt_bias: Optional[Tensor] = None, beta_act: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor,
                                                                                  Tensor, Tensor, Tensor, Tensor,
                                                                                  Tensor, Tensor, Tensor, Tensor]:
    return _chunk_gdn_fwd(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, state_v_first,
                          need_bwd, context_parallel, A_log, dt_bias, beta_act)


@chunk_gdn_fwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, state_v_first, need_bwd,
      context_parallel=0, A_log=None, dt_bias=None, beta_act=0):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = _num_seqs(q, cu_seqlens)
    plan = dispatch.plan(q.device, K, V, q.dtype, need_bwd=need_bwd)
    states = N if need_bwd and _saves_states(context_parallel, plan) else -1
    starts = _starts(context_parallel, N, q, v, cu_seqlens) if need_bwd and states < 0 else (0, 0)
    norms = need_bwd and _saves_norms(context_parallel, N, q, v, cu_seqlens is not None, use_qk_l2norm)
    meta = _saved_meta(q, k, v, use_qk_l2norm, need_bwd, beta_act, plan, starts, states, norms)
    return (q.new_empty(B, T, HV, V), q.new_empty(_state_shape(N, HV, K, V, state_v_first), dtype=accum_dtype(q.dtype)),
            *(q.new_empty(0) if m is None else q.new_empty(m[0], dtype=m[1]) for m in meta))


@torch.library.custom_op("flashdelta::chunk_gdn_bwd", mutates_args=())
def chunk_gdn_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
                  cu_seqlens: Optional[Tensor], do: Tensor, dht: Optional[Tensor], scale: float,
                  use_qk_l2norm: bool, state_v_first: bool, context_parallel: int = 0,
                  A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None, beta_act: int = 0,
                  g_cumsum: Optional[Tensor] = None, A: Optional[Tensor] = None, beta_act_out: Optional[Tensor] = None,
                  q_rstd: Optional[Tensor] = None, k_rstd: Optional[Tensor] = None,
                  cp_starts: Optional[Tensor] = None, states: Optional[Tensor] = None,
                  k_norm2: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                             Tensor]:
    """Every input gradient. g_cumsum, A, beta_act_out (the activated beta, with beta_act) and q_rstd, k_rstd (with
    use_qk_l2norm; q and k are then the l2-normalised ones), cp_starts (where the forward saved the backward's
    partition start states), states (where it saved the chunk states, `_saves_states`) and k_norm2 (prepare's squared
    key norms, `_saves_norms`) are the forward's `_SAVED` outputs; where they are not given, the stages that made
    them run again (the warm-up condition reads k without k_norm2)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dh0_empty = q.new_empty(0, dtype=torch.float32)
    if B * T == 0:
        dh0 = dh0_empty if initial_state is None else (
            dht.to(initial_state.dtype).clone() if dht is not None else torch.zeros_like(initial_state))
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(g),
                torch.zeros_like(beta), dh0, *_param_grads(q, A_log, dt_bias))
    plan = _plan(q, v, True)
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    if use_qk_l2norm:
        if q_rstd is not None:
            rq, rk = q_rstd, k_rstd
        else:
            l2norm = plan.fn("l2norm_fwd")
            (qf, rq), (kf, rk) = l2norm(qf), l2norm(kf)
    cu = _cu(q, cu_seqlens)
    dht = aligned(dht.to(accum_dtype(q.dtype))) if dht is not None else None
    if g_cumsum is None or A is None:
        g_cumsum, A, bf = _prepare(plan, q, kf, g, beta, cu, A_log, dt_bias, beta_act)
    else:
        bf = beta_act_out if beta_act else _flat(beta)
    ks = plan.kset("chunk_bwd")      # state_recompute's too (stages.COUPLED: h is backend-private)
    N = _num_seqs(q, cu_seqlens)
    L = cp.resolve_code(context_parallel, kset=plan.kset("chunk_fwd"), device=q.device, dtype=q.dtype, B=B, T=T,
                        HV=HV, K=K, V=V, N=N, varlen=cu_seqlens is not None, backward=True, bwd_kset=ks)
    if L:
        parts = cp.make_plan(cu, B * T, L, seq_len=None if cu_seqlens is not None else T, kset=ks)
        dq, dk, dv, dbeta, dG, dh0 = cp.cp_chunk_bwd(qf, kf, vf, g_cumsum, bf, A, initial_state, _flat(do), dht, cu,
                                                     scale=scale, state_v_first=state_v_first, plan=parts,
                                                     backends=plan, keys_normalized=use_qk_l2norm, starts=cp_starts,
                                                     states=states, k_norm2=k_norm2)
    else:
        h = states if states is not None else ks.state_recompute(kf, vf, g_cumsum, _param(bf, ks), A,
                                                                 _param(initial_state, ks), cu,
                                                                 state_v_first=state_v_first)
        dq, dk, dv, dbeta, dG, dh0 = ks.chunk_bwd(qf, kf, vf, g_cumsum, _param(bf, ks), A, h, _flat(do), dht, cu,
                                                  scale=scale, state_v_first=state_v_first)
        del h
    del A, g_cumsum     # chunk_bwd's inputs go before the group sums allocate (the backward's peak memory)
    # dq, dk per key head in q's dtype, with the l2norm's backward fused in; one at a time: dq per value head is
    # freed before dk's result allocates
    group_sum = plan.fn("group_sum")
    l2q, l2k = (dict(y=qf, rstd=rq), dict(y=kf, rstd=rk)) if use_qk_l2norm else ({}, {})
    dq = group_sum(dq, H, out_dtype=q.dtype, **l2q)
    dk = group_sum(dk, H, out_dtype=k.dtype, **l2k)
    dg = plan.fn("prepare_bwd")(dG, cu)
    dA_log, ddt_bias = _param_grads(q, A_log, dt_bias)
    if A_log is not None:       # the in-kernel gate's backward (docs/stages.md "The activations' backward")
        dg, dA_log, ddt_bias = gdn_gate_bwd(dg, _flat(g), A_log, dt_bias)
        dA_log, ddt_bias = dA_log.to(A_log.dtype), (ddt_bias.to(dt_bias.dtype) if dt_bias is not None else ddt_bias)
    if beta_act:
        dbeta = beta_activation_bwd(dbeta, bf, beta_act)
    dh0 = dh0.to(initial_state.dtype) if initial_state is not None else dh0_empty
    return (dq.reshape(q.shape).to(q.dtype), dk.reshape(k.shape).to(k.dtype), dv.reshape(v.shape).to(v.dtype),
            dg.reshape(g.shape).to(g.dtype), dbeta.reshape(beta.shape).to(beta.dtype), dh0, dA_log, ddt_bias)


def _param_grads(q: Tensor, A_log: Optional[Tensor], dt_bias: Optional[Tensor]) -> tuple:
    """Zero gradients of A_log and dt_bias (an empty tensor of its own for an absent one: custom ops return
    tensors, none an alias of another)."""
    return tuple(torch.zeros_like(x) if x is not None else q.new_empty(0, dtype=torch.float32)
                 for x in (A_log, dt_bias))


@chunk_gdn_bwd.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, do, dht, scale, use_qk_l2norm, state_v_first, context_parallel=0,
      A_log=None, dt_bias=None, beta_act=0, g_cumsum=None, A=None, beta_act_out=None, q_rstd=None, k_rstd=None,
      cp_starts=None, states=None, k_norm2=None):
    dh0 = torch.empty_like(initial_state) if initial_state is not None else q.new_empty(0, dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), dh0, *_param_grads(q, A_log, dt_bias))


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm, state_v_first = inputs[:10]
    A_log, dt_bias, beta_act = inputs[12:15] if len(inputs) > 12 else (None, None, 0)
    # the forward's `_SAVED` outputs, None where empty (the backward recomputes those); the normalised q and k, where
    # saved, replace the inputs
    g_cumsum, A, beta_out, q_l2, k_l2, rq, rk, starts, states, k_norm2 = (x if x.dim() > 1 else None
                                                                           for x in output[2:])
    if rq is not None:
        q, k = q_l2, k_l2
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, g_cumsum, A, beta_out, rq, rk,
                          starts, states, k_norm2)
    ctx.mark_non_differentiable(*output[2:])
    ctx.set_materialize_grads(False)      # no zero gradients for the saved outputs
    ctx.opts = (scale, use_qk_l2norm, state_v_first)
    ctx.cp_code = inputs[11] if len(inputs) > 11 else 0        # the forward's CP code: the backward's split
    ctx.beta_act = beta_act


def _backward(ctx, do, dht, *_saved_grads):
    saved = ctx.saved_tensors
    q, k, v, g, beta, initial_state, cu_seqlens = saved[:7]
    A_log, dt_bias = saved[7:9] if len(saved) > 7 else (None, None)
    fwd_saved = saved[9:17] if len(saved) > 9 else (None,) * 8
    scale, use_qk_l2norm, state_v_first = ctx.opts
    context_parallel = getattr(ctx, "cp_code", 0)
    beta_act = getattr(ctx, "beta_act", 0)
    if do is None:
        do = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = chunk_gdn_bwd(
        q, k, v, g, beta, initial_state, cu_seqlens, do, dht, scale, use_qk_l2norm, state_v_first, context_parallel,
        A_log, dt_bias, beta_act, *fwd_saved)
    # one entry per forward input: q, k, v, g, beta, initial_state, cu_seqlens, scale, l2norm, layout, need_bwd,
    # context_parallel, A_log, dt_bias, beta_act
    return (dq, dk, dv, dg, dbeta, (dh0 if initial_state is not None else None), None, None, None, None, None, None,
            dA_log if A_log is not None else None, ddt_bias if dt_bias is not None else None, None)


torch.library.register_autograd("flashdelta::chunk_gdn_fwd", _backward, setup_context=_setup_context)
