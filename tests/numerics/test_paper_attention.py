"""stable_attn.numerics.paper_attention: the paper's all-BF16 flash attention as a training op (model b)."""

from __future__ import annotations

import pytest
import torch

from stable_attn.kernels import naive
from stable_attn.numerics import arithmetic
from stable_attn.numerics.paper_attention import PaperStats, paper_attention, paper_forward

BF16 = torch.bfloat16


def qkv(B=2, H=2, N=48, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(1.5 * torch.randn(B, H, N, D, generator=g)).to(BF16) for _ in range(3)]


@pytest.mark.parametrize("fix", ["off", "paper"])
def test_forward_is_the_blockwise_bf16_model_bit_for_bit(fix):
    # planted scores (q = e_0, k_j = s_j e_0, scale 1: q.k = s_j exactly), one query row per trial, as the
    # bias study's model (b) takes them; ties at the max in the first block so the paper's rule fires
    g = torch.Generator().manual_seed(1)
    T, N, D = 40, 96, 8
    scores = (4 * torch.randn(T, N, generator=g)).to(BF16).float()
    scores[:, 1:3] = scores[:, :1] = scores.amax(dim=1, keepdim=True)
    values = (torch.randn(T, N, D, generator=g) - 2).to(BF16)
    q = torch.zeros(T, 1, 1, D, dtype=BF16)
    q[..., 0] = 1.0
    k = torch.zeros(T, 1, N, D, dtype=BF16)
    k[:, 0, :, 0] = scores.to(BF16)
    stats = PaperStats()
    out, _ = paper_forward(q, k, values[:, None], scale=1.0, fix=fix, block_n=32, causal=False, stats=stats)
    ref = arithmetic.blockwise_bf16_model(scores, values, fix, block_n=32)
    assert torch.equal(out[:, 0, 0].double(), ref.out)
    assert stats.blocks == T * 3 and stats.tie_blocks >= T  # the planted tie, in the first block
    assert stats.fired_rate * 3 == pytest.approx(ref.fired_rate) if fix == "paper" else stats.fired_blocks == 0


@pytest.mark.parametrize("fix", ["off", "paper"])
def test_forward_and_backward_track_the_fp64_oracle(fix):
    q, k, v = qkv()
    for t in (q, k, v):
        t.requires_grad_(True)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(BF16)
    out = paper_attention(q, k, v, fix=fix, block_n=16)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = naive.attention(q64, k64, v64, causal=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    err = (out.double() - ref).abs().max().item()
    assert err < 0.06, err  # several bf16 roundings of |O| <~ 4
    for g, r in zip(grads, ref_grads, strict=True):
        cos = torch.nn.functional.cosine_similarity(g.double().flatten(), r.flatten(), dim=0).item()
        assert g.dtype == BF16 and cos > 0.995, cos


def test_paper_rule_fires_on_ties_and_leaves_the_output_near_the_fix_off_one():
    q, k, v = qkv(N=32)
    k[:, :, 1] = k[:, :, 0]  # two identical keys: every row that sees both ties whenever they are its max
    on, off = PaperStats(), PaperStats()
    o_on, _ = paper_forward(q, k, v, scale=0.25, fix="paper", block_n=16, stats=on)
    o_off, _ = paper_forward(q, k, v, scale=0.25, fix="off", block_n=16, stats=off)
    assert on.fired_blocks > 0 and off.fired_blocks == 0 and on.tie_blocks == off.tie_blocks > 0
    assert (o_on.float() - o_off.float()).abs().max().item() < 0.1


def test_rejects_bad_inputs():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="bfloat16"):
        paper_attention(q.float(), k, v)
    with pytest.raises(ValueError, match="fix='ours'"):
        paper_attention(q, k, v, fix="ours")
