"""Portable PyTorch implementation of the chunked Gated DeltaNet stages (docs/stages.md).

This is the backend used where no Hopper GPU is present, the body of the float64 reference
(`flashdelta.reference.chunked` calls it at ``compute_dtype=torch.float64``) and, with ``operand_dtype``,
the "same algorithm in PyTorch at the kernel's precision" baseline of the tests.

The math (ungated WY inverse, chunk step, explicit backward, transition M) is written out once in
docs/algorithm.md; the section numbers in the comments below point there.

Implementation notes
--------------------
* Inputs are in the flat varlen form (batch dim 1, ``cu_seqlens`` given; it is read on the host).
* Tokens are gathered once into a padded chunk layout ``[NT, heads, BT, D]``. Rows of a ragged last chunk
  past the sequence end are zero (q, k, v, beta, A rows) and repeat the chunk's last cumulative gate, which
  makes every padded row inert: it contributes exactly nothing to outputs, states or gradients
  (docs/algorithm.md §2.4), so no padding garbage can leak.
* The serial walk loops over the chunk index ``c`` in Python; each step is batched over every
  (sequence that has a chunk ``c``) x (value head), so many short sequences cost as little as one long one.
* ``compute_dtype`` (float32 or float64) is the accumulation and element-wise dtype; None (the default)
  means float32, or float64 when the stage's main operands (q/k/v, dx, dG) are float64, so float64 inputs
  through the public API stay exact. With ``operand_dtype``
  (e.g. torch.bfloat16) every GEMM operand is rounded to it just before the product, as a tensor-core
  kernel does, and A is rounded when stored. The gate (cumsum, exp) always stays in float32 or better.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from .gates import beta_activation, gdn_gate
from .numerics import GATE_FLOOR, accum_dtype

__all__ = [
    "prepare_fwd", "chunk_fwd", "state_recompute", "chunk_bwd", "chunk_dstate", "group_sum", "prepare_bwd",
    "chunked_fwd", "chunked_bwd", "l2norm_fwd", "l2norm_bwd", "chunk_layout",
]

Tensor = torch.Tensor
L2NORM_EPS = 1e-6


# ------------------------------------------------------------------------------------------------ layout

@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Host-side description of how the flat varlen tokens fall into chunks (docs/stages.md conventions).

    ``tok[c, r]`` is the token of row ``r`` of global chunk ``c`` (clamped to a valid index where the row is
    padding), ``valid[c, r]`` says whether the row is a real token, ``clen[c]`` is the chunk's length.
    ``steps[i] = (chunk_ids, seq_ids)`` lists, for chunk index ``i`` within a sequence, the global chunks
    and their sequences (only sequences that have an ``i``-th chunk).
    """
    T: int
    BT: int
    N: int
    NT: int
    cu: tuple[int, ...]
    chunk_offsets: tuple[int, ...]
    tok: Tensor
    valid: Tensor
    clen: Tensor
    steps: tuple[tuple[Tensor, Tensor], ...]


def chunk_layout(cu_seqlens: Tensor, T: int, chunk_size: int, device) -> ChunkLayout:
    """Build the chunk layout of `cu_seqlens` (read on the host) for a buffer of `T` tokens."""
    if cu_seqlens is None:
        raise ValueError("cu_seqlens: the internal stages need it (flat varlen form); got None")
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > T:
        raise ValueError(f"cu_seqlens: must start at 0, be non-decreasing and end <= T={T}; got {cu}")
    BT = int(chunk_size)
    N = len(cu) - 1
    nch = [-(-(cu[n + 1] - cu[n]) // BT) for n in range(N)]
    offs = [0]
    for x in nch:
        offs.append(offs[-1] + x)
    NT = offs[-1]
    starts, ends = [], []
    for n in range(N):
        for c in range(nch[n]):
            starts.append(cu[n] + c * BT)
            ends.append(cu[n + 1])
    start_t = torch.tensor(starts, dtype=torch.long, device=device).reshape(NT)
    end_t = torch.tensor(ends, dtype=torch.long, device=device).reshape(NT)
    tok = start_t[:, None] + torch.arange(BT, device=device)[None, :]
    valid = tok < end_t[:, None]
    tok = torch.where(valid, tok, torch.zeros_like(tok))
    clen = valid.sum(1)
    offs_t = torch.tensor(offs[:-1], dtype=torch.long, device=device)
    steps = []
    for c in range(max(nch, default=0)):
        seqs = [n for n in range(N) if nch[n] > c]
        if len(seqs) == N:
            seq_ids = torch.arange(N, device=device)
        else:
            seq_ids = torch.tensor(seqs, dtype=torch.long, device=device)
        steps.append((offs_t[seq_ids] + c, seq_ids))
    return ChunkLayout(T=T, BT=BT, N=N, NT=NT, cu=tuple(cu), chunk_offsets=tuple(offs), tok=tok,
                       valid=valid, clen=clen, steps=tuple(steps))


def _gather(x: Tensor, lay: ChunkLayout, dtype) -> Tensor:
    """[1, T, Hx(, D)] -> [NT, Hx, BT(, D)] in `dtype`, zero on padded rows."""
    y = x[0].to(dtype)[lay.tok]                                     # [NT, BT, Hx(, D)]
    mask = lay.valid.reshape(lay.valid.shape + (1,) * (y.dim() - 2))
    y = torch.where(mask, y, torch.zeros((), dtype=dtype, device=y.device))
    return y.transpose(1, 2).contiguous()


def _scatter(xc: Tensor, lay: ChunkLayout, dtype) -> Tensor:
    """[NT, Hx, BT(, D)] -> [1, T, Hx(, D)] in `dtype`, zero on tokens outside every chunk (padding tail)."""
    y = xc.transpose(1, 2)                                          # [NT, BT, Hx(, D)]
    out = torch.zeros((lay.T,) + tuple(y.shape[2:]), dtype=dtype, device=xc.device)
    out[lay.tok[lay.valid]] = y[lay.valid].to(dtype)
    return out.unsqueeze(0)


def _gather_gate(g_cumsum: Tensor, lay: ChunkLayout, dtype) -> Tensor:
    """Chunked cumulative gate [NT, HV, BT]; padded rows repeat the chunk's last real value (inert rows)."""
    G = _gather(g_cumsum, lay, dtype)
    last = G.gather(-1, (lay.clen - 1).clamp_min(0)[:, None, None].expand(G.shape[0], G.shape[1], 1))
    return torch.where(lay.valid[:, None, :], G, last)


# ------------------------------------------------------------------------------------------------ dtypes

def _resolve(compute_dtype, operand_dtype, *tensors):
    """The compute dtype: as given, or (None) float64 when the main operands are float64, else float32."""
    if compute_dtype is None:
        compute_dtype = accum_dtype(*(t.dtype for t in tensors))
    _check_dtypes(compute_dtype, operand_dtype)
    return compute_dtype


def _check_dtypes(compute_dtype, operand_dtype):
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype: {compute_dtype} not supported; use torch.float32 or torch.float64")
    if operand_dtype is not None and not operand_dtype.is_floating_point:
        raise ValueError(f"operand_dtype: {operand_dtype} is not a floating dtype")


def _rounder(compute_dtype, operand_dtype) -> Callable[[Tensor], Tensor]:
    """GEMM operand rounding: identity, or round-trip through `operand_dtype`."""
    if operand_dtype is None or operand_dtype == compute_dtype:
        return lambda x: x
    return lambda x: x.to(operand_dtype).to(compute_dtype)


def _head_map(H: int, HV: int, device) -> Tensor:
    if H <= 0 or HV % H != 0:
        raise ValueError(f"HV={HV} must be a positive multiple of H={H}")
    return torch.arange(HV, device=device) // (HV // H)


def _default_scale(scale, K):
    return K ** -0.5 if scale is None else float(scale)


def _state_in(state: Optional[Tensor], N, HV, K, V, state_v_first, dtype, device, name) -> Tensor:
    """Caller's state ([N,HV,K,V] or [N,HV,V,K]) -> internal [N, HV, K, V] in `dtype` (zeros for None)."""
    if state is None:
        return torch.zeros(N, HV, K, V, dtype=dtype, device=device)
    want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if tuple(state.shape) != want:
        raise ValueError(f"{name}: shape {tuple(state.shape)}, expected {want} (state_v_first={state_v_first})")
    s = state.to(dtype)
    return s.transpose(-1, -2).contiguous() if state_v_first else s.clone()


def _state_out(s: Tensor, state_v_first: bool, dtype) -> Tensor:
    s = s.to(dtype)
    return s.transpose(-1, -2).contiguous() if state_v_first else s


# ------------------------------------------------------------------------------------------------ chunk math

def _tril(BT, device, diagonal=0):
    return torch.ones(BT, BT, dtype=torch.bool, device=device).tril(diagonal)


def _gamma(G: Tensor, tril: Tensor) -> Tensor:
    """Gamma_ij = exp(G_i - G_j) for i >= j, else 0; never forms exp(+G) (docs/algorithm.md §2.1)."""
    d = G[..., :, None] - G[..., None, :]
    return torch.exp(torch.where(tril, d, torch.full((), -math.inf, dtype=G.dtype, device=G.device)))


def _fwd_step(Q, K, V, G, b, A, S0, *, scale, rnd, tril, need_o):
    """One chunk (batched over leading dims) from state S0 [.., K, V]: returns (O or None, S1). §2.2."""
    eG = G.exp()
    GL = G[..., -1:]
    eL = GL.exp()
    Gam = _gamma(G, tril)
    Ag = A * Gam * b[..., None, :]                         # (A o Gamma) diag(b)
    Kr, S0r = rnd(K), rnd(S0)
    U = Kr @ S0r                                            # K S0
    W = V - eG[..., None] * U                               # V - D K S0
    Vn = rnd(Ag) @ rnd(W)                                   # new values V'
    R = torch.exp(GL - G)                                   # exp(G_last - G) <= 1
    S1 = eL[..., None] * S0 + Kr.transpose(-1, -2) @ rnd(R[..., None] * Vn)
    O = None
    if need_o:
        Qr = rnd(Q)
        Pg = (scale * Gam) * (Qr @ Kr.transpose(-1, -2))
        O = (scale * eG)[..., None] * (Qr @ S0r) + rnd(Pg) @ rnd(Vn)
    return O, S1


def _bwd_step(Q, K, V, G, b, A, S0, dO, dS1, clen, *, scale, rnd, tril):
    """Explicit backward of one chunk (docs/algorithm.md §3). Returns dq, dk, dv, dbeta, dG, dS0."""
    slower = tril & ~torch.eye(tril.shape[0], dtype=torch.bool, device=tril.device)
    eG = G.exp()
    GL = G[..., -1:]
    eL = GL.exp()
    Gam = _gamma(G, tril)
    R = torch.exp(GL - G)
    bcol = b[..., None, :]
    Ag = A * Gam * bcol
    Qr, Kr, S0r, dOr, dS1r = rnd(Q), rnd(K), rnd(S0), rnd(dO), rnd(dS1)
    Agr = rnd(Ag)
    mT = lambda x: x.transpose(-1, -2)  # noqa: E731
    # recompute the forward pieces
    U = Kr @ S0r
    W = V - eG[..., None] * U
    Vn = Agr @ rnd(W)
    P = Qr @ mT(Kr)
    Pg = (scale * Gam) * P
    # value path
    dVn = mT(rnd(Pg)) @ dOr + R[..., None] * (Kr @ dS1r)   # dV' = Pg^T dO + R K dS1
    dW = mT(Agr) @ rnd(dVn)                                 # = dv
    dU = -eG[..., None] * dW
    dAg = rnd(dVn) @ mT(rnd(W))
    dAb = Gam * dAg
    dA = dAb * bcol
    Ar = rnd(A)
    dL = -(rnd(mT(Ar) @ rnd(dA)) @ mT(Ar))
    dL = torch.where(slower, dL, torch.zeros((), dtype=dL.dtype, device=dL.device))
    # output path
    dPg = dOr @ mT(rnd(Vn))
    dP = (scale * Gam) * dPg
    dq1 = (scale * eG)[..., None] * (dOr @ mT(S0r))        # s D dO S0^T
    dq = dq1 + rnd(dP) @ Kr
    # keys
    RVn = R[..., None] * Vn
    dkS = rnd(RVn) @ mT(dS1r)                               # R V' dS1^T
    dAt = b[..., :, None] * dL
    dk = dkS + rnd(dU) @ mT(S0r) + mT(rnd(dP)) @ Qr + rnd(dAt + mT(dAt)) @ Kr
    # beta
    KKt = Kr @ mT(Kr)
    dAbA = dAb * A
    db = dAbA.sum(-2) + (dL * KKt).sum(-1)
    # gate (w.r.t. the chunk-local cumsum G)
    Mx = Pg * dPg + dAbA * bcol
    kdk = (K * dkS).sum(-1)
    dG = (rnd(dU) * U).sum(-1) + (Q * dq1).sum(-1) - kdk + Mx.sum(-1) - Mx.sum(-2)
    last = (kdk.sum(-1) + eL[..., 0] * (dS1 * S0).sum((-1, -2)))  # terms of the chunk's last real row
    idx = (clen - 1).clamp_min(0).reshape(-1, 1, 1).expand(dG.shape[0], dG.shape[1], 1)
    dG = dG.scatter_add(-1, idx, last[..., None])
    # state gradient
    dS0 = eL[..., None] * dS1 + mT(Kr) @ rnd(dU) + mT(Qr) @ rnd((scale * eG)[..., None] * dO)
    return dq, dk, dW, db, dG, dS0


# ------------------------------------------------------------------------------------------------ stages

def prepare_fwd(k, g, beta, cu_seqlens, *, chunk_size=64, A_log=None, dt_bias=None, beta_act=0, compute_dtype=None,
                operand_dtype=None, norms=False):
    """Chunk-local inclusive cumsum of g and the ungated WY inverse A (docs/algorithm.md §2.1). Gates below
    `numerics.GATE_FLOOR` (-inf included) count as GATE_FLOOR (docs/numerics.md).

    With `A_log` (and optionally `dt_bias`), g is the raw gate and the log decay is `gates.gdn_gate`'s
    ``-exp(A_log) * softplus(g + dt_bias)``; with `beta_act` 1 or 2, beta holds logits and the stage uses
    `gates.beta_activation`'s ``beta_act * sigmoid(beta)`` (docs/stages.md `prepare_fwd`).

    Returns ``g_cumsum [1,T,HV]`` (float32; float64 when compute_dtype is float64; 0 on padding) and
    ``A [1,T,HV,BT]`` (row i of each chunk's ``(I + strictly_lower(diag(b) K K^T))^{-1}`` at token
    ``chunk_start + i``; columns past the chunk's length are 0), in `operand_dtype` if set else compute_dtype; with
    `beta_act`, a third tensor: the activated beta ``[1,T,HV]`` in g_cumsum's dtype, 0 on padding; with `norms`,
    last, the squared key norms ``[1,T,H]`` (g_cumsum's dtype; 0 on padding), K K^T's diagonal.
    """
    cd = _resolve(compute_dtype, operand_dtype, k)
    gd = accum_dtype(cd)
    rnd = _rounder(cd, operand_dtype)
    T, H = k.shape[1], k.shape[2]
    HV = g.shape[-1]
    lay = chunk_layout(cu_seqlens, T, chunk_size, k.device)
    hmap = _head_map(H, HV, k.device)
    if A_log is not None:
        g = gdn_gate(g.to(gd), A_log.to(gd), None if dt_bias is None else dt_bias.to(gd))
    if beta_act:
        tail = torch.arange(T, device=k.device)[None, :, None] >= lay.cu[-1]     # the padding tail: 0
        beta = torch.where(tail, torch.zeros((), dtype=gd, device=k.device), beta_activation(beta.to(gd), beta_act))
    gc = _gather(g, lay, gd)                                  # padded rows are 0 -> repeat the last value
    gc = torch.where(gc < GATE_FLOOR, GATE_FLOOR, gc).cumsum(-1)  # -inf and huge negative gates: the floor
    g_cumsum = _scatter(gc, lay, gd)
    kc = rnd(_gather(k, lay, cd))                             # [NT, H, BT, K]
    bc = _gather(beta, lay, cd)                               # [NT, HV, BT]
    KKt = (kc @ kc.transpose(-1, -2))[:, hmap]                # [NT, HV, BT, BT], shared by a key head's group
    BT = lay.BT
    slower = _tril(BT, k.device, -1)
    Lm = torch.where(slower, bc[..., :, None] * KKt, torch.zeros((), dtype=cd, device=k.device))
    eye = torch.eye(BT, dtype=cd, device=k.device).expand_as(Lm)
    # unit lower-triangular solve (the diagonal of Lm is ignored: unitriangular)
    Ac = torch.linalg.solve_triangular(Lm, eye, upper=False, unitriangular=True)
    adt = operand_dtype if operand_dtype is not None else cd
    A = _scatter(Ac, lay, adt)
    out = (g_cumsum, A, beta) if beta_act else (g_cumsum, A)
    if norms:
        out += (_scatter(kc.square().sum(-1), lay, gd),)            # [NT, H, BT] -> [1, T, H]
    return out


def _gather_all(q, k, v, g_cumsum, beta, A, lay, cd):
    kc = _gather(k, lay, cd)
    qc = _gather(q, lay, cd) if q is not None else None
    vc = _gather(v, lay, cd)
    Gc = _gather_gate(g_cumsum, lay, accum_dtype(cd)).to(cd)
    bc = _gather(beta, lay, cd)
    Ac = _gather(A, lay, cd)                                  # [NT, HV, BT, BT]
    return qc, kc, vc, Gc, bc, Ac


def _check_chunk_counts(name: str, counts: Optional[Tensor], N: int, HV: int) -> None:
    """Context parallelism's per-(sequence, value head) chunk counts (`chunk_skip`, `chunk_take`): None or an
    integer ``[N, HV]`` tensor."""
    if counts is not None and (tuple(counts.shape) != (N, HV) or counts.is_floating_point()):
        raise ValueError(f"{name}: an integer [N, HV] = [{N}, {HV}] tensor, got {counts.dtype} {tuple(counts.shape)}")


def chunk_fwd(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, *, scale=None, state_v_first=False,
              chunk_size=64, chunk_skip=None, zero_values=False, states_only=False, partition_starts=None,
              transitions=False, transition_skip=None, compute_dtype=None, operand_dtype=None, out=None):
    """Chunked forward from g_cumsum and A. Returns ``o [1,T,HV,V]`` (v.dtype) and the final state
    ``[N,HV,K,V]`` (or ``[N,HV,V,K]``), float32 (float64 at compute_dtype float64).

    `chunk_skip` (context parallelism's internal passes, `flashdelta.cp`): None, or an integer ``[N, HV]`` tensor;
    sequence n's value head hv starts at its chunk ``chunk_skip[n, hv]`` (clamped to [0, its chunk count]) from its
    initial state, so its final state is the state after its last chunk of a walk over the chunks from there. o on
    the skipped chunks is unspecified. Applied on the device (a mask per step), no host read. `zero_values`: the
    values are zero (context parallelism's M pass); v gives only its shape and dtype. `states_only`: o is returned
    as None (context parallelism's M and E passes). `partition_starts` ``(L, slot [N] integer, P)``: also return,
    third, the state entering every L-th chunk of each sequence (and its initial state) at slot ``slot[n] + c // L``
    of a ``[P, HV, K, V]`` tensor in the state dtype, K-first, 0 on slots no sequence owns (context parallelism's
    partition start states, saved by the training forward for its backward). `transitions` (with `states_only`, no
    initial state, K-first): also return, third, each sequence's transition ``M [N, HV, K, K]`` (zero values walked
    from the identity; `transition_skip` ``[N, HV]`` integer, with `chunk_skip` only, its walks' start chunks; M = 0
    where that skips every chunk of a non-empty sequence): the SM90 launcher's one-launch M and E passes, here two
    walks. `out`: a ``[1, T, HV, V]`` tensor in v's dtype that o is written into and returned as o: only the chunks
    walked and the padding tail (zeros), so two calls over complementary `chunk_skip` fill one o (context
    parallelism's output pass in two launches, `flashdelta.cp`); not with `states_only`."""
    if out is not None and (states_only or transitions or tuple(out.shape) != (1, *v.shape[1:])
                            or out.dtype != v.dtype):
        raise ValueError(f"out: a [1, T, HV, V] tensor in v's dtype and not with states_only, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if transitions:
        return _with_transitions(q, k, v, g_cumsum, beta, A, cu_seqlens, scale=scale, chunk_size=chunk_size,
                                 chunk_skip=chunk_skip, transition_skip=transition_skip,
                                 checks=(initial_state is None and states_only and not state_v_first
                                         and not zero_values and partition_starts is None),
                                 compute_dtype=compute_dtype, operand_dtype=operand_dtype)
    if transition_skip is not None:
        raise ValueError("transition_skip: only with transitions=True")
    if zero_values:
        v = torch.zeros_like(v)
    cd = _resolve(compute_dtype, operand_dtype, q, k, v)
    rnd = _rounder(cd, operand_dtype)
    T, H, K = q.shape[1], q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    scale = _default_scale(scale, K)
    lay = chunk_layout(cu_seqlens, T, chunk_size, q.device)
    hmap = _head_map(H, HV, q.device)
    _check_chunk_counts("chunk_skip", chunk_skip, lay.N, HV)
    qc, kc, vc, Gc, bc, Ac = _gather_all(q, k, v, g_cumsum, beta, A, lay, cd)
    S = _state_in(initial_state, lay.N, HV, K, V, state_v_first, cd, q.device, "initial_state")
    oc = torch.zeros(lay.NT, HV, lay.BT, V, dtype=cd, device=q.device)
    tril = _tril(lay.BT, q.device)
    starts = None
    if partition_starts is not None:
        L, slot, P = partition_starts
        if int(L) < 1 or tuple(slot.shape) != (lay.N,) or slot.is_floating_point():
            raise ValueError(f"partition_starts: (L >= 1, an integer [N] = [{lay.N}] slot tensor, P), got "
                             f"L={L}, slot {slot.dtype} {tuple(slot.shape)}")
        if chunk_skip is not None or zero_values or states_only:
            raise ValueError("partition_starts: not with chunk_skip, zero_values or states_only")
        slot = slot.to(device=q.device, dtype=torch.long)
        starts = S.new_zeros(int(P), HV, K, V)
        starts[slot] = S
    walked = torch.ones(lay.NT, HV, dtype=torch.bool, device=q.device)       # [NT, HV]: the chunks walked
    for c, (ids, seqs) in enumerate(lay.steps):
        if starts is not None and c and c % L == 0:
            starts[slot[seqs] + c // L] = S[seqs]
        O, S1 = _fwd_step(qc[ids][:, hmap], kc[ids][:, hmap], vc[ids], Gc[ids], bc[ids], Ac[ids], S[seqs],
                          scale=scale, rnd=rnd, tril=tril, need_o=not states_only)
        if not states_only:
            oc[ids] = O
        if chunk_skip is not None:              # heads that start later keep their initial state through chunk c
            walks = chunk_skip[seqs].to(q.device) <= c
            S1 = torch.where(walks[:, :, None, None], S1, S[seqs])
            walked[ids] = walks
        S[seqs] = S1
    o = None if states_only else _scatter(oc, lay, v.dtype)
    if out is not None:
        # tokens of the chunks walked, and those outside every chunk (the padding tail, zeros); the rest keep out's
        inside = _scatter(torch.ones_like(oc[..., 0]), lay, torch.bool)                       # [1, T, HV]
        keep = _scatter(walked[:, :, None].expand(-1, -1, lay.BT), lay, torch.bool) | ~inside
        o = out.copy_(torch.where(keep[..., None], o, out))
    ht = _state_out(S, state_v_first, accum_dtype(cd))
    return (o, ht) if starts is None else (o, ht, starts.to(accum_dtype(cd)))


def _with_transitions(q, k, v, g_cumsum, beta, A, cu_seqlens, *, scale, chunk_size, chunk_skip, transition_skip,
                      checks: bool, compute_dtype, operand_dtype):
    """`chunk_fwd(transitions=True)`: ``(None, E, M)``, E the walk of v from zero (from `chunk_skip`), M of zero
    values from the identity (from `transition_skip`; 0 where that skips every chunk of a non-empty sequence)."""
    if not checks:
        raise ValueError("transitions: only with states_only, no initial state, K-first states and no other "
                         "context-parallel option")
    if (transition_skip is None) != (chunk_skip is None):
        raise ValueError("transition_skip: given exactly when chunk_skip is")
    kw = dict(scale=scale, chunk_size=chunk_size, states_only=True, compute_dtype=compute_dtype,
              operand_dtype=operand_dtype)
    _, E = chunk_fwd(q, k, v, g_cumsum, beta, A, None, cu_seqlens, chunk_skip=chunk_skip, **kw)
    N, HV, K = E.shape[0], E.shape[1], k.shape[-1]
    _check_chunk_counts("transition_skip", transition_skip, N, HV)
    cu = cu_seqlens.to(device=k.device, dtype=torch.long)
    nt = torch.div(cu[1:] - cu[:-1] + chunk_size - 1, chunk_size, rounding_mode="floor")[:, None]    # [N, 1]
    first = (torch.zeros_like(nt) if transition_skip is None
             else torch.clamp(transition_skip.to(device=k.device, dtype=torch.long), min=0))
    walks = ((first < nt) | (nt == 0))[:, :, None, None]                                               # [N, HV]
    eye = torch.eye(K, dtype=E.dtype, device=k.device)
    start = torch.where(walks, eye, eye.new_zeros(())).expand(N, HV, K, K).contiguous()   # walks: [N, 1] without skip
    _, M = chunk_fwd(q, k, v.new_empty(1, v.shape[1], HV, K), g_cumsum, beta, A, start, cu_seqlens,
                     chunk_skip=transition_skip, zero_values=True, **kw)
    return None, E, M


def state_recompute(k, v, g_cumsum, beta, A, initial_state, cu_seqlens, *, state_v_first=False, chunk_size=64,
                    compute_dtype=None, operand_dtype=None):
    """The state entering every chunk: ``h [NT,HV,K,V]`` (or ``[NT,HV,V,K]``), float32 (float64 at float64)."""
    cd = _resolve(compute_dtype, operand_dtype, k, v)
    rnd = _rounder(cd, operand_dtype)
    T, H, K = k.shape[1], k.shape[2], k.shape[3]
    HV, V = v.shape[2], v.shape[3]
    lay = chunk_layout(cu_seqlens, T, chunk_size, k.device)
    hmap = _head_map(H, HV, k.device)
    _, kc, vc, Gc, bc, Ac = _gather_all(None, k, v, g_cumsum, beta, A, lay, cd)
    S = _state_in(initial_state, lay.N, HV, K, V, state_v_first, cd, k.device, "initial_state")
    h = torch.zeros(lay.NT, HV, K, V, dtype=cd, device=k.device)
    tril = _tril(lay.BT, k.device)
    for ids, seqs in lay.steps:
        S0 = S[seqs]
        h[ids] = S0
        _, S1 = _fwd_step(None, kc[ids][:, hmap], vc[ids], Gc[ids], bc[ids], Ac[ids], S0,
                          scale=1.0, rnd=rnd, tril=tril, need_o=False)
        S[seqs] = S1
    return _state_out(h, state_v_first, accum_dtype(cd))


def chunk_bwd(q, k, v, g_cumsum, beta, A, h, do, dht, cu_seqlens, *, scale=None, state_v_first=False,
              chunk_size=64, h_seqs=None, compute_dtype=None, operand_dtype=None):
    """Explicit chunked backward (docs/algorithm.md §3), chunks walked in reverse with dS carried.

    `h_seqs` (docs/stages.md): h may come from the forward over the sequences that cu_seqlens' items are
    chunk-aligned pieces of; this layout (global chunk order) is the same for both, so it is not read.

    Returns ``dq [1,T,HV,K]``, ``dk [1,T,HV,K]`` (per value head), ``dv [1,T,HV,V]``, ``dbeta [1,T,HV]``,
    ``dG [1,T,HV]`` (w.r.t. g_cumsum), all in compute_dtype, and ``dh0`` (state layout, float32/float64).
    """
    cd = _resolve(compute_dtype, operand_dtype, q, k, v)
    rnd = _rounder(cd, operand_dtype)
    T, H, K = q.shape[1], q.shape[2], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    scale = _default_scale(scale, K)
    dev = q.device
    lay = chunk_layout(cu_seqlens, T, chunk_size, dev)
    hmap = _head_map(H, HV, dev)
    qc, kc, vc, Gc, bc, Ac = _gather_all(q, k, v, g_cumsum, beta, A, lay, cd)
    doc = _gather(do, lay, cd)
    if tuple(h.shape) != ((lay.NT, HV, V, K) if state_v_first else (lay.NT, HV, K, V)):
        raise ValueError(f"h: shape {tuple(h.shape)} does not match NT={lay.NT}, HV={HV}, K={K}, V={V}")
    hc = h.to(cd)
    if state_v_first:
        hc = hc.transpose(-1, -2)
    dS = _state_in(dht, lay.N, HV, K, V, state_v_first, cd, dev, "dht")
    NT, BT = lay.NT, lay.BT
    dqc = torch.zeros(NT, HV, BT, K, dtype=cd, device=dev)
    dkc = torch.zeros(NT, HV, BT, K, dtype=cd, device=dev)
    dvc = torch.zeros(NT, HV, BT, V, dtype=cd, device=dev)
    dbc = torch.zeros(NT, HV, BT, dtype=cd, device=dev)
    dGc = torch.zeros(NT, HV, BT, dtype=cd, device=dev)
    tril = _tril(BT, dev)
    for ids, seqs in reversed(lay.steps):
        dq, dk, dv, db, dG, dS0 = _bwd_step(
            qc[ids][:, hmap], kc[ids][:, hmap], vc[ids], Gc[ids], bc[ids], Ac[ids], hc[ids], doc[ids],
            dS[seqs], lay.clen[ids], scale=scale, rnd=rnd, tril=tril)
        dqc[ids], dkc[ids], dvc[ids], dbc[ids], dGc[ids] = dq, dk, dv, db, dG
        dS[seqs] = dS0
    valid = lay.valid[:, None, :]
    zero = torch.zeros((), dtype=cd, device=dev)
    dbc = torch.where(valid, dbc, zero)
    dGc = torch.where(valid, dGc, zero)
    return (_scatter(dqc, lay, cd), _scatter(dkc, lay, cd), _scatter(dvc, lay, cd), _scatter(dbc, lay, cd),
            _scatter(dGc, lay, cd), _state_out(dS, state_v_first, accum_dtype(cd)))


def chunk_dstate(q, k, g_cumsum, beta, A, do, cu_seqlens, *, scale=None, chunk_size=64, chunk_take=None,
                 compute_dtype=None, operand_dtype=None):
    """Each sequence's start gradient from a zero end gradient, ``[N, HV, K, V]`` (K-first): `chunk_bwd`'s dh0 with
    dht = 0. It depends on dO and the chunk maps only, so `chunk_bwd`'s chunk step runs here on zero values and
    states, walking the chunks in reverse.

    `chunk_take` (context parallelism's backward warm-up, `flashdelta.cp`): None, or an integer ``[N, HV]`` tensor;
    sequence n's value head hv walks only its first ``chunk_take[n, hv]`` chunks (clamped to [0, its chunk count]),
    from a zero gradient at the end of the last of them (0 where it walks none). Applied on the device (a mask per
    step), no host read."""
    cd = _resolve(compute_dtype, operand_dtype, q, k, do)
    rnd = _rounder(cd, operand_dtype)
    T, H, K = q.shape[1], q.shape[2], q.shape[3]
    HV, V = do.shape[2], do.shape[3]
    scale = _default_scale(scale, K)
    dev = q.device
    lay = chunk_layout(cu_seqlens, T, chunk_size, dev)
    hmap = _head_map(H, HV, dev)
    _check_chunk_counts("chunk_take", chunk_take, lay.N, HV)
    qc, kc, doc = _gather(q, lay, cd), _gather(k, lay, cd), _gather(do, lay, cd)
    Gc, bc, Ac = _gather_gate(g_cumsum, lay, accum_dtype(cd)).to(cd), _gather(beta, lay, cd), _gather(A, lay, cd)
    dS = torch.zeros(lay.N, HV, K, V, dtype=cd, device=dev)
    tril = _tril(lay.BT, dev)
    for c in reversed(range(len(lay.steps))):
        ids, seqs = lay.steps[c]
        v0 = torch.zeros(len(ids), HV, lay.BT, V, dtype=cd, device=dev)          # values and states: zero
        S0 = torch.zeros(len(ids), HV, K, V, dtype=cd, device=dev)
        dS0 = _bwd_step(qc[ids][:, hmap], kc[ids][:, hmap], v0, Gc[ids], bc[ids], Ac[ids], S0, doc[ids], dS[seqs],
                        lay.clen[ids], scale=scale, rnd=rnd, tril=tril)[5]
        if chunk_take is not None:              # heads that stop earlier keep their zero gradient through chunk c
            dS0 = torch.where((chunk_take[seqs].to(dev) > c)[:, :, None, None], dS0, dS[seqs])
        dS[seqs] = dS0
    return dS.to(accum_dtype(cd))


def group_sum(dx, H, *, y=None, rstd=None, out_dtype=None, compute_dtype=None, operand_dtype=None):
    """[1,T,HV,K] -> [1,T,H,K]: sum over the HV/H value heads sharing each key head, then with (y, rstd) from
    `l2norm_fwd` the l2norm backward through it (`l2norm_bwd`); accumulated in at least compute_dtype, returned in
    out_dtype (default dx's)."""
    B, T, HV, D = dx.shape
    if HV % H != 0:
        raise ValueError(f"H={H} must divide HV={HV}")
    acc = torch.promote_types(dx.dtype, _resolve(compute_dtype, None, dx))
    s = dx.to(acc).reshape(B, T, H, HV // H, D).sum(3)
    if y is not None:
        s = l2norm_bwd(y, rstd.to(acc), s)
    return s.to(dx.dtype if out_dtype is None else out_dtype)


def prepare_bwd(dG, cu_seqlens, *, chunk_size=64, compute_dtype=None, operand_dtype=None):
    """Chunk-local reverse cumsum of dG: the gradient w.r.t. the raw g ([1,T,HV], 0 on padding)."""
    T = dG.shape[1]
    acc = torch.promote_types(dG.dtype, accum_dtype(_resolve(compute_dtype, None, dG)))
    lay = chunk_layout(cu_seqlens, T, chunk_size, dG.device)
    x = _gather(dG, lay, acc)
    x = x.flip(-1).cumsum(-1).flip(-1)
    return _scatter(x, lay, acc)


# ------------------------------------------------------------------------------------------------ composites

def l2norm_fwd(x):
    """``y = x * rsqrt(sum(x^2) + 1e-6)`` over the last dim, in x.dtype, with rstd (float32 or float64)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    rstd = torch.rsqrt((xf * xf).sum(-1, keepdim=True) + L2NORM_EPS)
    return (xf * rstd).to(x.dtype), rstd


def l2norm_fwd_compute(x):
    """`l2norm_fwd` in the portable path's compute precision: 16-bit inputs are normalised to float32."""
    return l2norm_fwd(x.to(torch.promote_types(x.dtype, torch.float32)))


def l2norm_bwd(y, rstd, dy):
    """``dx = (dy - (dy . y) y) * rstd``, in dy.dtype."""
    acc = rstd.dtype
    yf, dyf = y.to(acc), dy.to(acc)
    return ((dyf - (dyf * yf).sum(-1, keepdim=True) * yf) * rstd).to(dy.dtype)


def chunked_fwd(q, k, v, g, beta, initial_state, cu_seqlens, *, scale=None, state_v_first=False, chunk_size=64,
                compute_dtype=None, operand_dtype=None):
    """prepare_fwd + chunk_fwd from the raw gate. Returns ``(o, final_state, g_cumsum, A)``."""
    g_cumsum, A = prepare_fwd(k, g, beta, cu_seqlens, chunk_size=chunk_size, compute_dtype=compute_dtype,
                              operand_dtype=operand_dtype)
    o, ht = chunk_fwd(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, scale=scale,
                      state_v_first=state_v_first, chunk_size=chunk_size, compute_dtype=compute_dtype,
                      operand_dtype=operand_dtype)
    return o, ht, g_cumsum, A


def chunked_bwd(q, k, v, g_cumsum, beta, A, initial_state, do, dht, cu_seqlens, *, scale=None,
                state_v_first=False, H=None, chunk_size=64, compute_dtype=None, operand_dtype=None):
    """state_recompute + chunk_bwd + group_sum + prepare_bwd.

    Returns ``(dq [1,T,H,K], dk [1,T,H,K], dv, dbeta, dg, dh0)`` with dg w.r.t. the raw g."""
    H = q.shape[2] if H is None else H
    kw = dict(compute_dtype=compute_dtype, operand_dtype=operand_dtype)
    h = state_recompute(k, v, g_cumsum, beta, A, initial_state, cu_seqlens, state_v_first=state_v_first,
                        chunk_size=chunk_size, **kw)
    dq, dk, dv, db, dG, dh0 = chunk_bwd(q, k, v, g_cumsum, beta, A, h, do, dht, cu_seqlens, scale=scale,
                                        state_v_first=state_v_first, chunk_size=chunk_size, **kw)
    dg = prepare_bwd(dG, cu_seqlens, chunk_size=chunk_size, **kw)
    return group_sum(dq, H, **kw), group_sum(dk, H, **kw), dv, db, dg, dh0
