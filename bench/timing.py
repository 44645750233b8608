"""Timing (CUDA-graph replay, CUDA events) and the GDN FLOP / byte models.

FLOP model (per value head, per chunk of C tokens; K = key dim, V = value dim; a GEMM m x n x k costs 2mnk).
Forward, the chunk step of docs/algorithm.md §2 (ungated WY inverse, as FlashQLA and flashdelta compute it):

    K K^T            C x C x K     (A = (I + strictly_lower(diag(b) K K^T))^-1; the 64x64 solve is not counted)
    K S0             C x V x K     (W = V - D K S0)
    Ag W             C x V x C     (Vd)
    Q S0             C x V x K     (inter-chunk output)
    Q K^T            C x C x K     (intra-chunk scores)
    P Vd             C x V x C     (intra-chunk output)
    K^T (R Vd)       K x V x C     (state update)

    per token: 2 (3 K V + 2 C K + 2 C V) = 163,840 FLOP for C = 64, K = V = 128  ("about 164 k").

Backward = state recompute (K S0, Ag W, K^T R Vd per chunk) plus the fused reverse walk, which rebuilds
K S0, Ag W, Q K^T, K K^T and forms every term of docs/algorithm.md §3:
dV' (R K dS1, Pg^T dO), dV = Ag^T dV', dAg = dV' W^T, dL = A^T dA A^T (two C x C x C), dPg = dO V'^T,
dq (D dO S0^T, dP K), dk (R V' dS1^T, dU S0^T, dP^T Q, (dAt + dAt^T) K), dS0 (K^T dU, Q^T D dO):

    per token: 2 (9 K V + 6 C V + 5 C K + 2 C^2) = 491,520 FLOP for C = 64, K = V = 128  (3.0x the forward).

fwdbwd counts both. These are models of useful work for one algorithm, the same for every provider; a provider
that does more (FLA materialises w, u, h) gets no credit for it.

Byte model: each tensor the operator must read or write, once: forward reads q, k, v, g, beta, h0 and writes
o, final state; backward reads q, k, v, g, beta, h0, do, dht and writes dq, dk, dv, dg, dbeta, dh0; fwdbwd
reads the inputs once, writes o and the final state, reads do and dht and writes the gradients. Saved
intermediates (A, g_cumsum, per-chunk states) are not counted: they are the implementation's choice.

Ceilings (H200, measured): 790 TFLOP/s bf16 dense, 4.3 TB/s. `floor_ms = max(flops / peak, bytes / bandwidth)`
and `floor_frac = floor_ms / ms` (1.0 = at the roofline floor).
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Callable

CHUNK = 64
PEAK_TFLOPS = 790.0     # bf16 dense, measured on the H200 (docs/performance.md)
PEAK_TBPS = 4.3         # device memory, measured on the H200
FLOP_MODEL = "gdn-c64-v1"


def fwd_flops_per_token_head(k: int = 128, v: int = 128, c: int = CHUNK) -> int:
    return 2 * (3 * k * v + 2 * c * k + 2 * c * v)


def bwd_flops_per_token_head(k: int = 128, v: int = 128, c: int = CHUNK) -> int:
    return 2 * (9 * k * v + 6 * c * v + 5 * c * k + 2 * c * c)


def flops(suite: str, tokens: int, hv: int, k: int = 128, v: int = 128) -> float:
    per = {"fwd": fwd_flops_per_token_head(k, v),
           "bwd": bwd_flops_per_token_head(k, v),
           "fwdbwd": fwd_flops_per_token_head(k, v) + bwd_flops_per_token_head(k, v)}[suite]
    return float(per) * tokens * hv


def bytes_moved(suite: str, tokens: int, h: int, hv: int, n_seqs: int, k: int = 128, v: int = 128, *,
                act_bytes: int = 2, g_bytes: int = 4, beta_bytes: int = 4, state_bytes: int = 4) -> float:
    qk = 2 * tokens * h * k * act_bytes            # q and k
    vv = tokens * hv * v * act_bytes               # v (and o, dv, do: same size)
    gb = tokens * hv * (g_bytes + beta_bytes)      # g and beta (and dg, dbeta)
    st = n_seqs * hv * k * v * state_bytes         # one state tensor
    inputs = qk + vv + gb + st
    fwd_out = vv + st                              # o, final state
    grads_in = vv + st                             # do, dht
    grads_out = inputs                             # dq, dk, dv, dg, dbeta, dh0
    return float({"fwd": inputs + fwd_out,
                  "bwd": inputs + grads_in + grads_out,
                  "fwdbwd": inputs + fwd_out + grads_in + grads_out}[suite])


@dataclasses.dataclass(frozen=True)
class Roofline:
    flops: float
    bytes: float
    compute_ms: float
    memory_ms: float

    @property
    def floor_ms(self) -> float:
        return max(self.compute_ms, self.memory_ms)

    def tflops(self, ms: float) -> float:
        return self.flops / (ms * 1e-3) / 1e12

    def tbps(self, ms: float) -> float:
        return self.bytes / (ms * 1e-3) / 1e12

    def floor_frac(self, ms: float) -> float:
        return self.floor_ms / ms


def roofline(suite: str, tokens: int, h: int, hv: int, n_seqs: int, k: int = 128, v: int = 128, *,
             peak_tflops: float = PEAK_TFLOPS, peak_tbps: float = PEAK_TBPS, **byte_kw) -> Roofline:
    f = flops(suite, tokens, hv, k, v)
    b = bytes_moved(suite, tokens, h, hv, n_seqs, k, v, **byte_kw)
    return Roofline(f, b, f / (peak_tflops * 1e12) * 1e3, b / (peak_tbps * 1e12) * 1e3)


# ----------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Timed:
    """One provider's timing samples (milliseconds) for one case."""
    method: str                    # "cudagraph" | "events"
    samples: list = dataclasses.field(default_factory=list)
    note: str = ""

    @property
    def ms(self) -> float:
        return statistics.median(self.samples)

    @property
    def p20(self) -> float:
        return quantile(self.samples, 0.2)

    @property
    def p80(self) -> float:
        return quantile(self.samples, 0.8)


def quantile(xs, q: float) -> float:
    """Linear-interpolated quantile (numpy's default), without numpy."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class Runner:
    """Something timeable: a captured CUDA graph (`replay`) or, when capture failed, the eager call."""

    def __init__(self, fn: Callable[[], object], method: str, graph=None, keep=None, note: str = ""):
        self.fn, self.method, self.graph, self.keep, self.note = fn, method, graph, keep, note

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


def make_runner(fn: Callable[[], object], *, stream, warmup: int = 2, allow_eager: bool = True) -> Runner:
    """Warm `fn` up on `stream` (compilation and autotuning happen here), then capture it in a CUDA graph.

    The graph's outputs and `fn`'s closure stay alive in the runner. If capture raises, fall back to timing
    the eager call with events, and say so in `note` (the row's `timing` column becomes ``events``).
    """
    import torch

    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            out = fn()
        stream.synchronize()
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()
        return Runner(fn, "cudagraph", graph=graph, keep=out)
    except Exception as exc:  # noqa: BLE001 - any capture failure means: time eagerly, and say so
        del graph
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            raise exc from None
        if not allow_eager:
            raise
        msg = f"graph capture failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})"
        return Runner(fn, "events", note=msg)


class L2Flush:
    """Overwrite a buffer larger than L2 before every timed replay (outside the timed window)."""

    def __init__(self, mbytes: int = 256):
        import torch
        self.buf = torch.empty(mbytes << 20, dtype=torch.uint8, device="cuda") if mbytes > 0 else None

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.zero_()


def time_runners(runners: dict, *, stream, budget_ms: float = 300.0, min_reps: int = 10, max_reps: int = 200,
                 rounds: int = 4, flush: L2Flush | None = None) -> dict:
    """Time every runner, interleaved in `rounds` rounds (order A B C, then C B A, ...) to cancel drift.

    Each sample is one call between two CUDA events (L2 flushed before it). The number of samples per runner
    comes from a 3-call pilot so that each runner spends about `budget_ms`, clamped to [min_reps, max_reps].
    Returns ``{name: Timed}``.
    """
    import torch

    names = list(runners)
    reps = {}
    with torch.cuda.stream(stream):
        for name in names:
            pilot = _sample(runners[name], 3, flush, stream)
            est = max(statistics.median(pilot), 1e-3)
            reps[name] = int(min(max_reps, max(min_reps, budget_ms / est)))
        out = {n: Timed(runners[n].method, note=runners[n].note) for n in names}
        for r in range(rounds):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                n = max(1, -(-reps[name] // rounds))
                out[name].samples.extend(_sample(runners[name], n, flush, stream))
    return out


def _sample(run: Runner, n: int, flush, stream) -> list:
    import torch

    events = []
    for _ in range(n):
        if flush is not None:
            flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        run()
        end.record(stream)
        events.append((start, end))
    stream.synchronize()
    return [s.elapsed_time(e) for s, e in events]
