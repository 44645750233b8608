"""The wide fused forward's synchronisation protocol (bench/dev/fused_fwd_wide_protocol.py, a model of
kernels/fused_fwd_wide.py's mbarrier waits and arrivals, TMA loads and every tile's reads against its writes) holds
for every chunk count in a fixed role order and on random interleavings; the model fails a wrong barrier count or a
wrong wait parity, and it hangs on the earlier two-state-warpgroup design's order (the prep warpgroup issuing chunk
c + 1's q/k loads before its prep_done of chunk c) from three chunks per walk, as that kernel hung on the GPU. Pure
Python, ~2 s."""
import importlib.util
import os
import random
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "dev", "fused_fwd_wide_protocol.py")


def _load():
    spec = importlib.util.spec_from_file_location("fused_fwd_wide_protocol", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


protocol = _load()


@pytest.mark.parametrize("NT", range(9))
def test_in_order(NT):
    """Each role as far as it can go, first role first and last role first."""
    protocol.run(NT)


def test_random_interleavings():
    rng = random.Random(0)
    for _ in range(1000):
        protocol.run_random(rng.randrange(0, 9), rng)


@pytest.mark.parametrize("barrier,delta", [("empty", -128), ("empty_va", 128), ("pout_empty", -128),
                                           ("prep_done", -32), ("full", 32), ("o_empty", 32)])
def test_a_wrong_barrier_count_fails(barrier, delta, monkeypatch):
    """One arrival count off by a warpgroup or a warp: a phase that never completes (deadlock, partial phase) or one
    that completes early (a wait that sees a later completion, an over-arrival, a tile read or overwritten too
    soon)."""
    real = protocol.counts

    def wrong(prep_loads=False):
        c = real(prep_loads)
        c[barrier] += delta
        return c

    monkeypatch.setattr(protocol, "counts", wrong)
    rng = random.Random(1)
    with pytest.raises(AssertionError, match="deadlock|parity alias|over-arrival|partial phases|reads"):
        for NT in range(1, 5):
            protocol.run(NT)
        for _ in range(300):
            protocol.run_random(rng.randrange(1, 6), rng)


def test_a_wrong_wait_parity_fails(monkeypatch):
    """The store warps' wait on o_full with the parity flipped."""
    real = protocol.store_role

    def flipped(NT, h):
        for op in real(NT, h):
            if op[0] == "wait":
                op = op[:3] + (op[3] ^ 1,)
            yield op

    monkeypatch.setattr(protocol, "store_role", flipped)
    with pytest.raises(AssertionError, match="parity"):
        protocol.run(2)


@pytest.mark.parametrize("NT", range(6))
def test_prep_issued_loads_hang_from_three_chunks(NT):
    """The earlier design's order: fine for walks of up to two chunks, a deadlock from three on."""
    if NT < 3:
        protocol.run(NT, prep_loads=True)
    else:
        with pytest.raises(AssertionError, match="deadlock"):
            protocol.run(NT, prep_loads=True)
