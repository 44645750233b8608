"""Command line.

`flashdelta check`: a realistic forward + backward through the public API on the best backend, compared
with the float64 reference; exits non-zero on a mismatch.
`flashdelta warmup --heads H/HV ...`: compile the SM90 kernels a model needs into TileLang's cache.

Errors a user can fix (a bad option, no GPU for ``--device cuda``, no CUDA toolkit for ``warmup``) print one line
on stderr and exit non-zero: 2 for bad options, 1 for what the machine lacks or a mismatch.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time

import torch

from . import __version__, toolkit


def _inputs(seqlens, H, HV, K, V, dtype, device, seed=0):
    from .testing import model_gate  # noqa: PLC0415

    gen = torch.Generator().manual_seed(seed)
    T = sum(seqlens)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x = dict(
        q=torch.nn.functional.normalize(rnd(1, T, H, K), dim=-1).to(dtype),
        k=torch.nn.functional.normalize(rnd(1, T, H, K), dim=-1).to(dtype),
        v=rnd(1, T, HV, V).to(dtype),
        g=model_gate(T, HV, generator=gen)[None].float(),
        beta=torch.sigmoid(rnd(1, T, HV)).to(dtype),
        initial_state=rnd(len(seqlens), HV, K, V).float(),
    )
    cu = torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0)), dtype=torch.int32)
    do, dht = rnd(1, T, HV, V).to(dtype), rnd(len(seqlens), HV, K, V).float()
    move = lambda t: t.to(device)  # noqa: E731
    return {n: move(t) for n, t in x.items()}, move(cu), move(do), move(dht)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device(text: str) -> torch.device:
    try:
        return torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"--device takes cpu or cuda[:i], got {text!r}") from None


def _device_missing(device: torch.device):
    """None when `device` can hold tensors; else one line saying what is missing."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (f"this torch ({torch.__version__}) is a CPU-only build" if torch.version.cuda is None
                   else "torch sees no GPU (driver missing or CUDA_VISIBLE_DEVICES empty)")
            return f"no CUDA device: {why}; run with --device cpu"
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            return f"no CUDA device: {device} does not exist (this machine has {count}); run with --device cuda:0"
    try:
        torch.zeros(1, device=device)
    except (RuntimeError, AssertionError) as e:
        return f"no {device.type.upper()} device: {str(e).strip().splitlines()[0]}"
    return None


def check(args) -> int:
    from . import chunk_gated_delta_rule, dispatch  # noqa: PLC0415
    from .numerics import TOLS, rel_l2  # noqa: PLC0415
    from .portable import l2norm_bwd  # noqa: PLC0415
    from .reference.chunked import chunked_bwd, chunked_fwd, l2norm_fwd  # noqa: PLC0415

    if args.heads_v % args.heads_qk:
        print(f"flashdelta check: --heads-v {args.heads_v} must be a multiple of --heads-qk {args.heads_qk}",
              file=sys.stderr)
        return 2
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    missing = _device_missing(device)
    if missing:
        print(f"flashdelta check: {missing}", file=sys.stderr)
        return 1
    H, HV, K, V = args.heads_qk, args.heads_v, args.head_dim, args.head_dim
    seqlens = [args.tokens] * args.seqs
    inputs, cu, do, dht = _inputs(seqlens, H, HV, K, V, torch.bfloat16, device)
    if args.l2norm:  # unnormalised q, k: the kernels' normalisation has something to do
        inputs["q"], inputs["k"] = inputs["q"] * 3, inputs["k"] * 0.5
    fwd_b, bwd_b = dispatch.resolve(device, K, V, torch.bfloat16, need_bwd=True)
    if "sm90" in (fwd_b, bwd_b) and toolkit.missing():  # the kernels compile on first use
        print(f"flashdelta check: {toolkit.missing()}", file=sys.stderr)
        return 1
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inputs.items()}

    times = {}
    for rep in range(2):  # the first repetition compiles (Hopper) / warms up; the second is timed
        for t in leaves.values():
            t.grad = None
        _sync(device)
        t0 = time.perf_counter()
        o, ht = chunk_gated_delta_rule(**leaves, cu_seqlens=cu, output_final_state=True,
                                       use_qk_l2norm_in_kernel=args.l2norm)
        _sync(device)
        t1 = time.perf_counter()
        ((o.float() * do.float()).sum() + (ht * dht).sum()).backward()
        _sync(device)
        times = {"fwd": t1 - t0, "bwd": time.perf_counter() - t1}

    x64 = {n: t.detach().double().cpu() for n, t in inputs.items()}
    scale = K ** -0.5
    cu_cpu = cu.cpu()
    q64, k64 = x64["q"], x64["k"]
    if args.l2norm:
        (q64, rq), (k64, rk) = l2norm_fwd(q64), l2norm_fwd(k64)
    o_ref, ht_ref, g_cumsum, A = chunked_fwd(q64, k64, x64["v"], x64["g"], x64["beta"],
                                             x64["initial_state"], cu_cpu, scale=scale, state_v_first=False)
    dq, dk, dv, dbeta, dg, dh0 = chunked_bwd(q64, k64, x64["v"], g_cumsum, x64["beta"], A,
                                             x64["initial_state"], do.double().cpu(), dht.double().cpu(), cu_cpu,
                                             scale=scale, state_v_first=False, H=H)
    if args.l2norm:
        dq, dk = l2norm_bwd(q64, rq, dq), l2norm_bwd(k64, rk, dk)
    rows = [("o", o, o_ref), ("ht", ht, ht_ref), ("dq", leaves["q"].grad, dq), ("dk", leaves["k"].grad, dk),
            ("dv", leaves["v"].grad, dv), ("dg", leaves["g"].grad, dg), ("dbeta", leaves["beta"].grad, dbeta),
            ("dh0", leaves["initial_state"].grad, dh0)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"flashdelta check: {args.seqs} x {args.tokens} tokens, H={H}, HV={HV}, K=V={K}, bf16, model-like gates"
          + (", q/k l2norm in the kernel" if args.l2norm else ""))
    print(f"device: {name} | backend: forward={fwd_b}, backward={bwd_b}")
    print(f"time: forward {times['fwd'] * 1e3:.1f} ms, backward {times['bwd'] * 1e3:.1f} ms (second call)")
    print(f"{'tensor':<8}{'rel L2 err':>12}{'tolerance':>12}  status")
    failed = False
    for tname, out, ref in rows:
        err = rel_l2(out, ref)
        ok = err <= TOLS[tname]  # NaN compares False
        failed |= not ok
        print(f"{tname:<8}{err:>12.3e}{TOLS[tname]:>12.1e}  {'ok' if ok else 'MISMATCH'}")
    print("(o and the q, k, v, beta gradients come back in bf16, so ~2e-3 is their output rounding)")
    print("result:", "MISMATCH" if failed else "ok")
    return 1 if failed else 0


def _dtype(name: str) -> torch.dtype:
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name not in table:
        raise argparse.ArgumentTypeError(f"dtype must be one of {list(table)}, got {name!r}")
    return table[name]


def _optional_dtype(name: str):
    """A dtype, or None for ``none`` (an absent tensor)."""
    if name == "none":
        return None
    try:
        return _dtype(name)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"dtype must be one of ['bf16', 'fp16', 'fp32', 'none'], got {name!r}") \
            from None


# --context-parallel's values as `flashdelta.warmup` takes them (not given: FLASHDELTA_CP, as the operator)
_CP_CHOICES = {"auto": "auto", "on": True, "off": False}


def _heads(text: str) -> tuple:
    try:
        H, HV = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads takes H/HV such as 16/64, got {text!r}") from None
    if H <= 0 or HV % H:
        raise argparse.ArgumentTypeError(f"--heads {text}: HV must be a positive multiple of H")
    return H, HV


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _cache_dir():
    """TileLang's persistent kernel cache (TILELANG_CACHE_DIR, default ~/.tilelang/cache); None when it is off
    (TILELANG_DISABLE_CACHE)."""
    import tilelang  # noqa: PLC0415

    enabled = getattr(tilelang.env, "is_cache_enabled", lambda: True)()
    return str(tilelang.env.TILELANG_CACHE_DIR) if enabled else None


def _cache_entries(root: str) -> set:
    """Every directory under `root` but TileLang's staging ones (names starting with '.'): a build that compiles
    adds its entry, one that loads from the cache adds none."""
    out = set()
    for path, dirs, _ in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        out.add(os.path.relpath(path, root))
    return out


@contextlib.contextmanager
def _quiet_tilelang():
    """TileLang's logger at WARNING while the CLI prints its own progress (it logs every compile at INFO)."""
    logger = logging.getLogger("tilelang")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def warmup(args) -> int:
    try:
        from .precompile import variants  # noqa: PLC0415
    except ModuleNotFoundError as e:
        if e.name != "tilelang":
            raise
        print("flashdelta warmup: TileLang is not installed; pip install 'flashdelta[hopper]'", file=sys.stderr)
        return 1
    opts = dict(head_dim=(args.head_dim, args.head_dim_v or args.head_dim), dtype=args.dtype,
                beta_dtype=args.beta_dtype, scale=args.scale,
                state_v_first=(args.state_v_first,), num_sms=args.num_sms, backward=args.backward,
                use_gate_in_kernel=args.use_gate_in_kernel, g_dtype=args.g_dtype, a_log_dtype=args.a_log_dtype,
                dt_bias_dtype=args.dt_bias_dtype, use_beta_sigmoid_in_kernel=args.use_beta_sigmoid_in_kernel,
                allow_neg_eigval=args.allow_neg_eigval, context_parallel=_CP_CHOICES.get(args.context_parallel))
    try:
        todo = variants(args.heads, **opts)
    except (TypeError, ValueError) as e:
        print(f"flashdelta warmup: {e}", file=sys.stderr)
        return 2
    missing = toolkit.missing()
    if missing:
        print(f"flashdelta warmup: {missing}", file=sys.stderr)
        return 1
    cache = _cache_dir()
    where = f"TileLang cache {cache}" if cache else "TileLang's cache is off (TILELANG_DISABLE_CACHE): nothing is kept"
    print(f"flashdelta warmup: {len(todo)} SM90 kernel builds, {where}", file=sys.stderr)
    start, compiled = time.perf_counter(), 0
    with _quiet_tilelang():
        for i, (label, builder, build_args) in enumerate(todo, 1):
            before, t0 = _cache_entries(cache) if cache else set(), time.perf_counter()
            builder(*build_args)
            new = not cache or bool(_cache_entries(cache) - before)
            compiled += new
            print(f"[{i}/{len(todo)}] {label}: {'compiled' if new else 'cached'} ({time.perf_counter() - t0:.1f} s)",
                  file=sys.stderr, flush=True)
    print(f"done in {time.perf_counter() - start:.1f} s: {compiled} compiled, {len(todo) - compiled} already cached")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashdelta",
        description="Gated DeltaNet chunked prefill: fused Hopper (SM90) kernels and a portable PyTorch path.",
        epilog="Run 'flashdelta COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"flashdelta {__version__}")
    sub = parser.add_subparsers(dest="cmd", title="commands", metavar="COMMAND")
    p = sub.add_parser("check",
                       help="forward + backward through the public API vs the float64 reference",
                       description="Run a realistic forward and backward (bf16, model-like gates, varlen with an "
                                   "initial state) through the public API on the best backend for the device, and "
                                   "compare o, the final state and every gradient with the float64 reference. "
                                   "Exits 1 on a mismatch.")
    p.add_argument("--device", type=_device, default=None,
                   help="cpu or cuda[:i] (default: cuda if a GPU is visible, else cpu)")
    p.add_argument("--seqs", type=_positive, default=2,
                   help="number of sequences (N), packed varlen (default: %(default)s)")
    p.add_argument("--tokens", type=_positive, default=4096, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--heads-qk", type=_positive, default=4, help="q/k heads H (default: %(default)s)")
    p.add_argument("--heads-v", type=_positive, default=8,
                   help="value heads HV, a multiple of H (default: %(default)s)")
    p.add_argument("--head-dim", type=_positive, default=128, help="head dim K = V (default: %(default)s)")
    p.add_argument("--l2norm", action="store_true",
                   help="use_qk_l2norm_in_kernel=True (q, k given unnormalised), as Hugging Face models call it")
    p.set_defaults(func=check)
    w = sub.add_parser("warmup",
                       help="compile the SM90 kernels a model needs into TileLang's persistent cache",
                       description="Compile every SM90 kernel the forward of the given layer shapes launches, "
                                   "with the operator options the model passes and context parallelism's kernels "
                                   "where it may split, into "
                                   "TileLang's persistent cache (TILELANG_CACHE_DIR, default ~/.tilelang/cache). "
                                   "Needs the CUDA toolkit's nvcc, no GPU; builds already in the cache load in "
                                   "well under a second.")
    w.add_argument("--heads", type=_heads, action="append", required=True, metavar="H/HV",
                   help="H/HV of one layer shape, e.g. 16/64; repeat for several")
    w.add_argument("--head-dim", type=int, default=128, help="K, and V unless --head-dim-v (default: %(default)s)")
    w.add_argument("--head-dim-v", type=int, default=None, help="V when it differs from K")
    w.add_argument("--dtype", type=_dtype, default="bf16", metavar="{bf16,fp16}",
                   help="q/k/v dtype (default: bf16)")
    w.add_argument("--beta-dtype", type=_dtype, default="fp32", metavar="{bf16,fp16,fp32}",
                   help="beta dtype (default: fp32)")
    w.add_argument("--scale", type=float, default=None, help="output scale (default: K ** -0.5)")
    w.add_argument("--state-v-first", action="store_true", help="states laid out [N, HV, V, K] (state_v_first=True)")
    w.add_argument("--backward", action="store_true", help="also the backward's kernels (for training)")
    w.add_argument("--use-gate-in-kernel", action="store_true",
                   help="the model passes use_gate_in_kernel=True: g is the raw gate, activated in the prepare kernel "
                        "(dtypes: --g-dtype, --a-log-dtype, --dt-bias-dtype)")
    w.add_argument("--g-dtype", type=_dtype, default="fp32", metavar="{bf16,fp16,fp32}",
                   help="the raw gate's dtype with --use-gate-in-kernel (default: fp32)")
    w.add_argument("--a-log-dtype", type=_dtype, default="fp32", metavar="{bf16,fp16,fp32}",
                   help="A_log's dtype with --use-gate-in-kernel (default: fp32)")
    w.add_argument("--dt-bias-dtype", type=_optional_dtype, default="fp32", metavar="{bf16,fp16,fp32,none}",
                   help="dt_bias' dtype with --use-gate-in-kernel; none: the model passes no dt_bias (default: fp32)")
    w.add_argument("--use-beta-sigmoid-in-kernel", action="store_true",
                   help="the model passes use_beta_sigmoid_in_kernel=True: beta holds logits, activated in the "
                        "prepare kernel (the later kernels read the activated beta in fp32)")
    w.add_argument("--allow-neg-eigval", action="store_true",
                   help="the model passes allow_neg_eigval=True (2 * sigmoid(beta); with "
                        "--use-beta-sigmoid-in-kernel)")
    w.add_argument("--context-parallel", choices=tuple(_CP_CHOICES), default=None,
                   help="context parallelism's builds: auto (for the heads where its cost model may split a pass), "
                        "on (wherever it runs), off (none); default: as FLASHDELTA_CP says, else auto")
    w.add_argument("--num-sms", type=int, default=None,
                   help="SM count of the GPU the cache is for (default: this machine's GPU, else 132: H100 SXM, H200)")
    w.set_defaults(func=warmup)
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help(sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
