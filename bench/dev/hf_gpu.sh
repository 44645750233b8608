#!/usr/bin/env bash
# The Hugging Face test (tests/cpu/test_hf_qwen3_next.py: a tiny random Qwen3-Next, its GDN layers on flashdelta) on
# the GPU machine, which has no network and no transformers: transformers 5.24.0 and the packages it imports come as
# py312 wheels staged on the CPU machine. With CUDA the test runs its logits and gradient cases in bf16 with
# FLASHDELTA_BACKEND=sm90 (every GDN call on the SM90 kernels or an error: chunked prefill and its backward through
# chunk_gated_delta_rule, decode steps through fused_recurrent_gated_delta_rule's kernel, whose launches it counts).
#   bash bench/dev/hf_gpu.sh stage            # CPU machine: .cache/wheels-hf (~21 MB; carry that path)
#   bash bench/dev/hf_gpu.sh precompile       # CPU machine: the test's SM90 builds into $TILELANG_CACHE_DIR
#   source .device/bootstrap.sh; source bench/dev/tlcache.sh unpack; bash bench/dev/hf_gpu.sh   # GPU machine
# Staged: transformers and what the test imports of its dependencies, installed with --no-deps. Left out: numpy (the
# GPU machine has it: TileLang needs it), hf-xet (downloads from the Hub only) and the `hf` CLI's typer / rich /
# pydantic stack (never imported by the model code).
set -u
W=.cache/wheels-hf
SITE=/tmp/site-hf
WHEELS="transformers==5.24.0 huggingface_hub tokenizers safetensors regex pyyaml packaging filelock tqdm httpx2
        httpcore2 h11 anyio idna truststore typing_extensions fsspec click"
case "${1:-run}" in
  stage)
    rm -rf "$W" /tmp/wheels-hf-all && mkdir -p "$W"
    python3 -m pip download -q --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d /tmp/wheels-hf-all transformers==5.24.0 \
      || exit 1
    for w in $WHEELS; do
      f=$(ls /tmp/wheels-hf-all/"${w%%==*}"-*.whl 2>/dev/null) || { echo "no wheel for $w" >&2; exit 1; }
      cp $f "$W"/
    done
    du -sh "$W" ;;
  precompile)
    # the test's GPU shapes: H=2, HV=4, K=V=128, bf16 q/k/v and beta, fp32 g and state, l2norm, forward with and
    # without the initial state, backward (the training step), decode (dense, varlen)
    : "${TILELANG_CACHE_DIR:?set TILELANG_CACHE_DIR (e.g. .cache/tl-ship) so the kernels land where they can be carried}"
    FLASHDELTA_ARCH=sm_90a PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} python3 -c "
import torch, flashdelta
s = flashdelta.warmup([(2, 4)], head_dim=(128, 128), dtype=torch.bfloat16, beta_dtype=torch.bfloat16, num_sms=132,
                      backward=True, decode=True)
print(f'{s:.0f} s')" ;;
  run)
    # a warm machine whose /tmp/site an earlier call's bootstrap unpacked: .device need not be carried again
    if ! python3 -c "import tilelang" 2> /dev/null && [ -f /tmp/site/.ready ]; then
      export PYTHONPATH=/tmp/site:$PWD/.device/peers:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH} FLA_FLASH_QLA=0
    fi
    ls "$W"/transformers-*.whl > /dev/null || { echo "carry $W (bash bench/dev/hf_gpu.sh stage)" >&2; exit 2; }
    if [ ! -f $SITE/.ready ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE "$W"/*.whl 2>&1 | grep -v -i warning
      touch $SITE/.ready
    fi
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    python3 -c "import torch, transformers; print('transformers', transformers.__version__, '| cuda', torch.cuda.is_available())" \
      || exit 1
    timeout "${TEST_S:-540}" python3 -u -m pytest tests/cpu/test_hf_qwen3_next.py -v -p no:cacheprovider 2>&1 \
      | grep -v "TileLang.*INFO" ;;
  *) echo "usage: bench/dev/hf_gpu.sh [stage|precompile|run]" >&2; exit 2 ;;
esac
