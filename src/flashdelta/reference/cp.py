"""Context parallelism (CP) in float64: partitions, exact (E, M) scan, gate-driven warm-up (docs/algorithm.md §4).

The math and the error bounds are in docs/algorithm.md §4. Everything here is float64 and torch-only; the
per-partition work is done by the float64 stage twins (`reference.chunked`), so a CP result differs from
the serial one only through how partition start states / end gradients are obtained.

Conventions: inputs are the flat varlen stage inputs (``q, k [1,T,H,K]``, ``v [1,T,HV,V]``,
``g_cumsum, beta [1,T,HV]``, ``A [1,T,HV,BT]`` from ``prepare_fwd``; partitions are chunk-aligned, so
g_cumsum and A are the same with or without CP). State-like tensors (E, start states, end gradients) follow
``state_v_first`` (``[.., K, V]`` or ``[.., V, K]``); the transition ``M`` is always ``[.., K, K]`` and acts on
the K index (``S -> M S`` in the K-first layout, ``S^T -> S^T M^T`` in the V-first one).

API
---
``partition(cu_seqlens, partition_chunks, *, chunk_size=64) -> Partitions``
    Cut every sequence with more than ``partition_chunks`` chunks into consecutive partitions of exactly
    ``partition_chunks * chunk_size`` tokens (the last one takes the remainder); shorter sequences stay whole;
    an empty sequence gives one empty partition.
``chunk_summaries(q, k, v, g_cumsum, beta, A, do, cu_seqlens, *, scale=None, chunk_size=64) -> ChunkSummaries``
    Per chunk (global chunk index, K-first layout): ``E`` end state from a zero start, ``M`` transition,
    ``F`` start gradient from a zero end gradient (needs ``do``; None otherwise), ``decay`` = ``G_last``.
``partition_summaries(k, v, g_cumsum, beta, A, parts, *, state_v_first=False) -> (E [P,HV,..], M [P,HV,K,K])``
    Each partition's end state from a zero start and its transition (product of its chunk Ms).
``scan_states(E, M, parts, initial_state, *, state_v_first=False) -> (h0 [P,HV,..], final [N,HV,..])``
    The exact serial scan ``S_{p+1} = M_p S_p + E_p``: every partition's start state and each sequence's
    final state.
``warmup_chunks(g_cumsum, parts, *, threshold=-10.0, direction="fwd") -> WarmupPlan``
    Per (partition, head) the shortest suffix ("fwd": of a partition, to produce the next one's start state)
    or prefix ("bwd": of a partition, to produce the previous one's end gradient) of chunks whose summed log
    decay is ``<= threshold``; where none is, the whole partition and ``fallback=True`` (exact through M).
``warmup_states(k, v, g_cumsum, beta, A, initial_state, parts, plan, *, state_v_first=False) -> (h0, final)``
    Start states from the warm-up windows (fallback heads: exact through M); ``final`` is exact given the
    last partition's start state.
``grad_summaries(q, k, v, g_cumsum, beta, A, do, parts, *, scale=None, state_v_first=False) -> (F, M)``
    Each partition's start gradient from a zero end gradient, and its transition M (``dS0 = M^T dS1 + F``).
``scan_grads(F, M, parts, dht, *, state_v_first=False) -> (dht_parts [P,HV,..], dh0 [N,HV,..])``
    The exact reverse scan with ``M^T``: every partition's end gradient and each sequence's dh0.
``warmup_grads(q, k, v, g_cumsum, beta, A, do, dht, parts, plan, *, scale=None, state_v_first=False)``
    End gradients from the next partition's first ``plan.n`` chunks walked in reverse from zero (fallback:
    exact through M^T). Returns ``(dht_parts, dh0)``.
``cp_fwd(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, *, scale=None, state_v_first=False,
         chunk_size=64, partition_chunks=4, mode="exact", threshold=-10.0) -> (o, final_state)``
    Forward through partitions run as independent sequences, with start states from the exact scan
    (``mode="exact"``) or the warm-up (``mode="warmup"``).
``cp_bwd(q, k, v, g_cumsum, beta, A, initial_state, do, dht, cu_seqlens, *, same keywords)
         -> (dq [1,T,HV,K], dk [1,T,HV,K], dv, dbeta, dG, dh0)``
    Backward mirroring it (returns exactly what ``chunk_bwd`` returns for the unpartitioned input).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import portable as _p
from . import chunked as _ref

__all__ = [
    "Partitions", "partition", "ChunkSummaries", "chunk_summaries", "partition_summaries", "scan_states",
    "WarmupPlan", "warmup_chunks", "warmup_states", "grad_summaries", "scan_grads", "warmup_grads",
    "cp_fwd", "cp_bwd",
]

F64 = torch.float64
Tensor = torch.Tensor


# ------------------------------------------------------------------------------------------------ partitions

@dataclasses.dataclass(frozen=True)
class Partitions:
    """Chunk-aligned partitions of a sequence set (all host-side tuples).

    ``cu_seqlens[p]:cu_seqlens[p+1]`` are partition p's tokens; ``seq[p]`` its raw sequence; ``first``/``last``
    whether it starts/ends that sequence; ``chunk_start[p]``/``nchunks[p]`` its chunks as global chunk indices
    (identical in the raw and the partitioned layout, since cuts are chunk-aligned).
    """
    cu_seqlens: tuple[int, ...]
    seq: tuple[int, ...]
    first: tuple[bool, ...]
    last: tuple[bool, ...]
    chunk_start: tuple[int, ...]
    nchunks: tuple[int, ...]
    chunk_size: int
    partition_chunks: int

    @property
    def P(self) -> int:
        return len(self.seq)

    @property
    def N(self) -> int:
        return (self.seq[-1] + 1) if self.seq else 0

    def cu_tensor(self, device=None) -> Tensor:
        return torch.tensor(self.cu_seqlens, dtype=torch.int32, device=device)

    def first_of(self) -> list[int]:
        """Index of each sequence's first partition."""
        return [p for p in range(self.P) if self.first[p]]

    def last_of(self) -> list[int]:
        """Index of each sequence's last partition."""
        return [p for p in range(self.P) if self.last[p]]


def partition(cu_seqlens, partition_chunks: int, *, chunk_size: int = 64) -> Partitions:
    """Cut sequences into partitions of ``partition_chunks`` chunks (the last one of a sequence may be shorter)."""
    cu = [int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    if partition_chunks < 1:
        raise ValueError(f"partition_chunks: must be >= 1, got {partition_chunks}")
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: must start at 0 and be non-decreasing, got {cu}")
    BT, L = int(chunk_size), int(partition_chunks)
    bounds, seq, first, last, cstart, nch = [0], [], [], [], [], []
    chunk = 0
    for n in range(len(cu) - 1):
        bos, eos = cu[n], cu[n + 1]
        starts = list(range(bos, eos, L * BT)) or [bos]
        for i, s in enumerate(starts):
            e = min(s + L * BT, eos)
            bounds.append(e)
            seq.append(n)
            first.append(i == 0)
            last.append(i == len(starts) - 1)
            cstart.append(chunk)
            nch.append(-(-(e - s) // BT))
            chunk += nch[-1]
    return Partitions(tuple(bounds), tuple(seq), tuple(first), tuple(last), tuple(cstart), tuple(nch), BT, L)


# ------------------------------------------------------------------------------------------------ per chunk

@dataclasses.dataclass(frozen=True)
class ChunkSummaries:
    """Per global chunk, K-first layout, float64: ``E [NT,HV,K,V]``, ``M [NT,HV,K,K]``, ``F [NT,HV,K,V]`` or
    None, ``decay [NT,HV]`` (the chunk's summed log decay G_last)."""
    E: Tensor
    M: Tensor
    F: Optional[Tensor]
    decay: Tensor


def chunk_summaries(q, k, v, g_cumsum, beta, A, do, cu_seqlens, *, scale=None, chunk_size=64) -> ChunkSummaries:
    """Gate-free per-chunk affine maps (docs/algorithm.md §4.1), from the ungated A:

    ``S1 = M S0 + E`` with ``E = K^T R (A o Gamma) diag(b) V``, ``M = e_L (I - K^T A diag(b) K)``;
    ``dS0 = M^T dS1 + F`` with ``F = scale (Q - tril(Q K^T) X)^T D dO``, ``X = A diag(b) K``.
    """
    T, H, K = k.shape[1], k.shape[2], k.shape[3]
    HV = v.shape[2]
    dev = k.device
    lay = _p.chunk_layout(cu_seqlens, T, chunk_size, dev)
    hmap = _p._head_map(H, HV, dev)
    up = (lambda x: None if x is None else x.to(F64))
    qc, kc, vc, Gc, bc, Ac = _p._gather_all(up(q), up(k), up(v), up(g_cumsum), up(beta), up(A), lay, F64)
    tril = _p._tril(lay.BT, dev)
    Kh = kc[:, hmap]
    mT = lambda x: x.transpose(-1, -2)  # noqa: E731
    GL = Gc[..., -1:]
    eL = GL.exp()
    R = torch.exp(GL - Gc)
    Gam = _p._gamma(Gc, tril)
    Ag = Ac * Gam * bc[..., None, :]
    E = mT(Kh) @ (R[..., None] * (Ag @ vc))
    X = Ac @ (bc[..., None] * Kh)
    eye = torch.eye(K, dtype=F64, device=dev)
    M = eL[..., None] * (eye - mT(Kh) @ X)
    F = None
    if do is not None:
        scale = K ** -0.5 if scale is None else float(scale)
        Qh = qc[:, hmap]
        P = torch.where(tril, Qh @ mT(Kh), torch.zeros((), dtype=F64, device=dev))
        F = scale * (mT(Qh - P @ X) @ (Gc.exp()[..., None] * _p._gather(do, lay, F64)))
    return ChunkSummaries(E=E, M=M, F=F, decay=GL[..., 0])


def _to_kv(x, state_v_first):
    return None if x is None else (x.transpose(-1, -2) if state_v_first else x)


def _from_kv(x, state_v_first):
    return x.transpose(-1, -2).contiguous() if state_v_first else x


def _compose_fwd(cs: ChunkSummaries, chunks: range, include: Optional[Tensor] = None):
    """Compose chunk maps in order: returns (E_window, M_window) with S_end = M_window S_start + E_window.
    `include [len(chunks), HV]` (bool) restricts the window per head (chunks not included are skipped)."""
    NT, HV, K, V = cs.E.shape
    E = torch.zeros(HV, K, V, dtype=F64, device=cs.E.device)
    M = torch.eye(K, dtype=F64, device=cs.E.device).expand(HV, K, K).clone()
    for i, c in enumerate(chunks):
        E1, M1 = cs.M[c] @ E + cs.E[c], cs.M[c] @ M
        if include is None:
            E, M = E1, M1
        else:
            m = include[i][:, None, None]
            E, M = torch.where(m, E1, E), torch.where(m, M1, M)
    return E, M


def _compose_bwd(cs: ChunkSummaries, chunks: range, include: Optional[Tensor] = None):
    """Compose chunk gradient maps walking `chunks` in reverse: returns F_window (dS_start from a zero end
    gradient); the window's transition is the same M as in `_compose_fwd`."""
    NT, HV, K, V = cs.E.shape
    Fw = torch.zeros(HV, K, V, dtype=F64, device=cs.E.device)
    for i in reversed(range(len(chunks))):
        c = chunks[i]
        F1 = cs.M[c].transpose(-1, -2) @ Fw + cs.F[c]
        Fw = F1 if include is None else torch.where(include[i][:, None, None], F1, Fw)
    return Fw


def _prange(parts: Partitions, p: int) -> range:
    return range(parts.chunk_start[p], parts.chunk_start[p] + parts.nchunks[p])


# ------------------------------------------------------------------------------------------------ exact

def partition_summaries(k, v, g_cumsum, beta, A, parts: Partitions, *, state_v_first=False):
    """``(E [P,HV,K,V] (layout per state_v_first), M [P,HV,K,K])``: each partition from a zero start."""
    cs = chunk_summaries(None, k, v, g_cumsum, beta, A, None, parts.cu_tensor(k.device),
                         chunk_size=parts.chunk_size)
    HV, K, V = cs.E.shape[1:]
    Es, Ms = [], []
    for p in range(parts.P):
        E, M = _compose_fwd(cs, _prange(parts, p))
        Es.append(E)
        Ms.append(M)
    E = torch.stack(Es) if Es else torch.zeros(0, HV, K, V, dtype=F64)
    M = torch.stack(Ms) if Ms else torch.zeros(0, HV, K, K, dtype=F64)
    return _from_kv(E, state_v_first), M


def _h0_kv(initial_state, N, HV, K, V, state_v_first, device):
    if initial_state is None:
        return torch.zeros(N, HV, K, V, dtype=F64, device=device)
    return _to_kv(initial_state.to(F64), state_v_first)


def scan_states(E, M, parts: Partitions, initial_state, *, state_v_first=False):
    """Exact scan ``S_{p+1} = M_p S_p + E_p``. Returns ``(h0 [P,HV,..], final [N,HV,..])``."""
    E = _to_kv(E.to(F64), state_v_first)
    P, HV, K, V = E.shape
    S0 = _h0_kv(initial_state, parts.N, HV, K, V, state_v_first, E.device)
    h0, final = [None] * P, [None] * parts.N
    S = None
    for p in range(P):
        if parts.first[p]:
            S = S0[parts.seq[p]]
        h0[p] = S
        S = M[p] @ S + E[p]
        if parts.last[p]:
            final[parts.seq[p]] = S
    return _from_kv(torch.stack(h0), state_v_first), _from_kv(torch.stack(final), state_v_first)


def grad_summaries(q, k, v, g_cumsum, beta, A, do, parts: Partitions, *, scale=None, state_v_first=False):
    """``(F [P,HV,..], M [P,HV,K,K])``: each partition's start gradient from a zero end gradient, and its
    transition (``dS_start = M^T dS_end + F``)."""
    cs = chunk_summaries(q, k, v, g_cumsum, beta, A, do, parts.cu_tensor(k.device), scale=scale,
                         chunk_size=parts.chunk_size)
    Fs, Ms = [], []
    for p in range(parts.P):
        r = _prange(parts, p)
        Fs.append(_compose_bwd(cs, r))
        Ms.append(_compose_fwd(cs, r)[1])
    return _from_kv(torch.stack(Fs), state_v_first), torch.stack(Ms)


def scan_grads(F, M, parts: Partitions, dht, *, state_v_first=False):
    """Exact reverse scan ``dS_end[p] = F_{p+1} + M_{p+1}^T dS_end[p+1]``, ``dS_end[last] = dht``.
    Returns ``(dht_parts [P,HV,..], dh0 [N,HV,..])``."""
    F = _to_kv(F.to(F64), state_v_first)
    P, HV, K, V = F.shape
    dT = _h0_kv(dht, parts.N, HV, K, V, state_v_first, F.device)
    out, dh0 = [None] * P, [None] * parts.N
    d = None
    for p in reversed(range(P)):
        if parts.last[p]:
            d = dT[parts.seq[p]]
        out[p] = d
        d = M[p].transpose(-1, -2) @ d + F[p]
        if parts.first[p]:
            dh0[parts.seq[p]] = d
    return _from_kv(torch.stack(out), state_v_first), _from_kv(torch.stack(dh0), state_v_first)


# ------------------------------------------------------------------------------------------------ warm-up

@dataclasses.dataclass(frozen=True)
class WarmupPlan:
    """Per (partition, head): ``n [P,HV]`` warm-up chunks, ``fallback [P,HV]`` (no window reached the
    threshold: exact through M), ``log_decay [P,HV]`` the window's summed log decay (the truncation bound is
    ``exp(log_decay) * ||state (or gradient) entering the window||_F``, docs/algorithm.md §4.3);
    ``direction`` is "fwd" (suffix windows) or "bwd" (prefix windows)."""
    n: Tensor
    fallback: Tensor
    log_decay: Tensor
    direction: str
    threshold: float


def warmup_chunks(g_cumsum, parts: Partitions, *, threshold=-10.0, direction="fwd") -> WarmupPlan:
    """Shortest suffix ("fwd") / prefix ("bwd") of each partition whose summed chunk log decay is
    ``<= threshold``. Partitions that end ("fwd") / start ("bwd") their sequence need none (n = 0)."""
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction: {direction!r}, expected 'fwd' or 'bwd'")
    lay = _p.chunk_layout(parts.cu_tensor(g_cumsum.device), g_cumsum.shape[1], parts.chunk_size, g_cumsum.device)
    decay = _p._gather_gate(g_cumsum, lay, F64)[..., -1]            # [NT, HV] chunk G_last
    HV = g_cumsum.shape[-1]
    n = torch.zeros(parts.P, HV, dtype=torch.long)
    fb = torch.zeros(parts.P, HV, dtype=torch.bool)
    ld = torch.zeros(parts.P, HV, dtype=F64)
    for p in range(parts.P):
        if (parts.last if direction == "fwd" else parts.first)[p]:
            continue
        r = list(_prange(parts, p))
        order = reversed(r) if direction == "fwd" else r
        run = torch.zeros(HV, dtype=F64)
        done = torch.zeros(HV, dtype=torch.bool)
        for c in order:
            run = torch.where(done, run, run + decay[c].cpu())
            n[p] += (~done).long()
            done |= run <= threshold
        ld[p] = run
        fb[p] = ~done
    return WarmupPlan(n=n, fallback=fb, log_decay=ld, direction=direction, threshold=float(threshold))


def warmup_states(k, v, g_cumsum, beta, A, initial_state, parts: Partitions, plan: WarmupPlan, *,
                  state_v_first=False):
    """Start states from warm-up windows: ``S_{p+1} = W_p + (fallback_p ? M_p S_p : 0)``, ``W_p`` the last
    ``plan.n[p]`` chunks of p run from zero. Returns ``(h0 [P,HV,..], final [N,HV,..])``."""
    if plan.direction != "fwd":
        raise ValueError("warmup_states: needs a 'fwd' plan")
    cs = chunk_summaries(None, k, v, g_cumsum, beta, A, None, parts.cu_tensor(k.device),
                         chunk_size=parts.chunk_size)
    HV, K, V = cs.E.shape[1:]
    S0 = _h0_kv(initial_state, parts.N, HV, K, V, state_v_first, k.device)
    h0, final = [None] * parts.P, [None] * parts.N
    S = None
    for p in range(parts.P):
        if parts.first[p]:
            S = S0[parts.seq[p]]
        h0[p] = S
        r = _prange(parts, p)
        if parts.last[p]:
            E, M = _compose_fwd(cs, r)
            final[parts.seq[p]] = M @ S + E
            continue
        L = len(r)
        idx = torch.arange(L)[:, None]
        include = idx >= (L - plan.n[p])[None, :]                    # [L, HV]: the last n[p, h] chunks
        W, M = _compose_fwd(cs, r, include.to(k.device))
        S = W + torch.where(plan.fallback[p].to(k.device)[:, None, None], M @ S, torch.zeros_like(S))
    return _from_kv(torch.stack(h0), state_v_first), _from_kv(torch.stack(final), state_v_first)


def warmup_grads(q, k, v, g_cumsum, beta, A, do, dht, parts: Partitions, plan: WarmupPlan, *, scale=None,
                 state_v_first=False):
    """End gradients from the next partition's first ``plan.n`` chunks walked in reverse from zero:
    ``dS_end[p] = Fw_{p+1} + (fallback_{p+1} ? M_{p+1}^T dS_end[p+1] : 0)``.
    Returns ``(dht_parts [P,HV,..], dh0 [N,HV,..])`` (dh0 exact given the first partition's end gradient)."""
    if plan.direction != "bwd":
        raise ValueError("warmup_grads: needs a 'bwd' plan")
    cs = chunk_summaries(q, k, v, g_cumsum, beta, A, do, parts.cu_tensor(k.device), scale=scale,
                         chunk_size=parts.chunk_size)
    HV, K, V = cs.E.shape[1:]
    dT = _h0_kv(dht, parts.N, HV, K, V, state_v_first, k.device)
    out, dh0 = [None] * parts.P, [None] * parts.N
    d = None
    for p in reversed(range(parts.P)):
        if parts.last[p]:
            d = dT[parts.seq[p]]
        out[p] = d
        r = _prange(parts, p)
        if parts.first[p]:
            dh0[parts.seq[p]] = _compose_fwd(cs, r)[1].transpose(-1, -2) @ d + _compose_bwd(cs, r)
            continue
        include = (torch.arange(len(r))[:, None] < plan.n[p][None, :]).to(k.device)  # the first n[p, h] chunks
        Fw = _compose_bwd(cs, r, include)
        M = _compose_fwd(cs, r)[1]
        d = Fw + torch.where(plan.fallback[p].to(k.device)[:, None, None], M.transpose(-1, -2) @ d,
                             torch.zeros_like(d))
    return _from_kv(torch.stack(out), state_v_first), _from_kv(torch.stack(dh0), state_v_first)


# ------------------------------------------------------------------------------------------------ drivers

def _start_states(k, v, g_cumsum, beta, A, initial_state, parts, *, state_v_first, mode, threshold):
    if mode == "exact":
        E, M = partition_summaries(k, v, g_cumsum, beta, A, parts, state_v_first=state_v_first)
        return scan_states(E, M, parts, initial_state, state_v_first=state_v_first)[0]
    if mode == "warmup":
        plan = warmup_chunks(g_cumsum, parts, threshold=threshold, direction="fwd")
        return warmup_states(k, v, g_cumsum, beta, A, initial_state, parts, plan, state_v_first=state_v_first)[0]
    raise ValueError(f"mode: {mode!r}, expected 'exact' or 'warmup'")


def cp_fwd(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, *, scale=None, state_v_first=False,
           chunk_size=64, partition_chunks=4, mode="exact", threshold=-10.0):
    """Forward through partitions (run as independent sequences) with start states from the exact scan or
    the warm-up. Returns ``(o [1,T,HV,V], final_state [N,HV,..])`` in float64."""
    parts = partition(cu_seqlens, partition_chunks, chunk_size=chunk_size)
    h0p = _start_states(k, v, g_cumsum, beta, A, initial_state, parts, state_v_first=state_v_first, mode=mode,
                        threshold=threshold)
    o, htp = _ref.chunk_fwd(q, k, v, g_cumsum, beta, A, h0p, parts.cu_tensor(q.device), scale=scale,
                            state_v_first=state_v_first, chunk_size=chunk_size)
    return o, htp[parts.last_of()]


def cp_bwd(q, k, v, g_cumsum, beta, A, initial_state, do, dht, cu_seqlens, *, scale=None, state_v_first=False,
           chunk_size=64, partition_chunks=4, mode="exact", threshold=-10.0):
    """Backward through partitions: start states as in `cp_fwd`, partition end gradients by the exact
    ``M^T`` scan or the reverse warm-up, then ``chunk_bwd`` on all partitions at once.
    Returns what ``chunk_bwd`` returns for the unpartitioned input: ``(dq, dk, dv, dbeta, dG, dh0)``."""
    parts = partition(cu_seqlens, partition_chunks, chunk_size=chunk_size)
    h0p = _start_states(k, v, g_cumsum, beta, A, initial_state, parts, state_v_first=state_v_first, mode=mode,
                        threshold=threshold)
    cu_p = parts.cu_tensor(q.device)
    h = _ref.state_recompute(k, v, g_cumsum, beta, A, h0p, cu_p, state_v_first=state_v_first,
                             chunk_size=chunk_size)
    if mode == "exact":
        F, M = grad_summaries(q, k, v, g_cumsum, beta, A, do, parts, scale=scale, state_v_first=state_v_first)
        dhtp, _ = scan_grads(F, M, parts, dht, state_v_first=state_v_first)
    else:
        plan = warmup_chunks(g_cumsum, parts, threshold=threshold, direction="bwd")
        dhtp, _ = warmup_grads(q, k, v, g_cumsum, beta, A, do, dht, parts, plan, scale=scale,
                               state_v_first=state_v_first)
    dq, dk, dv, db, dG, dh0p = _ref.chunk_bwd(q, k, v, g_cumsum, beta, A, h, do, dhtp, cu_p, scale=scale,
                                             state_v_first=state_v_first, chunk_size=chunk_size)
    return dq, dk, dv, db, dG, dh0p[parts.first_of()]
