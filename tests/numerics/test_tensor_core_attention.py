"""arithmetic.tensor_core_model: the kernel's forward with P-bar V on the tensor-core models."""

import pytest
import torch

from stable_attn.numerics import arithmetic, tensor_core

BF16 = torch.bfloat16


def tied_inputs(trials=8, n=100, d=6, k=4, m=None, seed=0):
    """k exact ties at the row max (first keys), others 3+ below it, values mostly negative."""
    gen = torch.Generator().manual_seed(seed)
    mx = (8 * torch.rand(trials, 1, generator=gen) - 4).to(BF16).float() if m is None else torch.full((trials, 1), m)
    s = (mx - 3 - 2 * torch.rand(trials, n, generator=gen)).to(BF16).float()
    s[:, :k] = mx
    v = (-2 + torch.randn(trials, n, d, generator=gen)).to(BF16)
    return s, v


@pytest.mark.parametrize("fix", arithmetic.FIXES)
@pytest.mark.parametrize("m", [None, 0.0])
def test_fp32_matmul_variant_is_the_kernels_torch_path(fix, m):
    # the loop reproduces the PyTorch path of the kernel bit for bit when its P-bar V is an fp32 matmul,
    # so (d) differs from (a) only in the MMA arithmetic; n = 100 with block_n = 32 leaves a short block
    s, v = tied_inputs(m=m)
    a = arithmetic.kernel_model(s, v, fix, block_n=32, backend="torch")
    d = arithmetic.tensor_core_model(s, v, fix, block_n=32, model="fp32_matmul")
    assert torch.equal(a.out, d.out)


def test_instruction_chain_is_one_mma_per_block():
    # K-chunks of 16 keys (one bf16 instruction) chained C -> D equal one mma over the block: 16 is a
    # multiple of both fused sizes (8 on A100, 16 on H100), and mma chains its fused blocks the same way
    g = torch.Generator().manual_seed(1)
    p = torch.rand(5, 1, 64, generator=g).to(BF16)
    v = torch.randn(5, 64, 7, generator=g).to(BF16)
    c = torch.randn(5, 1, 7, generator=g)
    for model in ("a100", "h100"):
        assert torch.equal(arithmetic._tc_chain(p, v, c, model, 16), tensor_core.mma(p, v, c, model))
    # a chunk that is not a multiple of the A100's fused block changes the grouping, and so can differ
    assert arithmetic._tc_chain(p, v, c, "a100", 12).shape == c.shape


@pytest.mark.parametrize("model", ["a100", "h100", "ieee"])
def test_tensor_core_model_runs_every_fix(model):
    s, v = tied_inputs()
    exact = arithmetic.oracle(s, v)
    for fix in arithmetic.FIXES:
        res = arithmetic.tensor_core_model(s, v, fix, block_n=32, model=model)
        assert res.out.shape == exact.shape and torch.isfinite(res.out).all()
        # within a few bf16 roundings of the exact answer
        assert ((res.out - exact).abs() <= 2.0**-5 * exact.abs().max(dim=1, keepdim=True).values).all()
        if fix == "off":
            assert (res.pbar_ones >= 4).all()  # the four ties give four P-bar = 1.0
        if fix == "ours":
            assert (res.pbar_ones <= 1).all()  # the rule leaves at most one P-bar = 1.0 per block


def test_rejects_unknown_model():
    s, v = tied_inputs(trials=2)
    with pytest.raises(ValueError, match=r"model='b200'.*accepted values"):
        arithmetic.tensor_core_model(s, v, "off", model="b200")
