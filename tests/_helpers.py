"""Shared test helpers: the one tolerance helper, input makers and the named case type.

Everything numeric in the tests goes through `assert_close`; per-tensor tolerances live in
`flashdelta.numerics.TOLS` (shared with `flashdelta check` and the benchmark gate).
"""
from __future__ import annotations

import dataclasses
import random

import torch

from flashdelta.numerics import TOLS, rel_l2
from flashdelta.testing import bench_gate, model_gate

__all__ = ["TOLS", "Case", "assert_close", "bench_gate", "divergent_syncs", "make_inputs", "model_gate", "random_lengths",
           "rel_l2"]


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, *, baseline: torch.Tensor | None = None,
                 factor: float = 2.0, tol: float | None = None, eps: float = 1e-6,
                 atol: float | None = None) -> float:
    """Fail loudly unless `out` matches the float64 `ref`.

    - shapes must match and NaN/Inf positions must coincide (a NaN where the reference is finite fails);
    - relative L2 error must be <= `tol` (default `TOLS[name]`);
    - with `baseline` (the same algorithm in PyTorch at the kernel's precision), also
      `err(out) <= factor * err(baseline) + eps`;
    - with `atol`, a largest absolute difference <= atol passes whatever the relative error (FLA's tests' floor:
      a reference that is ~0 everywhere, such as the gate gradient under gates of -50 per token, has a relative
      error of pure rounding).
    Returns the relative L2 error.
    """
    if tol is None:
        tol = TOLS[name]
    assert tuple(out.shape) == tuple(ref.shape), f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    o64, r64 = out.detach().double().cpu(), ref.detach().double().cpu()
    bad_o, bad_r = ~torch.isfinite(o64), ~torch.isfinite(r64)
    if not torch.equal(bad_o, bad_r):
        idx = torch.nonzero(bad_o ^ bad_r)[0].tolist()
        raise AssertionError(f"{name}: non-finite mismatch at {idx}: out={o64[tuple(idx)].item()} "
                             f"ref={r64[tuple(idx)].item()} ({int(bad_o.sum())} non-finite in out)")
    o64 = torch.where(bad_r, 0.0, o64)
    r64 = torch.where(bad_r, 0.0, r64)
    err = rel_l2(o64, r64)
    if atol is not None and (o64.numel() == 0 or (o64 - r64).abs().max().item() <= atol):
        return err
    limit = tol
    if baseline is not None:
        limit = min(tol, factor * rel_l2(baseline, r64) + eps)
    if not err <= limit:
        diff = (o64 - r64).abs()
        idx = tuple(torch.nonzero(diff == diff.max())[0].tolist()) if diff.numel() else ()
        raise AssertionError(
            f"{name}: relative L2 error {err:.3e} > limit {limit:.3e} (tol {tol:.1e}"
            + (f", baseline {rel_l2(baseline, r64):.3e} x {factor}" if baseline is not None else "")
            + f"); worst at {list(idx)}: out={o64[idx].item():.6g} ref={r64[idx].item():.6g}")
    return err


@dataclasses.dataclass(frozen=True)
class Case:
    """One named test configuration. `seqlens` with `varlen=True` become `cu_seqlens`; with
    `varlen=False` all lengths must be equal and the input is dense `[B, T, ...]`."""
    name: str
    seqlens: tuple[int, ...]
    H: int = 2
    HV: int = 4
    K: int = 32
    V: int = 32
    varlen: bool = True
    pad: int = 0                 # padding tokens after cu_seqlens[-1] (varlen only)
    h0: bool = True
    state_v_first: bool = False
    gate: str = "model"          # model | bench | zero

    def __str__(self) -> str:
        return self.name


def random_lengths(n: int, choices, seed: int) -> tuple:
    """`n` sequence lengths drawn from `choices` with a fixed seed (many-sequence varlen cases)."""
    rng = random.Random(seed)
    return tuple(rng.choice(choices) for _ in range(n))


def at_odd_offset(t: torch.Tensor) -> torch.Tensor:
    """t's values in a contiguous view that starts one element into a larger buffer (not 16-byte aligned)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


def make_inputs(case: Case, *, dtype=torch.bfloat16, device="cpu", seed: int = 0, requires_grad: bool = False):
    """Inputs for `chunk_gated_delta_rule` as a dict of keyword arguments (q, k l2-normalised)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(case.seqlens)
    if case.varlen:
        B, T = 1, total + case.pad
    else:
        assert len(set(case.seqlens)) == 1 and case.pad == 0
        B, T = len(case.seqlens), case.seqlens[0]
    N = len(case.seqlens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = torch.nn.functional.normalize(randn(B, T, case.H, case.K), dim=-1)
    k = torch.nn.functional.normalize(randn(B, T, case.H, case.K), dim=-1)
    v = randn(B, T, case.HV, case.V)
    gate = {"model": model_gate, "bench": bench_gate,
            "zero": lambda T, HV, generator: torch.zeros(T, HV, dtype=torch.float64)}[case.gate]
    g = torch.stack([gate(T, case.HV, generator=gen) for _ in range(B)])
    beta = torch.sigmoid(randn(B, T, case.HV))
    out = dict(
        q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.float(), beta=beta.to(dtype),
        initial_state=None, cu_seqlens=None, state_v_first=case.state_v_first,
    )
    if case.h0:
        shape = (N, case.HV, case.V, case.K) if case.state_v_first else (N, case.HV, case.K, case.V)
        out["initial_state"] = randn(*shape).float()
    if case.varlen:
        cu = [0]
        for n in case.seqlens:
            cu.append(cu[-1] + n)
        out["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    for name in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"):
        if out[name] is not None:
            out[name] = out[name].to(device)
            if requires_grad and out[name].is_floating_point():
                out[name].requires_grad_(True)
    return out


def split_backward_only(monkeypatch) -> list:
    """Make `cp.decide` code the backward split alone (its own L, the forward serial), as auto does where the serial
    forward fills the GPU, so that the forward saves what the split backward reads (every chunk state on a native
    backend, `autograd._saves_states`, else the partition start states); returns the list that collects every
    `cp.cp_chunk_bwd` call's (L, starts, states)."""
    from flashdelta import cp

    calls = []
    real_decide, real_bwd = cp.decide, cp.cp_chunk_bwd

    def decide(request, **kw):
        code = real_decide(request, **kw)
        return cp.encode(0, cp.decode(code)[1]) if code > 0 else code

    def bwd(*a, **kw):
        calls.append((kw["plan"].L, kw.get("starts"), kw.get("states")))
        return real_bwd(*a, **kw)

    monkeypatch.setattr(cp, "decide", decide)
    monkeypatch.setattr(cp, "cp_chunk_bwd", bwd)
    return calls


def divergent_syncs(src: str) -> list[int]:
    """Line numbers of generated CUDA where `__syncthreads()` sits under an `if` (or its `else`) whose condition
    reads threadIdx: a hang when the threads split. TileLang's sync insertion put one inside a thread-dependent
    branch of a prepare variant, which hung on the GPU (docs/dev/prepare.md)."""
    bad, stack, sibling = [], [], False      # stack: per open block, (thread-dependent so far, its own condition)
    for n, line in enumerate(src.splitlines(), 1):
        code = line.strip()
        for k, ch in enumerate(code):
            if ch == "}" and stack:
                sibling = stack.pop()[1]
            elif ch == "{":
                head = code[:k]
                own = "threadIdx" in head if head.lstrip("} ").startswith(("if (", "else")) else False
                if head.lstrip("} ").startswith("else"):   # else / else if: reached by the threads the if did not take
                    own = own or sibling
                stack.append(((stack[-1][0] if stack else False) or own, own))
        if "__syncthreads()" in code and stack and stack[-1][0]:
            bad.append(n)
    return bad
