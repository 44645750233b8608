"""The synchronisation protocol of kernels/fused_fwd_wide.py (`chunk_fwd(wide=True)`) as a model: the two state
warpgroups (S0, S1), the prep warpgroup (P), the load warp (L), the gate warp (G) and the two store warps (W0, W1)
step through their mbarrier waits and arrivals, their TMA issues and their shared-memory reads and writes in the
kernel's order. Every interleaving tried must finish with no deadlock, no arrival past a barrier's count (the count
is exactly the threads that arrive per phase), every wait seeing exactly the completion it means with the parity the
kernel passes (never a later one, which the same parity would also let through), and every read seeing exactly the
version of a tile it means: not an older one (read before its write or its load landed) and not a newer one
(overwritten or reloaded before its last reader released it). A TMA load's data lands when its barrier's phase
completes; an asynchronous GEMM reads its operands from its issue to its wait (both reads are listed). Each
warpgroup is one actor: the order among its own warps (its stores before its own wgmma reads them: a proxy fence and
its named barrier) is not modelled. The op lists mirror the kernel by hand: change both together.

Ring slot, prep buffer and o buffer of chunk c: c % 2; the kernel's wait on chunk c's "full" side passes parity
(c // 2) % 2 (completion c // 2), on the "empty" side of the slot it reuses ((c // 2) % 2) ^ 1 (completion
c // 2 - 1, a fresh barrier's -1 passing at once).

`prep_loads=True` is the earlier two-state-warpgroup design's order (its prep warpgroup issued chunk c + 1's q/k
loads before arriving on chunk c's prep_done, waiting for the slot that the state warpgroups free only after that
arrival): the model deadlocks on it from three chunks per walk, as that kernel hung.

    python3 bench/dev/fused_fwd_wide_protocol.py

tests/cpu/test_fused_fwd_wide_protocol.py runs it in the CPU tier and checks that a wrong count or parity fails it.
"""
import random

NS = 2      # ring slots, prep buffers, o buffers


def counts(prep_loads: bool = False) -> dict:
    """Arrivals per phase, as the kernel's T.alloc_barrier gives them (per slot; o_* per V half and buffer)."""
    c = dict(full=64, empty=256, empty_va=256, prep_done=128, pout_empty=256, o_full=128, o_empty=32)
    if prep_loads:
        c["full"] = 64 + 128        # the prep warpgroup's arrival after its q/k loads
    return c


def bar(name, slot, half=None):
    return (name, slot) if half is None else (name, slot, half)


def wait(b, x):
    """Wait for completion x (0-based; -1: the first use of an "empty" barrier) of barrier b with the kernel's
    parity for chunk-derived x (x % 2, which for x = -1 is 1: the flipped parity of a fresh barrier)."""
    return ("wait", b, x, x % 2)


def rd(buf, ver):
    return ("read", buf, ver)


def wr(buf, ver):
    return ("write", buf, ver)


def arrive(b, n):
    return ("arrive", b, n)


def tma(buf, ver, b):
    return ("tma", buf, ver, b)


def state_role(NT, h):
    """State warpgroup h: its V half of the state chain, software-pipelined as the kernel."""
    def vag(c):      # V^T Ag^T: its columns of v, Ag
        s = c % NS
        return [rd(f"v{s}", ("V", c)), rd(f"a{s}", ("Ag", c))]

    def issue_ws(c):
        s = c % NS
        yield wr(f"sb{h}", c)                                           # bf16(S0^T), its rows
        yield rd(f"sb{h}", c); yield rd(f"k{s}", ("k", c))              # Y issued
        yield rd(f"el{s}", c)                                           # e_L S0^T under it
        for op in vag(c):                                               # wait_wgmma(0): V^T Ag^T and Y complete
            yield op
        yield rd(f"sb{h}", c); yield rd(f"k{s}", ("k", c))
        yield rd(f"ae{s}", c)                                           # Y Ae^T issued

    def finish(c):
        s = c % NS
        yield rd(f"sb{h}", c); yield rd(f"q{s}", ("q", c))              # O^T = S0^T Q^T issued
        yield rd(f"r{s}", c)
        yield rd(f"k{s}", ("k", c))                                     # S1 issued
        yield rd(f"sb{h}", c); yield rd(f"q{s}", ("q", c))              # wait_wgmma(1): O^T complete
        yield rd(f"dq{s}", c)
        yield rd(f"pg{s}", c)                                           # O^T += Vd^T Pg^T issued

    def tail_done(c):                                                   # S1 and O^T += .. complete
        s = c % NS
        yield rd(f"k{s}", ("k", c)); yield rd(f"pg{s}", c)

    def release(c):
        s = c % NS
        yield arrive(bar("empty", s), 128)
        yield arrive(bar("pout_empty", s), 128)
        yield wait(bar("o_empty", s, h), c // NS - 1)
        yield wr(f"o{h}{s}", c)
        yield arrive(bar("o_full", s, h), 128)

    if NT == 0:
        return
    yield wait(bar("full", 0), 0)
    yield wait(bar("prep_done", 0), 0)
    yield from vag(0)
    yield from issue_ws(0)
    yield rd("ae0", 0)                                                  # wait_wgmma(0)
    yield arrive(bar("empty_va", 0), 128)
    for c in range(NT - 1):
        s1 = (c + 1) % NS
        yield from finish(c)
        yield wait(bar("full", s1), (c + 1) // NS)
        yield wait(bar("prep_done", s1), (c + 1) // NS)
        yield from vag(c + 1)                                           # V^T Ag^T of chunk c + 1 issued
        yield from tail_done(c)                                         # wait_wgmma(1)
        yield from release(c)
        yield from issue_ws(c + 1)
        yield rd(f"ae{s1}", c + 1)                                      # wait_wgmma(0)
        yield arrive(bar("empty_va", s1), 128)
    yield from finish(NT - 1)
    yield from tail_done(NT - 1)                                        # wait_wgmma(0)
    yield from release(NT - 1)


def prep_role(NT, prep_loads=False):
    """The prep warpgroup: Q K^T, the gates, Ag in place over A, Ae, Pg and the row scalars of every chunk."""
    if prep_loads and NT > 0:
        yield tma("q0", ("q", 0), bar("full", 0)); yield tma("k0", ("k", 0), bar("full", 0))
        yield arrive(bar("full", 0), 128)
    for c in range(NT):
        s = c % NS
        yield wait(bar("full", s), c // NS)
        yield rd(f"q{s}", ("q", c)); yield rd(f"k{s}", ("k", c))       # ragged rows zeroed in place
        yield rd(f"v{s}", ("V", c)); yield rd(f"a{s}", ("A", c))
        yield rd(f"q{s}", ("q", c)); yield rd(f"k{s}", ("k", c))       # Q K^T issued
        yield rd(f"g{s}", c)                                            # G of its rows
        yield wait(bar("pout_empty", s), c // NS - 1)
        yield rd(f"q{s}", ("q", c)); yield rd(f"k{s}", ("k", c))       # Q K^T complete
        yield rd(f"a{s}", ("A", c)); yield rd(f"g{s}", c); yield rd(f"b{s}", c)
        yield wr(f"a{s}", ("Ag", c)); yield wr(f"ae{s}", c); yield wr(f"pg{s}", c)
        yield rd(f"g{s}", c)
        yield wr(f"r{s}", c); yield wr(f"dq{s}", c); yield wr(f"el{s}", c)
        if prep_loads and c + 1 < NT:
            # the earlier design: chunk c + 1's q/k before this chunk's prep_done
            s1 = (c + 1) % NS
            yield wait(bar("empty", s1), (c + 1) // NS - 1)
            yield tma(f"q{s1}", ("q", c + 1), bar("full", s1)); yield tma(f"k{s1}", ("k", c + 1), bar("full", s1))
            yield arrive(bar("full", s1), 128)
        yield arrive(bar("prep_done", s), 128)


def load_role(NT, prep_loads=False):
    """The load warp: v and A once the slot's v/A part is free, then q and k once all of it is."""
    for c in range(NT):
        s = c % NS
        yield wait(bar("empty_va", s), c // NS - 1)
        yield tma(f"v{s}", ("V", c), bar("full", s)); yield tma(f"a{s}", ("A", c), bar("full", s))
        if not prep_loads:
            yield wait(bar("empty", s), c // NS - 1)
            yield tma(f"q{s}", ("q", c), bar("full", s)); yield tma(f"k{s}", ("k", c), bar("full", s))
        yield arrive(bar("full", s), 32)


def gate_role(NT):
    """The gate warp: g and beta by plain stores into the slot."""
    for c in range(NT):
        s = c % NS
        yield wait(bar("empty_va", s), c // NS - 1)
        yield wr(f"g{s}", c); yield wr(f"b{s}", c)
        yield arrive(bar("full", s), 32)


def store_role(NT, h):
    """Store warp h: V half h's o rows of every chunk."""
    for c in range(NT):
        s = c % NS
        yield wait(bar("o_full", s, h), c // NS)
        yield rd(f"o{h}{s}", c)
        yield arrive(bar("o_empty", s, h), 32)


class Model:
    def __init__(self, NT, prep_loads=False, count=None):
        self.NT = NT
        self.count = count or counts(prep_loads)
        self.roles = {"S0": state_role(NT, 0), "S1": state_role(NT, 1), "P": prep_role(NT, prep_loads),
                      "L": load_role(NT, prep_loads), "G": gate_role(NT), "W0": store_role(NT, 0),
                      "W1": store_role(NT, 1)}
        self.phase, self.pend, self.tma = {}, {}, {}
        self.buf = {}                                 # buffer -> version; "pending" while a load is in flight
        self.cur = {r: next(g, None) for r, g in self.roles.items()}

    def fail(self, msg):
        raise AssertionError(f"NT={self.NT}: {msg}")

    def runnable(self, r):
        op = self.cur[r]
        if op is None:
            return False
        if op[0] == "wait":
            return self.phase.get(op[1], 0) > op[2]
        return True

    def step(self, r):
        op = self.cur[r]
        kind = op[0]
        if kind == "arrive":
            _, b, n = op
            self.pend[b] = self.pend.get(b, 0) + n
            if self.pend[b] > self.count[b[0]]:
                self.fail(f"{r}: over-arrival on {b}")
            if self.pend[b] == self.count[b[0]]:
                self.phase[b] = self.phase.get(b, 0) + 1
                self.pend[b] = 0
                for buf, ver in self.tma.pop(b, []):
                    self.buf[buf] = ver
        elif kind == "wait":
            _, b, x, parity = op
            if parity != x % 2:
                self.fail(f"{r}: waits completion {x} of {b} with parity {parity}")
            if self.phase.get(b, 0) != x + 1:
                self.fail(f"{r}: waits completion {x} of {b} but it is at {self.phase.get(b, 0)} (parity alias)")
        elif kind == "tma":
            _, buf, ver, b = op
            self.buf[buf] = "pending"
            self.tma.setdefault(b, []).append((buf, ver))
        elif kind == "write":
            self.buf[op[1]] = op[2]
        elif kind == "read":
            _, buf, ver = op
            if self.buf.get(buf) != ver:
                self.fail(f"{r}: reads {buf} as {ver} but it holds {self.buf.get(buf)}")
        self.cur[r] = next(self.roles[r], None)

    def run(self, pick):
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


def run(NT, prep_loads=False):
    """Each role as far as it can go, first role first, then last role first."""
    Model(NT, prep_loads).run(lambda ready: ready[0])
    Model(NT, prep_loads).run(lambda ready: ready[-1])


def run_random(NT, rng, prep_loads=False):
    """One random interleaving of the roles."""
    Model(NT, prep_loads).run(rng.choice)


if __name__ == "__main__":
    for NT in range(0, 9):
        run(NT)
    rng = random.Random(0)
    for _ in range(3000):
        run_random(rng.randrange(0, 9), rng)
    hangs = []
    for NT in range(0, 6):
        try:
            run(NT, prep_loads=True)
        except AssertionError as e:
            assert "deadlock" in str(e), e
            hangs.append(NT)
    print("protocol ok: NT 0..8 in order (both role orders), 3000 random interleavings; the earlier design's "
          f"prep-issued q/k loads deadlock at NT {hangs}")
