"""The fp64 oracle itself, against torch's own float64 SDPA (an implementation it shares nothing with)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from stable_attn.kernels import naive


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("nq,nk", [(9, 9), (5, 13)])
def test_masks_match_sdpa_with_the_same_boolean_mask(causal, window, nq, nk):
    g = torch.Generator().manual_seed(nq * nk)
    q = torch.randn(2, 4, nq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, nk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    kpm = torch.rand(2, nk, generator=g) > 0.3
    kpm[:, -1] = True  # every row keeps a key: SDPA would return NaN for the others
    got = naive.attention(q, k, v, causal=causal, window=window, key_padding_mask=kpm, softcap=None)
    # the documented visibility, written independently: bottom-right positions p = i + nk - nq
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    p = i + nk - nq
    vis = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        vis &= j <= p
    if window is not None:
        vis &= j > p - window
    vis = vis[None, None] & kpm[:, None, None, :]
    seen = vis.any(-1, keepdim=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=vis | ~seen, enable_gqa=True)
    want = torch.where(seen, want, torch.zeros_like(want))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert torch.equal(naive.visibility(nq, nk, causal=causal, window=window, key_padding_mask=kpm), vis)


def test_softcap_additive_mask_and_rows_without_keys():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 2, 6, 6, generator=g, dtype=torch.float64)
    bias[0, 1, 2] = -math.inf  # a row that sees nothing
    got = naive.attention(q, k, v, softcap=2.0, attn_mask=bias, scale=0.7)
    s = 2.0 * torch.tanh(q @ k.transpose(-1, -2) * 0.7 / 2.0) + bias
    want = torch.nan_to_num(torch.softmax(s, -1), nan=0.0) @ v
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert (got[0, 1, 2] == 0).all()
    got.sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[0, 1, 2] == 0).all()


def test_probabilities_of_a_row_without_keys_are_zero_with_zero_gradient():
    s = torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]], dtype=torch.float64, requires_grad=True)
    p = naive.probabilities(s)
    torch.testing.assert_close(p[0], torch.softmax(s[0].detach(), -1))
    assert (p[1] == 0).all()
    p.sum().backward()
    assert torch.isfinite(s.grad).all()
