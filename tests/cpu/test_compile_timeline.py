"""The opt-in timeline facility (kernels/timeline.py): outside a recording nothing of it reaches a kernel (the plain
builds are the same byte for byte before, during and after a recording); inside one the instrumented build of each
kernel with a timeline table compiles on the CPU (a fake buffer address) and passes the hang checks."""
import pytest
import torch

pytest.importorskip("tilelang")

from _builds import hang_checks  # noqa: E402

from flashdelta.kernels import fused_fwd, prepare_oneshot, prepare_pipe, timeline  # noqa: E402

FAKE = 0x7F0000001000
BUILDS = {   # one build per kernel with a table, each also a shipped build of the GPU tier's cases
    "fused_fwd": (fused_fwd, fused_fwd.builder_args(2, 8, 128, 128, torch.bfloat16, torch.bfloat16, torch.float32,
                                                    128 ** -0.5, True, False)),
    "prepare_oneshot": (prepare_oneshot, prepare_oneshot.builder_args(2, 8, 128, torch.bfloat16, torch.bfloat16)),
    "prepare_pipe": (prepare_pipe, prepare_pipe.builder_args(2, 6, 128, torch.bfloat16, torch.bfloat16,
                                                             num_sms=132)),
}


@pytest.mark.parametrize("name", list(BUILDS))
def test_instrumented_build_compiles_and_plain_is_unchanged(name):
    module, args = BUILDS[name]
    plain = module.build(*args)
    src = plain.get_kernel_source()
    assert "fd_tl_" not in src
    with timeline.record(module.TABLE, address=FAKE) as rec:
        kernel = module.build(*args)
        assert module.build(*args) is kernel and kernel is not plain      # once per recording, not the plain build
        inst = kernel.get_kernel_source()
    assert f"{FAKE:#x}ull" in inst and inst.count("fd_tl_stamp(") > 1
    assert hang_checks(inst, kernel.get_host_source()) == []
    assert kernel.get_host_source().count("stack_ffi_any)[") == plain.get_host_source().count("stack_ffi_any)[")
    assert module.build(*args) is plain and plain.get_kernel_source() == src


def test_marker_is_a_no_op_outside_a_recording():
    table = fused_fwd.TABLE
    assert isinstance(timeline.marker(table, 0, 0), timeline.NoMarker) and timeline.prelude(table) == ""
    with timeline.record(table, address=FAKE) as rec:
        assert timeline.active(table) is rec and isinstance(timeline.marker(table, 0, 0), timeline.Marker)
        assert timeline.active(prepare_oneshot.TABLE) is None
        with pytest.raises(RuntimeError, match="already active"):
            with timeline.record(table, address=FAKE):
                pass
    assert timeline.active(table) is None


@pytest.mark.parametrize("table", [fused_fwd.TABLE, prepare_oneshot.TABLE, prepare_pipe.TABLE], ids=lambda t: t.kernel)
def test_tables(table):
    """Every event belongs to a declared role; the buffer layout is [ctas, steps, meta + events]."""
    assert all(e[0] in table.roles and e[1] == "." for e in table.events)
    assert table.names[:len(timeline.META)] == timeline.META and len(table.names) == len(set(table.names))
