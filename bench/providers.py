"""One calling convention for every implementation under test, import-guarded.

`Provider.forward(inp)` runs ``chunk_gated_delta_rule`` on an `Inputs` (bf16 q/k/v, fp32 g/beta/h0, varlen
`cu_seqlens` int32 with B = 1, output_final_state=True) and returns ``(o, final_state)``. Gradients go through
autograd, the same way for every provider (`backward_fn`).

Providers:
- ``flashdelta``: ``flashdelta.chunk_gated_delta_rule`` (given ``cu_seqlens_cpu``, as FLA is: its automatic
  context parallelism plans from it), with ``FLASHDELTA_BACKEND=sm90`` so that a missing Hopper kernel raises
  instead of silently timing the portable PyTorch path.
- ``fla``: FLA 0.6.0 ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` on its own Triton kernels:
  ``FLA_FLASH_QLA=0`` is set before FLA is imported (otherwise FLA dispatches to FlashQLA when it is
  installed), ``FLA_INTRACARD_CP=0`` (the default, stated). `chunk_indices` and ``cu_seqlens_cpu`` are
  precomputed once per input set so nothing syncs the host during capture. FLA's dispatch log is watched:
  a call that went to flash_qla is an error. On Hopper with Triton < 3.7.1 FLA's backward runs one kernel
  (dqkwg) through its TileLang backend; that is recorded in the notes.
- ``flashqla``: FlashQLA 0.1.3 ``flash_qla.chunk_gated_delta_rule`` (auto intra-card CP on, its default).
  With TileLang 0.1.15 its kernels need the pass config ``tl.disable_buffer_init_check``; FlashQLA exposes no
  switch and TileLang reads no environment variable for it, so `FlashQLA.load` adds the key to the
  ``pass_configs`` of every ``@tilelang.jit`` kernel object in the ``flash_qla`` modules before anything
  compiles (TileLang reads ``JITImpl.pass_configs`` at compile time).
- ``flashinfer``: FlashInfer's SM90 GDN prefill, ``flashinfer.gdn_prefill.chunk_gated_delta_rule`` when the
  ``flashinfer`` package imports, else ``fi_gdn_sm90`` (the same SM90 kernels compiled ahead of time, with the
  same call). Its conventions differ from the others'; `FlashInfer.prepare` converts the inputs once per input
  set, outside every timed region (`FlashInfer` says which). Forward only: it has no SM90 backward, so
  `supports` turns the bwd and fwdbwd suites away.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
from typing import Optional

CHUNK = 64


@dataclasses.dataclass
class Inputs:
    """One input set. Every provider gets the same tensors (they must not modify them)."""
    q: object
    k: object
    v: object
    g: object
    beta: object
    h0: object
    cu: object                       # int32 [N + 1] on the device
    cu_host: object                  # the same on the CPU (int64), for FLA's chunk_indices
    seqlens: tuple
    scale: float
    do: object = None                # output gradients for backward suites
    dht: object = None
    extras: dict = dataclasses.field(default_factory=dict)   # per-provider precomputed metadata

    def leaves(self) -> tuple:
        return (self.q, self.k, self.v, self.g, self.beta, self.h0)


GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def make_inputs(seqlens, h: int, hv: int, k: int = 128, v: int = 128, *, seed: int, device="cuda",
                requires_grad: bool = False, dtype=None, beta_dtype=None, zero_gate_frac: float = 0.25):
    """FlashQLA's benchmark inputs: q, k l2-normalised randn; v randn; g = logsigmoid(randn) / 16 with g = 0 on
    a seeded random `zero_gate_frac` of the heads; beta = sigmoid(randn); h0 randn fp32."""
    import torch
    import torch.nn.functional as F

    dtype = dtype or torch.bfloat16
    beta_dtype = beta_dtype or torch.float32
    seqlens = tuple(int(n) for n in seqlens)
    T, N = sum(seqlens), len(seqlens)
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    q = F.normalize(randn(1, T, h, k), dim=-1).to(dtype)
    kk = F.normalize(randn(1, T, h, k), dim=-1).to(dtype)
    vv = randn(1, T, hv, v).to(dtype)
    g = F.logsigmoid(randn(1, T, hv)) / 16
    n_zero = int(round(hv * zero_gate_frac))
    if n_zero:
        zero_heads = torch.randperm(hv, generator=cpu_gen)[:n_zero].to(device)
        g[..., zero_heads] = 0.0
    beta = torch.sigmoid(randn(1, T, hv)).to(beta_dtype)
    h0 = randn(N, hv, k, v)
    cu_list = [0]
    for n in seqlens:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    inp = Inputs(q, kk, vv, g, beta, h0, cu, torch.tensor(cu_list, dtype=torch.int64), seqlens, k ** -0.5)
    if requires_grad:
        for name in ("q", "k", "v", "g", "beta", "h0"):
            setattr(inp, name, getattr(inp, name).detach().requires_grad_(True))
        inp.do = randn(1, T, hv, v).to(dtype)
        inp.dht = randn(N, hv, k, v) / 8
    return inp


def backward_fn(provider: "Provider", inp: Inputs, outs):
    """Gradients of (o, final_state) w.r.t. the six inputs, as a tuple in `GRAD_NAMES` order."""
    import torch

    return torch.autograd.grad(outs, inp.leaves(), (inp.do, inp.dht), retain_graph=True, allow_unused=True)


class Provider:
    name = "?"
    dist = None                  # distribution name for the version lookup
    module = None

    def __init__(self):
        self._loaded = False
        self._error: Optional[str] = None
        self.notes: list = []

    def load(self) -> Optional[str]:
        """Import the implementation; returns None if usable, else why not (the provider is then skipped)."""
        if not self._loaded:
            self._loaded = True
            try:
                self._load()
            except Exception as exc:  # noqa: BLE001 - report any import failure as "unavailable"
                self._error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return self._error

    def _load(self) -> None:
        raise NotImplementedError

    def version(self) -> str:
        return dist_version(self.dist, self.module)

    def forward(self, inp: Inputs):
        raise NotImplementedError

    def prepare(self, inp: Inputs) -> None:
        """Precompute per-input metadata (outside every timed region)."""

    def cp_partitions(self, inp: Inputs, train: bool) -> Optional[int]:
        """Most partitions any one sequence is cut into by intra-card CP (1: no CP); None if unknown."""
        return None

    def check_call(self) -> Optional[str]:
        """After a call: an error message if the call did not run what this provider claims to time."""
        return None

    def supports(self, suite: str) -> Optional[str]:
        """None if this provider runs `suite`; else why not (its rows are then ``unsupported``)."""
        return None


class FlashDelta(Provider):
    name = "flashdelta"
    dist = "flashdelta"
    module = "flashdelta"

    def _load(self) -> None:
        os.environ.setdefault("FLASHDELTA_BACKEND", "sm90")
        import flashdelta
        self.fn = flashdelta.chunk_gated_delta_rule
        self.notes.append(f"FLASHDELTA_BACKEND={os.environ['FLASHDELTA_BACKEND']}")

    def forward(self, inp: Inputs):
        return self.fn(inp.q, inp.k, inp.v, inp.g, inp.beta, scale=inp.scale, initial_state=inp.h0,
                       output_final_state=True, cu_seqlens=inp.cu, cu_seqlens_cpu=inp.cu_host)

    def cp_partitions(self, inp: Inputs, train: bool) -> Optional[int]:
        """The most partitions of one sequence that flashdelta's context parallelism cuts (1: serial), for the
        forward or, with `train`, the backward, as the call decides it from ``FLASHDELTA_CP`` (`cp.parse_request`):
        off, a partition length, or the cost models the call consults (`cp.auto_lengths`; forced under ``on``)."""
        from flashdelta import cp

        request = cp.parse_request(None)
        if request == "off":
            return 1
        if isinstance(request, int):
            L = request
        else:
            T, HV, K, V = inp.q.shape[1], inp.v.shape[2], inp.k.shape[3], inp.v.shape[3]
            L = cp.auto_lengths(T=T, N=len(inp.seqlens), HV=HV, K=K, V=V, sms=cp.num_sms(inp.q.device),
                                lengths=list(inp.seqlens), force=request == "on")[1 if train else 0]
        return max(1, -(-max(inp.seqlens, default=0) // (64 * L))) if L else 1


class _LogWatch(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class FLA(Provider):
    name = "fla"
    dist = "fla-core"
    module = "fla"

    def _load(self) -> None:
        os.environ["FLA_FLASH_QLA"] = "0"          # else FLA silently runs FlashQLA when it is installed
        os.environ.setdefault("FLA_INTRACARD_CP", "0")
        self.watch = _LogWatch()
        log = logging.getLogger("fla.backends")
        log.addHandler(self.watch)
        log.setLevel(logging.INFO)
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.utils.index import prepare_chunk_indices
        self.fn, self._chunk_indices = chunk_gated_delta_rule, prepare_chunk_indices
        self.notes.append(f"FLA_FLASH_QLA={os.environ['FLA_FLASH_QLA']} FLA_INTRACARD_CP={os.environ['FLA_INTRACARD_CP']}")

    def prepare(self, inp: Inputs) -> None:
        inp.extras["fla_chunk_indices"] = self._chunk_indices(inp.cu, CHUNK, cu_seqlens_cpu=inp.cu_host)

    def forward(self, inp: Inputs):
        return self.fn(inp.q, inp.k, inp.v, inp.g, inp.beta, scale=inp.scale, initial_state=inp.h0,
                       output_final_state=True, cu_seqlens=inp.cu, cu_seqlens_cpu=inp.cu_host,
                       chunk_indices=inp.extras.get("fla_chunk_indices"))

    def cp_partitions(self, inp: Inputs, train: bool) -> Optional[int]:
        return 1                                   # intra-card CP is off (FLA_INTRACARD_CP=0)

    def dispatch_log(self) -> list:
        return [m for m in self.watch.messages if "[FLA Backend]" in m]

    def check_call(self) -> Optional[str]:
        went = [m for m in self.dispatch_log() if "-> flash_qla" in m and "rejected" not in m]
        return f"FLA dispatched to FlashQLA ({went[0]}); FLA_FLASH_QLA=0 did not take" if went else None


class FlashQLA(Provider):
    name = "flashqla"
    dist = "flash-qla"
    module = "flash_qla"

    def _load(self) -> None:
        import flash_qla
        self.fn = flash_qla.chunk_gated_delta_rule
        n = disable_buffer_init_check("flash_qla")
        self.notes.append(f"tl.disable_buffer_init_check set on {n} flash_qla jit kernels" if n is not None
                          else "this TileLang has no tl.disable_buffer_init_check (not needed)")
        from flash_qla.ops.gated_delta_rule import chunk as _chunk
        self._chunk = _chunk

    def forward(self, inp: Inputs):
        return self.fn(inp.q, inp.k, inp.v, inp.g, inp.beta, scale=inp.scale, initial_state=inp.h0,
                       output_final_state=True, cu_seqlens=inp.cu)

    def cp_partitions(self, inp: Inputs, train: bool) -> Optional[int]:
        # The same call FlashQLA makes internally (cached by cu_seqlens identity, so this is the decision
        # the timed call used). Run after a warm-up call, never under capture.
        ctx = self._chunk._auto_intra_cp_context(inp.k, inp.v, inp.cu, self._chunk.CHUNK_SIZE, True, train)
        if not getattr(ctx, "is_intra", False) or ctx.seq_map_r2c is None:
            return 1
        r2c = ctx.seq_map_r2c.tolist()
        return max(b - a for a, b in zip(r2c[:-1], r2c[1:]))


class FlashInfer(Provider):
    """FlashInfer's SM90 GDN chunked prefill (forward only).

    Where its conventions differ from the benchmark's, `prepare` converts once per input set, outside timing,
    into ``inp.extras["flashinfer"]``:

    - q, k, v packed varlen ``[T, H*, 128]`` (no batch dim): views of the bench's ``[1, T, H*, 128]``;
    - ``g`` is the per-token decay factor ``exp(g)``, not its log: fp32 ``[T, HV]``;
    - beta fp32 ``[T, HV]``;
    - states V-first, ``[N, HV, V, K]``: h0 is transposed (and made contiguous) once; the final state comes
      back V-first and `forward` returns its transposed view ``[N, HV, K, V]`` (a view: no kernel, no copy);
    - ``cu_seqlens`` int32 on the GPU (the bench's), plus ``max_seqlen`` = the longest sequence, FlashInfer's
      host-side hint that bounds its CP launch grids without reading ``cu_seqlens`` back;
    - q and k are already l2-normalised, so they go in as given: ``use_qk_l2norm_in_kernel=False`` for the
      package (the ahead-of-time build has no such switch and never normalises);
    - scale K^-0.5 as for the others; ``use_cp="auto"``: FlashInfer picks its own CP path.

    The output ``[T, HV, V]`` comes back as the view ``[1, T, HV, V]``.
    """
    name = "flashinfer"
    dist = "flashinfer-python"
    module = "flashinfer"
    AOT_MODULE = "fi_gdn_sm90"
    NO_BACKWARD = "FlashInfer has no SM90 backward (its GDN prefill is forward only)"

    def _load(self) -> None:
        try:
            from flashinfer.gdn_prefill import chunk_gated_delta_rule
            from flashinfer.gdn_kernels.delta_rule_dsl import varlen_helper
        except Exception as exc:  # noqa: BLE001 - not installed, or installed but not importable here
            why = ("not installed" if isinstance(exc, ModuleNotFoundError) and exc.name == "flashinfer"
                   else " ".join(f"{type(exc).__name__}: {exc}".split())[:200])
            try:
                aot = importlib.import_module(self.AOT_MODULE)
                aot.load()                   # the kernel library: a failure makes the provider unavailable
            except Exception as aot_exc:  # noqa: BLE001
                raise RuntimeError(f"package flashinfer {why}; {self.AOT_MODULE}: "
                                   f"{type(aot_exc).__name__}: {aot_exc}") from aot_exc
            self.fn, self._cp_host, self._kwargs = aot.chunk_gated_delta_rule, aot, {}
            self.source = self.AOT_MODULE
            self._version = f"{_aot_flashinfer_version(aot)} ({self.AOT_MODULE} ahead-of-time build)"
            self.notes.append(f"{self.AOT_MODULE}.chunk_gated_delta_rule (package flashinfer {why}); "
                              f"kernel library {os.path.basename(str(aot._lib.get('path') or '?'))}")
        else:
            self.fn, self._cp_host = chunk_gated_delta_rule, varlen_helper
            self._kwargs = {"use_qk_l2norm_in_kernel": False}
            self.source = "flashinfer"
            self._version = dist_version(self.dist, self.module)
            self.notes.append("flashinfer.gdn_prefill.chunk_gated_delta_rule")
        self.notes.append("converted outside timing: g -> exp(g), beta fp32, h0 [N,HV,V,K], packed [T,H,D], "
                          "max_seqlen hint; q/k as given (l2-normalised); use_cp=auto; forward only")

    def version(self) -> str:
        return getattr(self, "_version", "") or dist_version(self.dist, self.module)

    def supports(self, suite: str) -> Optional[str]:
        return None if suite == "fwd" else self.NO_BACKWARD

    def prepare(self, inp: Inputs) -> None:
        import torch

        if inp.q.dim() != 4 or inp.q.shape[0] != 1:
            raise ValueError(f"q: FlashInfer takes packed varlen input, B must be 1; got shape {tuple(inp.q.shape)}")
        N, HV = len(inp.seqlens), inp.v.shape[2]
        K, V = inp.k.shape[3], inp.v.shape[3]
        with torch.no_grad():
            h0 = (inp.h0.detach().transpose(-1, -2) if inp.h0 is not None else
                  torch.zeros(N, HV, V, K, device=inp.q.device))   # its AOT build always takes an initial state
            inp.extras["flashinfer"] = dict(
                q=inp.q.detach()[0].contiguous(), k=inp.k.detach()[0].contiguous(),
                v=inp.v.detach()[0].contiguous(),
                g=inp.g.detach()[0].float().exp().contiguous(),
                beta=inp.beta.detach()[0].float().contiguous(),
                h0=h0.float().contiguous(),
                cu=inp.cu, max_seqlen=max(inp.seqlens, default=0))

    def forward(self, inp: Inputs):
        fi = inp.extras.get("flashinfer")
        if fi is None:
            raise RuntimeError("FlashInfer.forward: prepare(inp) was not called (the conversion stays outside "
                               "the timed region)")
        o, ht = self.fn(fi["q"], fi["k"], fi["v"], g=fi["g"], beta=fi["beta"], scale=inp.scale,
                        initial_state=fi["h0"], output_final_state=True, cu_seqlens=fi["cu"],
                        max_seqlen=fi["max_seqlen"], **self._kwargs)
        return o.unsqueeze(0), ht.transpose(-1, -2)

    def device_info(self, device) -> dict:
        """What FlashInfer's CP heuristics read about the device: SM count, name, compute capability."""
        import torch

        props = torch.cuda.get_device_properties(device)
        return {"sm_count": props.multi_processor_count, "name": props.name, "cc": (props.major, props.minor)}

    def cp_partitions(self, inp: Inputs, train: bool) -> Optional[int]:
        """The most pieces FlashInfer's CP path cuts one sequence into (1: its non-CP kernel), from FlashInfer's
        own host heuristics (``should_use_cp_host``, ``choose_cp_chunk_len_host``) with the arguments its
        call passes them."""
        if train:
            return None
        info = self.device_info(inp.q.device)
        N, T = len(inp.seqlens), sum(inp.seqlens)
        heads = max(inp.q.shape[2], inp.v.shape[2])
        h = self._cp_host
        if not h.should_use_cp_host(N * heads, info["sm_count"], info["name"], device_capability=info["cc"]):
            return 1
        longest = max(inp.seqlens, default=0)
        chunk = h.choose_cp_chunk_len_host(longest, heads, info["sm_count"], device_capability=info["cc"],
                                           total_seqlen=T, num_seqs=N, device_name=info["name"])
        return max(1, -(-longest // chunk))


def _aot_flashinfer_version(mod) -> str:
    """The FlashInfer version the ahead-of-time build was made from (its manifest.json), else ''."""
    import json

    try:
        with open(os.path.join(os.path.dirname(mod.__file__), "manifest.json")) as f:
            return str(json.load(f).get("flashinfer", ""))
    except Exception:  # noqa: BLE001
        return ""


def disable_buffer_init_check(package: str) -> Optional[int]:
    """Add ``tl.disable_buffer_init_check = True`` to every TileLang JIT kernel object defined in `package`.

    Returns how many kernel objects were patched, or None if this TileLang has no such pass config.
    """
    import tilelang

    key = getattr(getattr(tilelang, "PassConfigKey", None), "TL_DISABLE_BUFFER_INIT_CHECK", None)
    if key is None:
        return None
    key = getattr(key, "value", key)
    patched = 0
    for modname, mod in list(sys.modules.items()):
        if mod is None or not (modname == package or modname.startswith(package + ".")):
            continue
        for obj in list(vars(mod).values()):
            if type(obj).__name__ == "JITImpl" and hasattr(obj, "pass_configs"):
                configs = dict(obj.pass_configs or {})
                configs[key] = True
                obj.pass_configs = configs
                patched += 1
    return patched


def dist_version(dist: Optional[str], module: Optional[str] = None) -> str:
    """Installed version of a distribution, else the module's __version__, else ''."""
    if dist:
        try:
            from importlib.metadata import version
            return version(dist)
        except Exception:  # noqa: BLE001
            pass
    if module:
        try:
            return str(getattr(importlib.import_module(module), "__version__", ""))
        except Exception:  # noqa: BLE001
            pass
    return ""


REGISTRY = {"flashdelta": FlashDelta, "fla": FLA, "flashqla": FlashQLA, "flashinfer": FlashInfer}


def get(names) -> dict:
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown provider(s) {unknown}; known: {list(REGISTRY)}")
    return {n: REGISTRY[n]() for n in names}
