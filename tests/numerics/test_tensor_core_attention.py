"""arithmetic.tensor_core_model: the kernel's forward with P-bar V on the tensor-core models."""

import math

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
    with pytest.raises(ValueError, match=r"model='v100'.*accepted values"):
        arithmetic.tensor_core_model(s, v, "off", model="v100")


def attention_inputs(B=2, Hq=4, Hkv=2, N=150, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, N, D, generator=g).to(BF16) for h in (Hq, Hkv, Hkv))
    rows = torch.stack(torch.meshgrid(torch.arange(B), torch.arange(Hq), torch.arange(N), indexing="ij"), -1)
    return q, k, v, rows.reshape(-1, 3)


@pytest.mark.parametrize("fix", arithmetic.FIXES)
def test_tensor_core_attention_fp32_matmul_is_the_torch_path(fix):
    # with fp32 products the q, k, v entry point reproduces stable_attn.attention's PyTorch path bit for bit:
    # GQA grouping, causal and padding masks, the rows skipping blocks they do not see, the output cast
    from stable_attn import attention

    q, k, v, rows = attention_inputs()
    kpm = torch.ones(2, 150, dtype=torch.bool)
    kpm[1, :20] = False
    ref = attention(q, k, v, causal=True, key_padding_mask=kpm, stabilize=arithmetic.FIX_NAMES[fix], backend="torch")
    pick = rows[::7]  # a sample of rows, in no particular grouping
    out = arithmetic.tensor_core_attention(q, k, v, pick, (fix,), model="fp32_matmul", causal=True,
                                           key_padding_mask=kpm)[fix].out
    assert torch.equal(out, ref[pick[:, 0], pick[:, 1], pick[:, 2]].double())


def test_tensor_core_attention_scores_are_tensor_core_products():
    # q.k^T of one row equals the mma chain over the head dim; a row's result does not depend on
    # which other rows are computed with it
    q, k, v, rows = attention_inputs(B=1, Hq=2, Hkv=1, N=70, D=32, seed=2)
    one = arithmetic.tensor_core_attention(q, k, v, rows[5:6], ("off",), model="a100")["off"].out
    many = arithmetic.tensor_core_attention(q, k, v, rows, model="a100")  # every fix on the same scores
    assert set(many) == set(arithmetic.FIXES)
    assert torch.equal(one[0], many["off"].out[5])
    x = tensor_core.mma(q[0, 0, 5:6, :16], k[0, 0, :, :16].T.contiguous(), torch.zeros(1, 70), "a100")
    x = tensor_core.mma(q[0, 0, 5:6, 16:], k[0, 0, :, 16:].T.contiguous(), x, "a100")
    direct = arithmetic.tensor_core_forward(x, v[0, 0][None], "off", qk_scale2=32**-0.5 * 1.4426950408889634,
                                            model="a100", block_n=64)
    assert torch.equal(direct.out[0], one[0])


def test_kernel_key_block_follows_the_launcher():
    # the rule's modes walk the default 128-key partition everywhere; stabilize off, which no rule sees,
    # the kernel's tile: 128 keys on sm_90's plain variants, 64 on A100 and with a padding mask
    for gpu in ("h100", "a100", "ieee"):
        for fix in ("ours", "paper"):
            assert arithmetic.kernel_key_block(gpu, fix, BF16, 64, plain=True) == 128
    assert arithmetic.kernel_key_block("h100", "off", BF16, 64, plain=True) == 128
    assert arithmetic.kernel_key_block("h100", "off", BF16, 64, plain=False) == 64
    assert arithmetic.kernel_key_block("a100", "off", BF16, 64, plain=True) == 64
    assert arithmetic.kernel_key_block("ieee", "off", BF16, 64, plain=True) == 128


def test_tensor_core_attention_rejects_what_it_does_not_model():
    q, k, v, rows = attention_inputs(B=1, N=8)
    with pytest.raises(ValueError, match="softcap"):
        arithmetic.tensor_core_attention(q, k, v, rows, softcap=30.0)
    with pytest.raises(ValueError, match=r"rows must be \[R, 3\]"):
        arithmetic.tensor_core_attention(q, k, v, rows[:, :2])
    with pytest.raises(ValueError, match=r"fixes=\['on'\]"):
        arithmetic.tensor_core_attention(q, k, v, rows, ("on",))


def test_fp8_rule_constants_and_model():
    tie2, min2, max2 = arithmetic.rule_constants(torch.float8_e4m3fn, arithmetic.options_mode("ours"))
    # exp(-tie) is the midpoint between 1.0 and E4M3's next number below, 1 - 2^-4
    tie = tie2 / 1.4426950408889634
    assert torch.tensor(math.exp(-tie * 0.999)).to(torch.float8_e4m3fn).item() == 1.0
    assert torch.tensor(math.exp(-tie * 1.001)).to(torch.float8_e4m3fn).item() == 1.0 - 2**-4
    assert (min2, max2) == pytest.approx((0.5 * 1.4426950408889634, 2.0 * 1.4426950408889634))
    s, v = tied_inputs(trials=6, n=96, d=8)
    for fix in arithmetic.FIXES:
        res = arithmetic.tensor_core_model(s, v, fix, block_n=32, model="h100", pbar_dtype=torch.float8_e4m3fn)
        exact = arithmetic.oracle(s, arithmetic.fp8_values(v))
        assert ((res.out - exact).abs() <= 2.0**-3 * exact.abs().max(dim=1, keepdim=True).values).all()
        if fix == "off":
            assert (res.pbar_ones >= 4).all()
        if fix == "ours":
            assert (res.pbar_ones <= 1).all()
    with pytest.raises(ValueError, match="not modelled for model='a100'"):
        arithmetic.tensor_core_model(s, v, "off", model="a100", pbar_dtype=torch.float8_e4m3fn)
