"""Context parallelism across GPUs (`flashdelta.distributed`) over NCCL: correctness against one GPU, then the
time of one layer call's forward + backward against one GPU and the share of it spent in the collectives
(docs/dev/cp_dist.md).

Launched with torchrun, one process per GPU (2, 4 or 8). The script sets ``NCCL_NVLS_ENABLE=0`` and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` (NVLink multicast off) before NCCL starts.

1. Correctness (``--check-tokens``, default 32768 over ``--check-seqlens``): every rank builds the same global
   inputs (bf16 q, k, v; model gates, fp32 h0), runs the single-GPU `chunk_gated_delta_rule` on the whole set
   and `chunk_gated_delta_rule_cp` on its slice (even split), and compares its o, final states and every
   gradient with its slice of the single-GPU ones (relative L2; both run the same bf16 kernels, so the
   difference is fp32 accumulation order: the limit is ``--tol``, default 2e-3).
2. Timing (``--tokens``, default 262144 in one sequence, ``--heads`` 16/32): the single-GPU forward + backward
   on rank 0 (the others wait at a barrier), then the distributed forward + backward on every rank; per rep the
   step time is the slowest rank's (all_reduce MAX). CUDA events, eager (the collectives are not captured), a
   barrier before each rep. The communication share: the CUDA time of the two all_gathers inside the step
   (events around `distributed._all_gather`; this includes waiting for a slower rank) and, apart, the same
   all_gathers alone after a barrier (the transfer itself).

    torchrun --standalone --nproc_per_node 2 bench/dev/cp_dist_bench.py --out $OUT/cp_dist_2.csv
    torchrun --standalone --nproc_per_node 8 bench/dev/cp_dist_bench.py --heads 16/32 2/8 --out $OUT/cp_dist_8.csv
"""
from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")                 # NVLink multicast off (NCCL's NVLS)
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # and torch's symmetric memory

import argparse  # noqa: E402
import csv  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

K = V = 128


def parse_heads(s: str) -> tuple:
    h, hv = s.split("/")
    return int(h), int(hv)


def log(*a) -> None:
    if dist.get_rank() == 0:
        print(*a, flush=True)


def inputs(cu: list, H: int, HV: int, seed: int = 0, grad_states: bool = True) -> dict:
    """The global inputs, identical on every rank (the same seeded generators on every GPU)."""
    from flashdelta.testing import model_gate

    T, N = cu[-1], len(cu) - 1
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev, generator=gen), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev, generator=gen), dim=-1).bfloat16()
    v = torch.randn(1, T, HV, V, device=dev, generator=gen).bfloat16()
    g = model_gate(T, HV, generator=torch.Generator().manual_seed(seed)).float().to(dev)[None]
    beta = torch.sigmoid(torch.randn(1, T, HV, device=dev, generator=gen)).bfloat16()
    h0 = torch.randn(N, HV, K, V, device=dev, generator=gen) * 0.1 if grad_states else None
    do = torch.randn(1, T, HV, V, device=dev, generator=gen).bfloat16()
    dht = torch.randn(N, HV, K, V, device=dev, generator=gen) if grad_states else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, do=do, dht=dht)


def leaves(x: dict) -> dict:
    return {n: (t.detach().clone().requires_grad_(True) if t is not None else None) for n, t in x.items()}


def single(x: dict, cu: list):
    """o, final states and the gradients of the single-GPU operator on the whole set."""
    from flashdelta import chunk_gated_delta_rule

    p = leaves({n: x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")})
    o, ht = chunk_gated_delta_rule(**p, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device="cuda"),
                                   cu_seqlens_cpu=torch.tensor(cu, dtype=torch.int32), output_final_state=True)
    outs = [o] + ([ht] if x["dht"] is not None else [])
    grads = [x["do"]] + ([x["dht"]] if x["dht"] is not None else [])
    torch.autograd.backward(outs, grads)
    return o.detach(), ht.detach(), {n: t.grad for n, t in p.items() if t is not None}


def sliced(x: dict, sl, t0: int):
    """This rank's o, final states and gradients from `chunk_gated_delta_rule_cp`."""
    from flashdelta.distributed import chunk_gated_delta_rule_cp

    t1 = t0 + sl.T
    p = {n: x[n][:, t0:t1] for n in ("q", "k", "v", "g", "beta")}
    p["initial_state"] = x["initial_state"][list(sl.start_ids)] if x["initial_state"] is not None else None
    p = leaves(p)
    o, ht = chunk_gated_delta_rule_cp(**p, cp_slice=sl, output_final_state=True)
    outs, grads = [o], [x["do"][:, t0:t1]]
    if x["dht"] is not None and sl.end_ids:
        outs.append(ht)
        grads.append(x["dht"][list(sl.end_ids)])
    torch.autograd.backward(outs, grads)
    return o.detach(), ht.detach(), {n: t.grad for n, t in p.items() if t is not None}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(args, H: int, HV: int) -> list:
    from flashdelta.distributed import build_cp_slice

    W, r = dist.get_world_size(), dist.get_rank()
    lens = [int(s) for s in args.check_seqlens.split(",")]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    if cu[-1] % W:
        raise SystemExit(f"--check-seqlens sum {cu[-1]} must divide by the {W} ranks")
    x = inputs(cu, H, HV, seed=1)
    o, ht, gr = single(x, cu)
    sl = build_cp_slice(cu)
    t0 = r * (cu[-1] // W)
    o2, ht2, gr2 = sliced(x, sl, t0)
    t1 = t0 + sl.T
    errs = {"o": rel(o2, o[:, t0:t1])}
    if sl.end_ids:
        errs["final"] = rel(ht2, ht[list(sl.end_ids)])
    for n in ("q", "k", "v", "g", "beta"):
        errs["d" + n] = rel(gr2[n], gr[n][:, t0:t1])
    if sl.start_ids:
        errs["dh0"] = rel(gr2["initial_state"], gr["initial_state"][list(sl.start_ids)])
    worst = torch.tensor([max(errs.values())], device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    rows = [dict(kind="check", heads=f"{H}/{HV}", ranks=W, rank=r, **{k: f"{v:.2e}" for k, v in errs.items()})]
    print(f"rank {r} check {H}/{HV} {args.check_seqlens}: " + " ".join(f"{k} {v:.2e}" for k, v in errs.items()),
          flush=True)
    dist.barrier()
    if worst.item() > args.tol:
        raise SystemExit(f"check failed: worst relative error {worst.item():.2e} > --tol {args.tol}")
    return rows


class CommTimer:
    """CUDA events around every `distributed._all_gather` while active."""

    def __init__(self):
        from flashdelta import distributed

        self.mod, self.orig, self.events, self.on, self.bytes = distributed, distributed._all_gather, [], False, 0

        def timed(buf, sl):
            if not self.on:
                return self.orig(buf, sl)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = self.orig(buf, sl)
            b.record()
            self.events.append((a, b))
            self.bytes = max(self.bytes, out.numel() * out.element_size())
            return out

        distributed._all_gather = timed

    def take_ms(self) -> float:
        torch.cuda.synchronize()
        ms = sum(a.elapsed_time(b) for a, b in self.events)
        self.events = []
        return ms


def step_ms(fn, reps: int, warmup: int, comm: CommTimer | None = None, everyone: bool = True) -> tuple:
    """(median step ms: the slowest rank's per rep, median comm ms of this rank) of `fn` (forward + backward)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    steps, comms = [], []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        if comm is not None:
            comm.on = True
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        if comm is not None:
            comm.on = False
            comms.append(comm.take_ms())
        t = torch.tensor([a.elapsed_time(b)], device="cuda")
        if everyone:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        steps.append(t.item())
    return statistics.median(steps), (statistics.median(comms) if comms else 0.0)


def bench(args, H: int, HV: int) -> list:
    from flashdelta import chunk_gated_delta_rule
    from flashdelta.distributed import _all_gather, build_cp_slice, chunk_gated_delta_rule_cp

    W, r = dist.get_world_size(), dist.get_rank()
    T = args.tokens
    cu = [0, T]
    x = inputs(cu, H, HV, seed=2, grad_states=False)
    rows = []
    one = float("nan")
    if r == 0 and not args.skip_single:
        p = leaves({n: x[n] for n in ("q", "k", "v", "g", "beta")})
        cu_d, cu_h = torch.tensor(cu, dtype=torch.int32, device="cuda"), torch.tensor(cu, dtype=torch.int32)

        def run_one():
            o, _ = chunk_gated_delta_rule(**p, cu_seqlens=cu_d, cu_seqlens_cpu=cu_h)
            o.backward(x["do"])

        for _ in range(args.warmup):
            run_one()
        torch.cuda.synchronize()
        ts = []
        for _ in range(args.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run_one()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        one = statistics.median(ts)
        del p
    dist.barrier()
    sl = build_cp_slice(cu)
    t0 = r * (T // W)
    p = leaves({n: x[n][:, t0:t0 + sl.T] for n in ("q", "k", "v", "g", "beta")})
    do = x["do"][:, t0:t0 + sl.T]
    del x

    def run_cp():
        o, _ = chunk_gated_delta_rule_cp(**p, cp_slice=sl)
        o.backward(do)

    comm = CommTimer()
    ms, comm_ms = step_ms(run_cp, args.reps, args.warmup, comm)
    # the same two collectives alone: the transfer without the wait for a slower rank
    buf = torch.zeros(HV, K, (K if sl.with_m else 0) + V, device="cuda")
    alone, _ = step_ms(lambda: (_all_gather(buf, sl), _all_gather(buf, sl)), args.reps, args.warmup)
    t_one = torch.tensor([one], device="cuda")
    dist.broadcast(t_one, 0)
    one = t_one.item()
    log(f"{H}/{HV} 1x{T} on {W} GPUs: step {ms:.3f} ms, one GPU {one:.3f} ms, speed-up {one / ms:.2f}x; "
        f"collectives in the step {comm_ms:.3f} ms ({100 * comm_ms / ms:.1f}%), alone {alone:.3f} ms "
        f"({buf.numel() * 4 * W / 2 ** 20:.1f} MiB gathered per rank per collective)")
    rows.append(dict(kind="time", heads=f"{H}/{HV}", ranks=W, rank=r, tokens=T, step_ms=f"{ms:.4f}",
                     one_gpu_ms=f"{one:.4f}", speedup=f"{one / ms:.3f}", comm_ms=f"{comm_ms:.4f}",
                     comm_share=f"{comm_ms / ms:.4f}", comm_alone_ms=f"{alone:.4f}",
                     gathered_mib=f"{buf.numel() * 4 * W / 2 ** 20:.2f}"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", nargs="+", type=parse_heads, default=[(16, 32)])
    ap.add_argument("--tokens", type=int, default=262144)
    ap.add_argument("--check-seqlens", default="3000,24000,768,5000")
    ap.add_argument("--tol", type=float, default=2e-3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-single", action="store_true", help="no one-GPU timing (speed-up column nan)")
    ap.add_argument("--out", default=None, help="CSV of every rank's rows (written by rank 0)")
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    t = time.time()
    rows = []
    try:
        for H, HV in args.heads:
            if not args.skip_check:
                rows += check(args, H, HV)
            rows += bench(args, H, HV)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, rows)
        if dist.get_rank() == 0 and args.out:
            flat = [row for rs in everyone for row in rs]
            keys = list(dict.fromkeys(k for row in flat for k in row))
            with open(args.out, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=keys)
                w.writeheader()
                w.writerows(flat)
        log(f"done in {time.time() - t:.0f} s")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
