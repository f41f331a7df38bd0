"""Head dims beyond the common case: a value head dim apart from the query's (multi-head latent attention,
DeepSeek-V3's 192 / 128) and head dim 512 (Gemma 4's global layers), on the PyTorch path, against the fp64
oracle: forward, every gradient, GQA, causal, varlen, the decode path, the statistics. Nothing is padded:
the output has v's head dim. The Triton kernels serve ``D == Dv <= 256``; other calls with
``backend="triton"`` go to the PyTorch path with a one-time log line.
"""

from __future__ import annotations

import logging

import pytest
import torch
from closeness import close

import stable_attn
from stable_attn import _ops
from stable_attn.kernels import naive, reference_decode
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


def test_triton_backend_sends_other_head_dims_to_the_pytorch_path(caplog, monkeypatch):
    monkeypatch.setattr(_ops, "_logged_once", set())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with caplog.at_level(logging.INFO, logger="stable_attn"):
        for D, Dv in ((24, 16), (24, 16), (512, 512)):
            q, k, v, _ = _inputs(D, Dv)
            got = stable_attn.attention(q, k, v, causal=True, backend="triton")
            assert torch.equal(got, stable_attn.attention(q, k, v, causal=True, backend="torch"))
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "stable_attn: a value head dim 16 apart from the query's 24 is served by the PyTorch path (stabilized, slower "
        "than the Triton kernel, which does not implement it)",
        "stable_attn: head dim 512 > 256 is served by the PyTorch path (stabilized, slower than the Triton kernel, "
        "which does not implement it)",
    ]


def test_bad_head_dims_name_the_argument():
    q, k, v, _ = _inputs(16, 8)
    with pytest.raises(ValueError, match=r"value head dim Dv=600 is not supported; use 1 <= Dv <= 512"):
        stable_attn.attention(q, k, torch.randn(2, 2, 19, 600))
    with pytest.raises(ValueError, match=r"k \[B, Hkv, Nk, D\] and v \[B, Hkv, Nk, Dv\] must agree in all but the "
                                         r"head dim, got \(2, 2, 19, 16\) and \(2, 2, 18, 8\)"):
        stable_attn.attention(q, k, v[:, :, :18])
