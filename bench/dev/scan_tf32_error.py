"""The tensor-core scan's error model on the CPU (kernels/cp_scan.py, docs/dev/cp.md): float64 arithmetic with the
roundings written out, against the exact scan of the same fp32 inputs (the benchmark's: M near a contraction,
Gaussian bias terms), relative L2 error of the state after J steps.

Each mma.sync m16n8k8 adds 8 exact products to its accumulator and rounds once. The tensor cores' rounding there is
modelled as round-to-nearest (an FMA kernel's quality) or round-toward-zero (truncation, the pessimistic bound);
the hi parts are rounded to tf32 as the kernel rounds them, the lo parts truncated as the tensor cores read them.
Rows: the kernel's accumulation (every product chained into one accumulator that starts at the bias), and the
alternative of accumulating each run of G mmas of one product from zero and adding the runs in fp32.

    python3 bench/dev/scan_tf32_error.py [--J 32] [--BV 8]

Measured on an H100 against the fp32 serial scan (cp_scan_bench.py): 3.7e-6 / 5.5e-6 / 7.1e-6 at J = 8 / 16 / 32,
between this model's two roundings.
"""
from __future__ import annotations

import argparse

import torch

K = 128


def tf32_rn(x: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to tf32 as the kernel's `_tf32_hi` does (add half an ulp of tf32, clear the 13 low bits)."""
    b = x.float().view(torch.int32)
    return ((b + 0x1000) & ~0x1FFF).view(torch.float32).double()


def tf32_trunc(x: torch.Tensor) -> torch.Tensor:
    """fp32 as the tensor cores read a tf32 operand: the 13 low mantissa bits dropped."""
    return (x.float().view(torch.int32) & ~0x1FFF).view(torch.float32).double()


def f32_rn(x: torch.Tensor) -> torch.Tensor:
    return x.float().double()


def f32_rz(x: torch.Tensor) -> torch.Tensor:
    f = x.float()
    toward0 = torch.nextafter(f, torch.zeros_like(f))
    return torch.where(f.double().abs() > x.abs(), toward0, f).double()


def step(M: torch.Tensor, S: torch.Tensor, X: torch.Tensor, rnd, group: int = 0) -> torch.Tensor:
    """One scan step ``M S + X`` in 3xTF32: group 0 chains every mma into one accumulator from X (the kernel);
    group G accumulates each run of G mmas of one product from zero and adds the runs to X in fp32."""
    Mh, Sh = tf32_rn(M), tf32_rn(S)
    terms = ((Mh, Sh), (Mh, tf32_trunc(S - Sh)), (tf32_trunc(M - Mh), Sh))
    C = X.clone()
    for A, B in terms:
        run = K // 8 if group == 0 else group
        for g0 in range(0, K, 8 * run):
            P = C if group == 0 else torch.zeros_like(C)
            for k0 in range(g0, g0 + 8 * run, 8):
                P = rnd(P + A[:, k0:k0 + 8] @ B[k0:k0 + 8, :])
            C = P if group == 0 else f32_rn(C + P)
    return C


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--J", type=int, default=32, help="steps (partitions)")
    ap.add_argument("--BV", type=int, default=8, help="state columns")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    G = torch.randn(args.J, K, K, generator=gen, dtype=torch.float64)
    Ms = f32_rn(0.9 * torch.eye(K, dtype=torch.float64) + 0.1 * G / K ** 0.5)
    Es = f32_rn(torch.randn(args.J, K, args.BV, generator=gen, dtype=torch.float64))
    S0 = f32_rn(torch.randn(K, args.BV, generator=gen, dtype=torch.float64))
    marks = [j for j in (8, 16, 32, 64, 128) if j <= args.J]
    print(f"{'accumulation':44s} " + " ".join(f"{'J=' + str(j):>9s}" for j in marks))
    rows = [("kernel, round-to-nearest", f32_rn, 0), ("kernel, truncating", f32_rz, 0)]
    rows += [(f"runs of {g} mma from zero, truncating", f32_rz, g) for g in (1, 2, 4, 16)]
    for name, rnd, group in rows:
        ref, s, errs = S0.clone(), S0.clone(), []
        for j in range(args.J):
            ref = Ms[j] @ ref + Es[j]
            s = step(Ms[j], s, Es[j], rnd, group)
            if j + 1 in marks:
                errs.append(float((s - ref).norm() / ref.norm()))
        print(f"{name:44s} " + " ".join(f"{e:9.2e}" for e in errs))


if __name__ == "__main__":
    main()
