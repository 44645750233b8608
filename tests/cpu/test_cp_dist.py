"""Context parallelism across ranks (`flashdelta.distributed`) on CPU: gloo processes on the portable backend.

- `rank_slices`: pieces, chains (pre / post), pass-throughs, empty sequences, the rows of h0 and final states;
- two spawns (3 and 4 gloo processes): every rank's o, final states and every gradient (dq, dk, dv, dg, dbeta,
  dh0) equal the single-process `chunk_gated_delta_rule` on the whole set (its slice of it) to fp32 rounding
  (float64: ~1e-12). Cases: a sequence over three and four ranks (pass-through ranks), a rank holding several
  short sequences, a rank starting and ending mid-sequence, uneven offsets with an empty sequence at a boundary,
  h0 present / absent, dht present / absent, GVA, l2norm in the kernel, V-first states, the intra-rank split
  (partitions of 1-2 chunks), FLA's context fields instead of a `CPSlice`.
"""
from __future__ import annotations

import datetime
import os
import types

import pytest
import torch

from _helpers import assert_close
from flashdelta import chunk_gated_delta_rule
from flashdelta import distributed as fdist

F64 = torch.float64
FP32_TOL = 1e-5          # fp32 vs fp32: rounding only (measured <= 1.2e-6, on dg)
F64_TOL = 1e-12


def test_rank_slices():
    s = fdist.rank_slices([0, 40, 300, 310, 330, 600], 3)
    assert [x.cu for x in s] == [(0, 40, 200), (0, 100, 110, 130, 200), (0, 200)]
    assert [(x.pre, x.post) for x in s] == [(0, 1), (1, 1), (1, 0)]
    assert s[1].seq_ids == (1, 2, 3, 4) and s[1].starts == (1, 2, 3) and s[1].ends == (0, 1, 2)
    assert s[1].start_ids == (2, 3, 4) and s[1].end_ids == (1, 2, 3)
    assert not any(x.through for x in s) and not s[0].with_m and s[0].exchange
    s = fdist.rank_slices([0, 10, 590, 600], 3)
    assert [(x.pre, x.post, x.through) for x in s] == [(0, 2, False), (1, 1, True), (2, 0, False)]
    assert all(x.with_m for x in s) and s[1].starts == () and s[1].ends == ()
    s = fdist.rank_slices([0, 100, 100, 450, 450, 600, 600], 3, [0, 100, 450, 600])
    assert [x.seq_ids for x in s] == [(0,), (1, 2), (3, 4, 5)] and not s[0].exchange   # empty ones: the next rank
    assert s[2].cu == (0, 0, 150, 150)
    with pytest.raises(ValueError, match="divisible"):
        fdist.rank_slices([0, 10], 3)
    with pytest.raises(ValueError, match="strictly increasing"):
        fdist.rank_slices([0, 10], 2, [0, 10, 10])


# ----------------------------------------------------------------------------------------- gloo ranks

SCENARIOS = {
    3: [
        # name, global cu_seqlens, offsets (None: even), H, HV, K, V, options
        ("span3_through_h0_gva", [0, 10, 590, 600], None, 1, 2, 16, 8, dict(h0=True, dht=True)),
        ("short_and_mid_vfirst_l2", [0, 40, 300, 310, 330, 600], None, 2, 2, 8, 16,
         dict(h0=False, dht=True, l2norm=True, state_v_first=True)),
        ("uneven_empty_split", [0, 30, 30, 520, 600], [0, 100, 450, 600], 1, 2, 16, 8,
         dict(h0=True, dht=True, context_parallel=1)),
        ("fla_context_no_states", [0, 70, 400, 600], None, 2, 4, 8, 8, dict(fla=True)),
    ],
    4: [
        ("span4_split_h0_nodht", [0, 20, 900, 1000], None, 1, 2, 16, 16, dict(h0=True, context_parallel=2)),
        ("span4_float64", [0, 20, 900, 930, 1000], [0, 300, 500, 640, 1000], 1, 2, 8, 8,
         dict(h0=True, dht=True, dtype=F64)),
    ],
}


def _inputs(cu, H, HV, K, V, o, seed):
    gen = torch.Generator().manual_seed(seed)
    dt = o.get("dtype", torch.float32)
    T, N = cu[-1], len(cu) - 1

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    x = dict(q=torch.nn.functional.normalize(rnd(1, T, H, K), dim=-1), k=torch.nn.functional.normalize(
        rnd(1, T, H, K), dim=-1), v=rnd(1, T, HV, V), g=-torch.rand(1, T, HV, generator=gen, dtype=F64) * 0.3,
        beta=torch.sigmoid(rnd(1, T, HV)))
    x["g"][..., 0] = 0.0                                          # a never-decaying head carries state far
    svf = o.get("state_v_first", False)
    x["initial_state"] = rnd(N, HV, *((V, K) if svf else (K, V))) if o.get("h0") else None
    x = {n: (t.to(dt) if t is not None else None) for n, t in x.items()}
    do = rnd(1, T, HV, V).to(dt)
    dht = rnd(N, HV, *((V, K) if svf else (K, V))).to(dt).float() if o.get("dht") else None
    return x, do, dht


def _leaves(x):
    return {n: (t.clone().requires_grad_(True) if t is not None else None) for n, t in x.items()}


def _loss(o, ht, do, dht):
    loss = (o.double() * do.double()).sum()
    if dht is not None:
        loss = loss + (ht.double() * dht.double()).sum()
    return loss


def _run(rank, world, name, cu, offsets, H, HV, K, V, o, seed):
    x, do, dht = _inputs(cu, H, HV, K, V, o, seed)
    kw = dict(use_qk_l2norm_in_kernel=o.get("l2norm", False), state_v_first=o.get("state_v_first", False))
    # the single-process result on the whole set
    ref = _leaves(x)
    o_ref, ht_ref = chunk_gated_delta_rule(**ref, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                                           output_final_state=True, context_parallel=False, **kw)
    _loss(o_ref, ht_ref, do, dht).backward()
    sl = fdist.build_cp_slice(cu, offsets=offsets)
    t0 = (offsets or [r * (cu[-1] // world) for r in range(world + 1)])[rank]
    t1 = t0 + sl.T
    mine = {n: x[n][:, t0:t1] for n in ("q", "k", "v", "g", "beta")}
    starts, ends = list(sl.start_ids), list(sl.end_ids)
    mine["initial_state"] = x["initial_state"][starts] if x["initial_state"] is not None else None
    mine = _leaves(mine)
    if o.get("fla"):
        ctx = types.SimpleNamespace(group=None, cu_seqlens=torch.tensor(sl.cu), is_first_rank=sl.pre == 0,
                                    pre_num_ranks=sl.pre, is_last_rank=sl.post == 0, post_num_ranks=sl.post)
        where = dict(cp_context=ctx)
    else:
        where = dict(cp_slice=sl)
    out, ht = fdist.chunk_gated_delta_rule_cp(**mine, output_final_state=True,
                                              context_parallel=o.get("context_parallel"), **where, **kw)
    _loss(out, ht, do[:, t0:t1], dht[ends] if dht is not None else None).backward()
    tol = F64_TOL if o.get("dtype") == F64 else FP32_TOL
    at = f"{name} rank {rank}"
    assert_close(f"o ({at})", out, o_ref[:, t0:t1], tol=tol)
    assert_close(f"final ({at})", ht, ht_ref[ends], tol=tol)
    for n in ("q", "k", "v", "g", "beta"):
        assert_close(f"d{n} ({at})", mine[n].grad, ref[n].grad[:, t0:t1], tol=tol)
    if x["initial_state"] is not None and starts:
        assert_close(f"dh0 ({at})", mine["initial_state"].grad, ref["initial_state"].grad[starts], tol=tol)


def _worker(rank, world, init):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for seed, (name, cu, offsets, H, HV, K, V, o) in enumerate(SCENARIOS[world]):
            _run(rank, world, name, cu, offsets, H, HV, K, V, o, seed)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", sorted(SCENARIOS))
def test_ranks_equal_single_process(world, tmp_path):
    import torch.multiprocessing as mp

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(world, str(tmp_path / "init")), nprocs=world, join=True)
