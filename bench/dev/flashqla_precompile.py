"""FlashQLA's TileLang kernels compiled on the CPU machine, into the cache a GPU call carries.

A benchmark call that times FlashQLA spends most of its first phase compiling FlashQLA's kernels (~300 s per head
config of a backward grid on the GPU machine's cores). They compile here too, with the cache keys the GPU machine
computes: FlashQLA's kernel factories take only compile-time arguments (head counts, dtypes, flags), and TileLang's
key holds the resolved target, which on an H100 or H200 is ``{"kind": "cuda", "arch": "sm_90a"}``, the target
this script sets. To reach every factory with the arguments a benchmark row gives it, the script runs FlashQLA's own
forward (and backward) on CPU tensors made by the benchmark's `make_inputs`, with the CUDA queries FlashQLA makes
answered as an H100 would (SM90, 132 SMs) and every kernel launch skipped: the factories compile, nothing runs,
and no result is read. Each case runs twice, at the correctness gate's lengths and at its own, as `run.py` does.
(Checked against the kernels the GPU machine compiled for the 4/8 and 8/16 backward grids: the same 32 cache keys,
none missing.)

    unzip -q -o .device/wheels/flash_qla-*.whl -d /tmp/fq      # FlashQLA's wheel is pure Python
    TILELANG_CACHE_DIR=.cache/tl-fq PYTHONPATH=/tmp/fq python3 bench/dev/flashqla_precompile.py --suite bwd \\
        --filter 'h16v16/'
    (then pack the kernel directories it reports, as bench/dev/tlcache.sh does, and carry the archive)
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = '{"kind": "cuda", "arch": "sm_90a"}'
SMS = 132


def _pretend_sm90():
    """Answer FlashQLA's CUDA queries as an SM90 GPU would and make kernel launches no-ops (import-time patches:
    FlashQLA reads the SM count and the compute version when its modules load)."""
    import tilelang.contrib.nvcc as nvcc
    import torch
    from tilelang.jit.kernel import JITKernel

    nvcc.get_target_compute_version = lambda *a, **k: "9.0"
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(multi_processor_count=SMS, major=9,
                                                                             minor=0, name="NVIDIA H100 80GB HBM3")
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_available = lambda: True
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.device = lambda *a, **k: contextlib.nullcontext()
    JITKernel.__call__ = lambda self, *a, **k: None


def _kernels(cache: str) -> set:
    """The kernel directories in a TileLang cache (<cache>/<version>/<platform>/kernels/<key>)."""
    return {os.path.basename(d) for d in glob.glob(os.path.join(cache, "*", "*", "kernels", "*"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default="bwd", help="fwd, bwd or fwdbwd (bwd and fwdbwd trace the backward too)")
    ap.add_argument("--filter", default=None, help="regex searched in case names, as run.py's")
    args = ap.parse_args()
    cache = os.environ.get("TILELANG_CACHE_DIR")
    if not cache:
        print("set TILELANG_CACHE_DIR: where the kernels land, to be packed and carried", file=sys.stderr)
        return 2
    os.environ["TILELANG_DEFAULT_TARGET"] = TARGET
    _pretend_sm90()
    sys.path.insert(0, os.path.dirname(HERE))                 # bench/
    import providers as P
    import shapes

    fq = P.FlashQLA()
    error = fq.load()
    if error:
        print(f"FlashQLA does not import: {error}", file=sys.stderr)
        return 2
    grads = args.suite != "fwd"
    before = _kernels(cache)
    t0 = time.time()
    for case in shapes.cases(args.suite, pattern=args.filter):
        for seqlens in (case.gate_seqlens(), case.seqlens):
            t = time.time()
            inp = P.make_inputs(seqlens, case.h, case.hv, case.k, case.v, seed=0, device="cpu",
                                requires_grad=grads)
            outs = fq.forward(inp)
            if grads:
                P.backward_fn(fq, inp, outs)
            print(f"{case.name} at {shapes.format_seqlens(seqlens)}: {time.time() - t:.0f} s, "
                  f"{len(_kernels(cache) - before)} kernels new so far", flush=True)
    print(f"{len(_kernels(cache) - before)} kernels compiled in {time.time() - t0:.0f} s into {cache}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
