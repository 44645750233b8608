"""chunk_bwd's synchronisation protocol (bench/dev/chunk_bwd_protocol.py, a model of the kernel's mbarrier waits and
arrivals, its state warpgroups' named barrier and every tile's reads against its writes) holds for every chunk count
in a fixed role order and on random interleavings, at V = 64 (one state warpgroup) and V = 128 (two); and the model
fails a protocol with a wrong barrier count or a wrong wait parity, so a pass means something. Pure Python, ~1 s."""
import importlib.util
import os
import random
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "dev", "chunk_bwd_protocol.py")


def _load():
    spec = importlib.util.spec_from_file_location("chunk_bwd_protocol", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


protocol = _load()
STATE_WGS = (1, 2)      # V = 64, 128


@pytest.mark.parametrize("nsw", STATE_WGS, ids=["V64", "V128"])
@pytest.mark.parametrize("NT", range(7))
def test_in_order(NT, nsw):
    """Each role as far as it can go, first role first and last role first."""
    protocol.run(NT, nsw)
    protocol.Model(NT, nsw).run(lambda ready: ready[-1])


def test_random_interleavings():
    rng = random.Random(0)
    for _ in range(1000):
        protocol.run_random(rng.randrange(0, 8), rng.choice(STATE_WGS), rng)


@pytest.mark.parametrize("barrier,delta", [("dvd_ready", 128), ("dvd_ready", -128), ("full_va", -32),
                                           ("rows_ready", 128)])
def test_a_wrong_barrier_count_fails(barrier, delta, monkeypatch):
    """One arrival count off by a warpgroup or a warp: a phase that never completes (deadlock, partial phase) or one
    that completes early (a wait that sees a later completion, an over-arrival, a tile read too soon)."""
    real = protocol.counts

    def wrong(nsw):
        c = real(nsw)
        c[barrier] += delta
        return c

    monkeypatch.setattr(protocol, "counts", wrong)
    with pytest.raises(AssertionError, match="deadlock|parity alias|over-arrival|partial phases|reads"):
        for NT in range(1, 4):
            protocol.run(NT, 2)


def test_a_wrong_wait_parity_fails(monkeypatch):
    """The state warpgroups' wait on full_k with the parity flipped."""
    real = protocol.state_role

    def flipped(NT, w, nsw):
        for op in real(NT, w, nsw):
            if op[0] == "wait" and op[1] == "full_k":
                op = protocol.wait("full_k", op[2], op[3] ^ 1)
            yield op

    monkeypatch.setattr(protocol, "state_role", flipped)
    with pytest.raises(AssertionError, match="parity"):
        protocol.run(2, 2)
