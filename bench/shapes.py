"""The benchmark grid as named presets (FlashQLA's own H200 grid; docs/performance.md).

A `Case` is one (suite, heads, sequence mix). Sequence mixes are varlen with B = 1 and `cu_seqlens`.

- ``fwd``: 8 head configs x 12 sequence mixes = 96 cases.
- ``bwd`` and ``fwdbwd``: 6 head configs x {8k, 32k} tokens x {1, 2, 4, 8} sequences = 48 cases each.
  Multi-sequence splits are random but fixed: seeded by (tokens, count), the seed is kept in the case and
  written to every CSV row, so a split can be regenerated with `random_split`.

Nothing here imports torch; `python bench/run.py --dry-run` lists the cases.
"""
from __future__ import annotations

import dataclasses
import random
import re

SUITES = ("fwd", "bwd", "fwdbwd")
HEAD_DIM = 128          # K = V = 128 throughout the grid (FlashQLA supports only this)

# (h_qk, h_v, model the split comes from): Qwen3.5/3.6-style GDN layers at different TP degrees.
FWD_HEADS = (
    (2, 8, "397B/122B TP8"),
    (4, 16, "397B/122B TP4"),
    (8, 32, "397B/122B TP2"),
    (16, 64, "397B/122B TP1"),
    (16, 32, "35B/9B/4B TP1"),
    (8, 24, "27B TP2"),
    (16, 48, "27B TP1"),
    (16, 16, "2B/0.8B TP1"),
)
FWD_SEQLENS = (
    (32768,), (16384,), (8192,), (4096,), (2048,),
    (28672, 4096), (16384, 16384), (4096, 28672),
    (8192,) * 4, (4096,) * 8, (2048,) * 4, (1024,) * 8,
)

BWD_HEADS = ((16, 32, "35B/9B/4B TP1"), (8, 16, "TP2"), (4, 8, "TP4"), (2, 4, "TP8"), (16, 64, "80B TP1"),
             (16, 16, "GVA 1"))
BWD_TOKENS = (8192, 32768)
BWD_NSEQS = (1, 2, 4, 8)
MIN_SPLIT_LEN = 64      # no random piece shorter than one chunk

# --quick: two cases per suite, all with 16/32, the one head config both grids share, so a smoke run
# compiles each peer's kernels for one head count only (JIT compilation dominates a short run).
QUICK_HEADS = (16, 32)
QUICK_FWD = ((8192,), (2048,) * 4)
QUICK_BWD = ((8192, 1), (8192, 4))

GATE_MAX_TOKENS = 1024  # the correctness gate runs each case's heads on at most this many tokens


@dataclasses.dataclass(frozen=True)
class Case:
    suite: str
    h: int                              # q/k heads
    hv: int                             # v heads (GVA: hv % h == 0)
    seqlens: tuple[int, ...]
    k: int = HEAD_DIM
    v: int = HEAD_DIM
    model: str = ""
    split_seed: int | None = None       # set for the seeded random splits of the bwd grid

    @property
    def tokens(self) -> int:
        return sum(self.seqlens)

    @property
    def n_seqs(self) -> int:
        return len(self.seqlens)

    @property
    def seqlens_str(self) -> str:
        return format_seqlens(self.seqlens)

    @property
    def name(self) -> str:
        return f"{self.suite}/h{self.h}v{self.hv}/{self.seqlens_str}"

    def gate_seqlens(self, max_tokens: int = GATE_MAX_TOKENS) -> tuple[int, ...]:
        return gate_seqlens(self.seqlens, max_tokens)


def format_seqlens(seqlens) -> str:
    """``1x32768`` / ``8192x4`` for equal lengths (count first only for one sequence), else ``28672+4096``."""
    seqlens = tuple(int(n) for n in seqlens)
    if len(seqlens) == 1:
        return f"1x{seqlens[0]}"
    if len(set(seqlens)) == 1:
        return f"{seqlens[0]}x{len(seqlens)}"
    return "+".join(str(n) for n in seqlens)


def parse_seqlens(text: str) -> tuple[int, ...]:
    """Inverse of `format_seqlens`."""
    text = text.strip()
    if "+" in text:
        return tuple(int(x) for x in text.split("+"))
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m:
        return (int(text),)
    a, b = int(m.group(1)), int(m.group(2))
    return (b,) if a == 1 else (a,) * b


def flashqla_rule_splits(hv: int, seqlens) -> bool:
    """Whether FlashQLA's SM90 rule, as the forward issue states it, splits sequences inside the GPU: with
    ``Be`` = total chunks / chunks of the longest sequence, it splits when ``Be * HV <= 40``, or ``<= 56`` when the
    longest sequence has 8k tokens or more. (The 0.1.3 wheel decides with a calibrated model instead: the
    benchmark records what it actually did in the ``cp`` column.)"""
    lens = [int(x) for x in seqlens]
    chunks = [-(-L // 64) for L in lens]
    longest = max(chunks)
    if longest == 0:
        return False
    load = sum(chunks) / longest * hv
    return load <= 40 or (load <= 56 and max(lens) >= 8192)


def random_split(total: int, n: int, seed: int, min_len: int = MIN_SPLIT_LEN) -> tuple[int, ...]:
    """`n` positive lengths summing to `total`, each >= `min_len`, from a seeded RNG (stdlib, stable)."""
    if n == 1:
        return (total,)
    if n * min_len > total:
        raise ValueError(f"cannot split {total} tokens into {n} pieces of at least {min_len}")
    rng = random.Random(seed)
    # draw n-1 cut points on the reduced line, then add min_len back to every piece
    free = total - n * min_len
    cuts = sorted(rng.randint(0, free) for _ in range(n - 1))
    edges = [0, *cuts, free]
    return tuple(edges[i + 1] - edges[i] + min_len for i in range(n))


def split_seed(tokens: int, n: int) -> int:
    return 1_000_003 * tokens + n


def gate_seqlens(seqlens, max_tokens: int = GATE_MAX_TOKENS) -> tuple[int, ...]:
    """The same mix shrunk proportionally to at most `max_tokens` tokens (same number of sequences)."""
    seqlens = tuple(int(n) for n in seqlens)
    total = sum(seqlens)
    if total <= max_tokens:
        return seqlens
    if len(seqlens) > max_tokens:
        raise ValueError(f"{len(seqlens)} sequences do not fit in a gate of {max_tokens} tokens")
    out = [max(1, n * max_tokens // total) for n in seqlens]
    while sum(out) > max_tokens:           # only possible through the max(1, .) floor
        out[out.index(max(out))] -= 1
    return tuple(out)


def fwd_cases() -> list[Case]:
    return [Case("fwd", h, hv, s, model=m) for h, hv, m in FWD_HEADS for s in FWD_SEQLENS]


def _split_cases(suite: str, heads, mixes) -> list[Case]:
    out = []
    for h, hv, m in heads:
        for tokens, n in mixes:
            seed = split_seed(tokens, n) if n > 1 else None
            seqlens = random_split(tokens, n, seed) if n > 1 else (tokens,)
            out.append(Case(suite, h, hv, seqlens, model=m, split_seed=seed))
    return out


def bwd_cases(suite: str = "bwd") -> list[Case]:
    return _split_cases(suite, BWD_HEADS, [(t, n) for t in BWD_TOKENS for n in BWD_NSEQS])


def quick_cases(suite: str) -> list[Case]:
    h, hv = QUICK_HEADS
    if suite == "fwd":
        return [Case("fwd", h, hv, s, model="quick") for s in QUICK_FWD]
    return _split_cases(suite, ((h, hv, "quick"),), QUICK_BWD)


def cases(suite: str, *, quick: bool = False, pattern: str | None = None) -> list[Case]:
    """The named preset for one suite; `pattern` is a regex searched in `Case.name`."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; expected one of {SUITES}")
    if quick:
        out = quick_cases(suite)
    else:
        out = fwd_cases() if suite == "fwd" else bwd_cases(suite)
    if pattern:
        rx = re.compile(pattern)
        out = [c for c in out if rx.search(c.name)]
    return out
