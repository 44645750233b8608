"""Write the generated CUDA of every shipped SM90 kernel build of a fixed set of configurations, one file per build
with a stable name, so that a refactor can be checked byte for byte (`diff -r before/ after/`). Needs no GPU.

    TILELANG_CACHE_DIR=/tmp/tlcache python3 bench/dev/dump_cuda.py OUT_DIR [--only REGEX]

The set: the benchmark grid's eight head configs (K = V = 128, bf16, fp32 beta and h0, with and without h0, both
state layouts); 16/64 in fp16 (fp16 beta); K = V = 64 and K = 128, V = 256 (bf16 beta) at 2/8 and 16/32; the
backward's prepare kernel for HV 8..64. Files: `<prefix><label>.cu`, the label as `flashdelta.precompile.variants`
gives it with spaces as `_`, `/` as `-` and no `=`.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import time

import torch

GRID_HEADS = [(2, 8), (4, 16), (8, 32), (16, 64), (16, 32), (8, 24), (16, 48), (16, 16)]
# (file prefix, heads, variants() keyword arguments)
CONFIGS = [
    ("", GRID_HEADS, dict(dtype=torch.bfloat16, beta_dtype=torch.float32, state_v_first=(False, True))),
    ("fp16_", [(16, 64)], dict(dtype=torch.float16, beta_dtype=torch.float16)),
    ("k64_", [(2, 8), (16, 32)], dict(head_dim=(64, 64), dtype=torch.bfloat16, beta_dtype=torch.float32)),
    ("v256_", [(2, 8), (16, 32)], dict(head_dim=(128, 256), dtype=torch.bfloat16, beta_dtype=torch.bfloat16)),
]
BWD_HV = (8, 16, 24, 32, 48, 64)


def builds(num_sms: int) -> list:
    """(file name, builder, args) of every build in the set, in a fixed order, each name once."""
    from flashdelta.kernels import prepare_bwd
    from flashdelta.precompile import variants

    out, seen = [], set()
    todo = [(prefix, label, b, a) for prefix, heads, kw in CONFIGS
            for label, b, a in variants(heads, initial_state=(False, True), num_sms=num_sms, **kw)]
    todo += [("", label, b, a) for HV in BWD_HV for label, b, a in prepare_bwd.launcher_builds(HV)]
    for prefix, label, builder, args in todo:
        name = prefix + label.replace(" ", "_").replace("/", "-").replace("=", "") + ".cu"
        if name not in seen:
            seen.add(name)
            out.append((name, builder, args))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--only", default="", help="regex on the file names")
    ap.add_argument("--num-sms", type=int, default=132, help="the persistent prepare kernel's grid")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name, builder, bargs in builds(args.num_sms):
        if not re.search(args.only, name):
            continue
        t0 = time.perf_counter()
        src = builder(*bargs).get_kernel_source()
        with open(os.path.join(args.out, name), "w") as f:
            f.write(src)
        print(f"{name} {hashlib.sha256(src.encode()).hexdigest()[:12]} {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
