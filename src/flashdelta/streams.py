"""Two independent launches at once: a side stream per CUDA device for work that does not depend on what the
current stream runs next (context parallelism: the forward runs its exact heads' passes there, `cp.cp_chunk_fwd`, the
backward chunk_dstate beside its M pass, `cp.cp_chunk_bwd`).

`fork(device)` makes the side stream wait for the current one and returns it (None off CUDA: the work runs inline);
work enqueued under ``on(side)`` then runs beside the current stream's, and `join(side)` makes
the current stream wait for it before anything reads its results. Both are events on the device, no host
synchronisation, so CUDA-graph capture records the fork and the join as graph edges.

`fork(device, urgent=True)` gives a second side stream whose priority is above the default (-1 against 0): where
both streams have CTAs waiting, the block scheduler gives freed SMs to its CTAs first, so a caller puts its critical
path there (context parallelism's forward: the M pass, scan and output pass of the heads on the exact path, beside
the warm-up heads' output pass on the current stream).

Memory: a tensor allocated under the side stream returns to that stream's pool when freed, and the side stream only
takes new work after a `fork`, which orders it after everything the current stream had enqueued, including the reads
of that tensor; so no `record_stream` is needed as long as the side stream is used through `fork` alone.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

_SIDE: dict = {}        # (CUDA device index, urgent) -> its side stream, made at first use


def fork(device: torch.device, *, urgent: bool = False) -> Optional[torch.cuda.Stream]:
    """The side stream of `device` (`urgent`: the one at priority -1, above the default 0), waiting for the current
    stream's work so far; None where `device` is not CUDA."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = _SIDE.get((index, urgent))
    if side is None:
        side = _SIDE[index, urgent] = torch.cuda.Stream(device=index, priority=-1 if urgent else 0)
    side.wait_stream(torch.cuda.current_stream(index))
    return side


def join(side: Optional[torch.cuda.Stream]) -> None:
    """The current stream waits for the work enqueued on `side` (from `fork`; None: nothing to wait for)."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)


def on(side: Optional[torch.cuda.Stream]):
    """A context in which work is enqueued on `side` (from `fork`; None: on the current stream, as off CUDA)."""
    return contextlib.nullcontext() if side is None else torch.cuda.stream(side)
