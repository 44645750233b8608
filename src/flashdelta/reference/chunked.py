"""Float64 twins of the internal stages (docs/stages.md): same names, signatures and returns, no dtype knobs.

Each twin upcasts every floating input to float64 and runs the portable implementation
(`flashdelta.portable`) at ``compute_dtype=torch.float64``; outputs are float64. They are checked against the
token-by-token recurrence (`flashdelta.reference.recurrent`) to ~1e-10 in tests/cpu/test_reference.py.
"""
from __future__ import annotations

import torch

from .. import portable as _p

__all__ = [
    "l2norm_fwd", "prepare_fwd", "chunk_fwd", "state_recompute", "chunk_bwd", "chunk_dstate", "group_sum",
    "prepare_bwd",
    "chunked_fwd", "chunked_bwd",
]

_F64 = dict(compute_dtype=torch.float64, operand_dtype=None)


def _up(x):
    return None if x is None else x.to(torch.float64)


def l2norm_fwd(x):
    return _p.l2norm_fwd(_up(x))


def prepare_fwd(k, g, beta, cu_seqlens, *, chunk_size=64, A_log=None, dt_bias=None, beta_act=0, norms=False):
    return _p.prepare_fwd(_up(k), _up(g), _up(beta), cu_seqlens, chunk_size=chunk_size, A_log=_up(A_log),
                          dt_bias=_up(dt_bias), beta_act=beta_act, norms=norms, **_F64)


def chunk_fwd(q, k, v, g_cumsum, beta, A, initial_state, cu_seqlens, *, scale=None, state_v_first=False,
              chunk_size=64, chunk_skip=None):
    return _p.chunk_fwd(_up(q), _up(k), _up(v), _up(g_cumsum), _up(beta), _up(A), _up(initial_state),
                        cu_seqlens, scale=scale, state_v_first=state_v_first, chunk_size=chunk_size,
                        chunk_skip=chunk_skip, **_F64)


def state_recompute(k, v, g_cumsum, beta, A, initial_state, cu_seqlens, *, state_v_first=False, chunk_size=64):
    return _p.state_recompute(_up(k), _up(v), _up(g_cumsum), _up(beta), _up(A), _up(initial_state), cu_seqlens,
                              state_v_first=state_v_first, chunk_size=chunk_size, **_F64)


def chunk_bwd(q, k, v, g_cumsum, beta, A, h, do, dht, cu_seqlens, *, scale=None, state_v_first=False,
              chunk_size=64):
    return _p.chunk_bwd(_up(q), _up(k), _up(v), _up(g_cumsum), _up(beta), _up(A), _up(h), _up(do), _up(dht),
                        cu_seqlens, scale=scale, state_v_first=state_v_first, chunk_size=chunk_size, **_F64)


def chunk_dstate(q, k, g_cumsum, beta, A, do, cu_seqlens, *, scale=None, chunk_size=64, chunk_take=None):
    return _p.chunk_dstate(_up(q), _up(k), _up(g_cumsum), _up(beta), _up(A), _up(do), cu_seqlens, scale=scale,
                           chunk_size=chunk_size, chunk_take=chunk_take, **_F64)


def group_sum(dx, H, *, y=None, rstd=None):
    return _p.group_sum(_up(dx), H, y=_up(y), rstd=_up(rstd), **_F64)


def prepare_bwd(dG, cu_seqlens, *, chunk_size=64):
    return _p.prepare_bwd(_up(dG), cu_seqlens, chunk_size=chunk_size, **_F64)


def chunked_fwd(q, k, v, g, beta, initial_state, cu_seqlens, *, scale=None, state_v_first=False, chunk_size=64):
    """prepare_fwd + chunk_fwd in float64: ``(o, final_state, g_cumsum, A)``."""
    return _p.chunked_fwd(_up(q), _up(k), _up(v), _up(g), _up(beta), _up(initial_state), cu_seqlens,
                          scale=scale, state_v_first=state_v_first, chunk_size=chunk_size, **_F64)


def chunked_bwd(q, k, v, g_cumsum, beta, A, initial_state, do, dht, cu_seqlens, *, scale=None,
                state_v_first=False, H=None, chunk_size=64):
    """state_recompute + chunk_bwd + group_sum + prepare_bwd in float64:
    ``(dq [1,T,H,K], dk [1,T,H,K], dv, dbeta, dg, dh0)`` with dg w.r.t. the raw g."""
    return _p.chunked_bwd(_up(q), _up(k), _up(v), _up(g_cumsum), _up(beta), _up(A), _up(initial_state), _up(do),
                          _up(dht), cu_seqlens, scale=scale, state_v_first=state_v_first, H=H,
                          chunk_size=chunk_size, **_F64)
