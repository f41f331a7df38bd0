"""Head dims beyond the common case: a value head dim apart from the query's (multi-head latent attention,
DeepSeek-V3's 192 / 128) and head dim 512 (Gemma 4's global layers), on the PyTorch path, against the fp64
oracle: forward, every gradient, GQA, causal, varlen, the decode path, the statistics. Nothing is padded:
the output has v's head dim. The Triton kernels serve ``D, Dv <= 512`` (under ``TRITON_INTERPRET=1`` here,
outputs poisoned first: conftest.py; above 256 in column chunks and V blocks, tests/kernels/test_head_dim_512.py);
what they cannot serve (float32 K and V tiles beyond their shared memory) goes to the PyTorch path with a
one-time log line.
"""

from __future__ import annotations

import logging

import pytest
import torch
from closeness import close

import stable_attn
from stable_attn import _ops
from stable_attn.kernels import naive, reference_decode, triton_decode
from stable_attn.options import Options

DIMS = [(24, 16), (16, 24), (192, 128), (512, 512), (8, 512)]


def _inputs(D, Dv, B=2, Hq=4, Hkv=2, Nq=11, Nk=19, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g)
    k = torch.randn(B, Hkv, Nk, D, generator=g)
    v = torch.randn(B, Hkv, Nk, Dv, generator=g)
    do = torch.randn(B, Hq, Nq, Dv, generator=g)
    return [t.to(dtype) for t in (q, k, v, do)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D, Dv", DIMS, ids=[f"{a}-{b}" for a, b in DIMS])
def test_forward_and_gradients_match_the_oracle(D, Dv, dtype):
    q, k, v, do = _inputs(D, Dv, dtype=dtype)
    kpm = torch.ones(2, 19, dtype=torch.bool)
    kpm[0, :4] = False
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    st = stable_attn.AttentionStats()
    out = stable_attn.attention(*leaves, causal=True, key_padding_mask=kpm, block_n=16, stats=st)
    assert out.shape == (2, 4, 11, Dv) and out.is_contiguous()
    out.backward(do)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = naive.attention(*exact, causal=True, key_padding_mask=kpm)
    want.backward(do.double())
    ulps = 2 if dtype == torch.float32 else 4
    close(out.detach(), want.detach(), ulps, dtype, "out")
    for name, a, b in zip(("dq", "dk", "dv"), leaves, exact, strict=True):
        assert a.grad.shape == a.shape
        close(a.grad, b.grad, 16 * ulps, dtype, name, floor=1e-5)
    assert int(st.rows.sum()) == 2 * 4 * 11


@pytest.mark.parametrize("D, Dv", [(24, 16), (512, 512)])
def test_varlen_and_decode(D, Dv):
    """Packed sequences are each sequence alone (bit for bit); the decode path gives the oracle."""
    q, k, v, _ = _inputs(D, Dv, B=1, Nq=17, Nk=17)
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    cu = torch.tensor([0, 6, 17], dtype=torch.int32)
    out = stable_attn.attention_varlen(*packed, cu, cu, 11, 11, causal=True, block_n=16)
    assert out.shape == (17, 4, Dv)
    for s, e in ((0, 6), (6, 17)):
        alone = stable_attn.attention(*(t[s:e].transpose(0, 1)[None] for t in packed), causal=True, block_n=16)
        assert torch.equal(out[s:e], alone[0].transpose(0, 1))
    q, k, v, _ = _inputs(D, Dv, Nq=2, Nk=40)
    opts = Options.create(head_dim=D, causal=True, block_n=16)
    got, _, _ = reference_decode.attention_forward(q, k, v, None, opts, split=16)
    torch.testing.assert_close(got.double(), naive.attention(q, k, v, causal=True), rtol=1e-5, atol=2e-6)


def test_triton_backend_serves_head_dims_up_to_512(caplog, monkeypatch):
    """Head dims up to 512 reach the kernels with ``backend="triton"``, float32 included (its K and V tiles are
    column chunks: 128 keys fit); nothing is logged. A 256-key partition in float32 does not fit their shared
    memory: the PyTorch path serves it, logged once."""
    from stable_attn.kernels import triton_attention

    monkeypatch.setattr(_ops, "_logged_once", set())
    launches = []
    real = triton_attention._forward
    monkeypatch.setattr(triton_attention, "_forward", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    with caplog.at_level(logging.INFO, logger="stable_attn"):
        q, k, v, _ = _inputs(512, 512, B=1, Hq=2, Hkv=1, Nq=5, Nk=7)
        got = stable_attn.attention(q, k, v, causal=True, backend="triton")
        assert launches == [1] and not caplog.records
        torch.testing.assert_close(got.double(), naive.attention(q, k, v, causal=True), rtol=1e-5, atol=2e-6)
        q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
        for dv in (512, 320):
            assert _ops.backend_rule("triton", q16, False, cuda=True, v=v16[..., :dv]) == ("triton", None)
        assert _ops.backend_rule("triton", q16[..., :64], False, cuda=True, v=v16) == ("triton", None)
        assert _ops.backend_rule("triton", q, False, cuda=True, v=v) == ("triton", None)
        for _ in range(2):
            wide = stable_attn.attention(q, k, v, causal=True, backend="triton", block_n=256)
            assert torch.equal(wide, stable_attn.attention(q, k, v, causal=True, backend="torch", block_n=256))
        assert launches == [1]
    assert [r.getMessage() for r in caplog.records] == [
        "stable_attn: float32 at head dim 512 with 256-key blocks (K and V tiles of 262144 bytes, above the kernels' "
        "131072; a smaller block_n fits) is served by the PyTorch path (stabilized, slower than the Triton kernel, "
        "which does not implement it)"]


def test_float32_tiles_too_large_for_the_default_partition_go_to_the_pytorch_path(caplog, monkeypatch):
    """float32 at head dim 256: K and V tiles of 128 keys (256 KiB) exceed the kernels' shared memory. With the
    default partition the PyTorch path serves the call (logged once, no error); with ``block_n=64`` the
    kernels do."""
    from stable_attn.kernels import triton_attention

    monkeypatch.setattr(_ops, "_logged_once", set())
    launches = []
    real = triton_attention._forward
    monkeypatch.setattr(triton_attention, "_forward", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    q, k, v, _ = _inputs(256, 256, B=1, Hq=2, Hkv=1, Nq=3, Nk=5)
    with caplog.at_level(logging.INFO, logger="stable_attn"):
        got = stable_attn.attention(q, k, v, causal=True, backend="triton")
        assert torch.equal(got, stable_attn.attention(q, k, v, causal=True, backend="torch")) and not launches
        assert _ops.backend_rule("triton", q, False, cuda=True, v=v) == ("torch", "kernel-gap")
        small = stable_attn.attention(q, k, v, causal=True, backend="triton", block_n=64)
        assert launches == [1]
        _, _, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
        assert _ops.backend_rule("triton", q.to(torch.bfloat16), False, cuda=True, v=v16) == ("triton", None)
    torch.testing.assert_close(small.double(), naive.attention(q, k, v, causal=True), rtol=1e-5, atol=2e-6)
    assert [r.getMessage() for r in caplog.records] == [
        "stable_attn: float32 at head dim 256 with 128-key blocks (K and V tiles of 262144 bytes, above the kernels' "
        "131072; a smaller block_n fits) is served by the PyTorch path (stabilized, slower than the Triton kernel, "
        "which does not implement it)"]


# ---------------------------------------------------------------- the Triton kernels, Dv != D (no log line)

TRITON_DIMS = [(24, 16), (16, 40), (192, 128), (512, 512)]


def _hard_inputs(D, Dv, dtype, seed, Nq=23, Nk=19):
    """GQA 4 / 2, odd lengths, Nq > Nk (bottom-right causal: the first Nq - Nk rows see no key), a key padding
    mask hiding all of batch 1's keys in one row range, and two identical keys at the max of most rows (exact
    ties, whatever the summation order: the products are equal)."""
    q, k, v, do = _inputs(D, Dv, Nq=Nq, Nk=Nk, seed=seed)
    q[..., 0] = 3.0 + q[..., 0].abs()
    k[:, :, 2, 0] = 4.0
    k[:, :, 9] = k[:, :, 2]
    kpm = torch.ones(2, Nk, dtype=torch.bool)
    kpm[1, 12:] = False
    return [t.to(dtype) for t in (q, k, v, do)] + [kpm]


def _run(backend, q, k, v, do, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    st = stable_attn.AttentionStats()
    out = stable_attn.attention(*leaves, stats=st, backend=backend, **kw)
    out.backward(do)
    return out.detach(), [t.grad for t in leaves], st


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D, Dv", TRITON_DIMS, ids=[f"{a}-{b}" for a, b in TRITON_DIMS])
def test_triton_unequal_head_dims_match_the_oracle(D, Dv, dtype, caplog):
    q, k, v, do, kpm = _hard_inputs(D, Dv, dtype, seed=D + Dv)
    kw = dict(causal=True, key_padding_mask=kpm, block_n=16)
    with caplog.at_level(logging.INFO, logger="stable_attn"):
        out, grads, st = _run("triton", q, k, v, do, **kw)
    assert not caplog.records  # served by the kernels
    assert out.shape == (2, 4, 23, Dv) and out.is_contiguous()
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))  # rows that see no key
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    want = naive.attention(*exact, causal=True, key_padding_mask=kpm)
    want.backward(do.double())
    ulps = 2 if dtype == torch.float32 else 4
    close(out, want.detach(), ulps, dtype, "out")
    for name, g, e in zip(("dq", "dk", "dv"), grads, exact, strict=True):
        close(g, e.grad, 16 * ulps, dtype, name, floor=1e-5)
    # the PyTorch path's decisions and statistics (the same partition, the same rule)
    _, _, ref = _run("torch", q, k, v, do, **kw)
    assert st.fixed_blocks.tolist() == ref.fixed_blocks.tolist() and ref.fixed_blocks.sum() > 0
    assert st.saturated_rows.tolist() == ref.saturated_rows.tolist() and ref.saturated_rows.sum() > 0
    assert st.rows.tolist() == ref.rows.tolist()
    torch.testing.assert_close(st.max_logit, ref.max_logit, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("D, Dv", [(24, 16), (512, 512)])
def test_triton_unequal_head_dims_with_the_fused_backward_take_the_two_kernels(monkeypatch, D, Dv):
    """The fused backward prototype has no value head dim of its own, and no tiles wider than 256: with it
    selected, Dv != D and head dim 512 get the two kernels' gradients, bit for bit."""
    q, k, v, do, kpm = _hard_inputs(D, Dv, torch.float32, seed=3, Nq=9, Nk=21)
    _, want, _ = _run("triton", q, k, v, do, causal=True, block_n=16)
    monkeypatch.setenv("STABLE_ATTN_BACKWARD", "fused")
    _, got, _ = _run("triton", q, k, v, do, causal=True, block_n=16)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("D, Dv", [(24, 16), (16, 40), (512, 512)])
def test_triton_varlen_and_decode_with_unequal_head_dims(D, Dv):
    """Packed sequences: each sequence's output and gradients bit for bit the dense kernels' on it alone; the
    decode kernel: the PyTorch decode path's partials' decisions, and the oracle."""
    q, k, v, do = _inputs(D, Dv, B=1, Nq=17, Nk=17, seed=5)
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v, do)]
    leaves = [t.clone().requires_grad_() for t in packed[:3]]
    cu = torch.tensor([0, 6, 6, 17], dtype=torch.int32)
    out = stable_attn.attention_varlen(*leaves, cu, cu, 11, 11, causal=True, block_n=16, backend="triton")
    assert out.shape == (17, 4, Dv)
    out.backward(packed[3])
    for s, e in ((0, 6), (6, 17)):
        alone, grads, _ = _run("triton", *(t[s:e].transpose(0, 1)[None] for t in packed), causal=True, block_n=16)
        assert torch.equal(out[s:e].detach(), alone[0].transpose(0, 1))
        for p, g in zip(leaves, grads, strict=True):
            assert torch.equal(p.grad[s:e], g[0].transpose(0, 1))

    q, k, v, _ = _inputs(D, Dv, Nq=2, Nk=40, seed=6)
    q, k = ((t * 4).round() / 4 for t in (q, k))  # exact products in any order: the decisions' bits must agree
    opts = Options.create(head_dim=D, causal=True, block_n=16)
    want = naive.attention(q, k, v, causal=True)
    ref_parts = reference_decode.partials(q, k, v, None, opts, 16)
    _, ref_lse, _ = reference_decode.attention_forward(q, k, v, None, opts, split=16)
    got, lse, _, parts = triton_decode.forward(q, k, v, None, opts, split=16, return_partials=True)
    assert got.shape == (2, 4, 2, Dv)
    assert torch.equal(parts[2], ref_parts[2]) and torch.equal(parts[3], ref_parts[3])  # offsets r, maxima m
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # the public op takes the decode path here
        out = stable_attn.attention(q, k, v, causal=True, block_n=16, backend="triton")
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-6)


def test_bad_head_dims_name_the_argument():
    q, k, v, _ = _inputs(16, 8)
    with pytest.raises(ValueError, match=r"value head dim Dv=600 is not supported; use 1 <= Dv <= 512"):
        stable_attn.attention(q, k, torch.randn(2, 2, 19, 600))
    with pytest.raises(ValueError, match=r"k \[B, Hkv, Nk, D\] and v \[B, Hkv, Nk, Dv\] must agree in all but the "
                                         r"head dim, got \(2, 2, 19, 16\) and \(2, 2, 18, 8\)"):
        stable_attn.attention(q, k, v[:, :, :18])
