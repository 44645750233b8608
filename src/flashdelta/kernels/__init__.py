"""Hopper (SM90) TileLang launchers, one per stage of docs/stages.md. Imported only by dispatch, at call time."""
from .fused_fwd import chunk_fwd
from .prepare import prepare_fwd

# (K, V) head dims the SM90 kernel set handles; others raise before any kernel runs.
SM90_HEAD_DIMS = ((128, 128),)

__all__ = ["SM90_HEAD_DIMS", "chunk_fwd", "prepare_fwd"]
