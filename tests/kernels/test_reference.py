"""What only the PyTorch path has: arbitrary masks (the kernels never see one) and memory bounded by one tile."""

from __future__ import annotations

import pytest
import torch

import stable_attn
from stable_attn.kernels import naive, reference
from stable_attn.options import Options


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_arbitrary_attn_mask_matches_oracle(kind):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 33, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 41, 16, generator=g, requires_grad=True) for _ in range(2))
    if kind == "bool":
        mask = torch.rand(2, 1, 33, 41, generator=g) > 0.4
        mask[0, 0, 3] = False  # a row that sees nothing
    else:
        mask = torch.randn(1, 4, 33, 41, generator=g)
    out = stable_attn.attention(q, k, v, attn_mask=mask)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = naive.attention(qd, kd, vd, attn_mask=mask)
    torch.testing.assert_close(out.double(), ref, atol=3e-6, rtol=1e-5)
    out.backward(torch.ones_like(out))
    ref.backward(torch.ones_like(ref))
    for a, b in ((q, qd), (k, kd), (v, vd)):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=3e-5, rtol=1e-4)



def test_memory_is_bounded_by_the_tile_not_the_score_matrix(monkeypatch):
    monkeypatch.setattr(reference, "TILE_ELEMENTS", 4096)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=g) for _ in range(3))
    opts = Options(block_n=32, scale=0.25)
    p = reference.Problem(q, k, v, None, None, opts)
    assert p.chunk == 64  # 4096 / (1 * 2 * 32): a [1, 2, 64, 32] tile, not [1, 2, 300, 300]
    out, _, _ = reference.attention_forward(q, k, v, opts=opts)
    torch.testing.assert_close(out.double(), naive.attention(q, k, v), atol=2e-6, rtol=1e-5)

