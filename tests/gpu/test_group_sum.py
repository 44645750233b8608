"""Stage `group_sum` on a Hopper GPU: `kernels.group_sum.group_sum` (the GVA group sum of dq or dk, with the l2norm
backward fused in) against its float64 twin (`reference.chunked.group_sum`), with `portable.group_sum` (fp32 math,
rounded to the output dtype) as the baseline. Outputs are NaN-poisoned (conftest), so a row the kernel forgets fails
the non-finite check."""
import pytest
import torch
from _helpers import assert_close
from cases import GROUP_SUM_CASES

from flashdelta import portable
from flashdelta.kernels.group_sum import group_sum
from flashdelta.kernels.l2norm import l2norm_fwd
from flashdelta.reference import chunked as ref


def _inputs(T, H, HV, K, dx_dtype, l2, out_dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dx = torch.randn(1, T, HV, K, generator=gen, device="cuda").to(dx_dtype)
    if not l2:
        return dx, None, None
    x = torch.randn(1, T, H, K, generator=gen, device="cuda").to(out_dtype if out_dtype != torch.float32 else dx_dtype)
    x[:, 0] = 0                                   # an all-zero row: rstd = 1e3, y = 0
    y, rstd = l2norm_fwd(x) if x.dtype != torch.float32 else portable.l2norm_fwd(x)
    return dx, y, rstd


@pytest.mark.parametrize("name,T,H,HV,K,dx_dtype,l2,out_dtype", GROUP_SUM_CASES, ids=[c[0] for c in GROUP_SUM_CASES])
def test_group_sum_matches_reference(name, T, H, HV, K, dx_dtype, l2, out_dtype):
    dx, y, rstd = _inputs(T, H, HV, K, dx_dtype, l2, out_dtype)
    out = group_sum(dx, H, y=y, rstd=rstd, out_dtype=out_dtype)
    want = ref.group_sum(dx, H, y=y, rstd=rstd)
    base = portable.group_sum(dx, H, y=y, rstd=rstd, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (1, T, H, K)
    assert_close("dq", out, want, baseline=base)
    again = group_sum(dx, H, y=y, rstd=rstd, out_dtype=out_dtype)
    assert torch.equal(out, again), "group_sum must be deterministic"


def test_group_sum_passthrough_and_empty():
    dx = torch.randn(1, 5, 4, 128, device="cuda").bfloat16()
    assert group_sum(dx, 4) is dx                 # HV == H, no l2norm, same dtype: chunk_bwd's dq is the result
    out = group_sum(torch.empty(1, 0, 8, 128, device="cuda", dtype=torch.bfloat16), 2)
    assert out.shape == (1, 0, 2, 128)
