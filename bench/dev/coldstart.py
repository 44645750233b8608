"""Cold-start cost of flashdelta's SM90 forward: the first call in a fresh process with an empty TileLang
cache, the same after `flashdelta warmup`, and a steady-state call, each in its own process.

    python3 bench/dev/coldstart.py [--heads 16/64] [--tokens 4096] [--profile]

`import tilelang` is timed apart from the first call (flashdelta imports it lazily, on the first SM90 call).
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import time, torch
t0 = time.perf_counter()
import flashdelta
H, HV, T = {H}, {HV}, {T}
dev = "cuda"
q = torch.nn.functional.normalize(torch.randn(1, T, H, 128, device=dev), dim=-1).bfloat16()
k = torch.nn.functional.normalize(torch.randn(1, T, H, 128, device=dev), dim=-1).bfloat16()
v = torch.randn(1, T, HV, 128, device=dev).bfloat16()
g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, device=dev)) / 16
beta = torch.rand(1, T, HV, device=dev)
h0 = torch.randn(1, HV, 128, 128, device=dev)
cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
torch.cuda.synchronize()
t1 = time.perf_counter()
import tilelang  # noqa: F401  (flashdelta imports it lazily, on the first SM90 call)
t_tl = time.perf_counter() - t1
t1 = time.perf_counter()
prof = None
if {PROFILE}:
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
with torch.no_grad():
    flashdelta.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
torch.cuda.synchronize()
t2 = time.perf_counter()
if prof is not None:
    import pstats
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
with torch.no_grad():
    flashdelta.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
torch.cuda.synchronize()
t3 = time.perf_counter()
print(f"RESULT import+setup {{t1 - t0 - t_tl:.2f}} import_tilelang {{t_tl:.2f}} first_call {{t2 - t1:.2f}} "
      f"second_call {{(t3 - t2) * 1e3:.2f}}ms")
"""


def _child(env, H, HV, T, profile=False):
    out = subprocess.run([sys.executable, "-c", CHILD.format(H=H, HV=HV, T=T, PROFILE=profile)], env=env,
                         capture_output=True, text=True)
    if profile:
        print(out.stdout)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    if out.returncode or not line:
        raise RuntimeError(out.stderr[-3000:])
    return line[0][len("RESULT "):]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="16/64")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--profile", action="store_true", help="cProfile the warm-cache first call (top 18, cumulative)")
    args = ap.parse_args()
    H, HV = (int(x) for x in args.heads.split("/"))
    cache = tempfile.mkdtemp(prefix="tlcache-")
    env = dict(os.environ, TILELANG_CACHE_DIR=cache, FLASHDELTA_BACKEND="sm90")
    print(f"heads {H}/{HV}, {args.tokens} tokens, bf16, h0 on; fresh process each line; cache {cache}")
    print("empty cache :", _child(env, H, HV, args.tokens))
    print("warm cache  :", _child(env, H, HV, args.tokens, profile=args.profile))
    cache2 = tempfile.mkdtemp(prefix="tlcache-")
    env2 = dict(env, TILELANG_CACHE_DIR=cache2)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "flashdelta.cli", "warmup", "--heads", args.heads], env=env2, check=True)
    print(f"flashdelta warmup --heads {args.heads}: {time.perf_counter() - t0:.1f} s (fresh cache)")
    print("after warmup:", _child(env2, H, HV, args.tokens))


if __name__ == "__main__":
    main()
