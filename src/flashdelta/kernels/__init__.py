"""Hopper (SM90) TileLang launchers, one per stage of docs/stages.md. Imported only by dispatch, at call time."""
from .fused_fwd import HEAD_DIMS as _FWD_HEAD_DIMS
from .fused_fwd import chunk_fwd
from .l2norm import l2norm_fwd
from .prepare import SUPPORTED_K as _PREPARE_K
from .prepare import prepare_fwd
from .warmup import warmup

# (K, V) head dims the whole SM90 forward handles; others raise (forced backend) or run the portable path.
SM90_HEAD_DIMS = tuple(kv for kv in _FWD_HEAD_DIMS if kv[0] in _PREPARE_K)

__all__ = ["SM90_HEAD_DIMS", "chunk_fwd", "l2norm_fwd", "prepare_fwd", "warmup"]
