"""A tiny, randomly initialised Qwen3-Next (transformers' ``qwen3_next``) with its Gated DeltaNet layers on flashdelta
(`flashdelta.hf.patch`): greedy generation against the same model on transformers' own PyTorch GDN (float32, on the
CPU); logits through a chunked prefill that continues the cache's state and then decode steps, and a training step's
gradients, against the float64 truth (the model in float64 with its GDN layers on the float64 recurrence), with
transformers' PyTorch GDN as the baseline that flashdelta must match or beat (`assert_close(baseline=...)`).

On the CPU the model is float32 and flashdelta runs its portable path. With CUDA (an SM90 GPU) the logits and gradient
tests run there: the model is bf16 with GDN head dims K = V = 128, and flashdelta runs with ``FLASHDELTA_BACKEND=sm90``,
so every call must run on the SM90 kernels (the chunked prefill and its backward, and the decode kernel, whose
launcher the test counts) or raise; the bar is the baseline alone (``factor`` x transformers' error), since in bf16
the rest of the model's arithmetic, the same for both, dominates either error.

"transformers' PyTorch GDN" is the torch function under transformers' dispatch wrapper (``__wrapped__``): with FLA
installed, the module-level names call FLA's kernels instead. transformers' PyTorch GDN computes in float32 whatever the
model's dtype, so the truth comes from the float64 recurrence. Gradients that are ~0 next to the rest (here the A_log
and dt_bias gradients of the last GDN layer, ~1e-8, whose float32 values are rounding noise in either implementation)
pass by FLA's absolute floor of 1e-6, as in test_fla_cases.py. Skipped without transformers (tested with 5.24.0; the
``hf`` extra).
"""
from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
from _helpers import assert_close

pytest.importorskip("transformers.models.qwen3_next", reason="needs transformers with Qwen3-Next (5.x): the hf extra")

import flashdelta.hf  # noqa: E402
from flashdelta import dispatch  # noqa: E402
from flashdelta.reference import recurrent_gated_delta_rule  # noqa: E402
from transformers import DynamicCache, Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402

REFERENCE = {name: recurrent_gated_delta_rule for name in flashdelta.hf.NAMES}
# transformers' own PyTorch functions, below its wrapper (which prefers FLA's kernels where FLA is installed)
TORCH = {name: getattr(getattr(modeling_qwen3_next, name), "__wrapped__", getattr(modeling_qwen3_next, name))
         for name in flashdelta.hf.NAMES}
ATOL = 1e-6
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32       # the logits and gradient tests' model dtype


def _config(head_dim: int = 16):
    return Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=256,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        experts_implementation="eager")       # the grouped-mm experts take no float64


@pytest.fixture(scope="module")
def cpu_model():
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(_config()).eval()


@pytest.fixture(scope="module")
def models(cpu_model):
    """(model in DTYPE on DEVICE, its float64 copy): the CPU's float32 model, or on CUDA a bf16 one with K = V = 128
    (head dims the SM90 kernels have)."""
    if not CUDA:
        return cpu_model, copy.deepcopy(cpu_model).double()
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(_config(head_dim=128)).eval().to(DEVICE, DTYPE)
    return model, copy.deepcopy(model).double()         # the truth holds the bf16 model's weights, exactly


@contextlib.contextmanager
def _sm90_only():
    """On CUDA, ``FLASHDELTA_BACKEND=sm90`` (a call the SM90 kernels cannot run raises instead of falling back), and
    the decode kernel's launches counted; elsewhere nothing."""
    launches = []
    if not CUDA:
        yield launches
        return
    from flashdelta.kernels import decode

    saved_env, launcher = os.environ.get(dispatch.ENV_BACKEND), decode.fused_recurrent_fwd

    def count(*a, **kw):
        launches.append(a[0].shape)
        return launcher(*a, **kw)

    os.environ[dispatch.ENV_BACKEND] = "sm90"
    decode.fused_recurrent_fwd = count
    try:
        yield launches
    finally:
        decode.fused_recurrent_fwd = launcher
        if saved_env is None:
            os.environ.pop(dispatch.ENV_BACKEND, None)
        else:
            os.environ[dispatch.ENV_BACKEND] = saved_env


def _on(impl: str, fn):
    """fn() with the GDN layers on `impl` (transformers | flashdelta | reference), and the GDN names it called."""
    calls = []
    saved = {name: getattr(modeling_qwen3_next, name) for name in flashdelta.hf.NAMES}
    try:
        flashdelta.hf.patch(modeling_qwen3_next, {"transformers": TORCH, "reference": REFERENCE}.get(impl))
        for name in flashdelta.hf.NAMES:
            inner = getattr(modeling_qwen3_next, name)

            def spy(*a, _inner=inner, _name=name, **kw):
                calls.append(_name)
                return _inner(*a, **kw)

            setattr(modeling_qwen3_next, name, spy)
        return fn(), calls
    finally:
        for name, f in saved.items():
            setattr(modeling_qwen3_next, name, f)


def _close(name: str, out, truth, hf, **kw) -> None:
    """The tolerance helper's bar: on the CPU its tolerance and the baseline; on CUDA (bf16) the baseline alone."""
    assert_close(name, out, truth, baseline=hf, **(dict(tol=float("inf")) if CUDA else {}), **kw)


def test_greedy_generation_matches_transformers(cpu_model):
    """float32 on the CPU (the portable path), on any machine."""
    model = cpu_model
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, _ = _on("transformers", lambda: model.generate(ids, max_new_tokens=8, do_sample=False))
        out, calls = _on("flashdelta", lambda: model.generate(ids, max_new_tokens=8, do_sample=False))
    assert torch.equal(out, ref)
    assert set(calls) == set(flashdelta.hf.NAMES)


def test_chunked_prefill_then_decode_logits(models):
    """Prefill 12 tokens, prefill 9 more from the cache's state (the chunked path with an initial state), then 4
    decode steps (the recurrent path): every step's logits."""
    ids = torch.randint(0, 128, (2, 25), generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def run(model):
        cache, logits = DynamicCache(config=model.config), []
        with torch.no_grad():
            for a, b in ((0, 12), (12, 21), (21, 22), (22, 23), (23, 24), (24, 25)):
                out = model(ids[:, a:b], cache=cache, use_cache=True)
                cache = out.past_key_values
                logits.append(out.logits)
        return torch.cat(logits, 1)

    model, model64 = models
    truth, _ = _on("reference", lambda: run(model64))
    hf, _ = _on("transformers", lambda: run(model))
    with _sm90_only() as launches:
        out, calls = _on("flashdelta", lambda: run(model))
    assert calls.count("torch_chunk_gated_delta_rule") == 2 * 3
    assert calls.count("torch_recurrent_gated_delta_rule") == 4 * 3
    assert len(launches) == (4 * 3 if CUDA else 0)
    _close("o", out, truth, hf)


def test_training_step_gradients(models):
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(3)).to(DEVICE)

    def step(model):
        model.train()
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        model.eval()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model, model64 = models
    (truth_loss, truth), _ = _on("reference", lambda: step(model64))
    (hf_loss, hf), _ = _on("transformers", lambda: step(model))
    with _sm90_only():
        (loss, out), _ = _on("flashdelta", lambda: step(model))
    _close("o", loss, truth_loss, hf_loss)
    assert out.keys() == truth.keys() and any("linear_attn.A_log" in n for n in out)
    for name in truth:
        gate = name.endswith(("A_log", "dt_bias"))
        _close("dg" if gate else "dq", out[name], truth[name], hf[name], atol=ATOL)


@pytest.mark.skipif(not CUDA, reason="the SM90 routing of the GPU run")
def test_gpu_run_is_on_sm90():
    """The GPU run's GDN calls (K = V = 128, bf16 q/k/v) resolve to the SM90 kernels: forward and backward."""
    assert dispatch.resolve(DEVICE, 128, 128, DTYPE, need_bwd=True) == ("sm90", "sm90")


def test_patch_and_unpatch():
    saved = {name: getattr(modeling_qwen3_next, name) for name in flashdelta.hf.NAMES}
    originals = flashdelta.hf.patch(modeling_qwen3_next)
    assert originals == saved and all(getattr(modeling_qwen3_next, n) is not f for n, f in saved.items())
    assert flashdelta.hf.patch(modeling_qwen3_next) == saved          # patching twice keeps the originals
    flashdelta.hf.unpatch(modeling_qwen3_next, originals)
    assert all(getattr(modeling_qwen3_next, n) is f for n, f in saved.items())


def test_patch_errors():
    with pytest.raises(TypeError, match="must be a Python module"):
        flashdelta.hf.patch(object())
    with pytest.raises(TypeError, match="has none of"):
        flashdelta.hf.patch(pytest)
