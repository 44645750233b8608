"""The SM90 kernel builds that FLA's own GDN op tests launch through flashdelta on an H200 (`bench/dev/fla_tests.sh`),
listed and compiled into TileLang's cache on the CPU machine (`bash bench/dev/fla_tests.sh precompile`), so the GPU
call loads kernels instead of compiling them.

    FLASHDELTA_ARCH=sm_90a TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/dev/fla_builds.py [-k FILTER] [--list]
        [--dry-run]

FLA's test file (staged at .cache/fla-tests/tests/ops/test_gdn.py) is read, never imported (FLA need not be
installed): the case lists of its ``@pytest.mark.parametrize`` decorators are evaluated from the syntax tree
(literals, comprehensions over them, ``pytest.param`` with ``str.format`` / f-string ids, torch dtypes,
``itertools.product``; any other expression is an error), and the cases are selected as pytest's ``-k`` selects them
(FILTER, default ``test_chunk or test_fused_recurrent``). `CALLS` mirrors each test function's body: the
``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` calls it makes, with the shapes, dtypes and options
of their tensors. A selected test function that `CALLS` lacks is reported as not mapped.

Each call maps to the builds flashdelta launches for it on an SM90 GPU with `NUM_SMS` SMs, from flashdelta's own
decisions: the stage plan of the chunked function (`dispatch.plan`: K = V in (64, 128) with bf16 / fp16 q/k/v runs the
SM90 kernels, other head dims in bf16 / fp16 only prepare_bwd there, fp32 the portable path);
`flashdelta.precompile.variants` for its forward and backward with exactly the call's initial-state, state-layout,
l2norm, gate and beta options; prepare's kernel pick for the call's token and sequence counts (`prepare.use_pipe`,
`prepare.pick_heads_per_cta`); the call's context-parallel decision (`cp.decide` under ``FLASHDELTA_CP``, default
auto): CP's builds of the passes that split (`precompile._cp_builds`, less what the call does not launch: `_cp_pick`),
the serial backward's state_recompute and chunk_bwd only where the backward does not split, chunk_dstate only where it
does. For ``fused_recurrent_gated_delta_rule``: the decode kernel's build arguments (`decode.builder_args`, as
`decode.fused_recurrent_fwd` computes them) where the call runs the kernel (no input requires grad,
`decode.unsupported` passes: K in (64, 128), bf16 / fp16 / fp32). Builds are deduplicated and compiled in order, as
`flashdelta.precompile.warmup` does (already-cached ones load in well under a second).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import itertools
import os
import sys
import time
import types
from typing import Optional

import torch

os.environ.setdefault("FLASHDELTA_ARCH", "sm_90a")      # the stage plan of an SM90 GPU, without one

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEST_FILE = os.path.join(ROOT, ".cache", "fla-tests", "tests", "ops", "test_gdn.py")
# the pytest node names above a test function (rootdir .cache/fla-tests): -k matches them too
PARENTS = ("tests", "ops", "test_gdn.py")
DEFAULT_FILTER = "test_chunk or test_fused_recurrent"
NUM_SMS = 132       # H200
F32 = torch.float32
CUDA = torch.device("cuda", 0)


# ------------------------------------------------------------------------------------------------ the case lists

@dataclasses.dataclass(frozen=True)
class Param:
    values: tuple
    id: Optional[str]


def _param(*values, id=None, marks=()):  # noqa: A002 - pytest.param's keyword
    return Param(values, id)


_DTYPES = {name: getattr(torch, name) for name in ("float", "float16", "float32", "float64", "half", "double",
                                                    "bfloat16")}
_NAMESPACE = {"__builtins__": {}, "pytest": types.SimpleNamespace(param=_param),
              "torch": types.SimpleNamespace(**_DTYPES), "itertools": types.SimpleNamespace(product=itertools.product),
              "range": range}
_NODES = (ast.Expression, ast.List, ast.Tuple, ast.Constant, ast.Name, ast.Load, ast.Store, ast.Attribute, ast.Call,
          ast.keyword, ast.Starred, ast.ListComp, ast.comprehension, ast.JoinedStr, ast.FormattedValue, ast.UnaryOp,
          ast.USub, ast.UAdd)
_ATTRS = {"torch": set(_DTYPES), "pytest": {"param"}, "itertools": {"product"}}


def _check_expr(node: ast.AST, where: str) -> None:
    """Only what a case list needs: literals, comprehensions, pytest.param, torch dtypes, itertools.product and
    str.format; anything else (another call, a name from the module) raises ValueError naming the test."""
    bound = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for n in ast.walk(node):
        if not isinstance(n, _NODES):
            raise ValueError(f"{where}: {type(n).__name__} in a parametrize list is not evaluated here")
        if isinstance(n, ast.Attribute):
            base = n.value
            ok = (isinstance(base, ast.Name) and n.attr in _ATTRS.get(base.id, ())) or (
                n.attr == "format" and isinstance(base, ast.Constant) and isinstance(base.value, str))
            if not ok:
                raise ValueError(f"{where}: attribute {ast.unparse(n)} in a parametrize list is not evaluated here")
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound and n.id not in _NAMESPACE:
            raise ValueError(f"{where}: name {n.id!r} in a parametrize list is not evaluated here")
        if isinstance(n, ast.Call) and not isinstance(n.func, ast.Attribute) and not (
                isinstance(n.func, ast.Name) and n.func.id == "range"):
            raise ValueError(f"{where}: call {ast.unparse(n.func)} in a parametrize list is not evaluated here")


def _evaluate(node: ast.AST, where: str):
    _check_expr(node, where)
    return eval(compile(ast.Expression(node), where, "eval"), dict(_NAMESPACE))  # noqa: S307 - checked above


def _is_parametrize(dec: ast.AST) -> bool:
    return isinstance(dec, ast.Call) and ast.unparse(dec.func) == "pytest.mark.parametrize"


def _auto_id(values: tuple) -> str:
    return "-".join(str(v) for v in values)


def cases(path: str = TEST_FILE) -> dict:
    """Test function name -> (marker names, [(id, {argument: value})]) for every test function of the file; a
    function without parametrize has one case with no arguments. Stacked parametrize decorators multiply."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = {}
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef) or not fn.name.startswith("test"):
            continue
        markers = {ast.unparse(d.func if isinstance(d, ast.Call) else d).rsplit(".", 1)[-1] for d in fn.decorator_list
                   if ast.unparse(d.func if isinstance(d, ast.Call) else d).startswith("pytest.mark.")}
        grids = []
        for dec in reversed(fn.decorator_list):       # the decorator nearest the function first, as pytest's ids
            if not _is_parametrize(dec):
                continue
            where = f"{fn.name} parametrize"
            names = ast.literal_eval(dec.args[0])
            names = [s.strip() for s in names.split(",")] if isinstance(names, str) else list(names)
            rows = []
            for item in _evaluate(dec.args[1], where):
                values, pid = (item.values, item.id) if isinstance(item, Param) else (
                    (tuple(item) if len(names) > 1 else (item,)), None)
                if len(values) != len(names):
                    raise ValueError(f"{where}: {len(values)} values for arguments {names}")
                rows.append((pid if pid is not None else _auto_id(values), dict(zip(names, values))))
            grids.append(rows)
        combos = []
        for combo in itertools.product(*grids):
            params: dict = {}
            for _, p in combo:
                params.update(p)
            combos.append(("-".join(pid for pid, _ in combo), params))
        out[fn.name] = (markers, combos)
    return out


def selected(table: dict, expr: str) -> list:
    """(function, id, params) of every case pytest's ``-k expr`` selects: a case-insensitive substring of the item's
    name (``function[id]``), its parents' names or its markers' names (pytest's keyword matching)."""
    from _pytest.mark.expression import Expression  # noqa: PLC0415 - pytest's own -k grammar

    compiled = Expression.compile(expr)
    out = []
    for fn, (markers, combos) in table.items():
        for pid, params in combos:
            names = [f"{fn}[{pid}]" if pid else fn, *PARENTS, *markers]
            if compiled.evaluate(lambda s, **_: any(s.lower() in n.lower() for n in names)):
                out.append((fn, pid, params))
    return out


# ------------------------------------------------------------------------------------------------ the calls

@dataclasses.dataclass(frozen=True)
class Chunk:
    """One ``chunk_gated_delta_rule`` call: q/k/v dtype, beta and initial-state dtypes (the initial state is always
    given in these tests), scale (None: K ** -0.5), options; gate: (raw g, A_log, dt_bias dtypes; dt_bias None: no
    bias) with ``use_gate_in_kernel``; cu: cu_seqlens' values (B = 1) or None; backward: the test calls backward."""
    B: int
    T: int
    H: int
    HV: int
    D: int
    dtype: torch.dtype
    beta_dtype: torch.dtype
    h0_dtype: torch.dtype
    scale: Optional[float]
    l2norm: bool
    state_v_first: bool
    backward: bool
    gate: Optional[tuple] = None
    beta_sigmoid: bool = False
    neg_eigval: bool = False
    cu: Optional[tuple] = None


@dataclasses.dataclass(frozen=True)
class Decode:
    """One ``fused_recurrent_gated_delta_rule`` call: q/k and v dtypes, g and beta dtypes, h0 dtype (None: no initial
    state), output_final_state, state layout, scale (None: K ** -0.5), options, cu_seqlens' values or None; grad: an
    input requires grad (the PyTorch loop runs the call)."""
    B: int
    T: int
    H: int
    HV: int
    D: int
    dtype: torch.dtype
    v_dtype: torch.dtype
    g_dtype: torch.dtype
    beta_dtype: torch.dtype
    h0_dtype: Optional[torch.dtype]
    final: bool
    state_v_first: bool
    scale: Optional[float]
    l2norm: bool
    grad: bool = False
    gate: Optional[tuple] = None
    beta_sigmoid: bool = False
    neg_eigval: bool = False
    cu: Optional[tuple] = None


def _gate(has_dt_bias: bool) -> tuple:
    """The in-kernel gate of these tests: raw g, A_log and dt_bias in fp32 (dt_bias None without one)."""
    return (F32, F32, F32 if has_dt_bias else None)


def _varlen(cu) -> dict:
    return dict(B=1, T=cu[-1], cu=tuple(cu))


def _test_fused_recurrent(p):
    # q, k fp32; v, beta in dtype; every input requires grad
    return [Decode(p["B"], p["T"], p["H"], p["HV"], p["D"], F32, p["dtype"], F32, p["dtype"], F32, True, False,
                   p["scale"], True, grad=True)]


def _test_chunk(p):
    return [Chunk(p["B"], p["T"], p["H"], p["HV"], p["D"], p["dtype"], F32, F32, p["scale"],
                  p["use_qk_l2norm_in_kernel"], False, True)]


def _test_chunk_with_chunk_size(p):
    return [Chunk(p["B"], p["T"], p["H"], p["HV"], p["D"], p["dtype"], F32, F32, p["scale"], False, False, True)]


def _test_chunk_beta_sigmoid_in_kernel(p):
    c = Chunk(p["B"], p["T"], p["H"], p["HV"], p["D"], p["dtype"], F32, F32, p["scale"], p["use_qk_l2norm_in_kernel"],
              False, True)
    # the in-kernel sigmoid, then the reference call with beta activated in PyTorch (fp32)
    return [dataclasses.replace(c, beta_sigmoid=True, neg_eigval=p["allow_neg_eigval"]), c]


def _test_chunk_state_v_first(p):
    # beta in dtype; both layouts
    c = Chunk(p["B"], p["T"], p["H"], p["H"], p["D"], p["dtype"], p["dtype"], F32, p["scale"], False, True, True)
    return [c, dataclasses.replace(c, state_v_first=False)]


def _test_fused_recurrent_state_v_first(p):
    # q, k fp32, v and beta in dtype, nothing requires grad: the reference layout, the V-first one, then the
    # deprecated transpose_state_layout=True call (no initial state, no final state, no l2norm, default scale); the
    # call passing both names raises before any kernel
    c = Decode(p["B"], p["T"], p["H"], p["HV"], p["D"], F32, p["dtype"], F32, p["dtype"], F32, True, False,
               p["scale"], True)
    return [c, dataclasses.replace(c, state_v_first=True),
            dataclasses.replace(c, state_v_first=True, h0_dtype=None, final=False, l2norm=False, scale=None)]


def _test_fused_recurrent_gate_in_kernel(p):
    # q, k, v, beta in dtype; the reference gets naive_gdn_gate's fp32 g
    c = Decode(p["B"], p["T"], p["H"], p["HV"], p["D"], p["dtype"], p["dtype"], F32, p["dtype"], F32, True, False,
               p["scale"], True)
    return [c, dataclasses.replace(c, gate=_gate(p["has_dt_bias"]))]


def _test_fused_recurrent_beta_sigmoid_in_kernel(p):
    # the reference's beta.sigmoid() * 2 stays in dtype
    c = Decode(p["B"], p["T"], p["H"], p["HV"], p["D"], p["dtype"], p["dtype"], F32, p["dtype"], F32, True, False,
               p["scale"], True)
    return [c, dataclasses.replace(c, beta_sigmoid=True, neg_eigval=p["allow_neg_eigval"])]


def _test_fused_recurrent_gate_in_kernel_varlen(p):
    c = Decode(H=p["H"], HV=p["HV"], D=p["D"], dtype=p["dtype"], v_dtype=p["dtype"], g_dtype=F32,
               beta_dtype=p["dtype"], h0_dtype=F32, final=True, state_v_first=False, scale=None, l2norm=True,
               **_varlen(p["cu_seqlens"]))
    return [c, dataclasses.replace(c, gate=_gate(p["has_dt_bias"]))]


def _test_chunk_varlen(p):
    # g in dtype (converted to fp32 without the in-kernel gate), beta fp32, h0 in dtype, default scale
    return [Chunk(H=p["H"], HV=p["HV"], D=p["D"], dtype=p["dtype"], beta_dtype=F32, h0_dtype=p["dtype"], scale=None,
                  l2norm=False, state_v_first=False, backward=True, **_varlen(p["cu_seqlens"]))]


def _test_chunk_varlen_prefill(p):
    # torch.inference_mode: forward only; beta and h0 in dtype
    return [Chunk(H=p["H"], HV=p["H"], D=p["D"], dtype=p["dtype"], beta_dtype=p["dtype"], h0_dtype=p["dtype"],
                  scale=None, l2norm=False, state_v_first=False, backward=False, **_varlen(p["cu_seqlens"]))]


def _test_chunk_gate_in_kernel(p):
    c = Chunk(p["B"], p["T"], p["H"], p["H"], p["D"], p["dtype"], F32, F32, p["scale"], p["use_qk_l2norm_in_kernel"],
              False, True)
    return [dataclasses.replace(c, gate=_gate(p["has_dt_bias"])), c]


def _test_chunk_gate_in_kernel_gqa(p):
    # the file's Hq is flashdelta's H, its H the value heads HV
    c = Chunk(p["B"], p["T"], p["Hq"], p["H"], p["D"], p["dtype"], F32, F32, p["scale"], True, False, True)
    return [dataclasses.replace(c, gate=_gate(p["has_dt_bias"])), c]


def _test_chunk_gate_in_kernel_varlen(p):
    c = Chunk(H=p["H"], HV=p["H"], D=p["D"], dtype=p["dtype"], beta_dtype=F32, h0_dtype=F32, scale=None, l2norm=True,
              state_v_first=False, backward=True, **_varlen(p["cu_seqlens"]))
    return [dataclasses.replace(c, gate=_gate(p["has_dt_bias"])), c]


def _none(p):
    return []


# test function -> (its parametrize arguments, the flashdelta calls of one case). Functions that call neither
# function map to no calls.
CALLS = {
    "test_chunk_gated_delta_rule_fwd_h_blackwell_triton_guard": ((), _none),
    "test_fused_recurrent": (("B", "T", "H", "HV", "D", "scale", "gate_logit_normalizer", "dtype"),
                             _test_fused_recurrent),
    "test_chunk": (("B", "T", "H", "HV", "D", "scale", "gate_logit_normalizer", "mask_p", "use_qk_l2norm_in_kernel",
                    "dtype"), _test_chunk),
    "test_chunk_with_chunk_size": (("B", "T", "H", "HV", "D", "scale", "gate_logit_normalizer", "dtype",
                                    "chunk_size"), _test_chunk_with_chunk_size),
    "test_chunk_beta_sigmoid_in_kernel": (("B", "T", "H", "HV", "D", "scale", "use_qk_l2norm_in_kernel",
                                           "allow_neg_eigval", "dtype"), _test_chunk_beta_sigmoid_in_kernel),
    "test_chunk_state_v_first": (("B", "T", "H", "D", "scale", "gate_logit_normalizer", "dtype"),
                                 _test_chunk_state_v_first),
    "test_fused_recurrent_state_v_first": (("B", "T", "H", "HV", "D", "scale", "gate_logit_normalizer", "dtype"),
                                           _test_fused_recurrent_state_v_first),
    "test_fused_recurrent_gate_in_kernel": (("B", "T", "H", "HV", "D", "scale", "has_dt_bias", "dtype"),
                                            _test_fused_recurrent_gate_in_kernel),
    "test_fused_recurrent_beta_sigmoid_in_kernel": (("B", "T", "H", "HV", "D", "scale", "allow_neg_eigval", "dtype"),
                                                    _test_fused_recurrent_beta_sigmoid_in_kernel),
    "test_fused_recurrent_gate_in_kernel_varlen": (("H", "HV", "D", "has_dt_bias", "cu_seqlens", "dtype"),
                                                   _test_fused_recurrent_gate_in_kernel_varlen),
    "test_chunk_varlen": (("H", "HV", "D", "mask_p", "cu_seqlens", "dtype"), _test_chunk_varlen),
    "test_chunk_varlen_prefill": (("H", "D", "mask_p", "cu_seqlens", "dtype"), _test_chunk_varlen_prefill),
    "test_chunk_gate_in_kernel": (("B", "T", "H", "D", "scale", "has_dt_bias", "use_qk_l2norm_in_kernel", "dtype"),
                                  _test_chunk_gate_in_kernel),
    "test_chunk_gate_in_kernel_gqa": (("B", "T", "Hq", "H", "D", "scale", "has_dt_bias", "dtype"),
                                      _test_chunk_gate_in_kernel_gqa),
    "test_chunk_gate_in_kernel_varlen": (("H", "D", "has_dt_bias", "cu_seqlens", "dtype"),
                                         _test_chunk_gate_in_kernel_varlen),
    "test_gate": (("B", "T", "HV", "HAS_BIAS"), _none),
    "test_prepare_wy_repr_bwd_no_g": (("B", "T", "H", "HV", "D"), _none),
}


# ------------------------------------------------------------------------------------------------ calls -> builds

@contextlib.contextmanager
def _sms(n: int):
    """`cp.num_sms` answering n for the CP decision of a CUDA call, on a machine without one."""
    from flashdelta import cp  # noqa: PLC0415

    saved = cp.num_sms
    cp.num_sms = lambda device: n
    try:
        yield
    finally:
        cp.num_sms = saved


def _cp_lengths(c: Chunk) -> tuple:
    """(forward L, backward L) the call's CP decision gives (`api._context_parallel`, `cp.decide`); 0: serial."""
    from flashdelta import cp, dispatch  # noqa: PLC0415

    request = cp.parse_request(None)
    if request == "off":
        return 0, 0
    N = c.B if c.cu is None else len(c.cu) - 1
    lengths = None if c.cu is None else [b - a for a, b in zip(c.cu, c.cu[1:])]
    kset = dispatch.plan(CUDA, c.D, c.D, c.dtype, need_bwd=False).kset("chunk_fwd")
    with _sms(NUM_SMS):
        code = cp.decide(request, kset=kset, device=CUDA, dtype=c.dtype, B=c.B, T=c.T, HV=c.HV, K=c.D, V=c.D,
                         varlen=c.cu is not None, N=N, lengths=lengths)
    return cp.decode(code) if code > 0 else (0, 0)


def _prepare_pick(c: Chunk, builds: list) -> list:
    """`builds` less the prepare_fwd builds the launcher does not pick for the call's token and sequence counts
    (`prepare.use_pipe`, `prepare.pick_heads_per_cta`; the backward's recompute picks the same)."""
    from flashdelta.kernels import prepare, prepare_oneshot, prepare_pipe  # noqa: PLC0415

    n_tok, n_seqs = c.B * c.T, (c.B if c.cu is None else len(c.cu) - 1)
    pipe = prepare.use_pipe(c.H, c.HV, c.D, n_tok, n_seqs, NUM_SMS)
    hpc = prepare_oneshot.heads_key(c.H, c.HV, prepare.pick_heads_per_cta(c.H, c.HV, n_tok, NUM_SMS))
    out = []
    for label, b, args in builds:
        if b is prepare_pipe.build and not pipe:
            continue
        if b is prepare_oneshot.build and (pipe or args[5] != hpc):
            continue
        out.append((label, b, args))
    return out


def _cp_pick(c: Chunk, todo: list, l_fwd: int) -> list:
    """CP's builds (`precompile._cp_builds`) less those the call does not launch: with a backward-only split, the
    forward's fused-forward builds (the output pass, no flags; the warm-up windows' E and M passes, `chunk_skip` on:
    the backward's `cp.summaries` run without windows and its states through state_recompute); the scan kernel's
    other V tile (`cp_scan.choose_bv` for the call's sequences) and its builds without a start value (the tests pass
    h0, and their final state enters the loss, so the backward gets dht)."""
    from flashdelta.kernels import cp_scan, fused_fwd  # noqa: PLC0415

    N = c.B if c.cu is None else len(c.cu) - 1
    bv = cp_scan.choose_bv(N, c.HV, c.D, NUM_SMS, c.D)
    scans = {cp_scan.builder_args(c.HV, c.D, c.D, bv, reverse=r, has_init=True, store_final=f)
             for r in (False, True) for f in (False, True)}
    n = len(fused_fwd.builder_args(c.H, c.HV, c.D, c.D, c.dtype, F32, F32, 1.0, False, False))
    out = []
    for label, b, args in todo:
        flags = args[n:] if b is fused_fwd.build else None
        # fused_fwd._flags order: save_states, chunk_skip, zero_values, states_only, save_starts, transitions,
        # state_seqs (trailing False dropped); state_seqs is the split forward's output pass saving the states
        if flags is not None and not l_fwd and (not flags or (len(flags) > 1 and flags[1]) or len(flags) > 6):
            continue
        if b is cp_scan.build and args not in scans:
            continue
        out.append((label, b, args))
    return out


def chunk_builds(c: Chunk) -> tuple:
    """(path, builds) of one chunk_gated_delta_rule call on the H200."""
    from flashdelta import dispatch, precompile, stages  # noqa: PLC0415
    from flashdelta.gates import beta_act_code  # noqa: PLC0415
    from flashdelta.kernels import chunk_dstate, prepare_bwd, sm90  # noqa: PLC0415

    plan = dispatch.plan(CUDA, c.D, c.D, c.dtype, need_bwd=c.backward)
    native = {s for s, b in plan.backends.items() if b != dispatch.PORTABLE}
    if not native:
        return "portable", []
    if not native & set(stages.FORWARD):
        if native - {"prepare_bwd", "group_sum"}:
            raise ValueError(f"{c}: SM90 stages {sorted(native)} without the SM90 forward are not mapped")
        return "portable + sm90 prepare_bwd", prepare_bwd.launcher_builds(c.HV)
    if not set(stages.FORWARD) <= native:
        raise ValueError(f"{c}: a forward split between SM90 and the portable path is not mapped ({plan.backends})")
    gate = {}
    if c.gate is not None:
        gate = dict(use_gate_in_kernel=True, g_dtype=c.gate[0], a_log_dtype=c.gate[1], dt_bias_dtype=c.gate[2])
    opts = dict(head_dim=(c.D, c.D), dtype=c.dtype, beta_dtype=c.beta_dtype, h0_dtype=c.h0_dtype, scale=c.scale,
                initial_state=(True,), state_v_first=(c.state_v_first,), qk_l2norm=c.l2norm, num_sms=NUM_SMS,
                use_beta_sigmoid_in_kernel=c.beta_sigmoid, allow_neg_eigval=c.neg_eigval, context_parallel=False,
                **gate)
    forward = precompile.variants([(c.H, c.HV)], **opts)
    builds = _prepare_pick(c, forward)
    l_fwd, l_bwd = _cp_lengths(c)
    l_bwd = l_bwd if c.backward else 0
    if c.backward:
        seen = {(b.__name__, args) for _, b, args in forward}
        extra = [x for x in precompile.variants([(c.H, c.HV)], backward=True, **opts)
                 if (x[1].__name__, x[2]) not in seen]
        # a serial backward never runs chunk_dstate; a CP-split one runs CP's state_recompute, chunk_bwd and
        # chunk_dstate (`cp.cp_chunk_bwd`, in `cp.builds`), not the serial builds
        builds += [x for x in extra if (x[1] is prepare_bwd.build) or (not l_bwd and x[1] is not chunk_dstate.build)]
    path = "sm90" + (" fwd+bwd" if c.backward else " fwd")
    if l_fwd or l_bwd:
        kset = sm90.KERNELS
        beta = sm90.stage_beta_dtype(kset.param_dtype(c.beta_dtype), beta_act_code(c.beta_sigmoid, c.neg_eigval))
        scale = c.D ** -0.5 if c.scale is None else float(c.scale)
        todo = precompile._cp_builds(c.H, c.HV, c.D, c.D, c.dtype, beta, scale, bool(l_fwd), bool(l_bwd))
        builds = builds + _cp_pick(c, todo, l_fwd)
        path += f" cp(L fwd {l_fwd}, bwd {l_bwd})"
    return path, builds


def decode_builds(c: Decode) -> tuple:
    """(path, builds) of one fused_recurrent_gated_delta_rule call on the H200: the decode kernel's build
    (`decode.fused_recurrent_fwd`'s arguments) where the call runs it (`recurrent._kernel_path`)."""
    from flashdelta.kernels import decode  # noqa: PLC0415

    if c.grad:
        return "torch loop (requires grad)", []
    if decode.unsupported(c.D, c.D, c.dtype, c.v_dtype) is not None:
        return "torch loop (unsupported)", []
    kernel = lambda dt: None if dt is None else (dt if dt in decode.DTYPES else F32)  # noqa: E731 - decode._input
    a_log, dt_bias = (c.gate[1], c.gate[2]) if c.gate is not None else (None, None)
    beta_act = (2 if c.neg_eigval else 1) if c.beta_sigmoid else 0
    scale = c.D ** -0.5 if c.scale is None else float(c.scale)
    varlen = c.cu is not None
    args = decode.builder_args(c.H, c.HV, c.D, c.D, c.dtype, c.v_dtype, g_dtype=kernel(c.g_dtype),
                               beta_dtype=kernel(c.beta_dtype), h0_dtype=kernel(c.h0_dtype),
                               output_final_state=c.final, state_v_first=c.state_v_first, varlen=varlen, scale=scale,
                               qk_l2norm=c.l2norm, a_log_dtype=kernel(a_log), dt_bias_dtype=kernel(dt_bias),
                               beta_act=beta_act, lanes=decode.lanes_for(len(c.cu) - 1 if varlen else c.B, c.HV, c.D,
                                                                          NUM_SMS))
    label = (f"decode H={c.H} HV={c.HV} K={c.D} V={c.D} {_dtype_name(c.dtype)}/{_dtype_name(c.v_dtype)} "
             f"h0={c.h0_dtype is not None} v_first={c.state_v_first} varlen={varlen} final={c.final} "
             f"l2norm={c.l2norm}" + (f" gate(dt_bias={dt_bias is not None})" if c.gate else "")
             + (f" beta_act={beta_act}" if beta_act else "") + f" lanes={args[-1]}")
    return "sm90 decode kernel", [(label, decode.build, args)]


def _dtype_name(dt) -> str:
    return "-" if dt is None else str(dt).removeprefix("torch.")


def collect(expr: str, path: str = TEST_FILE, out=sys.stdout) -> tuple:
    """(builds, not mapped): the deduplicated builds of the selected cases, and the selected test functions `CALLS`
    lacks. Prints a line per test function: cases, calls per path, new builds."""
    table = cases(path)
    picked = selected(table, expr)
    builds: dict = {}
    unmapped: dict = {}
    by_fn: dict = {}
    for fn, pid, params in picked:
        if fn not in CALLS:
            unmapped[fn] = unmapped.get(fn, 0) + 1
            continue
        names, mirror = CALLS[fn]
        if tuple(params) != names:
            raise ValueError(f"{fn}: parametrize arguments {tuple(params)} differ from the mirrored {names}; update "
                             f"CALLS for this version of the test file")
        stats = by_fn.setdefault(fn, {"cases": 0, "paths": {}, "builds": 0})
        stats["cases"] += 1
        for call in mirror(params):
            path_, todo = chunk_builds(call) if isinstance(call, Chunk) else decode_builds(call)
            stats["paths"][path_] = stats["paths"].get(path_, 0) + 1
            for label, b, args in todo:
                key = (b.__name__, args)
                if key not in builds:
                    builds[key] = (f"{fn}[{pid}]: {label}", b, args)
                    stats["builds"] += 1
    for fn, s in by_fn.items():
        paths = ", ".join(f"{p} x{n}" for p, n in s["paths"].items()) or "no flashdelta call"
        print(f"{fn:<46} {s['cases']:>3} cases  {s['builds']:>3} new builds  calls: {paths}", file=out)
    for fn, n in unmapped.items():
        print(f"{fn:<46} {n:>3} cases  NOT MAPPED (no entry in CALLS): its builds are not compiled", file=out)
    return list(builds.values()), unmapped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("-k", "--filter", default=os.environ.get("FILTER") or DEFAULT_FILTER,
                    help=f"pytest -k expression (default: $FILTER, else {DEFAULT_FILTER!r})")
    ap.add_argument("--file", default=TEST_FILE, help="FLA's test file (default: the staged copy)")
    ap.add_argument("--list", action="store_true", help="print every build's label")
    ap.add_argument("--dry-run", action="store_true", help="list and count, compile nothing")
    a = ap.parse_args()
    if not os.path.isfile(a.file):
        print(f"{a.file}: no such file; stage FLA's test file first: bash bench/dev/fla_tests.sh stage <checkout>",
              file=sys.stderr)
        return 2
    if not a.dry_run and not os.environ.get("TILELANG_CACHE_DIR"):
        print("set TILELANG_CACHE_DIR (e.g. .cache/tl-ship) so the kernels land where they can be carried",
              file=sys.stderr)
        return 2
    print(f"FILTER {a.filter!r}; FLASHDELTA_ARCH={os.environ['FLASHDELTA_ARCH']}, {NUM_SMS} SMs")
    todo, unmapped = collect(a.filter, a.file)
    if a.list:
        for label, _, _ in todo:
            print(f"  {label}")
    print(f"{len(todo)} builds")
    if a.dry_run:
        return 0
    start = time.perf_counter()
    for i, (label, builder, args) in enumerate(todo, 1):
        t0 = time.perf_counter()
        builder(*args)
        print(f"[{i}/{len(todo)}] {label} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"{len(todo)} builds in {time.perf_counter() - start:.0f} s "
          f"(TILELANG_CACHE_DIR={os.environ['TILELANG_CACHE_DIR']})")
    return 1 if unmapped else 0


if __name__ == "__main__":
    sys.exit(main())
