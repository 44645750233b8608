#!/usr/bin/env bash
# FLA's own GDN op tests (flash-linear-attention's tests/ops/test_gdn.py, with the conftest it runs under) against
# flashdelta: FLA's chunk_gated_delta_rule and fused_recurrent_gated_delta_rule replaced by flashdelta's, arguments
# unchanged (the pytest plugin bench/dev/fla_swap.py), FLA's references and tolerances. Prints the pass / fail counts
# per test function and which flashdelta backend ran the calls. FLA's files stay out of this repository: they are
# staged under .cache/fla-tests (git-ignored; carry that path, ~80 KB).
#   bash bench/dev/fla_tests.sh stage <flash-linear-attention checkout> [rev]     # CPU machine, once
#   TILELANG_CACHE_DIR=.cache/tl-ship nice -n 19 bash bench/dev/fla_tests.sh precompile   # CPU: the SM90 builds
#   source .device/bootstrap.sh; source bench/dev/tlcache.sh unpack; bash bench/dev/fla_tests.sh   # GPU machine
#   PYTHONPATH=<FLA + Triton + einops> bash bench/dev/fla_tests.sh                 # CPU: the portable path
# FILTER (default "test_chunk or test_fused_recurrent": the cases issue 20 counts) selects with pytest's -k; extra
# arguments go to pytest. precompile compiles into $TILELANG_CACHE_DIR every SM90 kernel build that FILTER's cases
# launch on an H200 (bench/dev/fla_builds.py: the case lists read from the staged file, each test's flashdelta calls
# mirrored; extra arguments go to it, e.g. --dry-run --list), so that the GPU call loads its kernels instead of
# compiling them (then bash bench/dev/tlcache.sh pack). FLA 0.6.0 is what the GPU machine has (.device/wheels); the
# test file is the stored version of FLA's repository closest to it (.cache/fla-tests/SOURCE says which).
set -u
D=.cache/fla-tests
ROOT=$(pwd)
case "${1:-run}" in
  stage)
    repo=${2:?usage: bench/dev/fla_tests.sh stage <flash-linear-attention checkout or git dir> [rev]}
    rev=${3:-HEAD}
    rm -rf "$D" && mkdir -p "$D/tests/ops"
    for f in tests/ops/test_gdn.py tests/conftest.py LICENSE; do
      git --git-dir="$(git -C "$repo" rev-parse --absolute-git-dir)" show "$rev:$f" > "$D/$f" || exit 1
    done
    printf '[pytest]\n' > "$D/pytest.ini"          # the rootdir: flashdelta's own pytest settings stay out
    echo "fla-org/flash-linear-attention $(git -C "$repo" rev-parse "$rev") (tests/ops/test_gdn.py, tests/conftest.py)" \
      > "$D/SOURCE"
    cat "$D/SOURCE"; du -sh "$D" ;;
  precompile)
    shift
    : "${TILELANG_CACHE_DIR:?set TILELANG_CACHE_DIR (e.g. .cache/tl-ship): where the kernels land, to be carried}"
    [ -f "$D/tests/ops/test_gdn.py" ] || { echo "stage FLA's test file first (fla_tests.sh stage)" >&2; exit 2; }
    FLASHDELTA_ARCH=sm_90a PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH} \
      python3 -u bench/dev/fla_builds.py -k "${FILTER:-test_chunk or test_fused_recurrent}" "$@" ;;
  run)
    shift $(( $# > 0 ? 1 : 0 ))
    # a warm machine whose /tmp/site an earlier call's bootstrap unpacked: .device need not be carried again
    if ! python3 -c "import fla" 2> /dev/null && [ -f /tmp/site/.ready ]; then
      export PYTHONPATH=/tmp/site:$PWD/.device/peers:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH} FLA_FLASH_QLA=0
    fi
    [ -f "$D/tests/ops/test_gdn.py" ] || { echo "stage FLA's test file first: bash bench/dev/fla_tests.sh stage" >&2; exit 2; }
    python3 -c "import fla, einops, flashdelta; print('fla', fla.__version__, '| flashdelta', flashdelta.__file__)" \
      || { echo "needs FLA (source .device/bootstrap.sh on the GPU machine) and flashdelta on PYTHONPATH" >&2; exit 2; }
    cat "$D/SOURCE"
    cd "$D" && PYTHONPATH="$ROOT/bench/dev:$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" FLA_CI_ENV=0 \
      timeout "${TEST_S:-560}" python3 -u -m pytest -p fla_swap tests/ops/test_gdn.py -q -p no:cacheprovider \
      -k "${FILTER:-test_chunk or test_fused_recurrent}" "$@" 2>&1 | grep -v "TileLang.*INFO" ;;
  *) echo "usage: bench/dev/fla_tests.sh [stage <repo> [rev] | precompile [fla_builds.py args] | run [pytest args]]" >&2
     exit 2 ;;
esac
