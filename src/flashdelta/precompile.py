"""Compile every SM90 kernel build a model needs ahead of time, into TileLang's persistent cache
(`flashdelta.warmup`, ``flashdelta warmup``).

Compilation needs no GPU (the target is fixed to sm_90a), so a cache can be built on a CPU machine and
shipped; TileLang keys it by the kernel's TIR and stores it under ``TILELANG_CACHE_DIR``
(default ``~/.tilelang/cache``). The list of builds is `kernels.sm90.forward_builds` (and `backward_builds`,
`decode_builds`): what the launchers pick from, with the options the public function passes them, and where context
parallelism may run, `cp.builds`.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Iterable, Optional, Union

import torch

from . import cp
from .gates import beta_act_code
from .kernels import _tl, prepare, sm90

# the longest single sequence (tokens) `variants` asks the CP cost models about: a split that pays for no sequence
# up to this long gets no builds under auto
LONGEST_SEQ = 1 << 20


def _floating(name: str, dt, optional: bool = False) -> None:
    if optional and dt is None:
        return
    if not (isinstance(dt, torch.dtype) and dt.is_floating_point):
        raise TypeError(f"{name}: must be a floating-point torch dtype{' or None' if optional else ''}, got {dt}")


def _check(kset, heads: list, head_dim: tuple, dtype, beta_dtype, h0_dtype, scale, num_sms, gate: dict,
           flags: dict) -> None:
    """The limits the SM90 kernel set declares and the options' types, as clear errors before any compile (a
    builder would fail an assertion instead)."""
    if kset.head_dims is not None and tuple(head_dim) not in kset.head_dims:
        raise ValueError(f"head_dim: (K, V)={tuple(head_dim)} has no SM90 kernels; supported: {list(kset.head_dims)}")
    if dtype not in kset.dtypes:
        raise TypeError(f"dtype: the SM90 kernels take q/k/v in {list(kset.dtypes)}, got {dtype}")
    for name, dt in (("beta_dtype", beta_dtype), ("h0_dtype", h0_dtype), ("g_dtype", gate["g_dtype"]),
                     ("a_log_dtype", gate["a_log_dtype"])):
        _floating(name, dt)
    _floating("dt_bias_dtype", gate["dt_bias_dtype"], optional=True)
    for name, x in flags.items():
        if not isinstance(x, bool):
            raise TypeError(f"{name}: must be a bool, got {x!r} ({type(x).__name__})")
    if flags["allow_neg_eigval"] and not flags["use_beta_sigmoid_in_kernel"]:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (as the operator)")
    for pair in heads:
        if len(pair) != 2 or not all(isinstance(x, int) and x > 0 for x in pair) or pair[1] % pair[0]:
            raise ValueError(f"heads: each entry must be (H, HV) with HV a positive multiple of H, got {pair!r}")
    if scale is not None and not math.isfinite(float(scale)):
        raise ValueError(f"scale: must be finite, got {scale!r}")
    if num_sms is not None and (not isinstance(num_sms, int) or num_sms <= 0):
        raise ValueError(f"num_sms: must be a positive int, got {num_sms!r}")


def _may_split(choose, min_chunks: int, **kw) -> bool:
    """Whether a cost model (`cp.choose` / `cp.choose_bwd`) splits one sequence of some length from `min_chunks`
    chunks up to `LONGEST_SEQ` tokens, doubling: one sequence is where CP gains most (its heads alone on the GPU)."""
    n = cp.BT * min_chunks
    while n <= LONGEST_SEQ:
        if choose(T=n, N=1, seq_len=n, **kw):
            return True
        n *= 2
    return False


def cp_passes(request, HV: int, K: int, V: int, dtype: torch.dtype, *, sms: int, backward: bool) -> tuple:
    """(forward, backward): whether context parallelism may split each pass of calls with these heads on the SM90
    kernels, for a request of `cp.parse_request`: never ``off``; ``on`` or a partition length wherever CP runs
    (`cp.supported`); ``auto`` where the pass's cost model splits some single sequence (`_may_split`; the forward's
    model with the warm-up where ``FLASHDELTA_CP_WARMUP`` turns it on for q's dtype, the backward's where SM90 runs
    its stages, `cp.supported_bwd`), as `cp.decide` decides at a call."""
    kset = sm90.KERNELS
    if request == "off" or not cp.supported(kset, K, V, dtype):
        return False, False
    if request != "auto":
        return True, backward
    kw = dict(HV=HV, K=K, V=V, sms=sms)
    warm = cp.warmup_threshold(cp.parse_warmup(None), dtype) is not None
    fwd = _may_split(cp.choose, cp.MIN_SEQ_CHUNKS, **kw, warmup=warm)
    bwd = backward and cp.supported_bwd(kset, K, V, dtype) and _may_split(cp.choose_bwd, cp.MIN_SEQ_CHUNKS_BWD, **kw)
    return fwd, bwd


def _cp_builds(H: int, HV: int, K: int, V: int, dtype, beta_dtype, scale: float, fwd: bool, bwd: bool) -> list:
    """`cp.builds` of the passes that may split (without a split forward, none of the builds only it launches)."""
    return cp.builds(H, HV, K, V, dtype, beta_dtype, scale, backward=bwd, forward=fwd)


def _unique(builds: list) -> list:
    """Each (builder, args) once, in order."""
    out: dict = {}
    for label, b, args in builds:
        out.setdefault((b.__name__, args), (label, b, args))
    return list(out.values())


def variants(heads: Iterable[tuple], *, head_dim: tuple = (128, 128), dtype=torch.bfloat16,
             beta_dtype=torch.float32, h0_dtype=torch.float32, scale: Optional[float] = None,
             initial_state: tuple = (False, True), state_v_first: tuple = (False,), qk_l2norm: bool = True,
             num_sms: Optional[int] = None, backward: bool = False, decode: bool = False,
             use_gate_in_kernel: bool = False, g_dtype=torch.float32, a_log_dtype=torch.float32,
             dt_bias_dtype=torch.float32, use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
             context_parallel: Union[None, bool, int, str] = None) -> list:
    """(label, builder, args) for every kernel the forward of these head configs launches, each once (with
    qk_l2norm, the q/k normalisation of ``use_qk_l2norm_in_kernel=True`` too; with backward, the SM90 kernels the
    backward adds). beta / h0 dtypes the kernels lack (float64) build the fp32 kernels the forward runs them with.
    num_sms: the GPU's SM count, which sizes the persistent prepare kernel's grid and is the CP cost models' (default:
    this machine's GPU, else 132 as on H100 SXM / H200). With decode, the decode kernel's builds too
    (`fused_recurrent_gated_delta_rule`: dense and varlen, with the final state).

    The operator's options, as the model passes them: ``use_gate_in_kernel`` (g the raw gate in `g_dtype`, A_log in
    `a_log_dtype`, dt_bias in `dt_bias_dtype` or None without one; the three are ignored without the option, where
    the chunked forward takes g in fp32 and decode builds fp32 g), ``use_beta_sigmoid_in_kernel`` and
    ``allow_neg_eigval`` (beta holds logits: the stages after prepare_fwd read the activated beta in fp32).
    `context_parallel` as the operator takes it (None: ``FLASHDELTA_CP``, default auto; also ``"auto"``): the CP
    builds (`cp.builds`) of each head config where CP may split a pass (`cp_passes`; auto: where the cost model
    splits one sequence of up to `LONGEST_SEQ` tokens); False: none.
    """
    kset = sm90.KERNELS
    heads = [tuple(h) for h in heads]
    gate = dict(g_dtype=g_dtype, a_log_dtype=a_log_dtype, dt_bias_dtype=dt_bias_dtype)
    flags = dict(use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                 allow_neg_eigval=allow_neg_eigval)
    _check(kset, heads, head_dim, dtype, beta_dtype, h0_dtype, scale, num_sms, gate, flags)
    request = "auto" if context_parallel == "auto" else cp.parse_request(context_parallel)
    K, V = head_dim
    beta_act = beta_act_code(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    beta_dtype = kset.param_dtype(beta_dtype)
    opts = dict(head_dim=tuple(head_dim), dtype=dtype, beta_dtype=beta_dtype, h0_dtype=kset.param_dtype(h0_dtype),
                scale=K ** -0.5 if scale is None else float(scale), initial_state=initial_state,
                state_v_first=state_v_first)
    if use_gate_in_kernel:
        g_dtype, a_log_dtype = kset.param_dtype(g_dtype), kset.param_dtype(a_log_dtype)
        dt_bias_dtype = None if dt_bias_dtype is None else kset.param_dtype(dt_bias_dtype)
        prep = dict(g_dtype=g_dtype, a_log_dtype=a_log_dtype, dt_bias_dtype=dt_bias_dtype)
        dec = dict(g_dtype=g_dtype, gate=(a_log_dtype, dt_bias_dtype))
    else:
        prep, dec = {}, {}
    out = sm90.forward_builds(heads, **opts, qk_l2norm=qk_l2norm, num_sms=num_sms, **prep, beta_act=beta_act)
    out += sm90.backward_builds(heads, **opts, qk_l2norm=qk_l2norm, beta_act=beta_act) if backward else []
    sms = _tl.num_sms() if num_sms is None else num_sms
    for H, HV in heads:
        fwd, bwd = cp_passes(request, HV, K, V, dtype, sms=sms, backward=backward)
        if fwd or bwd:
            out += _cp_builds(H, HV, K, V, dtype, sm90.stage_beta_dtype(beta_dtype, beta_act), opts["scale"], fwd, bwd)
            # prepare with the squared key norms the split passes' warm-up condition reads (`cp.windows`)
            out += prepare.launcher_builds(H, HV, K, dtype, beta_dtype, sms, **prep, beta_act=beta_act, norms=True)
        if bwd:         # the unsplit forward saving the backward's partition start states
            out += sm90.starts_builds([(H, HV)], **opts, beta_act=beta_act)
    if decode:
        out += sm90.decode_builds(heads, **opts, qk_l2norm=qk_l2norm, **dec, beta_act=beta_act)
    return _unique(out)


def warmup(heads: Iterable[tuple], *, progress: bool = True, **kwargs) -> float:
    """Compile the variants of `variants(heads, **kwargs)`; returns the seconds spent. Already-cached
    variants load from disk in well under a second."""
    todo = variants(heads, **kwargs)
    start = time.perf_counter()
    for i, (label, builder, args) in enumerate(todo, 1):
        t0 = time.perf_counter()
        builder(*args)
        if progress:
            done = int(20 * i / len(todo))
            print(f"\r[{'#' * done}{'.' * (20 - done)}] {i}/{len(todo)} {label} ({time.perf_counter() - t0:.1f} s)",
                  end="\n" if i == len(todo) else "", file=sys.stderr, flush=True)
    return time.perf_counter() - start
