"""The synchronisation protocol of kernels/chunk_bwd.py as a model: each state warpgroup (S0, S1 at V = 128; S0 alone
at V = 64) and the chunk warpgroup (A) step through their mbarrier waits and arrivals, the state warpgroups' named
barrier (bar.sync 1, ST) and their shared-memory reads and writes in the kernel's order. Every interleaving tried
must finish with no deadlock, no arrival past a barrier's count (the count is exactly the threads that arrive per
phase), every wait seeing exactly the completion it means with the parity the kernel passes (never a later one), and
every read seeing exactly the version of the tile it means: not an older one (read before its write) and not a newer
one (overwritten before its last reader released it). A TMA load's data lands when its barrier's phase completes; an
asynchronous product reads its operands from its issue to its wait (both are listed where a barrier step lies
between). Each warpgroup is one actor: the order among one warpgroup's warps (its writes before its own wgmma reads
them) is the kernel's bar.sync business and not modelled. The op lists mirror the kernel by hand: change both
together.

    python3 bench/dev/chunk_bwd_protocol.py

tests/cpu/test_chunk_bwd_protocol.py runs it in the CPU tier (fewer random interleavings) and checks that a wrong
barrier count or wait parity fails it.
"""
import random

A_THREADS = 128
PARTS = ("ds", "dvd", "du", "rs_q", "rs_k1", "rs_k2", "asum", "wsum")     # written per state warpgroup; v is written whole (TMA), then by part


def counts(nsw: int) -> dict:
    st = 128 * nsw
    c = dict(full_k=32, full_qh=32, full_va=A_THREADS, full_do=32, full_g0=A_THREADS,
             full_g1=A_THREADS, first=32, prep_ready=A_THREADS, dp_ready=A_THREADS, dat_ready=A_THREADS,
             w_ready=st, dvd_ready=st, dk_done=st, rows_ready=st)
    return c


def wait(bar, x, parity):
    """Wait for completion x (0-based) of bar; parity is the kernel's expression, which must be x's parity."""
    return ("wait", bar, x, parity)


def rd(buf, ver, part=None):
    return ("read", buf, ver, part)


def wr(buf, ver, part=None):
    return ("write", buf, ver, part)


def state_role(NT, w, nsw):
    """State warpgroup w: the dS chain, U and W, dv, dq, dk, the rows (warpgroup 0's first two warps)."""
    for cc in range(NT):
        ph, gs = cc % 2, cc % 2
        kb = cc % 2
        k, vd = f"kv{kb}", f"kv{1 - kb}"                              # this chunk's k and Vd tiles
        yield wait("full_k", cc, ph)
        yield wait("full_qh", cc, ph)
        yield wait(f"full_g{gs}", cc // 2, (cc // 2) % 2)
        yield rd(k, ("k", cc)); yield rd("h", cc)                     # U issued
        yield wr("ds", cc, w)                                         # dS1^T stored
        yield ("sync", "bar1")
        yield rd("ds", cc, w); yield rd(k, ("k", cc))                 # X^T issued (its rows of dS1^T)
        yield rd(k, ("k", cc)); yield rd("h", cc)                     # U complete
        yield wait("full_va", cc, ph)
        yield rd(f"g{gs}", cc); yield rd("v", ("V", cc), w); yield wr("v", ("W", cc), w)  # W = V - D U, its columns
        yield ("arrive", "w_ready", 128)
        yield rd("h", cc)                                             # <dS1, S0>
        yield rd("ds", cc, w); yield rd(k, ("k", cc))                 # X^T complete
        yield wait("full_do", cc, ph)
        yield wait("prep_ready", cc, ph)
        yield rd("do", cc); yield rd("pg", ("Pg", cc))                # Y^T
        yield rd("ag", ("Ag", cc))                                    # dv^T issued
        yield wr("dvd", cc, w)
        yield rd("ag", ("Ag", cc))                                    # dv^T complete
        yield ("arrive", "dvd_ready", 128)
        yield rd("do", cc); yield wr("du", cc, w)                     # (scale D dO)^T, dU^T stored
        yield rd("q", cc); yield rd(k, ("k", cc)); yield rd("h", cc); yield rd("do", cc)  # dS0^T, dO S0^T complete
        yield wr("wsum", cc, w)
        yield rd("q", cc); yield wr("rs_q", cc, w)                    # rowsum(Q o scale D dO S0^T)
        yield wait("dp_ready", cc, ph)
        yield rd("dp", cc); yield rd(k, ("k", cc))                    # dq += dP K
        yield rd(vd, ("Vd", cc)); yield rd("ds", cc)                  # Vd dS1^T (its columns of every row)
        yield rd(k, ("k", cc)); yield rd(f"g{gs}", cc); yield wr("rs_k1", cc, w)  # R o .., rowsum(K o ..)
        yield ("sync", "bar1")
        yield rd("du", cc); yield rd("h", cc)                         # dk += dU S0^T issued
        yield wr("asum", cc, w)                                       # the R-term total's parts
        yield rd("du", cc); yield rd("h", cc)                         # complete
        yield rd(k, ("k", cc)); yield wr("rs_k2", cc, w)
        yield rd("dp", cc); yield rd("q", cc)                         # dk += dP^T Q
        yield ("sync", "bar1")
        yield ("arrive", "rows_ready", 128)
        if w == 0 and cc < NT - 1:
            # its warp 0: the next chunk's k into this chunk's Vd tile, q, S0^T, dO
            yield ("tma", vd, ("k", cc + 1), "full_k"); yield ("tma", "q", cc + 1, "full_qh")
            yield ("tma", "h", cc + 1, "full_qh"); yield ("tma", "do", cc + 1, "full_do")
            for b in ("full_k", "full_qh", "full_do"):
                yield ("arrive", b, 32)
        yield wait("dat_ready", cc, ph)
        yield rd("pg", ("dAt", cc)); yield rd(k, ("k", cc))           # dk += (dAt + dAt^T) K issued
        yield rd("pg", ("dAt", cc)); yield rd(k, ("k", cc))           # complete
        yield ("arrive", "dk_done", 128)


def chunk_role(NT):
    """The chunk warpgroup: the loads, P, Pg, Vd, dP, the inverse's dAt and the sums."""
    if NT > 0:
        for b in ("q", "kv0", "v", "a", "do", "h"):
            yield ("tma", b, {"v": ("V", 0), "kv0": ("k", 0)}.get(b, 0), "first")
        yield ("arrive", "first", 32)
        yield wr("g0", 0)
        yield wait("first", 0, 0)
        yield rd("a", 0); yield rd("g0", 0); yield wr("ag", ("Ag", 0))
        for b in ("full_k", "full_qh", "full_do"):
            yield ("arrive", b, 32)
        for b in ("full_va", "full_g0"):
            yield ("arrive", b, A_THREADS)
    for cc in range(NT):
        c = NT - 1 - cc
        ph, gs = cc % 2, cc % 2
        kb = cc % 2
        k, vd = f"kv{kb}", f"kv{1 - kb}"
        yield wait("full_k", cc, ph); yield wait("full_qh", cc, ph)
        yield rd("q", cc); yield rd(k, ("k", cc))                     # P
        if cc > 0:
            yield wait("dk_done", cc - 1, ph ^ 1)                     # pg_s, dp_s released
        yield rd(f"g{gs}", cc); yield wr("pg", ("Pg", cc))
        yield ("arrive", "prep_ready", A_THREADS)
        yield wait("w_ready", cc, ph)
        if c > 0:
            yield wr(f"g{(cc + 1) % 2}", cc + 1)
            yield ("arrive", f"full_g{(cc + 1) % 2}", A_THREADS)
        yield rd("ag", ("Ag", cc)); yield rd("v", ("W", cc))          # Vd
        yield wr(vd, ("Vd", cc))
        yield wait("full_do", cc, ph)
        yield rd("do", cc); yield rd(vd, ("Vd", cc))                  # dPg
        yield wr("dp", cc)
        yield ("arrive", "dp_ready", A_THREADS)
        yield wr("vec", cc)                                           # Mx's first term's sums
        yield wait("dvd_ready", cc, ph)
        yield rd("dvd", cc); yield rd("v", ("W", cc)); yield rd(k, ("k", cc))   # dAg, K K^T
        yield rd("a", cc); yield wr("ag", ("dA", cc)); yield wr("vec", cc)   # dA, colsum(dAb o A)
        yield rd("a", cc); yield rd("ag", ("dA", cc)); yield wr("ag", ("x2", cc))   # A^T dA
        yield rd("ag", ("x2", cc)); yield rd("a", cc)                 # (A^T dA) A^T, Mx's sums
        if c > 0:
            yield ("tma", "v", ("V", cc + 1), "full_va"); yield ("tma", "a", cc + 1, "full_va")
            yield ("arrive", "full_va", A_THREADS)
        yield rd(f"g{gs}", cc); yield wr("pg", ("dAt", cc)); yield wr("vec", cc)
        yield ("arrive", "dat_ready", A_THREADS)
        if c > 0:
            yield wait("full_va", cc + 1, ph ^ 1)
            yield rd("a", cc + 1); yield rd(f"g{(cc + 1) % 2}", cc + 1); yield wr("ag", ("Ag", cc + 1))
        yield wait("rows_ready", cc, ph)
        for b in ("rs_q", "rs_k1", "rs_k2", "asum", "wsum", "vec"):
            yield rd(b, cc)                                           # the rows


class Model:
    def __init__(self, NT, nsw):
        self.NT, self.nsw = NT, nsw
        self.count = counts(nsw)
        self.phase = {b: 0 for b in self.count}
        self.pend = {b: 0 for b in self.count}
        self.tma = {b: [] for b in self.count}       # loads landing at the barrier's next completion
        self.buf = {}                                 # (buffer, part) -> version; "pending" while a load is in flight
        self.roles = {f"S{w}": state_role(NT, w, nsw) for w in range(nsw)}
        self.roles["A"] = chunk_role(NT)
        self.cur = {r: next(g, None) for r, g in self.roles.items()}
        self.synced = {r: 0 for r in self.roles if r[0] == "S"}    # bar1 syncs passed per state warpgroup
        self.at_sync = {r: False for r in self.synced}

    def parts(self, buf):
        return range(self.nsw) if buf in PARTS or buf == "v" else (None,)

    def set(self, buf, ver, part):
        for p in (self.parts(buf) if part is None else (part,)):
            self.buf[(buf, p)] = ver

    def fail(self, msg):
        raise AssertionError(f"NT={self.NT} V={64 * self.nsw}: {msg}")

    def runnable(self, r):
        op = self.cur[r]
        if op is None:
            return False
        if op[0] == "wait":
            return self.phase[op[1]] > op[2]
        if op[0] == "sync":
            # passes once every state warpgroup has reached this sync
            return all(self.synced[s] + self.at_sync[s] > self.synced[r] for s in self.synced)
        return True

    def step(self, r):
        op = self.cur[r]
        kind = op[0]
        if kind == "arrive":
            _, b, x = op
            self.pend[b] += x
            if self.pend[b] > self.count[b]:
                self.fail(f"{r}: over-arrival on {b}")
            if self.pend[b] == self.count[b]:
                self.phase[b] += 1
                self.pend[b] = 0
                for buf, ver in self.tma[b]:
                    self.set(buf, ver, None)
                self.tma[b] = []
        elif kind == "wait":
            _, b, x, parity = op
            if parity != x % 2:
                self.fail(f"{r}: waits completion {x} of {b} with parity {parity}")
            if self.phase[b] != x + 1:
                self.fail(f"{r}: waits completion {x} of {b} but it is at {self.phase[b]} (parity alias)")
        elif kind == "sync":
            self.at_sync[r] = False
            self.synced[r] += 1
        elif kind == "tma":
            _, buf, ver, b = op
            self.set(buf, "pending", None)
            self.tma[b].append((buf, ver))
        elif kind == "write":
            _, buf, ver, part = op
            self.set(buf, ver, part)
        elif kind == "read":
            _, buf, ver, part = op
            for p in (self.parts(buf) if part is None else (part,)):
                have = self.buf.get((buf, p))
                if have != ver:
                    self.fail(f"{r}: reads {buf}[{p}] as {ver} but it holds {have}")
        self.cur[r] = next(self.roles[r], None)
        if self.cur[r] is not None and self.cur[r][0] == "sync":
            self.at_sync[r] = True

    def run(self, pick):
        for r, op in self.cur.items():
            if op is not None and op[0] == "sync":
                self.at_sync[r] = True
        while any(op is not None for op in self.cur.values()):
            ready = [r for r in self.cur if self.runnable(r)]
            if not ready:
                self.fail(f"deadlock at {self.cur}")
            self.step(pick(ready))
        left = {b: p for b, p in self.pend.items() if p}
        if left:
            self.fail(f"partial phases left {left}")
        if any(self.tma.values()):
            self.fail(f"loads never landed {self.tma}")


def run(NT, nsw):
    """Each role as far as it can go, in a fixed order."""
    Model(NT, nsw).run(lambda ready: ready[0])


def run_random(NT, nsw, rng):
    """One random interleaving of the roles."""
    Model(NT, nsw).run(rng.choice)


if __name__ == "__main__":
    for nsw in (1, 2):
        for NT in range(0, 7):
            run(NT, nsw)
            Model(NT, nsw).run(lambda ready: ready[-1])
    rng = random.Random(0)
    for _ in range(3000):
        run_random(rng.randrange(0, 8), rng.choice((1, 2)), rng)
    print("protocol ok: NT 0..6 in order (both role orders), 3000 random interleavings, V = 64 and 128")
