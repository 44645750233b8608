"""Per-role stall summary of an Nsight Compute source page.

    # GPU machine: one report, then its SASS source page as CSV
    ncu --clock-control none --section SourceCounters --section WarpStateStats -k regex:chunk_fwd \\
        --profile-from-start off -o /tmp/rep python3 bench/dev/ncu_forward.py --tokens 8192
    ncu -i /tmp/rep.ncu-rep --page source --print-source sass --csv > $OUT/src.csv
    # anywhere
    python3 bench/dev/ncu_sites.py src.csv [--top 8]

Warp-specialized kernels put each role in its own code region, opened by a ``USETMAXREG`` (setmaxnreg): the
producer's DEALLOC, then one TRY_ALLOC per consumer warpgroup. This splits every profiled kernel of the CSV at
those instructions, prints per role the stall samples by reason, and lists the mbarrier wait sites (the
``SYNCS.PHASECHK...TRYWAIT`` + branch pairs) with the most samples. In these kernels "long scoreboard" (L1TEX)
stalls are mostly such waits: the phase check is an L1TEX-scoreboarded operation, so the site, not the reason,
says which barrier a role waits on.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_kernels(path: str) -> list:
    """[(kernel name, header, rows)] from an `ncu --page source --csv` file (one block per profiled kernel)."""
    kernels, header = [], None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                kernels.append((row[1] if len(row) > 1 else "?", None, []))
            elif row[0] == "Address":
                header = row
            elif kernels:
                name, _, rows = kernels[-1]
                kernels[-1] = (name, header, rows + [row])
    return kernels


def roles(rows: list, col: dict) -> list:
    """(name, first index, end index) of each code region opened by a USETMAXREG; the code before the first one is
    the prologue. Names: 'producer' for DEALLOC, then 'consumer 0x<regs>' in address order."""
    cuts = [(0, "prologue")]
    for i, r in enumerate(rows):
        m = re.search(r"USETMAXREG\.(\w+)\S*\s+(?:\S+,\s*)?(0x[0-9a-f]+)", r[col["Source"]])
        if m:
            kind = "producer" if m.group(1) == "DEALLOC" else "consumer"
            cuts.append((i, f"{kind} {int(m.group(2), 16)} regs"))
    return [(name, start, cuts[k + 1][0] if k + 1 < len(cuts) else len(rows)) for k, (start, name) in enumerate(cuts)]


def summarize(kernel: tuple, top: int) -> list:
    name, header, rows = kernel
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    base = int(rows[0][col["Address"]], 16)
    out = [f"== {name}: {len(rows)} SASS instructions, "
           f"{sum(int(r[col[SAMPLES]] or 0) for r in rows)} stall samples"]
    for role, lo, hi in roles(rows, col):
        sel = rows[lo:hi]
        total = sum(int(r[col[SAMPLES]] or 0) for r in sel)
        by = sorted(((sum(int(r[col[x]] or 0) for r in sel), x[6:]) for x in reasons), reverse=True)[:5]
        out.append(f"  {role:<22} @{int(rows[lo][col['Address']], 16) - base:#07x} samples {total:6d}  executed "
                   f"{sum(int(r[col[EXECUTED]] or 0) for r in sel):10d} | "
                   + " ".join(f"{reason}={n}" for n, reason in by if n))
    sites = []
    for i, r in enumerate(rows):
        if "TRYWAIT" in r[col["Source"]] and i + 1 < len(rows) and "BRA" in rows[i + 1][col["Source"]]:
            n = int(r[col[SAMPLES]] or 0) + int(rows[i + 1][col[SAMPLES]] or 0)
            role = next(name for name, lo, hi in roles(rows, col) if lo <= i < hi)
            sites.append((n, int(r[col["Address"]], 16) - base, role, int(r[col[EXECUTED]] or 0),
                          r[col["Source"]].strip()))
    out.append(f"  top mbarrier wait sites (samples on the try-wait and its branch):")
    for n, off, role, ex, src in sorted(sites, reverse=True)[:top]:
        out.append(f"    {off:#07x} {role:<22} samples {n:6d} executed {ex:8d}  {src}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args(argv)
    kernels = read_kernels(args.csv)
    if not kernels:
        print(f"{args.csv}: no 'Kernel Name' block (not an ncu --page source --csv file?)", file=sys.stderr)
        return 1
    for k in kernels:
        print("\n".join(summarize(k, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
