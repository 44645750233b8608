"""Per-role timeline of the fused forward (development tool: `fused_fwd.chunk_fwd_profiled`,
bench/profile_fwd.py): the event table and the markers the builder calls at each event.

With `profile=True` the builder adds one int64 output `prof [PROF_CTAS, PROF_CHUNKS, len(PROF_EVENTS)]`: one
designated thread per role (state WG thread 0, prep WG thread 128, load warp thread 256, store warp thread 288) of
each CTA with blockIdx.x < PROF_CTAS writes the SM cycle counter (%clock64) at each event of chunks
c < PROF_CHUNKS; everything else only evaluates the predicate. Entries never written stay as allocated (0).
The "m." entries live in row c = 0: clock64/globaltimer pairs at the state WG's start and end (cycles -> ns) and NT.
Chunk index convention: an event is filed under the chunk it belongs to (s.tail of chunk c is recorded in the
state loop iteration that starts chunk c+1). With profile=False nothing here reaches the kernel.
"""
import tilelang.language as T

PROF_CTAS = 2
PROF_CHUNKS = 128
PROF_EVENTS = (
    # meta (row 0)
    "m.clk0", "m.gt0", "m.clk1", "m.gt1", "m.nt",
    # state WG, thread 0, chunk c (overlap path order: s.full, s.prep, [s.tail c-1], s.vd_issued, [s.released..
    # s.o_staged c-1], s.vd_done, s.fin_begin, s.fin_o1, s.fin_end, [s.full/s.prep c+1], s.tail, s.released ...)
    "s.full",       # full[c] wait returned (q/k/v/A/g/beta of chunk c in shared memory)
    "s.prep",       # prep_done[c] wait returned (Ag, Ae or Xn, Pg, r, dq, e_L of chunk c ready)
    "s.vd_issued",  # Vd^T GEMMs of chunk c issued (S0 -> bf16, Y = S0^T K^T complete, e_L state scale done)
    "s.vd_done",    # Vd^T of chunk c complete (wait_wgmma)
    "s.fin_begin",  # finish_chunk(c) starts: O^T = S0^T Q^T issued next
    "s.fin_o1",     # O^T = S0^T Q^T complete (wait_wgmma(1) inside finish_chunk; S1 GEMM still in flight)
    "s.fin_end",    # O^T += Vd^T Pg^T issued (finish_chunk(c) has issued everything)
    "s.tail",       # S1 = e_L S0 + (Vd R) K and O^T of chunk c complete
    "s.released",   # empty[c] and pout_empty[c] arrived (ring slot and prep buffers handed back)
    "s.o_empty",    # o_empty wait returned (store warp done with this o_s buffer)
    "s.o_staged",   # O^T of chunk c written to o_s, o_full arrived
    # prep WG, thread 128, chunk c
    "p.begin",      # loop top, before the full[c] wait
    "p.full",       # full[c] wait returned (after the ragged-row zeroing, if any)
    "p.qk_issued",  # Q K^T issued; A tile and g/beta loaded into registers
    "p.pout",       # pout_empty wait returned (state WG released this ae/xn, pg, r, dq buffer)
    "p.qk_done",    # Q K^T complete
    "p.ew_done",    # element-wise pass done (Gamma, Ag, A o beta, Pg in registers)
    "p.stored",     # Ae, Ag, Pg, r, dq, e_L stored
    "p.done",       # fenced, prep_done arrived
    # producer load warp, thread 256, chunk c
    "l.begin",      # loop top, before the empty wait
    "l.empty",      # ring slot free (empty, or empty_va with early_release)
    "l.va_issued",  # v and A TMA issued
    "l.qk_slot",    # q/k half of the slot free (= l.va_issued without early_release)
    "l.issued",     # q and k TMA issued, full arrived
    # store warp, thread 288, chunk c
    "w.begin",      # loop top, before the o_full wait
    "w.o_full",     # o_full wait returned
    "w.stored",     # o rows stored to global memory, o_empty arrived
)
PROF_INDEX = {name: i for i, name in enumerate(PROF_EVENTS)}
_PROF_ROLE_THREAD = {"s": 0, "p": 128, "l": 256, "w": 288, "m": 0}


class NoMarker:
    """profile=False: every mark is a Python-level no-op, so the traced kernel is exactly the uninstrumented one."""

    def __call__(self, c, ev):
        return None

    def later(self, c, ev):
        return lambda: None

    def cal(self, ev):
        return None


class Marker(NoMarker):
    """profile=True: each mark is one `fd_prof_*` call, predicated on (designated thread, bx, chunk) on the device."""

    def __init__(self, prof, bx, tx):
        self.prof, self.bx, self.tx = prof, bx, tx

    def _at(self, c, ev):
        on = (self.tx == _PROF_ROLE_THREAD[ev[0]]) & (self.bx < PROF_CTAS) & (c < PROF_CHUNKS)
        # bx is clamped so that the (unused) index of a non-recording CTA cannot overflow int32
        idx = (T.min(self.bx, PROF_CTAS - 1) * PROF_CHUNKS + c) * len(PROF_EVENTS) + PROF_INDEX[ev]
        return idx, on

    def __call__(self, c, ev):
        idx, on = self._at(c, ev)
        return T.call_extern("handle", "fd_prof_stamp", self.prof.data, idx, on)

    def later(self, c, ev):
        return lambda: self(c, ev)

    def cal(self, ev):
        idx, on = self._at(0, ev)
        return T.call_extern("handle", "fd_prof_cal", self.prof.data, idx, on)


def marker(profile: bool, prof, bx, tx):
    """The builder's `mark`: `Marker` when profiling, else the no-op `NoMarker`."""
    return Marker(prof, bx, tx) if profile else NoMarker()
