"""Stage `chunk_bwd` (Hopper, TileLang): the reverse chunk walk producing dq, dk, dv, dbeta, dG and dh0.

The math is docs/algorithm.md §3; the per-chunk terms are the portable `_bwd_step`'s, in the same order and with
the same GEMM operand roundings (bf16/fp16 operands, fp32 accumulation), so the portable path at the kernel's
precision is this kernel's error baseline.

One CTA (two warpgroups) walks every chunk of one (sequence, value head), last chunk first, with all of V in the
CTA: every K-side product of a chunk (Q K^T, K K^T, the inverse's A^T dA A^T) is formed once. The state gradient
dS is held transposed, ``dS^T [V, K]`` fp32 in registers, for the whole walk; the state entering each chunk comes
from `state_recompute` as ``S0^T [V, K]`` (``h [slots, HV, V, K]`` in q's dtype, one row per chunk slot, see
below). Per chunk c
(C = BT = 64, ``G`` the chunk-local gate cumsum, rows past the sequence end zeroed in q, k, v, dO and A and given
``G[len - 1]`` and beta = 0, so they are inert):

    U = K S0, W = V - D U, Ag = A o Gamma o beta_j, Vd = Ag W, Pg = scale Gamma o Q K^T
    dVd = R o (K dS1) + Pg^T dO;  dv = Ag^T dVd;  dU = -D dv
    dAb = Gamma o (dVd W^T);  dL = -strictly_lower(A^T (dAb o beta_j) A^T)
    dP = scale Gamma o (dO Vd^T)
    dq = scale D dO S0^T + dP K
    dk = R o (Vd dS1^T) + dU S0^T + dP^T Q + (dAt + dAt^T) K,   dAt = diag(beta) dL
    dbeta = colsum(dAb o A) + rowsum(dL o K K^T)
    dG = rowsum(dU o U) + rowsum(Q o scale D dO S0^T) - rowsum(K o R o (Vd dS1^T)) + rowsum(Mx) - colsum(Mx),
         Mx = Pg o (dO Vd^T) + dAb o A o beta_j;  row len-1 also gets the R-term's total and e_L <dS1, S0>
    dS0 = e_L dS1 + K^T dU + scale Q^T D dO

Loads: q, k and dO arrive by TMA at the start of the chunk. Chunk c - 1's v and A (TMA) are issued as soon as
chunk c has consumed its tiles (after A^T dA A^T), its S0^T (TMA) after the last GEMM that reads S0^T, and its
gates (plain loads into registers at chunk c's start, stored into a second buffer under its dq GEMMs), so they
arrive under the rest of chunk c. Rows
past the end are zeroed in shared memory after the wait. GEMMs run on both warpgroups (each takes half the output
columns); independent ones are issued together (`T.wgmma_gemm`) and waited for once, and the dbeta / dG row work
runs under the dS0 GEMMs. The states are in q's dtype (the values the forward's GEMMs read), so the e_L <dS1, S0>
term of dG reads the rounded S0.

The gate path (Gamma, R, D, the dG and dbeta reductions) is fp32 throughout; row and column sums are fragment
reductions (no transpose through 16-bit shared memory). The dG row terms over V and K (dU o U, the R-term, the dq
term) accumulate in one fragment and are reduced once; the chunk total that the last row gets is a per-thread
partial sum, reduced by warp shuffles. dq and dk are written per value head in fp32 (the GVA group sum follows),
dv in v's dtype, dbeta and dG in fp32, dh0 in fp32 in the state layout.

Chunk slots: chunk c of sequence n (tokens [bos, eos)) is slot ``bos // BT + n + c`` (the numbering prepare uses,
below ``T // BT + N + 1``), so h needs no host-side chunk offsets. CTA x index = (sequence, value head), sequence
slowest; the extra sequence index N zero-fills every gradient on the padding tail [cu_seqlens[N], T). Token
offsets are int64, so tensors past 2^31 elements work.
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
import tilelang.language as T
import torch

from . import _tl, timeline

BT = 64
THREADS = 256
# (K, V) pairs this kernel supports: dS^T [V, K] fp32 is V * K / THREADS registers per thread (64 at 128 x 128).
HEAD_DIMS = ((128, 128), (64, 64))
DTYPES = (torch.bfloat16, torch.float16)   # q, k, v, A, do, dv
LOG2E = 1.4426950408889634

TABLE = timeline.Table(
    "chunk_bwd",
    roles={"c": ("CTA (thread 0)", 0)},
    events={
        "c.load": "q, k, dO (TMA at the chunk start), v, A, S0^T, gates (issued a chunk early) in shared",
        "c.fwd": "U, W, Ag, Vd, P, Pg",
        "c.dv": "dVd, dv stored, dAg, dU, dU o U row sums",
        "c.dk1": "R Vd dS1^T and its row sums",
        "c.inv": "dAb, dA, colsum(dAb o A), A^T dA A^T",
        "c.dp": "dP, Mx, its row and column sums",
        "c.dq": "dq stored (the previous chunk's gates and S0^T issued)",
        "c.dk": "K K^T, dk stored",
        "c.ds": "dS0^T GEMMs issued, dbeta and dG rows stored under them, dS0^T complete",
    },
    ctas=8, steps=32)


@T.macro
def fetch_gates(c, bos, eos, i_hv, tx, g, beta, gl):
    """Chunk c's G and beta of row tx (tx < BT) into the registers gl (rows past the end: G[len - 1] and beta = 0):
    the loads complete while the thread goes on, and the caller stores them where the next chunk reads them."""
    t0 = bos + c * BT
    if tx < BT:
        gl[0] = g[0, T.cast(T.min(t0 + tx, eos - 1), "int64"), i_hv]
        gl[1] = T.if_then_else(t0 + tx < eos, T.cast(beta[0, T.cast(t0 + tx, "int64"), i_hv], "float32"), 0.0)


@_tl.jit(table=TABLE)
def build(H: int, HV: int, K: int, V: int, dtype: str, beta_dtype: str, scale: float, has_dht: bool,
          state_v_first: bool):
    """The kernel for one compile-time configuration; T (tokens), N (sequences) and the slot count are dynamic."""
    # problem config
    G = HV // H
    acc = "float32"
    assert HV % H == 0 and (K, V) in HEAD_DIMS
    T_ = T.dynamic("T")
    N_ = T.dynamic("N")
    S_ = T.dynamic("S")
    state_shape = (N_, HV, V, K) if state_v_first else (N_, HV, K, V)
    # tiling config
    NVEC = 6            # per-row partial sums of dG (5) and dbeta (2) share one [NVEC + 1, BT] fp32 tile
    prelude = timeline.prelude(TABLE) or None      # the timer helpers while recording; else no prelude at all

    def gamma(g_s, i, j):
        # Gamma_ij = exp(G_i - G_j) for i >= j, exactly 0 above the diagonal (never exp of a positive number)
        return T.exp2(T.Select(i >= j, (g_s[i] - g_s[j]) * LOG2E, -T.infinity(acc)))

    @T.macro
    def colsum(x_f, x_s, part_s, vec_s, row, tx, tot):
        # column sums of a [BT, BT] fp32 fragment through fp32 shared memory (a fragment reduction over dim 0 has no
        # layout for the wgmma accumulator): each thread sums a quarter of one column, then one thread per column
        # adds the four quarters
        for i, j in T.Parallel(BT, BT):
            x_s[i, j] = x_f[i, j]
        tot[0] = 0.0
        for i in T.serial(BT // 4):
            tot[0] = tot[0] + x_s[(tx // BT) * (BT // 4) + i, tx % BT]
        part_s[tx // BT, tx % BT] = tot[0]
        if tx < BT:
            vec_s[row, tx] = part_s[0, tx] + part_s[1, tx] + part_s[2, tx] + part_s[3, tx]

    @T.macro
    def load_va(c, bos, i_hv, tx, v, A, v_s, a_s, bar_va):
        # one warp issues the TMA copies of chunk c's v and A tiles (all 64 rows; rows past the end are zeroed after
        # the wait) and arrives on bar_va
        t0 = bos + c * BT
        if tx < 32:
            T.tma_copy(v[0, t0:t0 + BT, i_hv, 0:V], v_s, barrier=bar_va[0])
            T.tma_copy(A[0, t0:t0 + BT, i_hv, 0:BT], a_s, barrier=bar_va[0])
            T.barrier_arrive(bar_va[0])

    @T.macro
    def load_h(slot, i_hv, tx, h, h_s, bar_h):
        # one warp issues the TMA copy of S0^T of the chunk at `slot` and arrives on bar_h
        if tx < 32:
            T.tma_copy(h[slot, i_hv, 0:V, 0:K], h_s, barrier=bar_h[0])
            T.barrier_arrive(bar_h[0])

    @T.macro
    def store_gates(tx, gl, gn_s, bn_s):
        if tx < BT:
            gn_s[tx] = gl[0]
            bn_s[tx] = gl[1]

    @T.prim_func
    def chunk_bwd_kernel(
        q: T.Tensor((1, T_, H, K), dtype),
        k: T.Tensor((1, T_, H, K), dtype),
        v: T.Tensor((1, T_, HV, V), dtype),
        g: T.Tensor((1, T_, HV), acc),
        beta: T.Tensor((1, T_, HV), beta_dtype),
        A: T.Tensor((1, T_, HV, BT), dtype),
        h: T.Tensor((S_, HV, V, K), dtype),
        do: T.Tensor((1, T_, HV, V), dtype),
        dht: T.Tensor(state_shape, acc),
        cu_seqlens: T.Tensor((N_ + 1,), "int32"),
        dq: T.Tensor((1, T_, HV, K), acc),
        dk: T.Tensor((1, T_, HV, K), acc),
        dv: T.Tensor((1, T_, HV, V), dtype),
        dbeta: T.Tensor((1, T_, HV), acc),
        dg: T.Tensor((1, T_, HV), acc),
        dh0: T.Tensor(state_shape, acc),
    ):
        with T.Kernel((N_ + 1) * HV, threads=THREADS, prelude=prelude) as bx:
            i_n = bx // HV
            i_hv = bx % HV
            i_h = i_hv // G
            tx = T.get_thread_binding()
            mark = timeline.marker(TABLE, bx, tx)

            # inputs of the chunk (rows past the end zeroed); W overwrites V in place, scale D Q overwrites Q last
            q_s = T.alloc_shared((BT, K), dtype)
            k_s = T.alloc_shared((BT, K), dtype)
            v_s = T.alloc_shared((BT, V), dtype)
            do_s = T.alloc_shared((BT, V), dtype)
            a_s = T.alloc_shared((BT, BT), dtype)
            h_s = T.alloc_shared((V, K), dtype)             # S0^T
            ds_s = T.alloc_shared((V, K), dtype)            # dS1^T
            vd_s = T.alloc_shared((BT, V), dtype)           # Vd
            dvd_s = T.alloc_shared((BT, V), dtype)          # dVd, then dU
            ag_s = T.alloc_shared((BT, BT), dtype)          # Ag
            pg_s = T.alloc_shared((BT, BT), dtype)          # Pg, then A^T dA, then dAt + dAt^T
            da_s = T.alloc_shared((BT, BT), dtype)          # dA = dAb o beta_j, then dP
            # fp32 staging of the column sums and of dAt = diag(beta) dL; rows padded by one word so that reading a
            # column (the transpose) is free of bank conflicts
            dat_s = T.alloc_shared((BT, BT + 1), acc)
            g_s = T.alloc_shared((BT,), acc)                # G (rows past the end: G[len - 1])
            b_s = T.alloc_shared((BT,), acc)                # beta (0 past the end)
            gn_s = T.alloc_shared((BT,), acc)               # G and beta of the next chunk in the walk
            bn_s = T.alloc_shared((BT,), acc)
            eg_s = T.alloc_shared((BT,), acc)               # exp(G)
            r_s = T.alloc_shared((BT,), acc)                # exp(G_last - G)
            vec_s = T.alloc_shared((NVEC + 1, BT), acc)     # per-row partial sums of dG and dbeta
            part_s = T.alloc_shared((THREADS // BT, BT), acc)   # column sums' quarter partials
            wsum_s = T.alloc_shared((THREADS // 32,), acc)  # per-warp parts of the chunk total
            bar_in = T.alloc_barrier([32])                  # q, k, dO of the chunk (TMA)
            bar_va = T.alloc_barrier([32])                  # v, A of the chunk (TMA, issued one chunk early)
            bar_h = T.alloc_barrier([32])                   # S0^T of the chunk (TMA, issued one chunk early)

            ds_f = T.alloc_fragment((V, K), acc)            # dS^T, carried across chunks
            u_f = T.alloc_fragment((BT, V), acc)
            vd_f = T.alloc_fragment((BT, V), acc)
            dvd_f = T.alloc_fragment((BT, V), acc)
            dv_f = T.alloc_fragment((BT, V), acc)
            dq_f = T.alloc_fragment((BT, K), acc)
            dk_f = T.alloc_fragment((BT, K), acc)
            p_f = T.alloc_fragment((BT, BT), acc)
            dag_f = T.alloc_fragment((BT, BT), acc)
            daba_f = T.alloc_fragment((BT, BT), acc)
            x_f = T.alloc_fragment((BT, BT), acc)
            dl_f = T.alloc_fragment((BT, BT), acc)
            mx_f = T.alloc_fragment((BT, BT), acc)
            kk_f = T.alloc_fragment((BT, BT), acc)
            x2_f = T.alloc_fragment((BT, BT), acc)
            rbt_f = T.alloc_fragment((BT, BT), acc)
            rs_f = T.alloc_fragment((BT, V), acc)           # dG row terms: dU o U - K o R-term + Q o (scale D dO S0^T)
            # one output fragment per reduction: its layout follows the reduced fragment's
            red_u = T.alloc_fragment((BT,), acc)
            red_mr = T.alloc_fragment((BT,), acc)
            red_l = T.alloc_fragment((BT,), acc)
            # in-place shared updates go through registers (read all, then write all: one barrier, not one per row)
            w_f = T.alloc_fragment((BT, V), dtype)
            qd_f = T.alloc_fragment((BT, K), dtype)
            tot = T.alloc_local((1,), acc)
            tsum = T.alloc_local((1,), acc)                 # this thread's part of the chunk total
            gl = T.alloc_local((2,), acc)                   # G and beta of one row of the next chunk, in flight

            if i_n == N_:
                # padding tail [cu_seqlens[N], T): every gradient of this value head is 0
                tb = cu_seqlens[N_]
                for it in T.serial(T.ceildiv(T_ - tb, THREADS)):
                    row = tb + it * THREADS + tx
                    if row < T_:
                        r64 = T.cast(row, "int64")
                        for j in T.serial(K):
                            dq[0, r64, i_hv, j] = 0.0
                            dk[0, r64, i_hv, j] = 0.0
                        for j in T.serial(V):
                            dv[0, r64, i_hv, j] = T.cast(0, dtype)
                        dbeta[0, r64, i_hv] = 0.0
                        dg[0, r64, i_hv] = 0.0
            else:
                bos = cu_seqlens[i_n]
                eos = cu_seqlens[i_n + 1]
                NT = T.ceildiv(eos - bos, BT)
                slot0 = bos // BT + i_n
                n64 = T.cast(i_n, "int64")
                if has_dht:
                    if state_v_first:
                        for i, j in T.Parallel(V, K):
                            ds_f[i, j] = dht[n64, i_hv, i, j]
                    else:
                        for i, j in T.Parallel(V, K):
                            ds_f[i, j] = dht[n64, i_hv, j, i]
                else:
                    T.clear(ds_f)

                if NT > 0:
                    # the last chunk's v, A, S0^T and gates; each later chunk's arrive while the chunk after it runs
                    load_va(NT - 1, bos, i_hv, tx, v, A, v_s, a_s, bar_va)
                    load_h(T.cast(slot0 + NT - 1, "int64"), i_hv, tx, h, h_s, bar_h)
                    fetch_gates(NT - 1, bos, eos, i_hv, tx, g, beta, gl)
                    store_gates(tx, gl, gn_s, bn_s)

                for cc in T.serial(NT):
                    c = NT - 1 - cc
                    t0 = bos + c * BT
                    ln = T.min(eos - t0, BT)
                    s64 = T.cast(slot0 + c, "int64")

                    # ---- loads: q, k, dO by TMA now; v, A, S0^T (TMA) and the gates were issued during the chunk
                    # after this one; rows >= ln are zeroed below (g: G[ln - 1], beta: 0) ----
                    T.sync_threads()
                    if tx < 32:
                        T.tma_copy(q[0, t0:t0 + BT, i_h, 0:K], q_s, barrier=bar_in[0])
                        T.tma_copy(k[0, t0:t0 + BT, i_h, 0:K], k_s, barrier=bar_in[0])
                        T.tma_copy(do[0, t0:t0 + BT, i_hv, 0:V], do_s, barrier=bar_in[0])
                        T.barrier_arrive(bar_in[0])
                    if c > 0:
                        fetch_gates(c - 1, bos, eos, i_hv, tx, g, beta, gl)              # stored under the dq GEMMs
                    for i in T.Parallel(BT):
                        g_s[i] = gn_s[i]
                        b_s[i] = bn_s[i]
                        eg_s[i] = T.exp2(gn_s[i] * LOG2E)
                        r_s[i] = T.exp2((gn_s[BT - 1] - gn_s[i]) * LOG2E)
                    # every thread reads exp(G_last) below (TileLang's own barrier here would cover only the writers)
                    T.sync_threads()
                    T.barrier_wait(bar_h[0], cc % 2)
                    tsum[0] = 0.0
                    for i, j in T.Parallel(V, K):
                        tsum[0] = tsum[0] + ds_f[i, j] * T.cast(h_s[i, j], acc)         # e_L <dS1, S0>, below
                    tsum[0] = tsum[0] * eg_s[BT - 1]
                    T.copy(ds_f, ds_s)                                                  # dS1 as a GEMM operand
                    T.barrier_wait(bar_in[0], cc % 2)
                    T.barrier_wait(bar_va[0], cc % 2)
                    if ln < BT:
                        for i, j in T.Parallel(BT, K):
                            if i >= ln:
                                q_s[i, j] = T.cast(0, dtype)
                                k_s[i, j] = T.cast(0, dtype)
                        for i, j in T.Parallel(BT, V):
                            if i >= ln:
                                v_s[i, j] = T.cast(0, dtype)
                                do_s[i, j] = T.cast(0, dtype)
                        for i, j in T.Parallel(BT, BT):
                            if i >= ln:
                                a_s[i, j] = T.cast(0, dtype)
                    mark(cc, "c.load")

                    # ---- forward pieces: U, P, and K dS1 issued together; then W, Ag, Pg; Vd, dVd ----
                    T.wgmma_gemm(k_s, h_s, u_f, transpose_B=True, clear_accum=True)    # U = K S0   [BT, K] @ [K, V]
                    T.wgmma_gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True)    # P = Q K^T  [BT, K] @ [K, BT]
                    T.wgmma_gemm(k_s, ds_s, dvd_f, transpose_B=True, clear_accum=True)  # K dS1     [BT, K] @ [K, V]
                    T.wait_wgmma(0)
                    for i, j in T.Parallel(BT, V):
                        w_f[i, j] = T.cast(T.cast(v_s[i, j], acc) - eg_s[i] * u_f[i, j], dtype)   # W = V - D U
                        dvd_f[i, j] = dvd_f[i, j] * r_s[i]
                    for i, j in T.Parallel(BT, BT):
                        gam = gamma(g_s, i, j)
                        ag_s[i, j] = T.cast(T.cast(a_s[i, j], acc) * gam * b_s[j], dtype)
                        pg_s[i, j] = T.cast(p_f[i, j] * gam * scale, dtype)
                    T.copy(w_f, v_s)
                    T.wgmma_gemm(ag_s, v_s, vd_f, clear_accum=True)                    # Vd = Ag W  [BT, BT] @ [BT, V]
                    T.wgmma_gemm(pg_s, do_s, dvd_f, transpose_A=True)                   # += Pg^T dO [BT, BT] @ [BT, V]
                    T.wait_wgmma(0)
                    T.copy(vd_f, vd_s)
                    T.copy(dvd_f, dvd_s)
                    mark(cc, "c.fwd")

                    # ---- value path: dv, dAg, dU; the dG row terms accumulate in rs_f ----
                    T.wgmma_gemm(ag_s, dvd_s, dv_f, transpose_A=True, clear_accum=True)  # dv = Ag^T dVd
                    T.wgmma_gemm(dvd_s, v_s, dag_f, transpose_B=True, clear_accum=True)  # dAg = dVd W^T
                    T.wait_wgmma(0)
                    for i, j in T.Parallel(BT, V):
                        if i < ln:
                            dv[0, T.cast(t0 + i, "int64"), i_hv, j] = T.cast(dv_f[i, j], dtype)
                    for i, j in T.Parallel(BT, V):
                        rs_f[i, j] = -eg_s[i] * dv_f[i, j] * u_f[i, j]                  # dU o U
                        dvd_s[i, j] = T.cast(-eg_s[i] * dv_f[i, j], dtype)              # dU = -D dv
                    mark(cc, "c.dv")

                    # ---- R Vd dS1^T (dk's first term), dPg = dO Vd^T; the inverse's dAb, dA ----
                    T.wgmma_gemm(vd_s, ds_s, dk_f, clear_accum=True)                    # Vd dS1^T   [BT, V] @ [V, K]
                    T.wgmma_gemm(do_s, vd_s, x_f, transpose_B=True, clear_accum=True)  # dPg = dO Vd^T [BT, V] @ [V, BT]
                    for i, j in T.Parallel(BT, BT):
                        dab = gamma(g_s, i, j) * dag_f[i, j]
                        da_s[i, j] = T.cast(dab * b_s[j], dtype)
                        daba_f[i, j] = dab * T.cast(a_s[i, j], acc)
                    T.wait_wgmma(0)
                    for i, j in T.Parallel(BT, K):
                        dk_f[i, j] = dk_f[i, j] * r_s[i]
                        rs_f[i, j] = rs_f[i, j] - dk_f[i, j] * T.cast(k_s[i, j], acc)
                        tsum[0] = tsum[0] + dk_f[i, j] * T.cast(k_s[i, j], acc)
                    mark(cc, "c.dk1")

                    colsum(daba_f, dat_s, part_s, vec_s, 6, tx, tot)
                    T.gemm(a_s, da_s, x2_f, transpose_A=True, clear_accum=True)        # A^T dA     [BT, BT] @ [BT, BT]
                    for i, j in T.Parallel(BT, BT):
                        gam = gamma(g_s, i, j)
                        mx_f[i, j] = p_f[i, j] * gam * scale * x_f[i, j] + daba_f[i, j] * b_s[j]
                        da_s[i, j] = T.cast(x_f[i, j] * gam * scale, dtype)               # dP
                    T.copy(x2_f, pg_s)
                    T.gemm(pg_s, a_s, dl_f, transpose_B=True, clear_accum=True)        # (A^T dA) A^T
                    if c > 0:
                        # A is consumed: the previous chunk's v and A load under the rest of this chunk
                        T.sync_threads()
                        load_va(c - 1, bos, i_hv, tx, v, A, v_s, a_s, bar_va)
                    for i, j in T.Parallel(BT, BT):
                        dl_f[i, j] = T.Select(i > j, -dl_f[i, j], 0.0)
                    mark(cc, "c.inv")

                    T.reduce_sum(mx_f, red_mr, dim=1)
                    for i in T.Parallel(BT):
                        vec_s[2, i] = red_mr[i]
                    colsum(mx_f, dat_s, part_s, vec_s, 3, tx, tot)
                    mark(cc, "c.dp")

                    # ---- dq = scale D dO S0^T + dP K; dk += dU S0^T + dP^T Q ----
                    T.wgmma_gemm(do_s, h_s, dq_f, clear_accum=True)                     # dO S0^T    [BT, V] @ [V, K]
                    T.wgmma_gemm(dvd_s, h_s, dk_f)                                      # dU S0^T    [BT, V] @ [V, K]
                    T.wgmma_gemm(da_s, q_s, dk_f, transpose_A=True)                     # dP^T Q     [BT, BT] @ [BT, K]
                    if c > 0:
                        store_gates(tx, gl, gn_s, bn_s)                                 # the previous chunk's gates
                    T.wait_wgmma(0)
                    if c > 0:
                        # S0^T is consumed: the previous chunk's comes in under the rest of this one
                        T.sync_threads()
                        load_h(s64 - 1, i_hv, tx, h, h_s, bar_h)
                    for i, j in T.Parallel(BT, K):
                        dq_f[i, j] = dq_f[i, j] * (eg_s[i] * scale)
                        rs_f[i, j] = rs_f[i, j] + dq_f[i, j] * T.cast(q_s[i, j], acc)
                    T.gemm(da_s, k_s, dq_f)                                             # += dP K    [BT, BT] @ [BT, K]
                    for i, j in T.Parallel(BT, K):
                        if i < ln:
                            dq[0, T.cast(t0 + i, "int64"), i_hv, j] = dq_f[i, j]
                    mark(cc, "c.dq")

                    # ---- dk += (dAt + dAt^T) K, dAt = diag(beta) dL ----
                    for i, j in T.Parallel(BT, BT):
                        dat_s[i, j] = b_s[i] * dl_f[i, j]
                    for i, j in T.Parallel(BT, BT):
                        pg_s[i, j] = T.cast(dat_s[i, j] + dat_s[j, i], dtype)
                    T.wgmma_gemm(pg_s, k_s, dk_f)                                       # (dAt + dAt^T) K
                    T.wgmma_gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)   # K K^T      [BT, K] @ [K, BT]
                    T.wait_wgmma(0)
                    for i, j in T.Parallel(BT, K):
                        if i < ln:
                            dk[0, T.cast(t0 + i, "int64"), i_hv, j] = dk_f[i, j]
                    mark(cc, "c.dk")

                    # ---- dS0^T = e_L dS1^T + dU^T K + dO^T (scale D Q), issued here and waited for after the rows
                    # below (which touch neither dS nor q, k, dO) ----
                    for i, j in T.Parallel(V, K):
                        ds_f[i, j] = ds_f[i, j] * eg_s[BT - 1]
                    for i, j in T.Parallel(BT, K):
                        qd_f[i, j] = T.cast(T.cast(q_s[i, j], acc) * (eg_s[i] * scale), dtype)
                    T.copy(qd_f, q_s)
                    T.wgmma_gemm(dvd_s, k_s, ds_f, transpose_A=True)                    # dU^T K     [V, BT] @ [BT, K]
                    T.wgmma_gemm(do_s, q_s, ds_f, transpose_A=True)                     # dO^T (scale D Q)
                    # ---- dbeta = colsum(dAb o A) + rowsum(dL o K K^T); dG rows (the last real row also gets the
                    # chunk total e_L <dS1, S0> + the R-term's sum) ----
                    for i, j in T.Parallel(BT, BT):
                        rbt_f[i, j] = dl_f[i, j] * kk_f[i, j]
                    T.reduce_sum(rbt_f, red_l, dim=1)
                    T.reduce_sum(rs_f, red_u, dim=1)
                    for i in T.Parallel(BT):
                        vec_s[5, i] = red_l[i]
                        vec_s[0, i] = red_u[i]
                    tsum[0] = T.warp_reduce_sum(tsum[0])
                    if tx % 32 == 0:
                        wsum_s[tx // 32] = tsum[0]
                    T.sync_threads()
                    if tx == 0:
                        tot[0] = 0.0
                        for i in T.serial(THREADS // 32):
                            tot[0] = tot[0] + wsum_s[i]
                        vec_s[0, ln - 1] = vec_s[0, ln - 1] + tot[0]
                    for i in T.Parallel(BT):
                        if i < ln:
                            dg[0, T.cast(t0 + i, "int64"), i_hv] = vec_s[0, i] + vec_s[2, i] - vec_s[3, i]
                            dbeta[0, T.cast(t0 + i, "int64"), i_hv] = vec_s[5, i] + vec_s[6, i]

                    T.wait_wgmma(0)
                    mark(cc, "c.ds")

                if state_v_first:
                    for i, j in T.Parallel(V, K):
                        dh0[n64, i_hv, i, j] = ds_f[i, j]
                else:
                    for i, j in T.Parallel(V, K):
                        dh0[n64, i_hv, j, i] = ds_f[i, j]

    return chunk_bwd_kernel


def builder_args(H: int, HV: int, K: int, V: int, dtype: torch.dtype, beta_dtype: torch.dtype, scale: float,
                 has_dht: bool, state_v_first: bool) -> tuple:
    """The `build` arguments (its compile-cache key) for one call."""
    return (H, HV, K, V, _tl.TL_DTYPE[dtype], _tl.TL_DTYPE[beta_dtype], float(scale), bool(has_dht),
            bool(state_v_first))


def launcher_builds(H: int, HV: int, K: int, V: int, dtype: torch.dtype, beta_dtype: torch.dtype, scale: float,
                    dht=(False, True), state_v_first=(False,)) -> list:
    """(label, builder, args) of every kernel `chunk_bwd` launches for these heads, dims and dtypes, with and without
    a final-state gradient, in the given state layouts."""
    return [(f"chunk_bwd H={H} HV={HV} K={K} V={V} dht={has_dht} v_first={vfirst}", build,
             builder_args(H, HV, K, V, dtype, beta_dtype, scale, has_dht, vfirst))
            for has_dht in dht for vfirst in state_v_first]


def chunk_bwd(q, k, v, g_cumsum, beta, A, h, do, dht, cu_seqlens, *, scale, state_v_first=False, chunk_size=64):
    """Fused backward (docs/stages.md `chunk_bwd`).

    Args:
        q, k: ``[1, T, H, K]`` bf16/fp16; v, do: ``[1, T, HV, V]`` (do is cast to v's dtype); (K, V) in `HEAD_DIMS`.
        g_cumsum: ``[1, T, HV]`` fp32; beta: ``[1, T, HV]`` bf16, fp16 or fp32; A: ``[1, T, HV, BT]`` (q's dtype).
        h: ``[slots, HV, V, K]`` in q's dtype: the transposed state entering each chunk slot, from this backend's
            `state_recompute`.
        dht: gradient of the final state, ``[N, HV, K, V]`` (``[N, HV, V, K]`` with state_v_first) fp32, or None.
        cu_seqlens: ``[N + 1]`` int32 (int64 is converted on the device).

    Returns:
        ``dq, dk [1, T, HV, K]`` fp32 (per value head), ``dv [1, T, HV, V]`` in v's dtype, ``dbeta, dG [1, T, HV]``
        fp32, ``dh0`` fp32 in the state layout; 0 on the padding tail. One launch of (N + 1) * HV CTAs; no host
        synchronisation.
    """
    _, T_, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.shape[0] - 1
    assert chunk_size == BT and (K, V) in HEAD_DIMS and HV % H == 0
    assert q.dtype == k.dtype == v.dtype and q.dtype in DTYPES
    assert g_cumsum.dtype == torch.float32 and h.dtype == q.dtype and h.shape[1:] == (HV, V, K)
    dev = q.device
    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    dq = _tl.alloc((1, T_, HV, K), torch.float32, dev)
    dk = _tl.alloc((1, T_, HV, K), torch.float32, dev)
    dv = _tl.alloc((1, T_, HV, V), v.dtype, dev)
    dbeta = _tl.alloc((1, T_, HV), torch.float32, dev)
    dG = _tl.alloc((1, T_, HV), torch.float32, dev)
    dh0 = _tl.alloc(state_shape, torch.float32, dev)
    if T_ == 0:
        if dht is None:
            dh0.zero_()
        else:
            dh0.copy_(dht)
        return dq, dk, dv, dbeta, dG, dh0
    cu_seqlens = _tl.cu_seqlens_int32(cu_seqlens)
    dht_in = dht.float().contiguous() if dht is not None else dh0
    args = builder_args(H, HV, K, V, q.dtype, beta.dtype, scale, dht is not None, state_v_first)
    kernel = build(*args)
    kernel(q.contiguous(), k.contiguous(), v.contiguous(), g_cumsum.contiguous(), beta.contiguous(),
           A.to(q.dtype).contiguous(), h.contiguous(), do.to(v.dtype).contiguous(), dht_in, cu_seqlens,
           dq, dk, dv, dbeta, dG, dh0)
    return dq, dk, dv, dbeta, dG, dh0
