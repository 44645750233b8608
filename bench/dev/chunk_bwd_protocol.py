"""The mbarrier protocol of kernels/chunk_bwd.py as a model: each role (the state warpgroups, the chunk warpgroup)
steps through its barrier waits and arrivals in the kernel's order; every interleaving tried must finish with no
deadlock, no arrival past a barrier's count and every wait seeing exactly the completion it means (never a later
one: a reused buffer overwritten early). The op lists mirror the kernel by hand: change both together.

    python3 bench/dev/chunk_bwd_protocol.py
"""
import random
ST, A = 256, 128
COUNTS = dict(full_qk=A, full_va=A, full_do=A, full_h=A, full_g0=A, full_g1=A, first=32, qk_free=ST, do_free=ST,
              h_free=ST, prep_ready=A, ds_ready=ST, ds_free=A, dvd_free=A, du_ready=ST, du_free=A)

def state_role(NT):
    for cc in range(NT):
        yield ("wait", "full_qk", cc)
        if cc >= 1: yield ("wait", "ds_free", cc - 1)
        yield ("arrive", "ds_ready", ST)
        yield ("wait", f"full_g{cc % 2}", cc // 2)
        yield ("wait", "full_h", cc)
        yield ("arrive", "h_free", ST)
        yield ("wait", "full_do", cc)
        yield ("wait", "prep_ready", cc)
        if cc >= 1: yield ("wait", "dvd_free", cc - 1)
        yield ("arrive", "do_free", ST)
        if cc >= 1: yield ("wait", "du_free", cc - 1)
        yield ("arrive", "du_ready", ST)
        yield ("arrive", "qk_free", ST)

def chunk_role(NT):
    if NT > 0:
        yield ("arrive", "first", 32)
        yield ("wait", "first", 0)
        for b in ("full_qk", "full_va", "full_do", "full_h", "full_g0"):
            yield ("arrive", b, A)
    for cc in range(NT):
        c = NT - 1 - cc
        yield ("wait", "full_qk", cc); yield ("wait", "full_h", cc)
        yield ("wait", f"full_g{cc % 2}", cc // 2); yield ("wait", "full_va", cc)
        yield ("arrive", "prep_ready", A)
        yield ("wait", "full_do", cc)
        yield ("wait", "du_ready", cc)
        if c > 0:
            yield ("wait", "do_free", cc); yield ("arrive", "full_do", A)
        yield ("arrive", "dvd_free", A)
        if c > 0: yield ("arrive", "full_va", A)
        yield ("wait", "ds_ready", cc)
        yield ("arrive", "ds_free", A)
        yield ("arrive", "du_free", A)
        if c > 0:
            yield ("wait", "qk_free", cc); yield ("wait", "h_free", cc)
            yield ("arrive", "full_qk", A); yield ("arrive", "full_h", A); yield ("arrive", f"full_g{(cc + 1) % 2}", A)

def run(NT):
    phase = {b: 0 for b in COUNTS}; pend = {b: 0 for b in COUNTS}
    roles = {"S": state_role(NT), "A": chunk_role(NT)}
    cur = {r: next(g, None) for r, g in roles.items()}
    while any(v is not None for v in cur.values()):
        progressed = False
        for r, op in cur.items():
            if op is None: continue
            kind, b, x = op
            if kind == "arrive":
                pend[b] += x
                assert pend[b] <= COUNTS[b], f"NT={NT}: over-arrival on {b}"
                if pend[b] == COUNTS[b]: phase[b] += 1; pend[b] = 0
            else:
                if phase[b] <= x: continue           # completion x not yet there
                assert phase[b] == x + 1, f"NT={NT}: {r} waits completion {x} of {b} but it is at {phase[b]} (aliasing)"
            cur[r] = next(roles[r], None); progressed = True
        if not progressed:
            raise AssertionError(f"NT={NT}: deadlock at {cur}")
    left = {b: p for b, p in pend.items() if p}
    assert not left, f"NT={NT}: partial phases left {left}"

def run_random(NT, rng):
    """One random interleaving of the two roles."""
    phase = {b: 0 for b in COUNTS}; pend = {b: 0 for b in COUNTS}
    roles = {"S": state_role(NT), "A": chunk_role(NT)}
    cur = {r: next(g, None) for r, g in roles.items()}
    while any(v is not None for v in cur.values()):
        runnable = [r for r, op in cur.items() if op is not None and (op[0] == "arrive" or phase[op[1]] > op[2])]
        assert runnable, f"NT={NT}: deadlock at {cur}"
        r = rng.choice(runnable)
        kind, b, x = cur[r]
        if kind == "arrive":
            pend[b] += x
            assert pend[b] <= COUNTS[b], f"NT={NT}: over-arrival on {b}"
            if pend[b] == COUNTS[b]:
                phase[b] += 1; pend[b] = 0
        else:
            assert phase[b] == x + 1, f"NT={NT}: {r} waits completion {x} of {b} but it is at {phase[b]}"
        cur[r] = next(roles[r], None)


if __name__ == "__main__":
    for NT in range(0, 7):
        run(NT)
    rng = random.Random(0)
    for _ in range(3000):
        run_random(rng.randrange(0, 8), rng)
    print("protocol ok: NT 0..6 in order, 3000 random interleavings")
