"""Every kernel build the GPU tier launches compiles for sm_90a on the CPU (TileLang needs no GPU for that): the
fused forward of each tests/gpu/test_fwd.py case, whatever `prepare` may launch for each test_prepare.py case,
and the builds the public-API tests reach (`flashdelta warmup`'s variants of their head configs). A failure here
is a build error the GPU machine would otherwise hit first. The development variants (switches, knobs) compile
in test_compile_fwd.py / test_compile_prepare.py and bench/precompile.py."""
import pytest

pytest.importorskip("tilelang")

from _builds import e2e_builds, fwd_builds, prepare_builds  # noqa: E402
from _helpers import divergent_syncs  # noqa: E402

BUILDS = dict(fwd_builds() + prepare_builds() + e2e_builds())


@pytest.mark.parametrize("label", list(BUILDS))
def test_gpu_tier_kernel_compiles_sm90(label):
    src = BUILDS[label]().get_kernel_source()
    assert "__global__" in src
    assert not divergent_syncs(src), "a block-wide barrier under a thread-dependent branch (a hang on the GPU)"
