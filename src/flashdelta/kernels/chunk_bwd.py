"""Stage `chunk_bwd` (Hopper, TileLang): the reverse chunk walk producing dq, dk, dv, dbeta, dG and dh0.

The math is docs/algorithm.md §3; the per-chunk terms are the portable `_bwd_step`'s, in the same order and with
the same GEMM operand roundings (bf16/fp16 operands, fp32 accumulation), so the portable path at the kernel's
precision is this kernel's error baseline.

One CTA per (sequence, value head) walks every chunk, last chunk first, with all of V in the CTA: every K-side
product of a chunk (Q K^T, K K^T, the inverse's A^T dA A^T) is formed once. Per chunk c (C = BT = 64, ``G`` the
chunk-local gate cumsum, rows past the sequence end zeroed in q, k, v, dO and A and given ``G[len - 1]`` and
beta = 0, so they are inert; S0 the state entering the chunk, dS1 the gradient of the state leaving it):

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

Only the dS chain is serial across chunks; everything else is chunk-local given S0 (from `state_recompute`) and dS1.
Two roles (V / 64 + 1 warpgroups, mbarrier hand-offs, no CTA-wide barrier after the set-up):

- **state warpgroups** (one per 64 value rows): ``dS^T [V, K]`` fp32 in registers for the whole walk. The chain's
  [V, *] products are split by value rows (warpgroup w owns rows [64 w, 64 w + 64) of dS^T and of every [V, BT]
  chain tile), so the chain needs no exchange between them; the [BT, *] products are split by columns (warpgroup w
  computes columns [64 w, 64 w + 64)). Per chunk: U = K S0 and W = V - D U (stored over V), dS1^T to shared,
  X^T = dS1^T K^T, Y^T = dO^T Pg, dVd^T = X^T R + Y^T (to shared), dv^T = dVd^T Ag (register A operand), dv stored,
  dU^T = -dv^T D, dS0^T = e_L dS1^T + dU^T K + (scale D dO)^T Q (register A operands), the e_L <dS1, S0> part of dG;
  then dq = scale D dO S0^T + dP K and dk = R o (Vd dS1^T) + dU S0^T + dP^T Q + dAt K + dAt^T K with their parts
  of dG's row terms read off the accumulators (rows_ready). Once dk's third product is complete they have released
  q, S0^T, dO and this chunk's Vd tile, and the first state warpgroup's warp 0 issues the previous chunk's k (into
  that Vd tile), q, S0^T and dO by TMA.
- **chunk warpgroup**: the first chunk's loads (its ragged rows zeroed before the arrivals), v and A (reloaded
  once the inverse has consumed them) and the gates (plain loads under its wait for W); P, Gamma, Pg, Vd, dPg, dP,
  Mx's sums; once the chain has produced dVd^T: dAg, K K^T, dA, the inverse's A^T dA A^T, dbeta's and dG's row and
  column sums, dAt; then the next chunk's Ag and this chunk's dG and dbeta rows.

k and Vd share a two-tile ring (K = V): chunk cc's k is tile cc % 2 and its Vd the other, so the next k loads while
dk's last two products still read this one, and the chunk warpgroup waits for dk_done only before it overwrites
Pg and dP. The per-chunk critical path: P, Pg (chunk) and U, W (state) -> Vd, dPg, dP (chunk), with dVd^T (state)
ready by then -> the inverse's dAt (chunk) -> dk's last products (state); the next chunk's k, q, S0^T and dO load
under the inverse, its Ag and this chunk's rows under the state warpgroups' last dk products and stores.

Every per-row or per-column gate factor of an element-wise pass is loaded into a register vector first: read from
shared memory per element, it would be reloaded after every store to shared memory (one dynamic buffer holds every
tile, so the compiler cannot tell them apart).

Row sums are fragment reductions (a wgmma accumulator row lives in one quad; a state warpgroup's part of a row goes to
shared memory and the parts are added in warpgroup order, `_ptx.ROWSUM_PRELUDE`); column sums go through per-warp
shuffles (`_ptx.COLSUM_PRELUDE`) and a fixed-order add, so every gradient is deterministic. rowsum(dU o U) is rowsum(K o
(dU S0^T)), read off dk's accumulator before and after its dU S0^T term; dAt (strictly lower) is stored whole with zeros
on and above the diagonal, and dk adds dAt K and dAt^T K. The gate path (Gamma, R, D, the dG and dbeta reductions) is
fp32 throughout. dq and dk are written per value head in q's dtype (rounded once from the fp32 accumulators; the GVA
group sum follows in fp32: half the bytes of fp32 written here and read there, and half the backward's largest buffers),
dv in v's dtype, dbeta and dG in fp32, dh0 in fp32 in the state layout; dq and dk of a full chunk are staged in dS1^T's
tile (free from dk's Vd dS1^T product to the next chunk's dS1^T) and written by TMA stores that thread 0 issues and
waits for before that tile is written again: per-thread stores had held the state warpgroups ~20% of their time (their
stalls queued the reloads of spilled addresses behind them). A ragged chunk's dq and dk (rows past it belong to the next
sequence), and dv, go by plain stores through one 64-bit row base per chunk (`_ptx.STORE_ACC_PRELUDE`,
`_ptx.STORE_DVT_PRELUDE`). At two value heads per key head (`group_add`) the GVA sum happens here instead: dq and dk
are ``[1, T, H, K]``, zeroed by the launcher, and each value head's rounded tile is added into its key head's rows by
a TMA reduce-add (red.global.add on a ragged chunk), issued and waited for as the stores are, which is exact in
either order (0 + a + b = round(a + b), the group_sum's result bit for bit), so no pass reads the per-value-head
gradients back.
bench/dev/chunk_bwd_protocol.py models the synchronisation (barrier counts, parities, every tile's reads against
its writes).

Chunk slots: chunk c of sequence n (tokens [bos, eos)) is slot ``bos // BT + n + c`` (the numbering prepare uses,
below ``T // BT + N + 1``), so h needs no host-side chunk offsets. CTA x index = (sequence rank, value head),
rank slowest; rank i is sequence ``seq_order[i]`` (`_tl.seq_order`: longest first where the grid takes more than one
wave), and the last, N, zero-fills every gradient on the padding tail [cu_seqlens[N], T). Token
offsets are int64, so tensors past 2^31 elements work.
"""
# No `from __future__ import annotations`: TileLang evaluates the prim_func annotations in this scope.
import tilelang.language as T
import torch
from tilelang import tvm

from . import _ptx, _tl, timeline

BT = 64
# (K, V) pairs this kernel supports: each state warpgroup holds 64 rows of dS^T [V, K] fp32 (64 registers per thread
# at K = 128) and 64 columns of every [BT, K] product (dq, dk)
HEAD_DIMS = ((128, 128), (64, 64))
DTYPES = (torch.bfloat16, torch.float16)   # q, k, v, A, do, dv
# cuda.h's CUtensorMapDataType of dq and dk (the group_add reduce-add's descriptor) and their element size
TMA_DTYPE = {"bfloat16": 9, "float16": 6}
ESIZE = 2
LOG2E = 1.4426950408889634
# the chain's [V, *] products: state warpgroup w owns value rows [64 w, 64 w + 64) of dS^T and of the [V, BT] chain
# tiles, so the chain needs no exchange between the state warpgroups
FULL_ROW = T.GemmWarpPolicy.FullRow
# the state warpgroups' [BT, *] products (U, dq, dk): warpgroup w computes columns [64 w, 64 w + 64) (a wgmma
# warpgroup spans all 64 rows); their row sums are per-warpgroup parts added in a fixed order
FULL_COL = T.GemmWarpPolicy.FullCol
# No setmaxnreg: it moves registers only within the CTA's launch allocation (168 per thread at 384 threads, the
# most ptxas gives; 64,512 of the SM's 65,536), and the state warpgroups need about all of theirs, so there is
# nothing to give the chunk warpgroup. Everything compiles at a flat 168 at V = 128, at the launch's 255 at V = 64
# (256 threads); the numbers are in docs/dev/chunk_bwd.md.

TABLE = timeline.Table(
    "chunk_bwd",
    roles={"s": ("state WGs", 0), "a": ("chunk WG", 256)},
    events={
        "s.k": "wait full_k (the TMA issued at the previous s.dk)",
        "s.w": "U = K S0, dS1^T stored, X^T issued; wait v; W stored, w_ready arrived",
        "s.prep": "<dS1, S0>, e_L dS1, X^T complete; wait prep_ready (chunk WG)",
        "s.dvd": "Y^T, dVd^T, dv^T; dVd^T stored, dvd_ready arrived",
        "s.ds0": "dv stored; dU^T stored; dS0^T complete, dO S0^T, dq's row sums",
        "s.dp": "wait dp_ready (chunk WG)",
        "s.dk": "dP K, Vd dS1^T; dq stored; dU S0^T, dP^T Q, dk's row sums; the next k, q, S0^T, dO issued",
        "s.dat": "wait dat_ready (chunk WG)",
        "s.end": "dAt K + dAt^T K; dk_done arrived; dk stored",
        "a.k": "wait full_k, full_qh (the TMA of k, q, S0^T)",
        "a.qk": "P = Q K^T complete",
        "a.dkd": "wait dk_done of the previous chunk (state WGs)",
        "a.prep": "Gamma, Pg stored, prep_ready arrived",
        "a.w": "the next gates' loads issued; wait w_ready (state WGs)",
        "a.g": "the next gates stored",
        "a.vd": "Vd = Ag W complete, stored",
        "a.dpg": "wait full_do; dPg = dO Vd^T complete",
        "a.dp": "Mx's first term, dP stored, dp_ready arrived; Mx's first term's sums",
        "a.dvd": "wait dvd_ready (state WGs)",
        "a.dag": "dAg = dVd W^T and K K^T complete",
        "a.da": "dA and dAb o A o beta_j formed; colsum(dAb o A)",
        "a.atda": "A^T dA complete, to shared",
        "a.dl": "(A^T dA) A^T complete; Mx's second row and column sums",
        "a.vload": "the previous chunk's v and A issued (c > 0)",
        "a.inv": "dL masked, dAt stored, rowsum(dL o K K^T); dat_ready arrived",
        "a.va": "wait full_va (the next v, A)",
        "a.ag": "the next chunk's Ag stored",
        "a.rows": "wait rows_ready (state WGs); dG and dbeta rows stored",
    },
    ctas=8, steps=32, value="NT")


@T.macro
def fetch_gates(c, bos, eos, i_hv, tx, g, beta, gl):
    """Chunk c's G and beta of row tx (tx < BT) into the registers gl (rows past the end: G[len - 1] and beta = 0):
    the loads complete while the thread goes on, and the caller stores them where the next chunk reads them."""
    t0 = bos + c * BT
    if tx < BT:
        gl[0] = g[0, T.cast(T.min(t0 + tx, eos - 1), "int64"), i_hv]
        gl[1] = T.if_then_else(t0 + tx < eos, T.cast(beta[0, T.cast(t0 + tx, "int64"), i_hv], "float32"), 0.0)


@_tl.jit(pass_configs=_tl.WS_PASS_CONFIGS, table=TABLE)
def build(H: int, HV: int, K: int, V: int, dtype: str, beta_dtype: str, scale: float, has_dht: bool,
          state_v_first: bool, group_add: bool = False, h_seqs: bool = False):
    """The kernel for one compile-time configuration; T (tokens), N (sequences) and the slot count are dynamic.
    group_add (G = 2): dq and dk are ``[1, T, H, K]``, zeroed by the caller, and each value head adds its rounded
    tile into its key head's rows (TMA reduce-add, red.global.add on a ragged chunk): the group sum, exact in either
    order (0 + a + b = round(a + b)), so no group_sum pass reads them back. Without it the kernel is unchanged.
    h_seqs: h was written over other sequences than cu_seqlens' items (the training forward's, over whole sequences,
    where context parallelism splits the backward into partitions): item n's first chunk is h's slot
    ``cu_seqlens[n] // BT + h_seq[n]``, its sequence's slot of that chunk (an extra int32 ``h_seq [N]``)."""
    # problem config
    G = HV // H
    acc = "float32"
    assert HV % H == 0 and (K, V) in HEAD_DIMS and (not group_add or G == 2)
    HQ = H if group_add else HV    # heads of dq and dk
    T_ = T.dynamic("T")
    N_ = T.dynamic("N")
    S_ = T.dynamic("S")
    state_shape = (N_, HV, V, K) if state_v_first else (N_, HV, K, V)
    # without h_seqs `h_seq` is no kernel parameter (a non-tensor annotation is a plain Python value to TileLang)
    h_seq_t = T.Tensor((N_,), "int32") if h_seqs else None
    # roles: V / 64 state warpgroups, one chunk warpgroup (which also issues the loads)
    NSW = V // 64               # state warpgroups
    ST = 128 * NSW              # state threads
    A0 = ST                     # first thread of the chunk warpgroup
    THREADS = ST + 128
    NW = ST // 32               # state warps
    KC = K // NSW               # columns of dq and dk per state warpgroup (64)
    NVEC = 6                    # the chunk warpgroup's per-row sums of dG (4) and dbeta (2)
    prelude = (_ptx.COLSUM_PRELUDE + _ptx.ROWSUM_PRELUDE + _ptx.STORE_DVT_PRELUDE + _ptx.STORE_ACC_PRELUDE
               + timeline.prelude(TABLE))

    @T.macro
    def colsum(x_f, part_s, vec_s, row, ta):
        # column sums of a [BT, BT] fp32 accumulator of the chunk warpgroup into vec_s[row] (fixed order)
        T.call_extern("handle", "fd_colsum64_part", x_f.data, part_s.data, ta)
        T.sync_threads(2, 128)
        for j in T.Parallel(BT):
            vec_s[row, j] = part_s[0, j] + part_s[1, j] + part_s[2, j] + part_s[3, j]
        T.sync_threads(2, 128)

    def parts(rs_s, q, tx):
        # row tx of the state warpgroups' row sums q: their parts added in warpgroup order
        x = rs_s[q, 0, tx]
        for w in range(1, NSW):
            x = x + rs_s[q, w, tx]
        return x

    @T.macro
    def rowsum_part(x_f, rs_s, q, wg, tx):
        # this state warpgroup's part of the row sums of a [BT, K] fp32 accumulator (its KC columns) into rs_s[q, wg]
        T.call_extern("handle", f"fd_rowsum64_part<{KC}>", x_f.data, T.address_of(rs_s[q, wg, 0]), tx)

    @T.macro
    def reduce_add_tile(dst, src_s, s_off, k0, t0, i_hq):
        # dst[0, t0:t0 + BT, i_hq, k0:k0 + KC] += the [BT, KC] 128-byte-swizzled block of src_s at element offset
        # s_off: one TMA reduce-add, committed and not waited for. T.atomic_add(use_tma=True) issues the same
        # instruction but then waits for its shared reads at once, which holds the state warpgroups; here the wait
        # is the plain stores' one, before the tile is written again. The descriptor is the one T.atomic_add
        # builds: dims (K, T, HQ, 1) innermost first, byte strides, a (KC, BT, 1, 1) box, 128-byte swizzle, L2
        # promotion 128 B (cuda.h's CUtensorMap enums).
        desc = T.create_tma_descriptor(
            TMA_DTYPE[dtype], 4, dst.data, K, T_, HQ, 1,
            ESIZE, HQ * K * ESIZE, K * ESIZE, T.cast(T_, "int64") * (HQ * K * ESIZE),
            KC, BT, 1, 1, 1, 1, 1, 1, 0, 3, 2, 0)
        T.call_intrin("handle", tvm.tirx.op.Op.get("tl.tma_store"), desc,
                      src_s.access_ptr("r", offset=s_off, extent=BT * KC), k0, t0, i_hq, 0, 1, 0)
        T.tma_store_arrive()

    @T.macro
    def store_tile(x_f, dst, ds_s, r0, t0, ln, i_hq, wg, tx):
        # the state warpgroups' [BT, K] fp32 accumulator (dq or dk) to dst rows [t0, t0 + ln) in q's dtype: a full
        # chunk through rows [r0, r0 + BT) of ds_s (free until the next chunk's dS1^T) and TMA stores issued by
        # thread 0, which waits for them before ds_s is written again; a ragged chunk (rows past it belong to the
        # next sequence) by plain stores of its rows
        if ln == BT:
            T.copy(x_f, ds_s[r0:r0 + BT, :])
            T.fence_proxy_async()
            T.sync_threads(1, ST)
            for w in range(NSW):
                # one TMA store per 64 columns: a [BT, K] region of ds_s is not one 128-byte-swizzled box
                if group_add:
                    if tx == 0:
                        reduce_add_tile(dst, ds_s, w * V * KC + r0 * KC, w * KC, t0, i_hq)
                else:
                    T.tma_copy(ds_s[r0:r0 + BT, w * KC:(w + 1) * KC], dst[0, t0:t0 + BT, i_hq, w * KC:(w + 1) * KC])
        else:
            kout = _ptx.STORE_ACC_ADD[dtype] if group_add else _ptx.STORE_ACC[dtype]
            T.call_extern("handle", f"fd_store_acc<{KC}, {kout}>", x_f.data,
                          T.address_of(dst[0, T.cast(t0, "int64"), i_hq, wg * KC]), HQ * K, ln, tx)

    @T.macro
    def store_gates(gs, ta, gl, g_s, b_s):
        if ta < BT:
            g_s[gs, ta] = gl[0]
            b_s[gs, ta] = gl[1]

    @T.macro
    def make_ag(gs, a_s, g_s, b_s, ag_s, x_f, gi_f, gj_f, bj_f):
        # the chunk warpgroup: Ag = A o Gamma o beta_j (the B operand of dv^T, the A operand of Vd) through the
        # accumulator-layout fragment x_f, with the gates in registers; stored for the whole warpgroup
        for i in T.Parallel(BT):
            gi_f[i] = g_s[gs, i] * LOG2E
        for j in T.Parallel(BT):
            gj_f[j] = g_s[gs, j] * LOG2E
            bj_f[j] = b_s[gs, j]
        for i, j in T.Parallel(BT, BT):
            x_f[i, j] = (T.cast(a_s[i, j], acc) * T.exp2(T.Select(i >= j, gi_f[i] - gj_f[j], -T.infinity(acc)))
                         * bj_f[j])
        T.copy(x_f, ag_s)
        T.fence_proxy_async()
        T.sync_threads(2, 128)

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
        seq_order: T.Tensor((N_ + 1,), "int32"),
        h_seq: h_seq_t,
        dq: T.Tensor((1, T_, HQ, K), dtype),
        dk: T.Tensor((1, T_, HQ, K), dtype),
        dv: T.Tensor((1, T_, HV, V), dtype),
        dbeta: T.Tensor((1, T_, HV), acc),
        dg: T.Tensor((1, T_, HV), acc),
        dh0: T.Tensor(state_shape, acc),
    ):
        with T.Kernel((N_ + 1) * HV, threads=THREADS, prelude=prelude) as bx:
            i_n = seq_order[bx // HV]                    # longest sequence first (`_tl.seq_order`)
            i_hv = bx % HV
            i_h = i_hv // G
            i_q = i_h if group_add else i_hv             # the head of dq and dk this CTA writes
            tx = T.get_thread_binding()
            mark = timeline.marker(TABLE, bx, tx)

            # ---- shared memory (one buffer of each input: the chunk warpgroup reloads a tile once its readers
            # release it)
            q_s = T.alloc_shared((BT, K), dtype)
            kv_s = T.alloc_shared((2, BT, K), dtype)        # k of chunk cc in kv_s[cc % 2], its Vd in the other
            v_s = T.alloc_shared((BT, V), dtype)            # V, then W in place (state WGs)
            do_s = T.alloc_shared((BT, V), dtype)
            a_s = T.alloc_shared((BT, BT), dtype)
            h_s = T.alloc_shared((V, K), dtype)             # S0^T (state WGs only)
            ds_s = T.alloc_shared((V, K), dtype)            # dS1^T (state WGs only)
            dvd_s = T.alloc_shared((V, BT), dtype)          # dVd^T (state WGs -> chunk WG)
            du_s = T.alloc_shared((V, BT), dtype)           # dU^T (state WGs only)
            pg_s = T.alloc_shared((BT, BT), dtype)          # Pg, then dAt (chunk WG -> state WGs)
            ag_s = T.alloc_shared((BT, BT), dtype)          # Ag, then dA = dAb o beta_j, then A^T dA
            dp_s = T.alloc_shared((BT, BT), dtype)          # dP (chunk WG -> state WGs)
            g_s = T.alloc_shared((2, BT), acc)              # G (rows past the end: G[len - 1]), two chunks
            b_s = T.alloc_shared((2, BT), acc)              # beta (0 past the end)
            vec_s = T.alloc_shared((NVEC, BT), acc)         # the chunk WG's row and column sums
            part_s = T.alloc_shared((4, BT), acc)           # column sums' per-warp parts
            rs_s = T.alloc_shared((3, NSW, BT), acc)        # the state WGs' row sums, one part per warpgroup
            wsum_s = T.alloc_shared((NW,), acc)             # the state warps' parts of e_L <dS1, S0>
            asum_s = T.alloc_shared((NW,), acc)             # the state warps' parts of the R-term total

            # k, q, S0^T and dO: the first chunk's from the chunk warpgroup's set-up, the others issued by the state
            # warpgroups as they release the tiles; the issuing warp arrives (its warp 0: the chunk warpgroup's or
            # the first state warpgroup's). v, A and the gates: the chunk warpgroup (TMA issued by its warp 0, then
            # all 128 arrive). Every other barrier's count is the threads of the role that arrives on it.
            full_k = T.alloc_barrier([32])
            full_qh = T.alloc_barrier([32])
            full_va = T.alloc_barrier([128])
            full_do = T.alloc_barrier([32])
            full_g = T.alloc_barrier([128, 128])
            first = T.alloc_barrier([32])                  # the first chunk's TMA (its ragged rows are zeroed after)
            prep_ready = T.alloc_barrier([128])             # Ag, Pg stored
            w_ready = T.alloc_barrier([ST])                 # W stored
            dp_ready = T.alloc_barrier([128])               # Vd, dP stored
            dvd_ready = T.alloc_barrier([ST])               # dVd^T stored, the dv^T product (reads Ag) complete
            dat_ready = T.alloc_barrier([128])              # dAt and the chunk WG's sums stored
            dk_done = T.alloc_barrier([ST])                 # k, dP, dAt released
            rows_ready = T.alloc_barrier([ST])              # the state WGs' parts of the dG rows stored

            if i_n == N_:
                # padding tail [cu_seqlens[N], T): every gradient of this value head is 0
                tb = cu_seqlens[N_]
                for it in T.serial(T.ceildiv(T_ - tb, THREADS)):
                    row = tb + it * THREADS + tx
                    if row < T_:
                        r64 = T.cast(row, "int64")
                        if not group_add:          # (group_add: the caller zeroed dq and dk)
                            for j in T.serial(K):
                                dq[0, r64, i_hv, j] = T.cast(0, dtype)
                                dk[0, r64, i_hv, j] = T.cast(0, dtype)
                        for j in T.serial(V):
                            dv[0, r64, i_hv, j] = T.cast(0, dtype)
                        dbeta[0, r64, i_hv] = 0.0
                        dg[0, r64, i_hv] = 0.0
            else:
                bos = cu_seqlens[i_n]
                eos = cu_seqlens[i_n + 1]
                NT = T.ceildiv(eos - bos, BT)
                slot0 = bos // BT + (h_seq[i_n] if h_seqs else i_n)
                n64 = T.cast(i_n, "int64")

                if tx < ST:
                    # ================= state warpgroups: the dS chain, U and W, dv, dq, dk, the rows ==============
                    wg = tx // 128
                    ds_f = T.alloc_fragment((V, K), acc)        # dS^T, carried across chunks
                    x_f = T.alloc_fragment((V, BT), acc)        # X^T = dS1^T K^T
                    y_f = T.alloc_fragment((V, BT), acc)        # Y^T = dO^T Pg
                    u_f = T.alloc_fragment((BT, V), acc)        # U = K S0
                    w_f = T.alloc_fragment((BT, V), dtype)      # W = V - D U
                    dos_f = T.alloc_fragment((V, BT), dtype)    # (scale D dO)^T
                    dvd_f = T.alloc_fragment((V, BT), dtype)    # dVd^T
                    dv_f = T.alloc_fragment((V, BT), acc)       # dv^T
                    du_f = T.alloc_fragment((V, BT), dtype)     # dU^T
                    dq_f = T.alloc_fragment((BT, K), acc)
                    rq_f = T.alloc_fragment((BT, K), acc)
                    dk_f = T.alloc_fragment((BT, K), acc)
                    rk_f = T.alloc_fragment((BT, K), acc)
                    tsum = T.alloc_local((1,), acc)
                    asum = T.alloc_local((1,), acc)
                    mark.start()
                    mark.value(NT)
                    if has_dht:
                        if state_v_first:
                            for i, j in T.Parallel(V, K):
                                ds_f[i, j] = dht[n64, i_hv, i, j]
                        else:
                            for i, j in T.Parallel(V, K):
                                ds_f[i, j] = dht[n64, i_hv, j, i]
                    else:
                        T.clear(ds_f)
                    for cc in T.serial(NT):
                        c = NT - 1 - cc
                        t0 = bos + c * BT
                        ln = T.min(eos - t0, BT)
                        ph = cc % 2
                        gs = cc % 2
                        kb = cc % 2
                        T.barrier_wait(full_k[0], ph)
                        mark(cc, "s.k")
                        # ---- U = K S0 first (W is the chunk WG's next need), dS1^T to shared under it (ds_s and
                        # du_s were last read before the previous dk_done), X^T = dS1^T K^T ----
                        T.barrier_wait(full_qh[0], ph)
                        T.barrier_wait(full_g[gs], (cc // 2) % 2)
                        # U = K S0
                        T.wgmma_gemm(kv_s[kb, :, :], h_s, u_f, transpose_B=True, clear_accum=True, policy=FULL_COL)
                        if tx == 0:
                            T.tma_store_wait(0)        # the previous chunk's dq and dk stores have read ds_s
                        T.sync_threads(1, ST)
                        T.copy(ds_f, ds_s)                                               # dS1^T in q's dtype
                        T.fence_proxy_async()
                        T.sync_threads(1, ST)
                        # X^T = dS1^T K^T
                        T.wgmma_gemm(ds_s, kv_s[kb, :, :], x_f, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                        T.wait_wgmma(1)                                                  # U
                        # ---- W = V - D U over V in place, this warpgroup's columns ----
                        T.barrier_wait(full_va[0], ph)
                        for i, j in T.Parallel(BT, V):
                            w_f[i, j] = T.cast(T.cast(v_s[i, j], acc) - T.exp2(g_s[gs, i] * LOG2E) * u_f[i, j],
                                               dtype)
                        T.copy(w_f, v_s)
                        T.fence_proxy_async()
                        T.barrier_arrive(w_ready[0])
                        mark(cc, "s.w")
                        tsum[0] = 0.0
                        for i, j in T.Parallel(V, K):
                            tsum[0] = tsum[0] + ds_f[i, j] * T.cast(h_s[i, j], acc)      # <dS1, S0>
                        el = T.exp2(g_s[gs, BT - 1] * LOG2E)
                        for i, j in T.Parallel(V, K):
                            ds_f[i, j] = ds_f[i, j] * el
                        T.wait_wgmma(0)                                                  # X^T
                        T.barrier_wait(full_do[0], ph)
                        T.barrier_wait(prep_ready[0], ph)
                        mark(cc, "s.prep")
                        # ---- dVd^T = X^T R + dO^T Pg, dv^T = dVd^T Ag ----
                        # Y^T = dO^T Pg
                        T.wgmma_gemm(do_s, pg_s, y_f, transpose_A=True, clear_accum=True, policy=FULL_ROW)
                        T.wait_wgmma(0)
                        for i, j in T.Parallel(V, BT):
                            dvd_f[i, j] = T.cast(x_f[i, j] * T.exp2((g_s[gs, BT - 1] - g_s[gs, j]) * LOG2E)
                                                 + y_f[i, j], dtype)                    # dVd^T = X^T R + Y^T
                        T.wgmma_gemm(dvd_f, ag_s, dv_f, clear_accum=True, policy=FULL_ROW)  # dv^T = dVd^T Ag
                        T.copy(dvd_f, dvd_s)          # (the chunk WG's dAg read the previous dVd^T before dat_ready)
                        T.wait_wgmma(0)               # dv^T: the chunk WG overwrites Ag once dvd_ready completes
                        T.fence_proxy_async()
                        T.barrier_arrive(dvd_ready[0])
                        mark(cc, "s.dvd")
                        # ---- dv; dU^T = -dv^T D; dS0^T = e_L dS1^T + (scale D dO)^T Q + dU^T K; dO S0^T ----
                        T.call_extern("handle", _ptx.STORE_DVT[dtype], dv_f.data,
                                      T.address_of(dv[0, T.cast(t0, "int64"), i_hv, 0]), HV * V, ln, tx)
                        for i, j in T.Parallel(V, BT):
                            du_f[i, j] = T.cast(-dv_f[i, j] * T.exp2(g_s[gs, j] * LOG2E), dtype)  # dU^T = -dv^T D
                        for i, j in T.Parallel(V, BT):
                            dos_f[i, j] = T.cast(T.cast(do_s[j, i], acc) * (T.exp2(g_s[gs, j] * LOG2E) * scale),
                                                 dtype)                                 # (scale D dO)^T
                        T.copy(du_f, du_s)
                        T.fence_proxy_async()
                        # chunk_dstate repeats this accumulation sequence (and dVd^T's X^T R + Y^T form): its F is this
                        # dh0 bit for bit only with the same order (docs/dev/chunk_bwd.md)
                        T.wgmma_gemm(dos_f, q_s, ds_f, policy=FULL_ROW)                  # dS0^T += (scale D dO)^T Q
                        T.wgmma_gemm(du_f, kv_s[kb, :, :], ds_f, policy=FULL_ROW)                   # dS0^T += dU^T K
                        T.wgmma_gemm(do_s, h_s, dq_f, clear_accum=True, policy=FULL_COL)  # dO S0^T
                        tsum[0] = T.warp_reduce_sum(tsum[0] * el)
                        if tx % 32 == 0:
                            wsum_s[tx // 32] = tsum[0]
                        T.wait_wgmma(0)
                        for i, j in T.Parallel(BT, K):
                            dq_f[i, j] = dq_f[i, j] * (T.exp2(g_s[gs, i] * LOG2E) * scale)
                            rq_f[i, j] = dq_f[i, j] * T.cast(q_s[i, j], acc)
                        rowsum_part(rq_f, rs_s, 0, wg, tx)                               # rowsum(Q o scale D dO S0^T)
                        mark(cc, "s.ds0")
                        # ---- dq += dP K; dk = R o (Vd dS1^T) + dU S0^T + dP^T Q + dAt K + dAt^T K ----
                        T.barrier_wait(dp_ready[0], ph)
                        mark(cc, "s.dp")
                        T.wgmma_gemm(dp_s, kv_s[kb, :, :], dq_f, policy=FULL_COL)                   # dq += dP K
                        T.wgmma_gemm(kv_s[1 - kb, :, :], ds_s, dk_f, clear_accum=True, policy=FULL_COL)  # Vd dS1^T
                        T.wait_wgmma(0)                                    # dq and Vd dS1^T: ds_s is free
                        store_tile(dq_f, dq, ds_s, 0, t0, ln, i_q, wg, tx)
                        asum[0] = 0.0
                        for i, j in T.Parallel(BT, K):
                            dk_f[i, j] = dk_f[i, j] * T.exp2((g_s[gs, BT - 1] - g_s[gs, i]) * LOG2E)
                            rk_f[i, j] = dk_f[i, j] * T.cast(kv_s[kb, i, j], acc)
                            asum[0] = asum[0] + rk_f[i, j]
                        rowsum_part(rk_f, rs_s, 1, wg, tx)                               # rowsum(K o R o (Vd dS1^T))
                        T.sync_threads(1, ST)                                            # every warpgroup's dU^T
                        T.wgmma_gemm(du_s, h_s, dk_f, transpose_A=True, policy=FULL_COL)  # dk += dU S0^T
                        asum[0] = T.warp_reduce_sum(asum[0])
                        if tx % 32 == 0:
                            asum_s[tx // 32] = asum[0]
                        T.wait_wgmma(0)
                        for i, j in T.Parallel(BT, K):
                            rk_f[i, j] = dk_f[i, j] * T.cast(kv_s[kb, i, j], acc)
                        rowsum_part(rk_f, rs_s, 2, wg, tx)                               # ... + rowsum(dU o U)
                        T.wgmma_gemm(dp_s, q_s, dk_f, transpose_A=True, policy=FULL_COL)  # dk += dP^T Q
                        T.wait_wgmma(0)
                        T.sync_threads(1, ST)                                            # the row sums' parts
                        T.barrier_arrive(rows_ready[0])
                        if c > 0:
                            # q, S0^T, dO and the Vd tile are released (the chunk WG read q, dO and Vd before
                            # dp_ready): the previous chunk's k into this chunk's Vd tile, its q, S0^T, dO
                            if tx < 32:
                                T.tma_copy(k[0, t0 - BT:t0, i_h, 0:K], kv_s[1 - kb, :, :], barrier=full_k[0])
                                T.tma_copy(q[0, t0 - BT:t0, i_h, 0:K], q_s, barrier=full_qh[0])
                                T.tma_copy(h[T.cast(slot0 + c - 1, "int64"), i_hv, 0:V, 0:K], h_s,
                                           barrier=full_qh[0])
                                T.tma_copy(do[0, t0 - BT:t0, i_hv, 0:V], do_s, barrier=full_do[0])
                                T.barrier_arrive(full_k[0])
                                T.barrier_arrive(full_qh[0])
                                T.barrier_arrive(full_do[0])
                        mark(cc, "s.dk")
                        T.barrier_wait(dat_ready[0], ph)
                        mark(cc, "s.dat")
                        T.wgmma_gemm(pg_s, kv_s[kb, :, :], dk_f, policy=FULL_COL)                   # dk += dAt K
                        T.wgmma_gemm(pg_s, kv_s[kb, :, :], dk_f, transpose_A=True, policy=FULL_COL)  # dk += dAt^T K
                        T.wait_wgmma(0)
                        T.barrier_arrive(dk_done[0])
                        if V == BT:
                            # one staging tile: dq's store has read it (issued long before)
                            if tx == 0:
                                T.tma_store_wait(0)
                            T.sync_threads(1, ST)
                        store_tile(dk_f, dk, ds_s, V - BT, t0, ln, i_q, wg, tx)
                        mark(cc, "s.end")
                    if tx == 0:
                        T.tma_store_wait(0)            # the last stores have read ds_s before the CTA exits
                    if state_v_first:
                        for i, j in T.Parallel(V, K):
                            dh0[n64, i_hv, i, j] = ds_f[i, j]
                    else:
                        for i, j in T.Parallel(V, K):
                            dh0[n64, i_hv, j, i] = ds_f[i, j]
                    mark.end()
                else:
                    # ================= chunk warpgroup: loads, Ag, P, Pg, Vd, dP, the inverse's dAt, sums ==========
                    ta = tx - A0
                    vd_f = T.alloc_fragment((BT, V), acc)
                    p_f = T.alloc_fragment((BT, BT), acc)
                    x_f = T.alloc_fragment((BT, BT), acc)
                    mx_f = T.alloc_fragment((BT, BT), acc)
                    dag_f = T.alloc_fragment((BT, BT), acc)
                    kk_f = T.alloc_fragment((BT, BT), acc)
                    daba_f = T.alloc_fragment((BT, BT), acc)
                    x2_f = T.alloc_fragment((BT, BT), acc)
                    dl_f = T.alloc_fragment((BT, BT), acc)
                    rbt_f = T.alloc_fragment((BT, BT), acc)
                    gam_f = T.alloc_fragment((BT, BT), acc)         # Gamma, from Pg's pass to dA's
                    # the gates of this thread's rows (i) and columns (j), loaded into registers before each pass
                    # that reads them (read from shared memory per element, they are reloaded after every store:
                    # the compiler cannot tell the tiles apart)
                    gi_f = T.alloc_fragment((BT,), acc)             # G_i log2(e)
                    gj_f = T.alloc_fragment((BT,), acc)             # G_j log2(e)
                    bi_f = T.alloc_fragment((BT,), acc)             # beta_i
                    bj_f = T.alloc_fragment((BT,), acc)             # beta_j
                    red_m = T.alloc_fragment((BT,), acc)
                    red_l = T.alloc_fragment((BT,), acc)
                    gl = T.alloc_local((2,), acc)                   # the next chunk's G and beta of row ta
                    tot = T.alloc_local((1,), acc)
                    if NT > 0:
                        # the last chunk's tiles and gates; rows past the sequence end are zeroed before the arrivals
                        cl = NT - 1
                        t0 = bos + cl * BT
                        ln = T.min(eos - t0, BT)
                        if ta < 32:
                            T.tma_copy(k[0, t0:t0 + BT, i_h, 0:K], kv_s[0, :, :], barrier=first[0])
                            T.tma_copy(q[0, t0:t0 + BT, i_h, 0:K], q_s, barrier=first[0])
                            T.tma_copy(v[0, t0:t0 + BT, i_hv, 0:V], v_s, barrier=first[0])
                            T.tma_copy(A[0, t0:t0 + BT, i_hv, 0:BT], a_s, barrier=first[0])
                            T.tma_copy(do[0, t0:t0 + BT, i_hv, 0:V], do_s, barrier=first[0])
                            T.tma_copy(h[T.cast(slot0 + cl, "int64"), i_hv, 0:V, 0:K], h_s, barrier=first[0])
                            T.barrier_arrive(first[0])
                        fetch_gates(cl, bos, eos, i_hv, ta, g, beta, gl)
                        store_gates(0, ta, gl, g_s, b_s)
                        T.barrier_wait(first[0], 0)
                        if ln < BT:
                            for i, j in T.Parallel(BT, K):
                                if i >= ln:
                                    q_s[i, j] = T.cast(0, dtype)
                                    kv_s[0, i, j] = T.cast(0, dtype)
                            for i, j in T.Parallel(BT, V):
                                if i >= ln:
                                    v_s[i, j] = T.cast(0, dtype)
                                    do_s[i, j] = T.cast(0, dtype)
                            for i, j in T.Parallel(BT, BT):
                                if i >= ln:
                                    a_s[i, j] = T.cast(0, dtype)
                        T.fence_proxy_async()
                        T.sync_threads(2, 128)                                              # the zeroed rows, gates
                        make_ag(0, a_s, g_s, b_s, ag_s, x2_f, gi_f, gj_f, bj_f)
                        if ta < 32:
                            T.barrier_arrive(full_k[0])
                            T.barrier_arrive(full_qh[0])
                            T.barrier_arrive(full_do[0])
                        T.barrier_arrive(full_va[0])
                        T.barrier_arrive(full_g[0])
                    for cc in T.serial(NT):
                        c = NT - 1 - cc
                        t0 = bos + c * BT
                        ln = T.min(eos - t0, BT)
                        ph = cc % 2
                        gs = cc % 2
                        kb = cc % 2
                        T.barrier_wait(full_k[0], ph)
                        T.barrier_wait(full_qh[0], ph)
                        mark(cc, "a.k")
                        # ---- P = Q K^T, Pg (pg_s and dp_s are free once the previous chunk's dk is complete) ----
                        T.wgmma_gemm(q_s, kv_s[kb, :, :], p_f, transpose_B=True, clear_accum=True)    # P = Q K^T
                        T.wait_wgmma(0)
                        mark(cc, "a.qk")
                        if cc > 0:
                            T.barrier_wait(dk_done[0], ph ^ 1)
                        mark(cc, "a.dkd")
                        for i in T.Parallel(BT):
                            gi_f[i] = g_s[gs, i] * LOG2E
                        for j in T.Parallel(BT):
                            gj_f[j] = g_s[gs, j] * LOG2E
                        for i, j in T.Parallel(BT, BT):
                            # Gamma_ij = exp(G_i - G_j) for i >= j, exactly 0 above the diagonal; one exp2 per
                            # element, reused by dP and dA
                            gam_f[i, j] = T.exp2(T.Select(i >= j, gi_f[i] - gj_f[j], -T.infinity(acc)))
                            pg_s[i, j] = T.cast(p_f[i, j] * gam_f[i, j] * scale, dtype)
                        T.fence_proxy_async()
                        T.sync_threads(2, 128)
                        T.barrier_arrive(prep_ready[0])
                        mark(cc, "a.prep")
                        # ---- the previous chunk's gates by plain loads under the wait for W (an outstanding load at
                        # a wgmma's fence would stall it); that gate buffer's readers are done. Then Vd = Ag W,
                        # dPg = dO Vd^T, Mx's first term, dP ----
                        if c > 0:
                            fetch_gates(c - 1, bos, eos, i_hv, ta, g, beta, gl)
                        T.barrier_wait(w_ready[0], ph)
                        mark(cc, "a.w")
                        if c > 0:
                            store_gates((cc + 1) % 2, ta, gl, g_s, b_s)
                            T.barrier_arrive(full_g[(cc + 1) % 2])
                        mark(cc, "a.g")
                        T.wgmma_gemm(ag_s, v_s, vd_f, clear_accum=True)                    # Vd = Ag W
                        T.wait_wgmma(0)
                        T.copy(vd_f, kv_s[1 - kb, :, :])
                        T.fence_proxy_async()
                        T.sync_threads(2, 128)
                        mark(cc, "a.vd")
                        T.barrier_wait(full_do[0], ph)
                        T.wgmma_gemm(do_s, kv_s[1 - kb, :, :], x_f, transpose_B=True, clear_accum=True)  # dPg = dO Vd^T
                        T.wait_wgmma(0)
                        mark(cc, "a.dpg")
                        for i, j in T.Parallel(BT, BT):
                            mx_f[i, j] = p_f[i, j] * gam_f[i, j] * scale * x_f[i, j]       # Pg o dPg
                            dp_s[i, j] = T.cast(x_f[i, j] * gam_f[i, j] * scale, dtype)    # dP
                        T.fence_proxy_async()
                        T.barrier_arrive(dp_ready[0])
                        T.reduce_sum(mx_f, red_m, dim=1)
                        for i in T.Parallel(BT):
                            vec_s[0, i] = red_m[i]
                        colsum(mx_f, part_s, vec_s, 1, ta)
                        mark(cc, "a.dp")
                        # ---- chain-dependent: dAg, the inverse's dL, dbeta's and dG's column terms, dAt ----
                        T.barrier_wait(dvd_ready[0], ph)
                        mark(cc, "a.dvd")
                        T.wgmma_gemm(dvd_s, v_s, dag_f, transpose_A=True, transpose_B=True,
                                     clear_accum=True)                                  # dAg = dVd W^T
                        T.wgmma_gemm(kv_s[kb, :, :], kv_s[kb, :, :], kk_f, transpose_B=True, clear_accum=True)   # K K^T
                        T.wait_wgmma(0)
                        mark(cc, "a.dag")
                        for j in T.Parallel(BT):
                            bj_f[j] = b_s[gs, j]
                        for i, j in T.Parallel(BT, BT):
                            dab = gam_f[i, j] * dag_f[i, j]
                            ag_s[i, j] = T.cast(dab * bj_f[j], dtype)                      # dA
                            daba_f[i, j] = dab * T.cast(a_s[i, j], acc)
                            mx_f[i, j] = daba_f[i, j] * bj_f[j]                            # dAb o A o beta_j
                        T.fence_proxy_async()
                        colsum(daba_f, part_s, vec_s, 2, ta)                                # (its barrier covers dA)
                        mark(cc, "a.da")
                        T.wgmma_gemm(a_s, ag_s, x2_f, transpose_A=True, clear_accum=True)  # A^T dA
                        T.wait_wgmma(0)
                        T.sync_threads(2, 128)
                        T.copy(x2_f, ag_s)
                        T.fence_proxy_async()
                        T.sync_threads(2, 128)
                        mark(cc, "a.atda")
                        T.wgmma_gemm(ag_s, a_s, dl_f, transpose_B=True, clear_accum=True)  # (A^T dA) A^T
                        T.reduce_sum(mx_f, red_m, dim=1)
                        for i in T.Parallel(BT):
                            vec_s[4, i] = red_m[i]
                        colsum(mx_f, part_s, vec_s, 5, ta)
                        T.wait_wgmma(0)
                        mark(cc, "a.dl")
                        if c > 0:
                            # v (W) and A are consumed: the previous chunk's
                            T.sync_threads(2, 128)
                            if ta < 32:
                                T.tma_copy(v[0, t0 - BT:t0, i_hv, 0:V], v_s, barrier=full_va[0])
                                T.tma_copy(A[0, t0 - BT:t0, i_hv, 0:BT], a_s, barrier=full_va[0])
                            T.barrier_arrive(full_va[0])
                        mark(cc, "a.vload")
                        # dL (strictly lower), rowsum(dL o K K^T), and dAt = diag(beta) dL stored whole (zero on and
                        # above the diagonal; the state WGs add dAt K and dAt^T K). Pg was last read by Y^T, before
                        # dvd_ready.
                        for i in T.Parallel(BT):
                            bi_f[i] = b_s[gs, i]
                        for i, j in T.Parallel(BT, BT):
                            dl_f[i, j] = T.Select(i > j, -dl_f[i, j], 0.0)
                            rbt_f[i, j] = dl_f[i, j] * kk_f[i, j]
                            pg_s[i, j] = T.cast(bi_f[i] * dl_f[i, j], dtype)
                        T.reduce_sum(rbt_f, red_l, dim=1)
                        for i in T.Parallel(BT):
                            vec_s[3, i] = red_l[i]
                        T.fence_proxy_async()
                        T.barrier_arrive(dat_ready[0])
                        mark(cc, "a.inv")
                        if c > 0:
                            # ---- the previous chunk's Ag (its A and gates are in; ag_s was last read by the
                            # (A^T dA) A^T product) ----
                            T.barrier_wait(full_va[0], ph ^ 1)
                            mark(cc, "a.va")
                            make_ag((cc + 1) % 2, a_s, g_s, b_s, ag_s, x2_f, gi_f, gj_f, bj_f)
                            mark(cc, "a.ag")
                        # ---- rows: dG (the last real row also gets e_L <dS1, S0> and the R-term total), dbeta. The
                        # state WGs rewrite their parts only after the next prep_ready ----
                        T.sync_threads(2, 128)                                              # vec_s
                        T.barrier_wait(rows_ready[0], ph)
                        if ta < BT:
                            tot[0] = 0.0
                            for w in T.serial(NW):
                                tot[0] = tot[0] + asum_s[w]
                            for w in T.serial(NW):
                                tot[0] = tot[0] + wsum_s[w]
                            if ta < ln:
                                r64 = T.cast(t0 + ta, "int64")
                                dg[0, r64, i_hv] = (parts(rs_s, 0, ta) + vec_s[0, ta] - vec_s[1, ta] + vec_s[4, ta]
                                                    - vec_s[5, ta] + parts(rs_s, 2, ta) - 2.0 * parts(rs_s, 1, ta)
                                                    + T.if_then_else(ta == ln - 1, tot[0], 0.0))
                                dbeta[0, r64, i_hv] = vec_s[2, ta] + vec_s[3, ta]
                        mark(cc, "a.rows")

    return chunk_bwd_kernel


def group_add(H: int, HV: int) -> bool:
    """Whether `chunk_bwd` sums dq and dk over each key head's value heads itself (the `group_add` build): at two value
    heads per key head, where the sum of two rounded tiles into a zeroed one is exact in either order; at three or more
    the order of the additions would change the rounding, so `group_sum` sums them in a fixed order."""
    return HV == 2 * H


def builder_args(H: int, HV: int, K: int, V: int, dtype: torch.dtype, beta_dtype: torch.dtype, scale: float,
                 has_dht: bool, state_v_first: bool, h_seqs: bool = False) -> tuple:
    """The `build` arguments (its compile-cache key) for one call."""
    args = (H, HV, K, V, _tl.TL_DTYPE[dtype], _tl.TL_DTYPE[beta_dtype], float(scale), bool(has_dht),
            bool(state_v_first))
    if h_seqs:
        return args + (group_add(H, HV), True)
    return args + (True,) if group_add(H, HV) else args


def launcher_builds(H: int, HV: int, K: int, V: int, dtype: torch.dtype, beta_dtype: torch.dtype, scale: float,
                    dht=(False, True), state_v_first=(False,), h_seqs=(False,)) -> list:
    """(label, builder, args) of every kernel `chunk_bwd` launches for these heads, dims and dtypes, with and without
    a final-state gradient, in the given state layouts, with or without `h_seqs`."""
    return [(f"chunk_bwd H={H} HV={HV} K={K} V={V} dht={has_dht} v_first={vfirst}" + (" h_seqs" if hs else ""),
             build, builder_args(H, HV, K, V, dtype, beta_dtype, scale, has_dht, vfirst, hs))
            for has_dht in dht for vfirst in state_v_first for hs in h_seqs]


def _check_dqk(dqk, q, HV: int):
    """`chunk_bwd`'s ``dqk``: two contiguous ``[1, T, H, K]`` tensors in q's dtype on its device, given only where the
    kernel adds into zeroed dq and dk (`group_add`)."""
    _, T_, H, K = q.shape
    if not group_add(H, HV):
        raise ValueError(f"dqk: chunk_bwd adds into zeroed dq and dk only at HV = 2 H (got H={H}, HV={HV}); pass None")
    if not (isinstance(dqk, (tuple, list)) and len(dqk) == 2):
        raise TypeError(f"dqk: a (dq, dk) pair of tensors (zero-filled), got {type(dqk).__name__}")
    for name, t in zip(("dq", "dk"), dqk):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"dqk: {name} must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != (1, T_, H, K) or t.dtype != q.dtype or t.device != q.device or not t.is_contiguous():
            raise ValueError(f"dqk: {name} must be a contiguous [1, T, H, K] = {[1, T_, H, K]} {q.dtype} tensor on "
                             f"{q.device}, got {list(t.shape)} {t.dtype} on {t.device}")


def chunk_bwd(q, k, v, g_cumsum, beta, A, h, do, dht, cu_seqlens, *, scale, state_v_first=False, chunk_size=64,
              h_seqs=None, dqk=None):
    """Fused backward (docs/stages.md `chunk_bwd`).

    Args:
        q, k: ``[1, T, H, K]`` bf16/fp16; v, do: ``[1, T, HV, V]`` (do is cast to v's dtype); (K, V) in `HEAD_DIMS`.
        g_cumsum: ``[1, T, HV]`` fp32; beta: ``[1, T, HV]`` bf16, fp16 or fp32; A: ``[1, T, HV, BT]`` (q's dtype).
        h: ``[slots, HV, V, K]`` in q's dtype: the transposed state entering each chunk slot, from this backend's
            `state_recompute` (or the training forward's `chunk_fwd(save_states=True)`) over cu_seqlens, or with
            h_seqs over the sequences cu_seqlens' items are pieces of.
        h_seqs: None, or ``[N]`` integer: item n of cu_seqlens is a chunk-aligned piece (a context-parallel
            partition) of sequence ``h_seqs[n]`` of the cu_seqlens h was made over.
        dht: gradient of the final state, ``[N, HV, K, V]`` (``[N, HV, V, K]`` with state_v_first) fp32, or None.
        cu_seqlens: ``[N + 1]`` int32 (int64 is converted on the device).
        dqk: None, or where `group_add` the zero-filled ``(dq, dk)`` ``[1, T, H, K]`` in q's dtype to add into,
            filled by the caller ahead of the launch (context parallelism's backward zeroes them on its side stream
            beside earlier work); returned as dq and dk.

    Returns:
        ``dq, dk [1, T, HV, K]`` in q's dtype (per value head; ``[1, T, H, K]``, summed over each key head's two value
        heads, where `group_add`), ``dv [1, T, HV, V]`` in v's dtype, ``dbeta, dG [1, T, HV]`` fp32, ``dh0`` fp32 in
        the state layout; 0 on the padding tail. One launch of (N + 1) * HV CTAs (after a zero fill of dq and dk
        where `group_add` and no ``dqk`` is given); no host synchronisation.
    """
    _, T_, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.shape[0] - 1
    assert chunk_size == BT and (K, V) in HEAD_DIMS and HV % H == 0
    assert q.dtype == k.dtype == v.dtype and q.dtype in DTYPES
    assert g_cumsum.dtype == torch.float32 and h.dtype == q.dtype and h.shape[1:] == (HV, V, K)
    dev = q.device
    state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if dqk is not None:
        _check_dqk(dqk, q, HV)
        dq, dk = dqk
    elif group_add(H, HV):     # the kernel adds both value heads' tiles into a zeroed tile
        dq = torch.zeros((1, T_, H, K), dtype=q.dtype, device=dev)
        dk = torch.zeros((1, T_, H, K), dtype=q.dtype, device=dev)
    else:
        dq = _tl.alloc((1, T_, HV, K), q.dtype, dev)
        dk = _tl.alloc((1, T_, HV, K), q.dtype, dev)
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
    args = builder_args(H, HV, K, V, q.dtype, beta.dtype, scale, dht is not None, state_v_first, h_seqs is not None)
    if h_seqs is not None:
        assert tuple(h_seqs.shape) == (N,) and not h_seqs.dtype.is_floating_point, "h_seqs: integer [N]"
    extra = (h_seqs.to(torch.int32).contiguous(),) if h_seqs is not None else ()
    kernel = build(*args)
    kernel(q.contiguous(), k.contiguous(), v.contiguous(), g_cumsum.contiguous(), beta.contiguous(),
           A.to(q.dtype).contiguous(), h.contiguous(), do.to(v.dtype).contiguous(), dht_in, cu_seqlens,
           _tl.seq_order(cu_seqlens, HV), *extra, dq, dk, dv, dbeta, dG, dh0)
    return dq, dk, dv, dbeta, dG, dh0
