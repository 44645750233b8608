"""The synchronisation protocol of the in-kernel-prepare variant (bench/dev/fused_fwd_wide_inv.py) in the wide build's
protocol model (bench/dev/fused_fwd_wide_protocol.py: its checker, its state, gate and store roles): the load warp
loads v, q and k (no A); the prep warpgroup writes A into the ring slot itself (the inverse, after `full` and
`pout_empty`), with L's hi/lo rows and the exchanges in the prep buffer it is about to fill (versions ("L", c) of ae
and pg, which the pass overwrites); with `early_release` the state warpgroups free chunk c's slot and prep buffers
once its GEMMs complete, before they wait for chunk c + 1. The inverse's own named barriers (1, 4, 5, 6: inside the
prep warpgroup) are not modelled: the model's actors are whole warpgroups. `qk_first` moves only the prep
warpgroup's Q K^T reads, which the `full` wait already covers.

A mutation check: the prep warpgroup writing A before its `full` wait (before the state warpgroups' V^T Ag^T of
chunk c - 2 has released the slot's A tile) must fail on some interleaving from the first reuse of a slot (3 chunks).

    python3 bench/dev/fused_fwd_wide_inv_protocol.py
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fused_fwd_wide_protocol as base  # noqa: E402
from fused_fwd_wide_protocol import NS, arrive, bar, rd, tma, wait, wr  # noqa: E402


def state_role(NT, h, early_release):
    """State warpgroup h as the variant runs it (the wide build's order, or with the early release)."""
    if not early_release:
        yield from base.state_role(NT, h)
        return

    def vag(c):
        s = c % NS
        return [rd(f"v{s}", ("V", c)), rd(f"a{s}", ("Ag", c))]

    def issue_ws(c):
        s = c % NS
        yield wr(f"sb{h}", c)
        yield rd(f"sb{h}", c); yield rd(f"k{s}", ("k", c))
        yield rd(f"el{s}", c)
        for op in vag(c):
            yield op
        yield rd(f"sb{h}", c); yield rd(f"k{s}", ("k", c))
        yield rd(f"ae{s}", c)

    def finish(c):
        s = c % NS
        yield rd(f"sb{h}", c); yield rd(f"q{s}", ("q", c))
        yield rd(f"r{s}", c)
        yield rd(f"k{s}", ("k", c))
        yield rd(f"sb{h}", c); yield rd(f"q{s}", ("q", c))
        yield rd(f"dq{s}", c)
        yield rd(f"pg{s}", c)

    def tail_done(c):
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
    yield rd("ae0", 0)
    yield arrive(bar("empty_va", 0), 128)
    for c in range(NT - 1):
        s1 = (c + 1) % NS
        yield from finish(c)
        yield from tail_done(c)                                         # wait_wgmma(0)
        yield from release(c)                                           # before chunk c + 1's waits
        yield wait(bar("full", s1), (c + 1) // NS)
        yield wait(bar("prep_done", s1), (c + 1) // NS)
        yield from vag(c + 1)
        yield from issue_ws(c + 1)
        yield rd(f"ae{s1}", c + 1)
        yield arrive(bar("empty_va", s1), 128)
    yield from finish(NT - 1)
    yield from tail_done(NT - 1)
    yield from release(NT - 1)


def prep_role(NT, early_a=False):
    """The prep warpgroup: K K^T, the split and the inverse (A into the slot, L's rows in ae/pg), Q K^T, the pass."""
    for c in range(NT):
        s = c % NS
        if early_a:
            yield wr(f"a{s}", ("A", c))                                 # the mutation: A before the slot is free
        yield wait(bar("full", s), c // NS)
        yield rd(f"q{s}", ("q", c)); yield rd(f"k{s}", ("k", c))       # ragged rows zeroed in place
        yield rd(f"v{s}", ("V", c))
        yield wait(bar("pout_empty", s), c // NS - 1)
        yield rd(f"k{s}", ("k", c))                                     # K K^T
        yield wr(f"ae{s}", ("L", c)); yield wr(f"pg{s}", ("L", c))      # the split: L's hi/lo rows
        yield rd(f"b{s}", c)
        yield rd(f"ae{s}", ("L", c)); yield rd(f"pg{s}", ("L", c))      # the inverse reads them ...
        if not early_a:
            yield wr(f"a{s}", ("A", c))                                 # ... and writes A (128-thread barrier after)
        yield rd(f"q{s}", ("q", c)); yield rd(f"k{s}", ("k", c))       # Q K^T
        yield rd(f"g{s}", c)
        yield rd(f"a{s}", ("A", c)); yield rd(f"g{s}", c); yield rd(f"b{s}", c)
        yield wr(f"a{s}", ("Ag", c)); yield wr(f"ae{s}", c); yield wr(f"pg{s}", c)
        yield rd(f"g{s}", c)
        yield wr(f"r{s}", c); yield wr(f"dq{s}", c); yield wr(f"el{s}", c)
        yield arrive(bar("prep_done", s), 128)


def load_role(NT):
    """The load warp: v once the slot's v/A part is free, then q and k once all of it is (no A)."""
    for c in range(NT):
        s = c % NS
        yield wait(bar("empty_va", s), c // NS - 1)
        yield tma(f"v{s}", ("V", c), bar("full", s))
        yield wait(bar("empty", s), c // NS - 1)
        yield tma(f"q{s}", ("q", c), bar("full", s)); yield tma(f"k{s}", ("k", c), bar("full", s))
        yield arrive(bar("full", s), 32)


def model(NT, early_release, early_a=False):
    m = base.Model(NT)
    m.roles = {"S0": state_role(NT, 0, early_release), "S1": state_role(NT, 1, early_release),
               "P": prep_role(NT, early_a), "L": load_role(NT), "G": base.gate_role(NT),
               "W0": base.store_role(NT, 0), "W1": base.store_role(NT, 1)}
    m.cur = {r: next(g, None) for r, g in m.roles.items()}
    return m


def main() -> int:
    rng = random.Random(0)
    for er in (False, True):
        for NT in range(0, 9):
            model(NT, er).run(lambda ready: ready[0])
            model(NT, er).run(lambda ready: ready[-1])
        for _ in range(3000):
            model(rng.randrange(0, 9), er).run(rng.choice)
    caught = []
    for NT in range(1, 6):
        for _ in range(2000):
            try:
                model(NT, False, early_a=True).run(rng.choice)
            except AssertionError as e:
                assert "reads" in str(e), e
                caught.append(NT)
                break
    assert caught == [3, 4, 5], caught          # from the first reuse of a slot on
    print("variant protocol ok: NT 0..8 in order (both role orders) and 3000 random interleavings, with and without "
          f"the early release; the early A write fails at NT {caught}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
