"""The kernel builds the launchers pick for the GPU tier's cases (tests/_builds.py `shipped`, from tests/cases.py)
compile for sm_90a on the CPU (TileLang needs no GPU for that) and pass the hang checks (`_builds.hang_checks`:
no block-wide barrier a thread can miss, setmaxnreg budgets the launch holds, shared memory that fits the CTAs per SM
it is sized for). A failure here is a build error or a hang the GPU machine would otherwise hit first. By default
the subset that makes every compile-time choice of the list once (`covering`: 37 of 115 builds, ~2.5 minutes on two
cores instead of ~8); `--all-builds` compiles every one, as bench/precompile.py --tests does before a GPU session.

The builds compile in the session's one compile pool (tests/conftest.py `sm90_kernels`) with every other build the
selected tests list in `sm90_builds` markers (the in-kernel gate's, the other compile tests', `flashdelta warmup`'s
option builds), so that both cores stay busy and no build compiles twice; each test then reads its own result."""
import pytest

pytest.importorskip("tilelang")

from _builds import build_params, covering, hang_checks, pooled, shipped  # noqa: E402

SHIPPED = shipped()
BUILDS = {label: (builder, args) for label, builder, args in SHIPPED}


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ == "test_shipped_build_compiles_sm90":
        builds = SHIPPED if metafunc.config.getoption("--all-builds") else covering(SHIPPED)
        metafunc.parametrize("sm90_build", build_params(builds))


def test_shipped_build_compiles_sm90(sm90_build, sm90_kernels):
    kernel = pooled(sm90_kernels, sm90_build)
    assert hang_checks(kernel.get_kernel_source(), kernel.get_host_source()) == []


def test_labels_name_one_build_each():
    """Each shipped build has a label of its own (a label shared by two builds would compile only one of them)."""
    assert len(BUILDS) == len(SHIPPED), sorted(label for label, _, _ in SHIPPED
                                               if sum(x[0] == label for x in SHIPPED) > 1)


def test_the_default_subset_makes_every_choice_of_the_whole_list():
    """`covering` leaves out only builds whose every compile-time choice another build in it makes."""
    from _builds import compile_choices

    subset = covering(SHIPPED)
    assert len(subset) < len(SHIPPED)
    made = set().union(*(compile_choices(b, a) for _, b, a in subset))
    assert made == set().union(*(compile_choices(b, a) for _, b, a in SHIPPED))
    assert {(b.__name__, a) for _, b, a in subset} <= {(b.__name__, a) for _, b, a in SHIPPED}
