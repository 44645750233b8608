"""The stages of the chunked operator and the kernel set a backend declares (docs/stages.md).

A pass runs its stages in order; each stage has the same signature in every backend, so a call may take some
stages from a native backend and the rest from the portable path (`flashdelta.dispatch` resolves them). What may
cross between backends is fixed by the contract below; everything else is private to one backend.

Forward (`FORWARD`): ``l2norm_fwd`` (q and k, with ``use_qk_l2norm_in_kernel``), ``prepare_fwd`` -> (g_cumsum, A;
its ``A_log``, ``dt_bias`` and ``beta_act`` keywords are FLA's in-kernel gate and beta sigmoid, and with ``beta_act``
it returns the activated beta third, the beta every later stage takes), ``chunk_fwd`` -> (o, final state; its ``chunk_skip`` keyword, a per-(sequence, value head) start chunk, is context
parallelism's, docs/stages.md). Backward (`BACKWARD`): ``l2norm_fwd`` and ``prepare_fwd`` only where the forward's
outputs were not saved (`autograd._SAVED`), ``state_recompute`` -> h, ``chunk_bwd`` -> (dq, dk, dv, dbeta, dG, dh0), ``group_sum`` (dq, dk per key head),
``prepare_bwd`` -> dg; with context parallelism also ``chunk_dstate`` -> each partition's start gradient from a zero
end gradient (chunk_bwd's dh0 with dht = 0, K-first; its ``chunk_take`` keyword, a per-(sequence, value head) chunk
count, is the backward warm-up's, docs/stages.md).

Contract between stages (flat varlen form: batch 1, cu_seqlens int32 ``[N + 1]``, chunks of 64 tokens aligned to
sequence starts):

- g_cumsum: fp32 (float64 for float64 inputs), ``[1, T, HV]``.
- A: ``[1, T, HV, 64]``, exactly 0 above the diagonal; in q's dtype from a native backend, in the compute dtype
  (fp32) from the portable one. Consumers take either: a native consumer converts A to q's dtype (its GEMM operand
  precision), the portable one to its compute dtype.
- l2norm_fwd's output: q's dtype from a native backend, the compute dtype from the portable one; rstd fp32.
- o in v's dtype; final state and dh0 fp32 in the layout of ``state_v_first``.
- dq, dk: per value head (``[1, T, HV, K]``), in q's dtype from a native backend, in the compute dtype (fp32)
  from the portable one; group_sum sums them per key head in fp32 (or wider), with the l2norm backward when given
  its output and rstd, and returns the result in the dtype asked for (the caller's q dtype). A backend may return
  them summed per key head already (``[1, T, H, K]``: the SM90 chunk_bwd at HV = 2 H); group_sum then has one value
  head per key head. dv in v's dtype or
  fp32; dbeta and dG fp32 (float64 for float64 inputs).
- h (the state entering each chunk) is private to a backend: `COUPLED` stages come from the same backend.
- Every tensor a stage takes is contiguous and starts on a 16-byte boundary (`aligned`): the native kernels load
  through TMA descriptors and 16-byte vector loads.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch


def aligned(x: torch.Tensor) -> torch.Tensor:
    """x contiguous and starting on a 16-byte boundary (what the native kernels' TMA descriptors and 16-byte vector
    loads take): x itself where it is, else a copy (a strided view, or a contiguous view at an odd offset into a
    larger buffer)."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


STAGES = ("l2norm_fwd", "prepare_fwd", "chunk_fwd", "state_recompute", "chunk_bwd", "chunk_dstate", "group_sum",
          "prepare_bwd")
FORWARD = ("l2norm_fwd", "prepare_fwd", "chunk_fwd")
# chunk_dstate runs only in a backward split by context parallelism (flashdelta.cp)
BACKWARD = ("l2norm_fwd", "prepare_fwd", "state_recompute", "chunk_bwd", "chunk_dstate", "group_sum", "prepare_bwd")
# stages that exchange a backend-private tensor (h): resolved to one backend together
COUPLED = (("state_recompute", "chunk_bwd"),)
ANY = "any"     # a `Stage` limit: no limit (the stage does not depend on it)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage's launcher with limits of its own: a tuple, `ANY`, or None for the kernel set's."""
    fn: Callable
    head_dims: object = None
    dtypes: object = None


class KernelSet:
    """The stage launchers of one backend, by keyword; a stage left out is None (the backend lacks it).

    Each stage is a callable (limited like the set: `head_dims`, `dtypes`) or a `Stage` with its own limits, so a
    kernel that supports fewer head dims than the rest ships as soon as it is tested.

    Args:
        name: the backend's name (``FLASHDELTA_BACKEND``).
        head_dims: supported (K, V) pairs; None = any.
        dtypes: supported q/k/v dtypes.
        param_dtypes: beta / initial_state dtypes the launchers take (others go in as fp32); None = any.
        **stages: launchers by stage name (`STAGES`).
    """

    def __init__(self, name: str, *, dtypes: tuple, head_dims: Optional[tuple] = None,
                 param_dtypes: Optional[tuple] = None, **stages):
        unknown = set(stages) - set(STAGES)
        if unknown:
            raise TypeError(f"KernelSet {name!r}: unknown stages {sorted(unknown)}; stages are {STAGES}")
        self.name, self.dtypes, self.head_dims, self.param_dtypes = name, tuple(dtypes), head_dims, param_dtypes
        self._stages = {s: (v if isinstance(v, Stage) or v is None else Stage(v)) for s, v in stages.items()}

    def __getattr__(self, stage: str):
        if stage in STAGES:
            entry = self.__dict__["_stages"].get(stage)
            return None if entry is None else entry.fn
        raise AttributeError(stage)

    def _replace(self, **changes) -> "KernelSet":
        """A copy with some stages (callables, `Stage`s or None) or limits replaced."""
        kw = dict(dtypes=self.dtypes, head_dims=self.head_dims, param_dtypes=self.param_dtypes, **self._stages)
        kw.update(changes)
        return KernelSet(self.name, **kw)

    def has(self, stages) -> bool:
        """Whether every one of `stages` is present."""
        return all(self._stages.get(s) is not None for s in stages)

    def has_fwd(self) -> bool:
        return self.has(FORWARD)

    def unsupported(self, K: int, V: int, dtype: torch.dtype, stage: Optional[str] = None) -> Optional[str]:
        """Why this kernel set (or one of its stages) cannot run (K, V, dtype), or None if it can. A missing stage
        is not checked here (`has`)."""
        entry = self._stages.get(stage) if stage is not None else None
        head_dims = entry.head_dims if entry is not None and entry.head_dims is not None else self.head_dims
        dtypes = entry.dtypes if entry is not None and entry.dtypes is not None else self.dtypes
        what = f"backend {self.name!r}" + (f" ({stage})" if entry is not None and entry.head_dims is not None else "")
        if head_dims not in (None, ANY) and (K, V) not in head_dims:
            return f"head dims (K={K}, V={V}) are not supported by {what} (supported: {list(head_dims)})"
        what = f"backend {self.name!r}" + (f" ({stage})" if entry is not None and entry.dtypes is not None else "")
        if dtypes != ANY and dtype not in dtypes:
            return f"dtype {dtype} is not supported by {what} (supported: {list(dtypes)})"
        return None

    def param_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a beta / initial state of `dtype` goes in as: itself where the launchers take it, else fp32 (the
        precision they compute in)."""
        return dtype if self.param_dtypes is None or dtype in self.param_dtypes else torch.float32

    def __repr__(self) -> str:
        present = [s for s in STAGES if self._stages.get(s) is not None]
        return f"KernelSet({self.name!r}, stages={present})"
