"""flashdelta as a backend of FLA's dispatch (`fla.backends`, FLA 0.6.0): after `register()`, FLA's
``chunk_gated_delta_rule`` (and every framework that calls it: FLA's layers, Hugging Face models importing FLA's ops)
runs on flashdelta wherever flashdelta can run the call as it is; FLA's own kernels take every other call.

    import flashdelta.fla_backend
    flashdelta.fla_backend.register()

FLA is an optional dependency: flashdelta never imports it, this module does (``pip install fla-core==0.6.0``).
FLA asks the backend's verifier before each call; `verify` accepts a call only where flashdelta runs it in full:

- on a GPU with native flashdelta kernels (SM90), when every stage of the forward, and of the backward where an input
  requires grad, has an SM90 kernel for the call's head dims and dtype (no silent portable-path stages on a GPU);
- on the CPU (FLA has no CPU kernels; flashdelta's portable path runs there);
- with ``FLASHDELTA_BACKEND`` forcing a backend, wherever that backend runs the call;

and says why not otherwise: other GPUs, context parallelism (``cp_context``), arguments flashdelta does not take (FLA
ignores unknown keywords, flashdelta rejects them), arguments FLA itself rejects (``head_first``, a chunk_size other
than 16/32/64: FLA's own function raises its error). ``FLA_FLASHDELTA=0`` disables the backend. Its priority, 2, puts
it ahead of FLA's FlashQLA backend (3) when both are registered and accept a call.

FLA 0.6.0 dispatches ``chunk_gated_delta_rule`` only; its ``fused_recurrent_gated_delta_rule`` always runs FLA's
kernel (use `flashdelta.fused_recurrent_gated_delta_rule` directly).
"""
from __future__ import annotations

import inspect

import torch
from torch import Tensor

from . import api, dispatch

try:
    from fla.backends import BaseBackend
    from fla.backends import register as _fla_register
except ImportError as error:     # FLA missing, or present without its runtime (Triton)
    raise ImportError(f"flashdelta.fla_backend needs FLA 0.6.0 (pip install fla-core==0.6.0 and its Triton): "
                      f"{error}") from error

__all__ = ["FlashDeltaBackend", "OPERATION", "register", "verify"]

OPERATION = "gated_delta_rule"       # FLA's registry of the GDN ops
_SIGNATURE = inspect.signature(api.chunk_gated_delta_rule)


def verify(*args, **kwargs) -> tuple[bool, str | None]:
    """``(True, None)`` when flashdelta runs this ``chunk_gated_delta_rule`` call in full, else ``(False, reason)``.
    Takes the call's arguments as FLA's function received them."""
    try:
        a = _SIGNATURE.bind(*args, **kwargs).arguments
    except TypeError as error:
        return False, f"flashdelta does not take these arguments ({error})"
    if a.get("cp_context") is not None:
        return False, ("flashdelta's chunk_gated_delta_rule does not take cp_context (context parallelism across "
                       "GPUs runs through flashdelta.distributed.chunk_gated_delta_rule_cp)")
    if "head_first" in a:
        return False, "head_first was removed from FLA; FLA's function raises its error"
    chunk_size = a.get("chunk_size", 64)
    if isinstance(chunk_size, bool) or chunk_size not in (16, 32, 64):
        return False, f"chunk_size={chunk_size!r} is not one of FLA's 16, 32, 64; FLA's function raises its error"
    q, k, v = a["q"], a["k"], a["v"]
    if not all(isinstance(x, Tensor) and x.dim() == 4 for x in (q, k, v)):
        return False, "q, k, v must be 4-D tensors"
    if not q.dtype == k.dtype == v.dtype:
        return False, f"flashdelta needs one dtype for q, k, v, got {q.dtype}, {k.dtype}, {v.dtype}"
    # A_log and dt_bias take part (and need gradients) only with the in-kernel gate; without it they are ignored
    grads = [a.get(n) for n in ("q", "k", "v", "g", "beta", "initial_state")
             + (("A_log", "dt_bias") if a.get("use_gate_in_kernel") else ())]
    need_bwd = torch.is_grad_enabled() and any(isinstance(x, Tensor) and x.requires_grad for x in grads)
    device = q.device
    if dispatch.native_backend(device) is None and dispatch.requested_backend() == "auto":
        if device.type == "cpu":
            return True, None
        return False, (f"flashdelta has native kernels for SM90 (Hopper) GPUs only; {device} runs FLA's own kernels "
                       f"(flashdelta's portable PyTorch path is slower there)")
    try:
        plan = dispatch.plan(device, q.shape[-1], v.shape[-1], q.dtype, need_bwd=need_bwd)
    except dispatch.UnsupportedError as error:
        return False, str(error)
    if plan.fallback:
        why = "; ".join(f"{s}: {r}" for s, r in plan.fallback.items())
        return False, f"flashdelta has no {plan.native} kernel for part of this call ({why})"
    return True, None


class FlashDeltaBackend(BaseBackend):
    """flashdelta's Hopper kernels for FLA's ``chunk_gated_delta_rule``; disable with ``FLA_FLASHDELTA=0``."""

    backend_type = "flashdelta"
    package_name = "flashdelta"
    env_var = "FLA_FLASHDELTA"
    default_enable = True
    priority = 2

    def chunk_gated_delta_rule_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
        return verify(*args, **kwargs)

    def chunk_gated_delta_rule(self, *args, **kwargs):
        return api.chunk_gated_delta_rule(*args, **kwargs)


def register() -> None:
    """Register flashdelta in FLA's ``gated_delta_rule`` backend registry (registering again replaces the entry)."""
    _fla_register(OPERATION)(FlashDeltaBackend)
