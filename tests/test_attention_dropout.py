"""Attention dropout of stable_attn.attention (what the integrations pass as ``dropout`` ends here).

The keep mask is read back from the output itself: with ``v`` the identity (``D = Nk``) the output row
is ``P * keep / (1 - p)``, so a zero marks a dropped probability. That mask then checks the keep rate,
the 1/(1-p) rescaling, the generator (Philox at the documented offsets) and the backward, which must
drop exactly the same entries.
"""

from __future__ import annotations

import math

import pytest
import torch

from stable_attn import attention
from stable_attn.kernels.philox import keep_mask

B, HQ, HKV, N = 2, 4, 2, 64


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, N, N, generator=g).requires_grad_()
    k = torch.randn(B, HKV, N, N, generator=g).requires_grad_()
    v = torch.eye(N).repeat(B, HKV, 1, 1).requires_grad_()  # out = P * keep / (1 - p)
    return q, k, v


def probabilities(q, k, causal: bool) -> torch.Tensor:
    s = q @ k.repeat_interleave(HQ // HKV, dim=1).transpose(-1, -2) / math.sqrt(N)
    if causal:
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), -math.inf)
    return s.softmax(-1)


def visible(causal: bool) -> torch.Tensor:
    return torch.ones(N, N, dtype=torch.bool).tril() if causal else torch.ones(N, N, dtype=torch.bool)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
@pytest.mark.parametrize("causal", [False, True])
def test_keep_rate_rescaling_and_backward_use_one_mask(p, causal):
    q, k, v = inputs(seed=int(p * 10) + causal)
    torch.manual_seed(11)
    out = attention(q, k, v, causal=causal, dropout_p=p, backend="torch")
    prob = probabilities(q, k, causal)
    vis = visible(causal).expand_as(out)
    keep = (out != 0) & vis

    n = int(vis.sum())
    rate = keep.sum().item() / n
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n), (rate, 1 - p)
    # kept entries are rescaled by 1/(1-p): the output is unbiased
    torch.testing.assert_close(out[keep], (prob / (1 - p))[keep], rtol=1e-5, atol=1e-7)

    # the backward must drop the same entries: compare with autograd through an explicit computation
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    ref = (prob * keep / (1 - p)) @ v.repeat_interleave(HQ // HKV, dim=1)
    torch.testing.assert_close(ref, out, rtol=1e-5, atol=1e-6)
    ref_grads = torch.autograd.grad(ref, (q, k, v), d_out)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=f"d{name}")


def test_the_mask_is_philox_at_the_documented_offsets():
    """Keep mask = keep_mask(seed, ((b * Hq + h) * Nq + i) * Nk + j, p), the seed drawn from torch's RNG."""
    p = 0.3
    q, k, v = inputs(seed=3)
    torch.manual_seed(21)
    seed = int(torch.randint(0, 2**62, (1,)).item())  # what attention() draws for this call
    torch.manual_seed(21)
    out = attention(q, k, v, dropout_p=p, backend="torch")
    b, h, i, j = torch.meshgrid(*(torch.arange(s) for s in (B, HQ, N, N)), indexing="ij")
    expected = keep_mask(seed, ((b * HQ + h) * N + i) * N + j, p)
    assert torch.equal(out != 0, expected)


def test_output_mean_over_draws_is_the_undropped_output():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    clean = attention(q, k, v, causal=True, backend="torch")[0]
    # 200 copies of one problem in a batch: each batch element draws its own mask (its own offsets)
    torch.manual_seed(0)
    draws = attention(*(t.expand(200, -1, -1, -1) for t in (q, k, v)), causal=True, dropout_p=0.3, backend="torch")
    mean, stderr = draws.mean(0), draws.std(0) / math.sqrt(draws.shape[0])
    assert ((mean - clean).abs() <= 5 * stderr + 1e-6).all()
    assert (draws[0] - draws[1]).abs().max() > 1e-3  # the masks differ
