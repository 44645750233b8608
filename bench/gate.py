"""The correctness gate that runs before any timing: a provider that computes the wrong thing is not timed.

1. Small T: each provider on the case's heads with the sequence mix shrunk to <= 1024 tokens, against the
   float64 token-by-token reference ``flashdelta.reference.recurrent_gated_delta_rule`` (autograd of it for
   the gradients), run on the GPU in float64. Error metric and bounds are ``flashdelta.numerics``'s (rel_l2,
   TOLS; docs/numerics.md): relative L2 <= 1e-2 for o, final state, dq, dk, dv, dh0 and <= 2e-2 for dg, dbeta.
   NaN never passes; a missing output or a shape mismatch counts as an infinite error.
2. Full size: every pair of providers that passed (1), relative L2 between their outputs, bound twice the
   per-output tolerance (two independent bf16 implementations). A provider that disagrees with the majority of
   the others fails; when no majority exists (two providers, or all disagree), each is flagged ``mismatch``
   and still timed, because nothing says which one is wrong.
"""
from __future__ import annotations

import math
from typing import Optional

from flashdelta import numerics

TOLS = numerics.TOLS
FULL_FACTOR = 2.0
FWD_NAMES = ("o", "ht")
ALL_NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def rel_l2(out, ref) -> float:
    """`flashdelta.numerics.rel_l2` (NaN in out gives nan, which fails every bound), plus inf for a missing
    output or a shape mismatch."""
    if out is None or ref is None or tuple(out.shape) != tuple(ref.shape):
        return math.inf
    return numerics.rel_l2(out, ref)


def passes(err: float, name: str, factor: float = 1.0) -> bool:
    """Whether `err` is within `factor` x TOLS[name]; NaN never passes."""
    return err <= factor * TOLS[name]


def _worst(errs) -> float:
    """The largest error, NaN counting as the largest."""
    errs = list(errs)
    return math.nan if any(math.isnan(e) for e in errs) else max(errs, default=0.0)


def reference(inp, *, grads: bool) -> dict:
    """Float64 ground truth for one `Inputs` (GPU, float64): ``{name: tensor}`` for o, ht (and gradients)."""
    import torch
    from flashdelta.reference import recurrent_gated_delta_rule

    leaves = [x.detach().double().requires_grad_(grads) for x in inp.leaves()]
    with torch.set_grad_enabled(grads):
        o, ht = recurrent_gated_delta_rule(*leaves[:5], scale=inp.scale, initial_state=leaves[5],
                                           output_final_state=True, cu_seqlens=inp.cu)
    out = {"o": o.detach(), "ht": ht.detach()}
    if grads:
        gs = torch.autograd.grad((o, ht), leaves, (inp.do.double(), inp.dht.double()))
        out.update(zip(ALL_NAMES[2:], gs))
    return out


def results(provider, inp, *, grads: bool) -> dict:
    """One eager call of `provider` (plus its backward when `grads`): ``{name: tensor}``."""
    import torch
    from providers import backward_fn

    with torch.set_grad_enabled(grads):
        o, ht = provider.forward(inp)
    out = {"o": o.detach(), "ht": None if ht is None else ht.detach()}
    if grads:
        gs = backward_fn(provider, inp, (o, ht))
        out.update(zip(ALL_NAMES[2:], (None if x is None else x.detach() for x in gs)))
    return out


def compare(outs: dict, ref: dict, names) -> tuple[float, str, bool]:
    """(worst relative L2 error, ``name=err;...`` detail text, whether every output is within its bound)."""
    errs = {n: rel_l2(outs.get(n), ref[n]) for n in names}
    ok = all(passes(errs[n], n) for n in names)
    worst = _worst(errs.values())
    detail = ";".join(f"{n}={errs[n]:.2e}" for n in names)
    return worst, detail, ok


def full_size_verdicts(outs: dict, names) -> dict:
    """Pairwise full-size comparison. ``outs = {provider: {name: tensor}}``.

    Returns ``{provider: (status, err, ref_provider)}`` where status is ``ok``, ``fail`` or ``mismatch`` and
    err is the largest error against the provider it is compared with (the first other provider).
    """
    provs = list(outs)
    if len(provs) < 2:
        return {p: ("ok", None, "") for p in provs}
    pair = {}
    for i, a in enumerate(provs):
        for b in provs[i + 1:]:
            errs = {n: rel_l2(outs[a].get(n), outs[b].get(n)) for n in names}
            bad = not all(passes(errs[n], n, FULL_FACTOR) for n in names)
            pair[(a, b)] = pair[(b, a)] = (_worst(errs.values()), bad)
    def bad(a, b):
        return pair[(a, b)][1]

    # the odd one out: a strict majority of the others disagree with it and agree among themselves
    failed = set()
    for p in provs:
        others = [q for q in provs if q != p]
        against = [q for q in others if bad(p, q)]
        if len(others) > 1 and 2 * len(against) > len(others) and \
                not any(bad(a, b) for a in against for b in against if a != b):
            failed.add(p)
    verdict = {}
    for p in provs:
        others = [q for q in provs if q != p]
        agreeing = [q for q in others if not bad(p, q)]
        ref = agreeing[0] if agreeing else others[0]
        if p in failed:
            status = "fail"
        elif any(bad(p, q) for q in others if q not in failed):
            status = "mismatch"
        else:
            status = "ok"
        verdict[p] = (status, pair[(p, ref)][0], ref)
    return verdict


def gate_status(ok_small: bool, full: Optional[str]) -> str:
    if not ok_small:
        return "gate_fail"
    return {"fail": "full_fail", "mismatch": "mismatch"}.get(full or "ok", "ok")
