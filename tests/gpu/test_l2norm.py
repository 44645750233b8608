"""Stage `l2norm_fwd` on a Hopper GPU: `kernels.l2norm.l2norm_fwd` against its float64 twin
(`reference.chunked.l2norm_fwd`), with `portable.l2norm_fwd` (fp32 math, 16-bit output) as the baseline.
Outputs are NaN-poisoned (conftest), so a row the kernel forgets fails the non-finite check."""
import pytest
import torch
from _helpers import assert_close
from cases import L2NORM_BIG, L2NORM_CASES

from flashdelta import portable
from flashdelta.kernels.l2norm import l2norm_fwd
from flashdelta.reference import chunked as ref


@pytest.mark.parametrize("shape,K,dtype,mag", L2NORM_CASES,
                         ids=[f"{s}-K{k}-{str(d)[6:]}" for s, k, d, _ in L2NORM_CASES])
def test_l2norm_matches_reference(shape, K, dtype, mag):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(*shape, K, generator=gen, device="cuda") * mag).to(dtype)
    x[..., 0, :] = 0 if shape[1] > 1 else x[..., 0, :]          # an all-zero row: rstd = 1e3, y = 0
    y, rstd = l2norm_fwd(x)
    y_ref, rstd_ref = ref.l2norm_fwd(x)
    y_pt, _ = portable.l2norm_fwd(x)                             # fp32 math, rounded to x's dtype
    assert y.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (*shape, 1)
    assert_close("qk_l2norm", y, y_ref, baseline=y_pt)
    assert_close("rstd", rstd, rstd_ref)


def test_l2norm_empty():
    y, rstd = l2norm_fwd(torch.empty(1, 0, 4, 128, device="cuda", dtype=torch.bfloat16))
    assert y.shape == (1, 0, 4, 128) and rstd.shape == (1, 0, 4, 1)


@pytest.mark.bigmem
def test_l2norm_offsets_past_2_31_elements():
    """Rows whose elements start past 2^31 (x [1, T, H, K] bf16, 4.3 GB, and y alike): y and rstd of the big launch
    equal, bit for bit, a launch on the last rows alone (from one row before element 2^31), and match the float64
    reference there."""
    shape, K, dtype = L2NORM_BIG
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(*shape, K, generator=gen, device="cuda", dtype=dtype)
    assert x.numel() > 2 ** 31
    y, rstd = l2norm_fwd(x)
    t0 = 2 ** 31 // (shape[2] * K) - 1          # token t0 + 1 starts at element 2^31
    tail = x[:, t0:].contiguous()
    y1, rstd1 = l2norm_fwd(tail)
    assert torch.equal(y[:, t0:], y1) and torch.equal(rstd[:, t0:], rstd1), "offsets past 2^31 elements"
    assert torch.isfinite(y).all() and torch.isfinite(rstd).all()       # no row left NaN-poisoned
    y_ref, rstd_ref = ref.l2norm_fwd(tail)
    assert_close("qk_l2norm", y1, y_ref)
    assert_close("rstd", rstd1, rstd_ref)
