"""Token-by-token Gated DeltaNet forward (Hopper, TileLang): the kernel of `fused_recurrent_gated_delta_rule` for
decode (T = 1 per sequence), multi-token verification (small T) and any other T.

Decode is memory-bound: each call reads the fp32 state once and writes it once, and everything else (q, k, v and the
gates of one token) is a few hundred bytes per head. The kernel therefore keeps the state in registers for the whole
call and does nothing that costs bandwidth besides those two passes.

One CTA per (sequence, value head, V slice), one warp. With one lane per value column (the default) the slice is
`BV` = 32 columns and thread j owns state column ``S[:, v0 + j]`` (all K rows, K fp32 registers); with four
(`lanes_for`: grids of at most one warp per SM, where each warp's serial chain is the step's time) the slice is
8 columns, each lane holds K / 4 rows of its column, and two shuffles add the column's partial dot products. The
warp loops over the sequence's tokens. Per token (fp32; q, k, v, the gates and beta converted on load)::

    d    = exp(g + gk[k] + gv[v])                     (each term optional; d = 1 without any)
    k^, q^ = rk k, rq q,  rk = rsqrt(|k|^2 + 1e-6)    (use_qk_l2norm_in_kernel; else rk = rq = 1)
    Sd   = d S
    u    = beta (v - Sd^T k^)                         (beta 1, per head or per value channel)
    S    = Sd + k^ u^T
    o    = scale Sd^T q^ + scale (k^ . q^) u         (= scale S^T q^, with no third pass over S)

The warp loads the token's q and k once (K / 32 elements per lane), reduces ``|k|^2``, ``|q|^2`` and ``k . q`` by
shuffles, and stores k^, scale q^ (and ``exp(gk)``) to shared memory, which every thread then reads as broadcasts.
Each thread makes two passes over its state registers: ``Sd`` with ``Sd^T k^`` and ``Sd^T q^``, then the rank-1
update (with the K split the shared vectors hold the four K parts 4 floats apart, so that the parts' broadcasts
fall in different banks). A CTA barrier (one warp: cheap) sits before each shared-memory write and read phase, and
one before the second pass, so that ptxas reads k^ from shared memory again instead of keeping K more registers live
from the first pass (that spilled). With ``use_gate_in_kernel`` g is the raw gate and ``g = -exp(A_log) softplus(g + dt_bias)`` (softplus(x)
= x above 20, as torch and `flashdelta.gates.gdn_gate`); with a beta activation, beta is ``sigmoid`` or ``2 sigmoid``
of the logits.

State tiles load and store coalesced: in the ``[N, HV, K, V]`` layout a warp reads one 128-byte row segment per K
row; in the ``[N, HV, V, K]`` layout (state_v_first) each thread moves its own row in 16-byte vectors.

CTA x index = (sequence, value head, V slice) flattened, sequence slowest, so any number of sequences fits one grid
dimension. Dense input ``[B, T, ..]`` runs B sequences of T tokens. Varlen input (B = 1) reads cu_seqlens on the
device (clamped to ``[0, T]``, so malformed values cannot make the kernel read or write out of bounds), and the extra
sequence index N zero-fills o on the padding tail ``[cu_seqlens[N], T)``. Token and sequence offsets are int64, so
tensors past 2^31 elements work. The float64 twin is `flashdelta.reference.recurrent`; the portable path is the
PyTorch loop in `flashdelta.recurrent`.
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
from typing import Optional

import tilelang.language as T
import torch

from ..stages import aligned
from . import _tl

F32 = "float32"
THREADS = 32            # one warp per CTA
BV = THREADS            # value columns per CTA with one lane per column (V is split into V / BV CTAs)
LANES = (1, 4)          # lanes per value column (the K split): 4 where the grid is short of warps (`lanes_for`)
ILP = 4                 # partial sums of each pass-1 dot product (dependency chains of K / ILP FMAs, not K)
KPAD = 4                # fp32 padding between the K parts of the shared k^/q^ vectors (no bank conflicts)
# Key dims the kernel supports: the state column is K fp32 registers per thread (128 at K = 128, no spills).
SUPPORTED_K = (64, 128)
MAX_V = 1024            # V is split into V / BV CTAs: any multiple of BV up to this
DTYPES = (torch.bfloat16, torch.float16, torch.float32)     # q/k, v, the gates, beta, A_log, dt_bias, h0
L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0
BETA_ACTS = (0, 1, 2)   # beta as given, sigmoid(beta), 2 * sigmoid(beta)


def _bytes(dtype: str) -> int:
    return 4 if dtype == F32 else 2


@_tl.jit()
def build(H: int, HV: int, K: int, V: int, dtype: str, v_dtype: str, g_dtype: Optional[str],
          gk_dtype: Optional[str], gv_dtype: Optional[str], beta_dtype: Optional[str], beta_per_v: bool,
          h0_dtype: Optional[str], store_state: bool, state_v_first: bool, varlen: bool, scale: float,
          qk_l2norm: bool, a_log_dtype: Optional[str], dt_bias_dtype: Optional[str], beta_act: int,
          lanes: int = 1):
    """The kernel for one compile-time configuration; B, T (tokens) and N (sequences, varlen) are dynamic. A dtype of
    None drops that input (no g, gk, gv, beta, initial state, in-kernel gate, dt_bias); store_state: write ht.
    lanes: lanes per value column (`LANES`): each of a column's lanes holds K / lanes of its rows, the warp covers
    32 / lanes columns, and shuffles add the column's partial dot products."""
    # problem config
    assert HV % H == 0 and K in SUPPORTED_K and V % BV == 0 and V <= MAX_V and beta_act in BETA_ACTS
    assert a_log_dtype is None or g_dtype is not None, "the in-kernel gate transforms g"
    assert dt_bias_dtype is None or a_log_dtype is not None
    assert lanes in LANES
    G = HV // H
    CW = THREADS // lanes                                     # value columns per CTA
    NV = V // CW
    B_ = T.dynamic("B")
    T_ = T.dynamic("T")
    N_ = T.dynamic("N")
    NS = N_ if varlen else B_                                 # sequences (state rows)
    rows = N_ + 1 if varlen else B_                           # grid rows: + the padding tail with varlen
    state_shape = (NS, HV, V, K) if state_v_first else (NS, HV, K, V)
    beta_shape = (B_, T_, HV, V) if beta_per_v else (B_, T_, HV)
    # tiling config
    KL = K // THREADS                                         # q/k elements per lane
    KP = K // lanes                                           # state rows per lane: rows [kp KP, (kp + 1) KP)
    KSTR = KP + (KPAD if lanes > 1 else 0)                    # shared vectors: part kp at [kp KSTR, kp KSTR + KP)
    SHUFFLES = [CW << i for i in range(lanes.bit_length() - 1)]   # lane distances of the column's butterfly
    VH = 16 // _bytes(h0_dtype) if h0_dtype is not None else 4
    VH = min(VH, KP)

    def opt(shape, dt):
        return T.Tensor(shape, dt) if dt is not None else None

    @T.macro
    def load_state(n64, i_hv, col, r0, h0, s, hc):
        # ---- state rows in: S[r0 : r0 + KP, col] (fp32) ----
        if h0_dtype is not None:
            if state_v_first:
                for c in T.unroll(KP // VH):
                    for j in T.vectorized(VH):
                        hc[j] = h0[n64, i_hv, col, r0 + c * VH + j]
                    for j in T.unroll(VH):
                        s[c * VH + j] = T.cast(hc[j], F32)
            else:
                for kk in T.unroll(KP):
                    s[kk] = T.cast(h0[n64, i_hv, r0 + kk, col], F32)
        else:
            for kk in T.unroll(KP):
                s[kk] = 0.0

    @T.macro
    def sequence(b64, n64, bos, ln, i_hv, i_h, col, r0, kp, q, k, v, g, gk, gv, beta, A_log, dt_bias, o, ht,
                 tx, s, kc, qc, k_s, q_s, e_s, acc, sc):
        # lane tx's q/k elements [tx KL, (tx + 1) KL) lie in one K part; their place in the shared vectors
        ws = tx * KL if lanes == 1 else (tx * KL) // KP * KSTR + (tx * KL) % KP
        for i in T.serial(ln):
            t64 = T.cast(bos + i, "int64")
            # ---- per-token scalars: the log decay of this column, beta, v ----
            sc[0] = 0.0
            if g_dtype is not None:
                if a_log_dtype is not None:
                    sc[1] = T.cast(g[b64, t64, i_hv], F32)
                    if dt_bias_dtype is not None:
                        sc[1] = sc[1] + T.cast(dt_bias[i_hv], F32)
                    sc[1] = T.if_then_else(sc[1] > SOFTPLUS_THRESHOLD, sc[1], T.log1p(T.exp(sc[1])))
                    sc[0] = -T.exp(T.cast(A_log[i_hv], F32)) * sc[1]
                else:
                    sc[0] = T.cast(g[b64, t64, i_hv], F32)
            if gv_dtype is not None:
                sc[0] = sc[0] + T.cast(gv[b64, t64, i_hv, col], F32)
            sc[0] = T.exp(sc[0])
            if beta_dtype is not None:
                if beta_per_v:
                    sc[1] = T.cast(beta[b64, t64, i_hv, col], F32)
                else:
                    sc[1] = T.cast(beta[b64, t64, i_hv], F32)
                if beta_act != 0:
                    sc[1] = float(beta_act) / (1.0 + T.exp(-sc[1]))
            else:
                sc[1] = 1.0
            sc[2] = T.cast(v[b64, t64, i_hv, col], F32)
            # ---- the token's q and k, shared: lane j loads elements [j KL, (j + 1) KL), the warp reduces ----
            for j in T.vectorized(KL):
                kc[j] = k[b64, t64, i_h, tx * KL + j]
            for j in T.vectorized(KL):
                qc[j] = q[b64, t64, i_h, tx * KL + j]
            for j in T.unroll(3):
                acc[j] = 0.0
            for j in T.unroll(KL):
                acc[0] = acc[0] + T.cast(kc[j], F32) * T.cast(qc[j], F32)
                if qk_l2norm:
                    acc[1] = acc[1] + T.cast(kc[j], F32) * T.cast(kc[j], F32)
                    acc[2] = acc[2] + T.cast(qc[j], F32) * T.cast(qc[j], F32)
            if qk_l2norm:
                acc[1] = T.rsqrt(T.warp_reduce_sum(acc[1]) + L2NORM_EPS)        # rk
                acc[2] = T.rsqrt(T.warp_reduce_sum(acc[2]) + L2NORM_EPS)        # rq
            else:
                acc[1] = 1.0
                acc[2] = 1.0
            acc[0] = T.warp_reduce_sum(acc[0]) * acc[1] * acc[2]              # k . q, normalised
            T.sync_threads()                          # the previous token's reads of k_s, q_s, e_s are done
            for j in T.unroll(KL):
                k_s[ws + j] = T.cast(kc[j], F32) * acc[1]
                q_s[ws + j] = T.cast(qc[j], F32) * (acc[2] * scale)
                if gk_dtype is not None:
                    e_s[ws + j] = T.exp(T.cast(gk[b64, t64, i_hv, tx * KL + j], F32))
            T.sync_threads()
            # ---- pass 1: Sd = d S; Sd^T k, Sd^T q (in ILP partial sums: short dependency chains) ----
            for j in T.unroll(2 * ILP):
                acc[5 + j] = 0.0                                                # Sd^T k parts, then Sd^T q parts
            for kk in T.unroll(KP):
                if gk_dtype is not None:
                    s[kk] = s[kk] * (sc[0] * e_s[kp * KSTR + kk])
                else:
                    s[kk] = s[kk] * sc[0]
                acc[5 + kk % ILP] = acc[5 + kk % ILP] + s[kk] * k_s[kp * KSTR + kk]
                acc[5 + ILP + kk % ILP] = acc[5 + ILP + kk % ILP] + s[kk] * q_s[kp * KSTR + kk]
            acc[3] = (acc[5] + acc[6]) + (acc[7] + acc[8])
            acc[4] = (acc[9] + acc[10]) + (acc[11] + acc[12])
            # the column's K parts: a butterfly over the lanes CW, 2 CW, .. apart (every lane of the column gets the
            # same sums, bit for bit: each step adds the same two values in either order)
            for off in SHUFFLES:
                acc[3] = acc[3] + T.shfl_xor(acc[3], off)
                acc[4] = acc[4] + T.shfl_xor(acc[4], off)
            sc[3] = sc[1] * (sc[2] - acc[3])                                  # u
            if lanes == 1:
                o[b64, t64, i_hv, col] = T.cast(acc[4] + scale * acc[0] * sc[3], v_dtype)
            elif kp == 0:
                o[b64, t64, i_hv, col] = T.cast(acc[4] + scale * acc[0] * sc[3], v_dtype)
            # ---- pass 2: S = Sd + k u^T ----
            # (the barrier makes ptxas read k_s again rather than keep K more registers live from pass 1: spills)
            T.sync_threads()
            for kk in T.unroll(KP):
                s[kk] = s[kk] + k_s[kp * KSTR + kk] * sc[3]
        # ---- state rows out ----
        if store_state:
            if state_v_first:
                for c in T.unroll(KP // 4):
                    for j in T.vectorized(4):
                        ht[n64, i_hv, col, r0 + c * 4 + j] = s[c * 4 + j]
            else:
                for kk in T.unroll(KP):
                    ht[n64, i_hv, r0 + kk, col] = s[kk]

    @T.prim_func
    def decode_kernel(
        q: T.Tensor((B_, T_, H, K), dtype),
        k: T.Tensor((B_, T_, H, K), dtype),
        v: T.Tensor((B_, T_, HV, V), v_dtype),
        g: opt((B_, T_, HV), g_dtype),
        gk: opt((B_, T_, HV, K), gk_dtype),
        gv: opt((B_, T_, HV, V), gv_dtype),
        beta: opt(beta_shape, beta_dtype),
        h0: opt(state_shape, h0_dtype),
        A_log: opt((HV,), a_log_dtype),
        dt_bias: opt((HV,), dt_bias_dtype),
        cu_seqlens: T.Tensor((N_ + 1,), "int32") if varlen else None,
        o: T.Tensor((B_, T_, HV, V), v_dtype),
        ht: T.Tensor(state_shape, F32) if store_state else None,
    ):
        with T.Kernel(rows * (HV * NV), threads=THREADS) as bx:
            i_n = bx // (HV * NV)
            i_hv = (bx // NV) % HV
            i_h = i_hv // G
            tx = T.get_thread_binding()
            kp = tx // CW if lanes > 1 else 0     # the lane's K part
            col = (bx % NV) * CW + (tx % CW if lanes > 1 else tx)
            r0 = kp * KP
            s = T.alloc_local((KP,), F32)         # the state rows S[r0 : r0 + KP, col]
            kc = T.alloc_local((KL,), dtype)
            qc = T.alloc_local((KL,), dtype)
            k_s = T.alloc_shared((lanes * KSTR,), F32)   # the token's k (normalised), q (normalised, scaled), exp(gk)
            q_s = T.alloc_shared((lanes * KSTR,), F32)
            e_s = T.alloc_shared((lanes * KSTR,), F32) if gk_dtype is not None else None
            hc = T.alloc_local((VH,), h0_dtype if h0_dtype is not None else F32)
            acc = T.alloc_local((5 + 2 * ILP,), F32)
            sc = T.alloc_local((4,), F32)
            n64 = T.cast(i_n, "int64")
            if varlen:
                if i_n == N_:
                    # padding tail [cu_seqlens[N], T): o = 0 for this (head, V slice)
                    tb = T.min(T.max(cu_seqlens[N_], 0), T_)
                    for i in T.serial(T.if_then_else(kp == 0, T_ - tb, 0)):    # one lane per column writes
                        o[0, T.cast(tb + i, "int64"), i_hv, col] = T.cast(0, v_dtype)
                else:
                    # the state's loads go out before cu_seqlens is read: they do not depend on it, and issued
                    # after it they would wait for its round trip (in-order issue stalls at bos's first use)
                    load_state(n64, i_hv, col, r0, h0, s, hc)
                    bos = T.min(T.max(cu_seqlens[i_n], 0), T_)
                    eos = T.min(T.max(cu_seqlens[i_n + 1], bos), T_)
                    sequence(T.cast(0, "int64"), n64, bos, eos - bos, i_hv, i_h, col, r0, kp, q, k, v, g, gk, gv,
                             beta, A_log, dt_bias, o, ht, tx, s, kc, qc, k_s, q_s, e_s, acc, sc)
            else:
                load_state(n64, i_hv, col, r0, h0, s, hc)
                sequence(n64, n64, 0, T_, i_hv, i_h, col, r0, kp, q, k, v, g, gk, gv, beta, A_log, dt_bias, o, ht,
                         tx, s, kc, qc, k_s, q_s, e_s, acc, sc)

    return decode_kernel


def _tl_dtype(x) -> Optional[str]:
    """A builder dtype argument: the TileLang name of a tensor's (or torch dtype's) dtype; None for None."""
    if x is None:
        return None
    return _tl.TL_DTYPE[x.dtype if isinstance(x, torch.Tensor) else x]


def unsupported(K: int, V: int, dtype: torch.dtype, v_dtype: torch.dtype) -> Optional[str]:
    """Why the kernel cannot run these head dims and q/k, v dtypes (float64 is the reference precision: it runs on
    the portable path), or None if it can. Every other input dtype the launcher converts (float64 to fp32)."""
    if K not in SUPPORTED_K or V % BV or V > MAX_V:
        return (f"head dims (K={K}, V={V}) are not supported by the SM90 decode kernel (K in {list(SUPPORTED_K)}, "
                f"V a multiple of {BV} up to {MAX_V})")
    for name, dt in (("q/k", dtype), ("v", v_dtype)):
        if dt not in DTYPES:
            return f"{name} dtype {dt} is not supported by the SM90 decode kernel (supported: {list(DTYPES)})"
    return None


def builder_args(H: int, HV: int, K: int, V: int, dtype: torch.dtype, v_dtype: torch.dtype, *,
                 g_dtype: Optional[torch.dtype], gk_dtype: Optional[torch.dtype] = None,
                 gv_dtype: Optional[torch.dtype] = None, beta_dtype: Optional[torch.dtype],
                 beta_per_v: bool = False, h0_dtype: Optional[torch.dtype], output_final_state: bool = True,
                 state_v_first: bool = False, varlen: bool, scale: float, qk_l2norm: bool,
                 a_log_dtype: Optional[torch.dtype] = None, dt_bias_dtype: Optional[torch.dtype] = None,
                 beta_act: int = 0, lanes: int = 1) -> tuple:
    """The `build` arguments (its compile-cache key) for one call: dtypes of the inputs it gets (None: absent; the
    launcher's float64 ones go in as fp32), beta per value channel or not, the final state written or not, the state
    layout, varlen or dense, the output scale, the q/k normalisation, the in-kernel gate (A_log's and dt_bias' dtypes),
    the beta activation (`BETA_ACTS`) and the lanes per value column (`lanes_for`)."""
    return (H, HV, K, V, _tl_dtype(dtype), _tl_dtype(v_dtype), _tl_dtype(g_dtype), _tl_dtype(gk_dtype),
            _tl_dtype(gv_dtype), _tl_dtype(beta_dtype), bool(beta_per_v), _tl_dtype(h0_dtype),
            bool(output_final_state), bool(state_v_first), bool(varlen), float(scale), bool(qk_l2norm),
            _tl_dtype(a_log_dtype), _tl_dtype(dt_bias_dtype), int(beta_act), int(lanes))


def lanes_for(N: int, HV: int, V: int, num_sms: int) -> int:
    """Lanes per value column for N sequences: 4 where one lane per column gives at most one warp per SM (a short
    grid: each warp's serial chain of K-row loads and FMAs is the step's time, and four lanes split it), else 1 (a
    full grid is bound by DRAM, where more, narrower warps cost more than they win). docs/dev/decode.md has the
    measurements."""
    return LANES[-1] if N * HV * (V // BV) <= num_sms else 1


def launcher_builds(H: int, HV: int, K: int, V: int, dtype: torch.dtype, *, beta_dtype: torch.dtype,
                    scale: float, g_dtype: Optional[torch.dtype] = torch.float32,
                    h0_dtype: torch.dtype = torch.float32, qk_l2norm: bool = True, gate: Optional[tuple] = None,
                    beta_act: int = 0, initial_state=(True,), state_v_first=(False,), varlen=(False, True),
                    output_final_state=(True,), lanes=LANES) -> list:
    """(label, builder, args) of the decode kernel for one head config (q, k, v in `dtype`), per combination of the
    option tuples (lanes: per value column, both by default since the launcher picks by batch size): the builds a
    model's decode steps launch, for `flashdelta.warmup`. gate: ``(A_log dtype, dt_bias
    dtype or None)`` for ``use_gate_in_kernel`` (g is then the raw gate in g_dtype), None without it."""
    a_log_dtype, dt_bias_dtype = gate if gate is not None else (None, None)
    out = []
    for has_h0 in initial_state:
        for vfirst in state_v_first:
            for vl in varlen:
                for store in output_final_state:
                    for ln in lanes:
                        label = (f"decode H={H} HV={HV} K={K} V={V} h0={has_h0} v_first={vfirst} varlen={vl} "
                                 f"final={store} lanes={ln}")
                        args = builder_args(H, HV, K, V, dtype, dtype, g_dtype=g_dtype, beta_dtype=beta_dtype,
                                            h0_dtype=h0_dtype if has_h0 else None, output_final_state=store,
                                            state_v_first=vfirst, varlen=vl, scale=scale, qk_l2norm=qk_l2norm,
                                            a_log_dtype=a_log_dtype, dt_bias_dtype=dt_bias_dtype,
                                            beta_act=beta_act, lanes=ln)
                        out.append((label, build, args))
    return out


def _input(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """An input as the kernel takes it: contiguous and 16-byte aligned (`stages.aligned`: its vector loads); a dtype
    outside `DTYPES` (float64) as fp32, the precision the kernel computes in."""
    if x is None:
        return None
    return aligned(x if x.dtype in DTYPES else x.float())


def fused_recurrent_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                        gk: Optional[torch.Tensor], gv: Optional[torch.Tensor], beta: Optional[torch.Tensor],
                        initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], *, scale: float,
                        output_final_state: bool, use_qk_l2norm: bool, A_log: Optional[torch.Tensor] = None,
                        dt_bias: Optional[torch.Tensor] = None, beta_act: int = 0,
                        state_v_first: bool = False) -> tuple:
    """The token-by-token forward in one launch (arguments validated by `flashdelta.fused_recurrent_gated_delta_rule`).

    Args:
        q, k: ``[B, T, H, K]`` bf16/fp16/fp32; v: ``[B, T, HV, V]`` bf16/fp16/fp32 (its own dtype); `unsupported`
            says which head dims.
        g: ``[B, T, HV]`` log decay (with A_log: the raw gate) or None; gk ``[B, T, HV, K]``, gv ``[B, T, HV, V]``
            per-channel log decays or None; beta ``[B, T, HV]`` or ``[B, T, HV, V]`` or None (ones), logits with
            beta_act 1 (sigmoid) or 2 (2 sigmoid).
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with state_v_first) or None (zeros).
        cu_seqlens: ``[N + 1]`` int32/int64 with B = 1, or None (dense: N = B). Read on the device only.
        A_log, dt_bias: ``[HV]``, the in-kernel gate ``g = -exp(A_log) softplus(g + dt_bias)`` (A_log None: off).

    Returns:
        o ``[B, T, HV, V]`` in v's dtype (0 on the padding tail past ``cu_seqlens[-1]``), and the final state fp32
        in the input layout (None without output_final_state). No host synchronisation.
    """
    B, T_, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    assert unsupported(K, V, q.dtype, v.dtype) is None and k.dtype == q.dtype and HV % H == 0
    assert beta_act in BETA_ACTS and (dt_bias is None or A_log is not None)
    varlen = cu_seqlens is not None
    N = cu_seqlens.shape[0] - 1 if varlen else B
    dev = q.device
    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    o = _tl.alloc((B, T_, HV, V), v.dtype, dev)
    ht = _tl.alloc(state_shape, torch.float32, dev) if output_final_state else None
    if B * T_ == 0:             # no tokens: every sequence is empty
        if ht is not None:
            if initial_state is None:
                ht.zero_()
            else:
                ht.copy_(initial_state)
        return o, ht
    g, gk, gv, beta, h0, A_log, dt_bias = map(_input, (g, gk, gv, beta, initial_state, A_log, dt_bias))
    args = builder_args(H, HV, K, V, q.dtype, v.dtype, g_dtype=_opt_dtype(g), gk_dtype=_opt_dtype(gk),
                        gv_dtype=_opt_dtype(gv), beta_dtype=_opt_dtype(beta),
                        beta_per_v=beta is not None and beta.dim() == 4, h0_dtype=_opt_dtype(h0),
                        output_final_state=output_final_state, state_v_first=state_v_first, varlen=varlen,
                        scale=scale, qk_l2norm=use_qk_l2norm, a_log_dtype=_opt_dtype(A_log),
                        dt_bias_dtype=_opt_dtype(dt_bias), beta_act=beta_act,
                        lanes=lanes_for(N, HV, V, _tl.num_sms(dev if dev.type == "cuda" else None)))
    cu = _tl.cu_seqlens_int32(cu_seqlens) if varlen else None
    tensors = [_input(q), _input(k), _input(v), g, gk, gv, beta, h0, A_log, dt_bias, cu, o, ht]
    build(*args)(*[x for x in tensors if x is not None])
    return o, ht


def _opt_dtype(x: Optional[torch.Tensor]) -> Optional[torch.dtype]:
    return None if x is None else x.dtype
