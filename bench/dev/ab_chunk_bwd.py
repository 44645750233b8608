"""A/B of the warp-specialized chunk_bwd against the two-warpgroup kernel it replaces, on the benchmark's inputs:
the outputs' relative L2 difference and CUDA-graph medians. The old kernel is main's kernels/chunk_bwd.py copied to
src/flashdelta/kernels/_chunk_bwd_v1.py in the device call's tree (not committed):

    git show main:src/flashdelta/kernels/chunk_bwd.py > src/flashdelta/kernels/_chunk_bwd_v1.py
    source .device/bootstrap.sh; python3 bench/dev/ab_chunk_bwd.py
"""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
import providers, shapes, timing
from flashdelta.kernels import chunk_bwd, _chunk_bwd_v1 as v1, fused_fwd, prepare

stream = torch.cuda.Stream()
rows = [("16/32", "1x8192"), ("16/64", "8192x4"), ("2/4", "1x8192"), ("16/32", "512x16")]
print(f"{'heads':>6} {'seqlens':>10} {'new ms':>9} {'v1 ms':>9} {'ratio':>6}  rel diff dq dk dv db dg dh0", flush=True)
for hh, sl in rows:
    h, hv = map(int, hh.split("/"))
    inp = providers.make_inputs(shapes.parse_seqlens(sl), h, hv, seed=0, requires_grad=True)
    q, k, v = inp.q.detach(), inp.k.detach(), inp.v.detach()
    g, beta, h0, cu = inp.g.detach(), inp.beta.detach(), inp.h0.detach(), inp.cu
    scale = q.shape[-1] ** -0.5
    g_cumsum, A = prepare.prepare_fwd(k, g, beta, cu)[:2]
    hs = fused_fwd.state_recompute(k, v, g_cumsum, beta, A, h0, cu)
    do, dht = inp.do, inp.dht
    a = chunk_bwd.chunk_bwd(q, k, v, g_cumsum, beta, A, hs, do, dht, cu, scale=scale)
    b = v1.chunk_bwd(q, k, v, g_cumsum, beta, A, hs, do, dht, cu, scale=scale)
    torch.cuda.synchronize()
    diffs = [((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item() for x, y in zip(a, b)]
    runners = {"new": timing.make_runner(lambda: chunk_bwd.chunk_bwd(q, k, v, g_cumsum, beta, A, hs, do, dht, cu, scale=scale), stream=stream),
               "v1": timing.make_runner(lambda: v1.chunk_bwd(q, k, v, g_cumsum, beta, A, hs, do, dht, cu, scale=scale), stream=stream)}
    t = timing.time_runners(runners, stream=stream, flush=None)
    print(f"{hh:>6} {sl:>10} {t['new'].ms:9.4f} {t['v1'].ms:9.4f} {t['v1'].ms / t['new'].ms:6.2f}  " + " ".join(f"{d:.1e}" for d in diffs), flush=True)
