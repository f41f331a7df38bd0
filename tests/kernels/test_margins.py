"""The margins the backend comparisons rely on (margins.py): grid inputs are exact in any summation
order, and rows called robust keep their decisions under another summation order.

Another summation order is made here on any CPU by permuting the head dimension: ``q[..., perm] .
k[..., perm]`` is the same dot product, summed in another order by the same matmul.
"""

from __future__ import annotations

import math

import pytest
import torch
from margins import on_grid, robust_rows, robust_rows_of, scores_exact_in_fp32

from stable_attn import rules
from stable_attn.kernels import reference
from stable_attn.options import Options


def near_tie_inputs(dtype, seed, B=1, H=2, N=48, D=32):
    """Copies of one key at every row's max plus keys a few ulps away (no grid): ties that a summation
    order can make or break."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(D, generator=g)
    u = u / u.norm()
    q = 4 * u + 0.1 * torch.randn(B, H, N, D, generator=g)
    k = 0.3 * torch.randn(B, H, N, D, generator=g)
    k[:, :, [5, 9, 17, 30]] = 2 * u
    k[:, :, [6, 31]] = 2 * u * (1 + 2.0**-22)
    v = torch.randn(B, H, N, D, generator=g)
    return [t.to(dtype) for t in (q, k, v)]


def decisions(q, k, v, opts):
    _, _, rs = reference.attention_forward(q, k, v, None, None, opts, True)
    return rs.saturated, rs.fixed_blocks


def test_grid_scores_are_the_same_in_every_order():
    g = torch.Generator().manual_seed(0)
    q = on_grid(3 * torch.randn(1, 2, 40, 64, generator=g))
    k = on_grid(2 * torch.randn(1, 2, 50, 64, generator=g))
    assert scores_exact_in_fp32(q, k)
    want = q.double() @ k.double().transpose(-1, -2)
    for seed in range(4):
        perm = torch.randperm(64, generator=torch.Generator().manual_seed(seed))
        got = q[..., perm] @ k[..., perm].transpose(-1, -2)
        assert torch.equal(got.double(), want)
    assert not scores_exact_in_fp32(q + 2.0**-12, k)  # off the grid
    assert not scores_exact_in_fp32(on_grid(q * 1000 + 2.0**-5), k)  # partial sums need more than 24 bits


@pytest.mark.parametrize("mode", [rules.MODE_EXACT, rules.MODE_PAPER, rules.MODE_OFF])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_robust_rows_keep_their_decisions_in_any_order(mode, dtype):
    q, k, v = near_tie_inputs(dtype, seed=3)
    opts = Options(scale=1.0 / math.sqrt(q.shape[-1]), mode=mode, block_n=16)
    keep = robust_rows_of(q, k, opts)
    assert keep.shape == q.shape[:-1]
    sat, fixed = decisions(q, k, v, opts)
    for seed in range(6):
        perm = torch.randperm(q.shape[-1], generator=torch.Generator().manual_seed(seed))
        sat_p, fixed_p = decisions(q[..., perm], k[..., perm], v, opts)
        assert torch.equal(sat_p[keep], sat[keep]) and torch.equal(fixed_p[keep], fixed[keep])
    if dtype == torch.float32:
        # fp32's tie window is below one ulp of the scores: every row is at the mercy of the order
        assert not keep.any()
    else:  # bf16's window (2e-3 nats) is far wider than the order's error: the decisions hold
        assert keep.all()


def test_a_row_at_the_threshold_is_not_robust_and_one_far_from_it_is():
    """One query, two keys: the second key's score sits at the saturation window's edge (fp64), or far
    below it. Random coordinates keep the scores inexact in fp32."""
    D = 16
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 1, D, generator=g).to(torch.float64)
    k1 = torch.randn(D, generator=g).double()
    s1 = float(q[0, 0, 0] @ k1)
    tol = rules.tie_tolerance(torch.float32)  # natural units, scale 1
    qn = q[0, 0, 0] / q[0, 0, 0].dot(q[0, 0, 0])
    edge = k1 - tol * qn  # q . edge = s1 - tol in fp64, before k is rounded to fp32
    far = k1 - 0.01 * qn  # far beyond any summation-order error of these scores (~1e-5)
    for k2, want in ((edge, False), (far, True)):
        k = torch.stack([k1, k2])[None, None].float()
        kw = dict(scale=1.0, stabilize=True, block_n=16)
        got = robust_rows(q.float(), k, **kw)
        assert bool(got.all()) is want, (s1, want)
    # exact scores: every row is robust, even exactly at the edge
    qg = torch.zeros(1, 1, 1, D)
    qg[..., 0] = 1.0
    kg = torch.zeros(1, 1, 2, D)
    kg[0, 0, :, 0] = torch.tensor([1.0, 0.5])
    assert robust_rows(qg, kg, scale=1.0).all()
