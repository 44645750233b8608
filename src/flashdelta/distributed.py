"""Context parallelism across the ranks of a process group: exact in fp32, forward and backward
(docs/dev/cp_dist.md; the math is docs/algorithm.md §4.6-4.7).

The global token stream (global ``cu_seqlens``) is cut into contiguous rank slices: rank r holds tokens
``offsets[r]:offsets[r + 1]``. A rank's **pieces** are the intersections of the global sequences with its slice, run
as the sequences of a rank-local varlen batch: the first piece may continue a sequence from the previous rank
(``pre > 0``: that many ranks before hold its earlier tokens), the last may continue on the next (``post > 0``), and
a rank whose slice lies inside one sequence (a **pass-through**) has one piece doing both.

Forward, per layer call: every rank computes, on its own tokens and in fp32, the end state E_r of its last piece
(from that piece's h0 where the sequence starts here, from zero on a pass-through) and, on a pass-through only,
its transition M_r (``S -> M_r S + E_r`` maps the state entering the slice to the one leaving it); one
`all_gather` of one packed buffer ``[HV, K, (K +) V]`` per rank gives every rank all pairs; rank r composes the
pairs of its ``pre`` predecessors (``S = E_{r-pre}``, then ``S = M_j S + E_j``) into its first piece's exact start
state; then the local forward runs from the start states. The backward mirrors it: each rank's first piece's
start gradient F_r (from a zero end gradient on a pass-through, from the sequence's dht otherwise), one
`all_gather` of ``[M_r | F_r]``, the reverse composition ``d = F_{r+post}``, ``d = M_j^T d + F_j`` gives the end
gradient of the last piece, then the local backward. No collective runs where no rank boundary lies inside a
sequence.

Inside a rank, long pieces are cut into partitions of L chunks as `flashdelta.cp` does (the intra-GPU CP: the
pieces' (M, E) and start gradients come from its summary passes and scans, so the cross-rank pass adds only the
small compositions), decided by `context_parallel` as in `chunk_gated_delta_rule`. Without a split the summaries
run only on the pieces that cross a boundary (E on the last piece, M on a pass-through, F on the first piece).

Importing this module needs neither an initialised process group nor a GPU; `torch.distributed` is used at call
time only.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Optional

import torch
from torch import Tensor

from . import api, cp
from .autograd import _flat, _param, _plan
from .dispatch import UnsupportedError
from .numerics import accum_dtype

__all__ = ["CPSlice", "build_cp_slice", "chunk_gated_delta_rule_cp", "from_fla_context", "rank_slices"]

BT = cp.BT


# ------------------------------------------------------------------------------------------------ slices

@dataclasses.dataclass(frozen=True, eq=False)
class CPSlice:
    """One rank's slice of a sequence set split across a process group (host information only).

    Fields: ``group`` (the process group; None: the default one), ``rank``, ``world``, ``cu`` (the rank-local
    piece boundaries, ``0 .. T_local``), ``pre`` / ``post`` (ranks before / after this one that hold tokens of
    the first / last piece's sequence; 0: it starts / ends here), ``seq_ids`` (each piece's global sequence index,
    or None where unknown, as from FLA's context), ``with_m`` (the packed buffers carry M: some rank of the group is a
    pass-through; every rank must agree), ``exchange`` (some rank boundary lies inside a sequence: the collectives
    run; every rank must agree).
    """
    group: object
    rank: int
    world: int
    cu: tuple
    pre: int
    post: int
    seq_ids: Optional[tuple]
    with_m: bool
    exchange: bool

    @property
    def T(self) -> int:
        """Tokens on this rank."""
        return self.cu[-1]

    @property
    def n_pieces(self) -> int:
        return len(self.cu) - 1

    @property
    def through(self) -> bool:
        """One piece that continues from the previous rank and on the next one."""
        return self.n_pieces == 1 and self.pre > 0 and self.post > 0

    @property
    def starts(self) -> tuple:
        """Local indices of the pieces whose sequence starts on this rank (the rows of ``initial_state``)."""
        return tuple(range(1 if self.pre else 0, self.n_pieces))

    @property
    def ends(self) -> tuple:
        """Local indices of the pieces whose sequence ends on this rank (the rows of the final state)."""
        return tuple(range(self.n_pieces - (1 if self.post else 0)))

    @property
    def start_ids(self) -> Optional[tuple]:
        """Global indices of the sequences starting on this rank (None where unknown)."""
        return None if self.seq_ids is None else tuple(self.seq_ids[i] for i in self.starts)

    @property
    def end_ids(self) -> Optional[tuple]:
        """Global indices of the sequences ending on this rank (None where unknown)."""
        return None if self.seq_ids is None else tuple(self.seq_ids[i] for i in self.ends)


def _host_ints(name: str, x) -> list:
    if isinstance(x, Tensor):
        if x.dim() != 1 or x.is_floating_point():
            raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {x.dtype} {tuple(x.shape)}")
        x = x.tolist()
    try:
        out = [int(v) for v in x]
    except TypeError:
        raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {type(x).__name__}") from None
    if any(b < a for a, b in zip(out, out[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {out}")
    return out


def rank_slices(cu_seqlens, world: int, offsets=None, group=None) -> list:
    """Every rank's `CPSlice` of the global `cu_seqlens` (host list or tensor, ``[N + 1]``, 0 first) split at
    `offsets` (``world + 1`` ints from 0 to ``cu_seqlens[-1]``, strictly increasing: rank r holds tokens
    ``offsets[r]:offsets[r + 1]``; None: an even split, FLA's convention, which needs ``cu_seqlens[-1] % world ==
    0``). An empty sequence belongs to the rank holding the token at its position (the last rank at the end)."""
    cu = _host_ints("cu_seqlens", cu_seqlens)
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"cu_seqlens must have N + 1 >= 2 entries starting at 0, got {cu}")
    total = cu[-1]
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world: a positive number of ranks, got {world!r}")
    if offsets is None:
        if total % world:
            raise ValueError(f"an even split needs cu_seqlens[-1]={total} divisible by world={world}; pass offsets")
        offsets = [r * (total // world) for r in range(world + 1)]
    offsets = _host_ints("offsets", offsets)
    if len(offsets) != world + 1 or offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(f"offsets must be world + 1 = {world + 1} ints from 0 to cu_seqlens[-1]={total}, got "
                         f"{offsets}")
    if any(b <= a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"offsets must be strictly increasing (every rank holds at least one token), got {offsets}")

    def owner(t: int) -> int:                      # the rank holding token t
        return min(bisect.bisect_right(offsets, t) - 1, world - 1)

    raw = []
    for r in range(world):
        t0, t1 = offsets[r], offsets[r + 1]
        lo = bisect.bisect_right(cu, t0) - 1       # the sequence holding token t0 (skipping empty ones before it)
        while lo > 0 and cu[lo] == t0 and cu[lo - 1] == t0:
            lo -= 1                                # empty sequences at t0 belong to this rank
        pieces, ids = [0], []
        for n in range(lo, len(cu) - 1):
            s, e = cu[n], cu[n + 1]
            if s >= t1 and not (s == e == t1 == total):
                break
            if e <= t0 and not (s == e == t0):
                continue
            ids.append(n)
            pieces.append(min(e, t1) - t0)
        s0, eN = cu[ids[0]], cu[ids[-1] + 1]
        pre = r - owner(s0) if s0 < t0 else 0
        post = owner(eN - 1) - r if eN > t1 else 0
        raw.append((r, tuple(pieces), pre, post, tuple(ids)))
    exchange = any(p[3] > 0 for p in raw)
    with_m = any(len(p[1]) == 2 and p[2] > 0 and p[3] > 0 for p in raw)
    return [CPSlice(group=group, rank=r, world=world, cu=pieces, pre=pre, post=post, seq_ids=ids, with_m=with_m,
                    exchange=exchange) for r, pieces, pre, post, ids in raw]


def build_cp_slice(cu_seqlens, *, group=None, offsets=None, rank: Optional[int] = None,
                   world: Optional[int] = None) -> CPSlice:
    """This rank's `CPSlice` (`rank_slices`), rank and world from `group` (None: the default process group) unless
    given. Build it once per batch and pass it to every layer call."""
    if rank is None or world is None:
        import torch.distributed as dist  # noqa: PLC0415 - only where a process group is used

        world = dist.get_world_size(group) if world is None else world
        rank = dist.get_rank(group) if rank is None else rank
    if not 0 <= rank < world:
        raise ValueError(f"rank: {rank} is not in [0, world={world})")
    return rank_slices(cu_seqlens, world, offsets, group)[rank]


def from_fla_context(ctx) -> CPSlice:
    """The `CPSlice` of FLA's context-parallel context (``fla.ops.cp.FLACPContext``: ``group``, rank-local
    ``cu_seqlens`` / ``cu_seqlens_cpu``, ``is_first_rank``, ``pre_num_ranks``, ``is_last_rank``,
    ``post_num_ranks``). Its metadata describes this rank only, so the buffers always carry M and the collectives
    always run (every rank must agree on both); global sequence indices are unknown."""
    import torch.distributed as dist  # noqa: PLC0415 - only where a process group is used

    for field in ("group", "cu_seqlens", "is_first_rank", "pre_num_ranks", "is_last_rank", "post_num_ranks"):
        if not hasattr(ctx, field):
            raise TypeError(f"cp_context: expected FLA's FLACPContext (a {field!r} field), got {type(ctx).__name__}")
    host = getattr(ctx, "cu_seqlens_cpu", None)
    cu = _host_ints("cp_context.cu_seqlens", host if host is not None else ctx.cu_seqlens.cpu())
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"cp_context.cu_seqlens must start at 0 with >= 2 entries, got {cu}")
    pre = 0 if ctx.is_first_rank else int(ctx.pre_num_ranks or 0)
    post = 0 if ctx.is_last_rank else int(ctx.post_num_ranks or 0)
    world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
    return CPSlice(group=ctx.group, rank=rank, world=world, cu=tuple(cu), pre=pre, post=post, seq_ids=None,
                   with_m=True, exchange=world > 1)


# ------------------------------------------------------------------------------------------------ exchange

def _all_gather(buf: Tensor, sl: CPSlice) -> Tensor:
    """``[world, *buf.shape]``: every rank's `buf`, by one collective."""
    import torch.distributed as dist  # noqa: PLC0415 - only where a process group is used

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # the newer name first
    out = buf.new_empty(sl.world * buf.numel())
    gather(out, buf.contiguous().view(-1), group=sl.group)
    return out.view(sl.world, *buf.shape)


def _pack(M: Optional[Tensor], X: Tensor, sl: CPSlice) -> Tensor:
    """``[HV, K, K + V]`` (``[M | X]``) where the group's buffers carry M, else ``[HV, K, V]``; a missing M is
    zeros (no rank reads it)."""
    if not sl.with_m:
        return X
    if M is None:
        M = X.new_zeros(*X.shape[:-1], X.shape[-2])
    return torch.cat([M, X], -1)


def _unpack(G: Tensor, K: int, sl: CPSlice) -> tuple:
    return (G[..., :K], G[..., K:]) if sl.with_m else (None, G)


def _chain_fwd(G: Tensor, K: int, sl: CPSlice) -> Tensor:
    """The start state of this rank's first piece: ``S = E_{r-pre}``, then ``S = M_j S + E_j`` over the
    pass-throughs between (fp32 / float64, as gathered)."""
    Ms, Es = _unpack(G, K, sl)
    r = sl.rank
    S = Es[r - sl.pre]
    for j in range(r - sl.pre + 1, r):
        S = torch.baddbmm(Es[j], Ms[j], S)
    return S


def _chain_bwd(G: Tensor, K: int, sl: CPSlice) -> Tensor:
    """The end gradient of this rank's last piece: ``d = F_{r+post}``, then ``d = M_j^T d + F_j`` backwards over
    the pass-throughs between."""
    Ms, Fs = _unpack(G, K, sl)
    r = sl.rank
    d = Fs[r + sl.post]
    for j in range(r + sl.post - 1, r, -1):
        d = torch.baddbmm(Fs[j], Ms[j].transpose(-1, -2), d)
    return d


# ------------------------------------------------------------------------------------------------ local passes

def _whole(T: int) -> int:
    """A partition length (chunks) that leaves every piece whole."""
    return T // BT + 1


def _eye(HV: int, K: int, dtype, device) -> Tensor:
    return torch.eye(K, dtype=dtype, device=device).expand(1, HV, K, K).contiguous()


def _piece(x: Tensor, a: int, b: int) -> Tensor:
    return x[:, a:b]


def _prepare(plan, q, k, g, beta, cu, l2norm: bool):
    qf, kf = _flat(q), _flat(k)
    rq = rk = None
    if l2norm:
        fn = plan.fn("l2norm_fwd")
        (qf, rq), (kf, rk) = fn(qf), fn(kf)
    gf, bf = _flat(g).to(accum_dtype(q.dtype)), _flat(beta)
    g_cumsum, A = plan.fn("prepare_fwd")(kf, gf, _param(bf, plan.kset("prepare_fwd")), cu)
    return qf, kf, bf, g_cumsum, A, rq, rk


def _m_pass(launch, qf, kf, g_cumsum, b, A, a: int, e: int, sd, scale: float) -> Tensor:
    """``[HV, K, K]``: the transition of the tokens ``a:e`` (one piece), by `chunk_fwd` on zero values from I."""
    HV, K = g_cumsum.shape[2], kf.shape[-1]
    cu = torch.tensor([0, e - a], dtype=torch.int32, device=kf.device)
    _, M = launch(_piece(qf, a, e), _piece(kf, a, e), kf.new_zeros(1, e - a, HV, K), _piece(g_cumsum, a, e),
                  _piece(b, a, e), _piece(A, a, e), _eye(HV, K, sd, kf.device), cu, scale=scale, state_v_first=False)
    return M[0]


def _code(request, ks, q: Tensor, sl: CPSlice, HV: int, K: int, V: int) -> tuple:
    """(forward L, backward L) of the intra-rank split (0: pieces whole), by `cp.decide` on the local pieces."""
    lengths = [b - a for a, b in zip(sl.cu, sl.cu[1:])]
    code = cp.decide(request, kset=ks, device=q.device, dtype=q.dtype, B=1, T=sl.T, HV=HV, K=K, V=V, varlen=True,
                     N=sl.n_pieces, lengths=lengths)
    return cp.decode(code)


def _forward(q, k, v, g, beta, h0s, sl: CPSlice, scale: float, l2norm: bool, L: int, need_bwd: bool):
    """(o [1, T, HV, V], final [n_ends, HV, K, V], start states of the pieces [n, HV, K, V], M_r or None)."""
    T, HV, V, K = q.shape[1], v.shape[2], v.shape[3], q.shape[3]
    plan = _plan(q, v, need_bwd)
    cu = torch.tensor(sl.cu, dtype=torch.int32, device=q.device)
    qf, kf, bf, g_cumsum, A, _, _ = _prepare(plan, q, k, g, beta, cu, l2norm)
    vf = _flat(v)
    ks = plan.kset("chunk_fwd")
    launch = ks.chunk_fwd
    b = _param(bf, ks)
    sd = ks.param_dtype(accum_dtype(q.dtype))
    h0 = torch.zeros(sl.n_pieces, HV, K, V, dtype=sd, device=q.device)
    if h0s is not None:
        h0[list(sl.starts)] = h0s.to(sd)
    parts = cp.make_plan(cu, T, L or _whole(T))
    split = parts.J > 1
    M_r = E_r = None
    if split:
        Mp, Ep = cp.summaries(qf, kf, vf, g_cumsum, b, A, parts, scale=scale, chunk_fwd=launch)
        scan = "kernel" if cp._kernel_scan(Ep, ks) else None
        H = cp.scan_states(Mp, Ep, parts, h0, scan)
        last = parts.last_index[-1]
        if sl.post:
            E_r = torch.baddbmm(Ep[last], Mp[last], H[last])
        if sl.through:                             # the product of the piece's partition maps
            Pm = cp.scan_states(Mp, torch.zeros_like(Mp), parts, _eye(HV, K, sd, q.device), None)
            M_r = torch.bmm(Mp[last], Pm[last])
    else:
        if sl.post:
            a = sl.cu[-2]
            one = torch.tensor([0, T - a], dtype=torch.int32, device=q.device)
            _, E = launch(_piece(qf, a, T), _piece(kf, a, T), _piece(vf, a, T), _piece(g_cumsum, a, T),
                          _piece(b, a, T), _piece(A, a, T), h0[-1:], one, scale=scale, state_v_first=False)
            E_r = E[0]
        if sl.through:
            M_r = _m_pass(launch, qf, kf, g_cumsum, b, A, 0, T, sd, scale)
    if sl.exchange:
        G = _all_gather(_pack(M_r, E_r if E_r is not None else h0.new_zeros(HV, K, V), sl), sl)
        if sl.pre:
            h0[0] = _chain_fwd(G, K, sl)
            if split:
                H = cp.scan_states(Mp, Ep, parts, h0, scan)
    if split:
        o, ht = launch(qf, kf, vf, g_cumsum, b, A, H, parts.cu, scale=scale, state_v_first=False)
        ht = ht.index_select(0, parts.last_index)
    else:
        o, ht = launch(qf, kf, vf, g_cumsum, b, A, h0, cu, scale=scale, state_v_first=False)
    final = ht[list(sl.ends)].to(sd)
    return o.reshape(v.shape).to(q.dtype), final, h0, M_r


def _backward(q, k, v, g, beta, h0, M_r, do, dfinal, sl: CPSlice, scale: float, l2norm: bool, L: int):
    """(dq, dk, dv, dg, dbeta, dh0 of every piece [n, HV, K, V]) given the start states `h0` of the pieces."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    plan = _plan(q, v, True)
    cu = torch.tensor(sl.cu, dtype=torch.int32, device=q.device)
    qf, kf, bf, g_cumsum, A, rq, rk = _prepare(plan, q, k, g, beta, cu, l2norm)
    vf, dof = _flat(v), _flat(do)
    fks, bks, dks = plan.kset("chunk_fwd"), plan.kset("chunk_bwd"), plan.kset("chunk_dstate")
    sd = h0.dtype
    dht = torch.zeros_like(h0)
    if dfinal is not None:
        dht[list(sl.ends)] = dfinal.to(sd)
    parts = cp.make_plan(cu, T, L or _whole(T))
    split = parts.J > 1
    F_r = None
    if split:
        fb = _param(bf, fks)
        Mp, Ep = cp.summaries(qf, kf, vf, g_cumsum, fb, A, parts, scale=scale, chunk_fwd=fks.chunk_fwd)
        scan = "kernel" if cp._kernel_scan(Ep, fks) else None
        Hs = cp.scan_states(Mp, Ep, parts, h0, scan)
        Fp = cp._start_grads(dks.chunk_dstate, qf, kf, g_cumsum, _param(bf, dks), A, dof, parts,
                             scale=scale).to(sd)
        D = cp.scan_grads(Mp, Fp, parts, dht, scan)
        if sl.pre:                                 # the first piece's first partition is slot 0
            F_r = torch.baddbmm(Fp[0], Mp[0].transpose(-1, -2), D[0])
    elif sl.pre:
        e = sl.cu[1]
        one = torch.tensor([0, e], dtype=torch.int32, device=q.device)
        F_r = dks.chunk_dstate(_piece(qf, 0, e), _piece(kf, 0, e), _piece(g_cumsum, 0, e),
                               _piece(_param(bf, dks), 0, e), _piece(A, 0, e), _piece(dof, 0, e), one,
                               scale=scale)[0].to(sd)
        if not sl.through and dfinal is not None:  # the sequence ends here: its dht enters through M^T
            M0 = _m_pass(fks.chunk_fwd, qf, kf, g_cumsum, _param(bf, fks), A, 0, e, sd, scale)
            F_r = torch.baddbmm(F_r, M0.transpose(-1, -2), dht[0])
    if sl.exchange:
        G = _all_gather(_pack(M_r, F_r if F_r is not None else h0.new_zeros(HV, K, V), sl), sl)
        if sl.post:
            dht[-1] = _chain_bwd(G, K, sl)
            if split:
                D = cp.scan_grads(Mp, Fp, parts, dht, scan)
    b = _param(bf, bks)
    if split:
        h = bks.state_recompute(kf, vf, g_cumsum, b, A, _param(Hs, bks), parts.cu, state_v_first=False)
        dq, dk, dv, dbeta, dG, dh0p = bks.chunk_bwd(qf, kf, vf, g_cumsum, b, A, h, dof, D, parts.cu, scale=scale,
                                                    state_v_first=False)
        first = torch.cat([parts.last_index[:1] * 0, parts.last_index[:-1] + 1])
        dh0 = dh0p.index_select(0, first)
    else:
        h = bks.state_recompute(kf, vf, g_cumsum, b, A, _param(h0, bks), cu, state_v_first=False)
        dq, dk, dv, dbeta, dG, dh0 = bks.chunk_bwd(qf, kf, vf, g_cumsum, b, A, h, dof, dht, cu, scale=scale,
                                                   state_v_first=False)
    del h, A, g_cumsum  # chunk_bwd's inputs go before the group sums allocate (the backward's peak memory)
    # dq, dk per key head in q's dtype, with the l2norm's backward fused in (as autograd's backward)
    group_sum = plan.fn("group_sum")
    l2q, l2k = (dict(y=qf, rstd=rq), dict(y=kf, rstd=rk)) if l2norm else ({}, {})
    dq = group_sum(dq, H, out_dtype=q.dtype, **l2q)
    dk = group_sum(dk, H, out_dtype=k.dtype, **l2k)
    dg = plan.fn("prepare_bwd")(dG, cu)
    return (dq.reshape(q.shape).to(q.dtype), dk.reshape(k.shape).to(k.dtype), dv.reshape(v.shape).to(v.dtype),
            dg.reshape(g.shape).to(g.dtype), dbeta.reshape(beta.shape).to(beta.dtype), dh0)


class _CPFunction(torch.autograd.Function):
    """The cross-rank operator: (o, final states of the sequences ending here) from this rank's inputs and the
    initial states of the sequences starting here (K-first)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0s, sl, scale, l2norm, Ls, need_bwd):
        ctx.set_materialize_grads(False)
        o, final, h0, M_r = _forward(q, k, v, g, beta, h0s, sl, scale, l2norm, Ls[0], need_bwd)
        ctx.save_for_backward(q, k, v, g, beta, h0, M_r)
        ctx.opts = (sl, scale, l2norm, Ls[1], h0s is not None, None if h0s is None else h0s.dtype)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, h0, M_r = ctx.saved_tensors
        sl, scale, l2norm, L, has_h0, h0_dtype = ctx.opts
        if do is None:                             # every rank runs the backward's collective
            do = torch.zeros(v.shape, dtype=q.dtype, device=q.device)
        dq, dk, dv, dg, dbeta, dh0 = _backward(q, k, v, g, beta, h0, M_r, do, dfinal, sl, scale, l2norm, L)
        dh0s = dh0[list(sl.starts)].to(h0_dtype) if has_h0 else None
        return dq, dk, dv, dg, dbeta, dh0s, None, None, None, None, None


def chunk_gated_delta_rule_cp(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    cp_slice: Optional[CPSlice] = None,
    cp_context=None,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    state_v_first: bool = False,
    context_parallel=None,
) -> tuple:
    """Gated DeltaNet over a sequence set split across the ranks of a process group, exact in fp32: this rank's
    part of `flashdelta.chunk_gated_delta_rule` on the whole set (docs/dev/cp_dist.md).

    Every rank of the group calls it with its own tokens, for every layer (the forward and the backward each run
    one collective where a rank boundary lies inside a sequence); every rank must run the backward of its output.

    Args:
        q, k: ``[1, T_local, H, K]``; v ``[1, T_local, HV, V]``; g, beta ``[1, T_local, HV]``: this rank's contiguous
            slice of the global token stream (as `chunk_gated_delta_rule`'s varlen input).
        cp_slice: this rank's `CPSlice` (`build_cp_slice` of the global cu_seqlens and the rank offsets; built once
            per batch).
        cp_context: instead of `cp_slice`, FLA's ``FLACPContext`` (`from_fla_context`).
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[n_starts, HV, K, V]`` (``[.., V, K]`` with ``state_v_first``): the initial states of the
            sequences that start on this rank, in order (``cp_slice.start_ids`` are their global indices). None:
            zeros.
        output_final_state: return the final states ``[n_ends, HV, K, V]`` fp32 of the sequences that end on this
            rank, in order (``cp_slice.end_ids``); each sequence's final state lives on the rank holding its last
            token, as its initial state lives on the one holding its first.
        use_qk_l2norm_in_kernel, state_v_first: as in `chunk_gated_delta_rule`.
        context_parallel: the intra-rank split of long pieces into partitions (`chunk_gated_delta_rule`'s argument:
            None / False / True / chunks).

    Returns:
        ``(o [1, T_local, HV, V] in q's dtype, final_state or None)``, differentiable w.r.t. q, k, v, g, beta and
        initial_state.
    """
    if (cp_slice is None) == (cp_context is None):
        raise ValueError("pass exactly one of cp_slice (build_cp_slice) and cp_context (FLA's FLACPContext)")
    sl = from_fla_context(cp_context) if cp_context is not None else cp_slice
    if not isinstance(sl, CPSlice):
        raise TypeError(f"cp_slice must be a CPSlice (build_cp_slice), got {type(sl).__name__}")
    request = cp.parse_request(context_parallel)
    q, k, v, g, beta, B, T, H, K, HV, V = api._check_qkv_g_beta(q, k, v, g, beta)
    api._check_devices(q, k, v, g, beta, initial_state)
    if B != 1 or T != sl.T:
        raise ValueError(f"q must be [1, T_local={sl.T}, H, K] (this rank's tokens), got {tuple(q.shape)}")
    scale = api._check_scale(scale, K)
    output_final_state = api._flag("output_final_state", output_final_state)
    l2norm = api._flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    state_v_first = api._flag("state_v_first", state_v_first)
    api._check_state("initial_state", initial_state, len(sl.starts), HV, K, V, state_v_first)
    need_bwd = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state))
    plan = _plan(q, v, need_bwd)
    ks = plan.kset("chunk_fwd")
    if (sl.through or sl.pre) and not cp.supported(ks, K, V, q.dtype):
        raise UnsupportedError(f"chunk_gated_delta_rule_cp: backend {ks.name!r} lacks chunk_fwd at value width K={K} "
                               f"(the transition pass) for (K={K}, V={V}, {q.dtype})")
    Ls = _code(request, ks, q, sl, HV, K, V)
    h0 = initial_state
    if h0 is not None and state_v_first:
        h0 = h0.transpose(-1, -2)
    o, final = _CPFunction.apply(q, k, v, g, beta, h0, sl, scale, l2norm, Ls, need_bwd)
    if not output_final_state:
        return o, None
    return o, (final.transpose(-1, -2) if state_v_first else final)
