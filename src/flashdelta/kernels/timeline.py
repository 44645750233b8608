"""Opt-in per-role timelines of the SM90 kernels (development: bench/dev/timeline.py prints them).

A kernel module declares its event table (`Table`), passes it to its `_tl.jit` builder and, in the builder, takes
``mark = timeline.marker(TABLE, cta, tx)`` and calls ``mark(step, "role.event")`` where the event happens (``mark.start``
and ``mark.end`` at the recording thread's first and last statement, ``mark.value`` for one integer of the CTA).
Outside a recording `marker` returns `NoMarker`, whose calls are Python no-ops, and `prelude` returns "": nothing
reaches the TIR, so the normal builds are the uninstrumented kernels, byte for byte.

Inside ``with timeline.record(TABLE) as rec:`` the kernel's builder compiles a separate instrumented build (once per
recording and builder arguments; TileLang's disk cache keys it by its own TIR). In it one designated thread per role
of each CTA with grid index ``cta < table.ctas`` writes the SM cycle counter (%clock64) at each event of its steps
``step < table.steps`` (chunks, work items) into ``rec.buffer``, int64 ``[ctas, steps, len(events)]``, zero where not
written. The buffer's address is a compile-time constant of the prelude, so the instrumented kernel has the plain
kernel's parameters and the launchers run it unchanged. The "m." entries sit in step 0: %clock64 / %globaltimer pairs
at the start and end (cycles -> ns) and one value (`mark.value`). Everything else only evaluates the predicate.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch

META = ("m.clk0", "m.gt0", "m.clk1", "m.gt1", "m.value")


@dataclasses.dataclass(frozen=True)
class Table:
    """The events one kernel records.

    kernel: the kernel's name (what `record` is keyed by); roles: role letter -> (title, the thread that records it;
    the first role's thread writes the "m." entries); events: "r.name" per role r, each with what ends at it
    (``"wait <barrier> (<who>)"`` for a returned wait, else the work done since the role's previous event);
    ctas, steps: the recorded CTAs and steps per CTA; value: what `mark.value` stores.
    """
    kernel: str
    roles: dict
    events: dict
    ctas: int
    steps: int
    value: str = ""

    @property
    def names(self) -> tuple:
        """Every entry of the last buffer axis, in order: `META`, then `events`."""
        return META + tuple(self.events)

    def index(self, name: str) -> int:
        return self.names.index(name)


class NoMarker:
    """Outside a recording: every mark is a Python no-op, so the traced kernel is exactly the uninstrumented one."""

    def __call__(self, step, event):
        return None

    def start(self):
        return None

    def end(self):
        return None

    def value(self, x):
        return None


class Marker(NoMarker):
    """Inside a recording: each mark is one `fd_tl_*` call, predicated on (role thread, CTA, step) on the device."""

    def __init__(self, table: Table, cta, tx, when):
        self.table, self.cta, self.tx, self.when = table, cta, tx, when

    def _at(self, step, name):
        import tilelang.language as T  # noqa: PLC0415

        t = self.table
        thread = t.roles[name[0]][1] if name[0] != "m" else next(iter(t.roles.values()))[1]
        on = (self.tx == thread) & (self.cta < t.ctas) & (step < t.steps)
        if self.when is not None:
            on = on & self.when
        # the CTA index is clamped so that the (unused) index of a non-recording CTA cannot overflow int32
        idx = (T.min(self.cta, t.ctas - 1) * t.steps + step) * len(t.names) + t.index(name)
        return T, idx, on

    def __call__(self, step, event):
        if event not in self.table.events:
            raise KeyError(f"{self.table.kernel}: no event {event!r} in its table")
        T, idx, on = self._at(step, event)
        return T.call_extern("handle", "fd_tl_stamp", idx, on)

    def start(self):
        T, idx, on = self._at(0, "m.clk0")
        return T.call_extern("handle", "fd_tl_cal", idx, on)

    def end(self):
        T, idx, on = self._at(0, "m.clk1")
        return T.call_extern("handle", "fd_tl_cal", idx, on)

    def value(self, x):
        T, idx, on = self._at(0, "m.value")
        return T.call_extern("handle", "fd_tl_value", idx, T.cast(x, "int64"), on)


class Recording:
    """One active recording: the buffer (or only its address, for compile-only use) and the instrumented kernels
    built during it."""

    def __init__(self, table: Table, device, address: Optional[int]):
        self.table = table
        self.buffer = None
        if address is None:
            self.buffer = torch.zeros((table.ctas, table.steps, len(table.names)), dtype=torch.int64, device=device)
            address = self.buffer.data_ptr()
        self.address = int(address)
        self.kernels: dict = {}


_ACTIVE: dict = {}


@contextlib.contextmanager
def record(table: Table, *, device="cuda", address: Optional[int] = None):
    """Record `table`'s kernel: while active, its builder returns the instrumented build writing into a zeroed
    ``rec.buffer`` on `device`. address: write there instead and allocate nothing (compile-only use: the build is
    valid only where that address is device memory)."""
    if table.kernel in _ACTIVE:
        raise RuntimeError(f"a recording of {table.kernel} is already active")
    rec = Recording(table, device, address)
    _ACTIVE[table.kernel] = rec
    try:
        yield rec
    finally:
        del _ACTIVE[table.kernel]


def active(table: Optional[Table]) -> Optional[Recording]:
    """The active recording of `table`'s kernel, or None."""
    return _ACTIVE.get(table.kernel) if table is not None else None


def marker(table: Table, cta, tx, when=None):
    """The builder's `mark`: `Marker` while `table` is being recorded, else `NoMarker`. when: an extra device
    predicate on recording (e.g. one key head only)."""
    return NoMarker() if active(table) is None else Marker(table, cta, tx, when)


def prelude(table: Table) -> str:
    """The PTX helpers the marks call, with the buffer address, while `table` is being recorded; else ""."""
    rec = active(table)
    return "" if rec is None else _PRELUDE.replace("ADDRESS", f"{rec.address:#x}ull")


# forceinline, so no call boundary sits between wgmma instructions; "memory" clobbers keep shared/global accesses
# from moving across a timer read. fd_tl_stamp writes %clock64 (the SM's cycle counter) to buf[idx] when `on`;
# fd_tl_cal a %clock64/%globaltimer pair to buf[idx], buf[idx + 1]; fd_tl_value one integer.
_PRELUDE = r"""
__device__ __forceinline__ long long* fd_tl_buf() { return reinterpret_cast<long long*>(ADDRESS); }
__device__ __forceinline__ void fd_tl_stamp(int idx, bool on) {
  if (on) {
    long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t) :: "memory");
    fd_tl_buf()[idx] = t;
  }
}
__device__ __forceinline__ void fd_tl_cal(int idx, bool on) {
  if (on) {
    long long t, g;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t) :: "memory");
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g) :: "memory");
    fd_tl_buf()[idx] = t;
    fd_tl_buf()[idx + 1] = g;
  }
}
__device__ __forceinline__ void fd_tl_value(int idx, long long v, bool on) {
  if (on) fd_tl_buf()[idx] = v;
}
"""
