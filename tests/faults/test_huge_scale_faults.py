"""Huge softmax scales (``scale * log2(e)`` over ``rules.FUSED_SCALE_MAX``): finite outputs and gradients wherever
SDPA in fp32 is finite for the same inputs, on both backends (the Triton kernels under TRITON_INTERPRET=1), in the
training forward and backward, forward only, decode and varlen; the output is the fp64 oracle's, ties at the max
included, and rows that see no key still give zeros. Before, the fused form's fp32 offset was off by up to half an
ulp of the scores, and from about scale 1e9 P-bar overflowed: NaN rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import stable_attn
from stable_attn import rules
from stable_attn.kernels import naive, triton_decode

BACKENDS = ["torch", "triton"]
SCALES = [1e3, 1e9, 1e12, 1e20, 1e36]


def _inputs(nq: int = 24, nk: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).bfloat16() for n in (nq, nk, nk))
    k[0, 0, 7] = k[0, 0, 3]  # a tie at the max for the rows whose best key is key 3
    return q, k, v


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", SCALES)
def test_training_forward_and_backward_stay_finite(backend, scale, row):
    q, k, v = _inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = stable_attn.attention(*leaves, causal=True, scale=scale, backend=backend, block_n=16)
    out.float().sum().backward()
    ref = [t.float().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, is_causal=True, scale=scale)
    want.sum().backward()
    oracle = naive.attention(q, k, v, causal=True, scale=scale)
    err = float((out.double() - oracle).abs().max())
    sdpa_grads = all(_finite(t.grad) for t in ref)
    row("finite output (as SDPA fp32's) and gradients, output = the fp64 oracle's to bf16 rounding",
        f"output finite {_finite(out)}, gradients finite {all(_finite(t.grad) for t in leaves)}, "
        f"max |out - oracle| {err:.3g}; SDPA fp32 (CPU): output finite {_finite(want)}, gradients {sdpa_grads}")
    assert rules.score_form(False, scale * rules.LOG2E) == rules.SCORES_SCALED
    assert _finite(want)  # the case is one SDPA fp32 serves (its CPU backward gives NaN and inf from 1e9 on)
    assert _finite(out) and all(_finite(t.grad) for t in leaves)
    assert err <= 2**-7 * float(v.abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_only_keeps_fully_masked_rows_zero(backend, row):
    q, k, v = _inputs()
    kpm = torch.ones(1, 24, dtype=torch.bool)
    kpm[0, :2] = False  # causal: rows 0 and 1 see no key
    with torch.no_grad():
        out = stable_attn.attention(q, k, v, causal=True, scale=1e12, key_padding_mask=kpm, backend=backend,
                                    block_n=16)
    oracle = naive.attention(q, k, v, causal=True, scale=1e12, key_padding_mask=kpm)
    row("finite; rows 0-1 zeros (they see no key); the oracle's output",
        f"finite {_finite(out)}; rows 0-1 zero {bool((out[0, :, :2] == 0).all())}; "
        f"max |out - oracle| {float((out.double() - oracle).abs().max()):.3g}")
    assert _finite(out) and (out[0, :, :2] == 0).all()
    assert float((out.double() - oracle).abs().max()) <= 2**-7 * float(v.abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode(backend, row, monkeypatch):
    calls = []
    real = triton_decode.forward
    monkeypatch.setattr(triton_decode, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = _inputs(nq=1, nk=100)
    kpm = torch.ones(1, 100, dtype=torch.bool)
    kpm[0, 90:] = False  # a padded cache: the decode path
    with torch.no_grad():
        out = stable_attn.attention(q, k, v, key_padding_mask=kpm, scale=1e9, backend=backend, block_n=16)
    oracle = naive.attention(q, k, v, key_padding_mask=kpm, scale=1e9)
    err = float((out.double() - oracle).abs().max())
    row("finite, the oracle's output", f"finite {_finite(out)}; max |out - oracle| {err:.3g}; "
        f"decode kernel calls {len(calls)}")
    assert _finite(out) and err <= 2**-7 * float(v.abs().max()) and len(calls) == (backend == "triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen(backend, row):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(30, 2, 16, generator=g).bfloat16() for _ in range(3))
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    with torch.no_grad():
        out = stable_attn.attention_varlen(q, k, v, cu, cu, 20, 20, causal=True, scale=1e9, backend=backend,
                                           block_n=16)
    pieces = [naive.attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), causal=True, scale=1e9)[0]
              .transpose(0, 1) for a, b in ((0, 10), (10, 30))]
    err = float((out.double() - torch.cat(pieces)).abs().max())
    row("finite, the oracle's output per sequence", f"finite {_finite(out)}; max |out - oracle| {err:.3g}")
    assert _finite(out) and err <= 2**-7 * float(v.abs().max())


def test_the_default_scales_keep_the_fused_form():
    """The variant is the launcher's choice at huge scales only: every usual scale keeps the fused products."""
    for d in (16, 64, 128, 256):
        assert rules.score_form(False, d**-0.5 * rules.LOG2E) == rules.SCORES_FUSED
    assert rules.score_form(False, 100.0 * rules.LOG2E) == rules.SCORES_FUSED
    assert rules.score_form(True, 1e9) == rules.SCORES_CAPPED


@pytest.mark.parametrize("scale", SCALES)
def test_the_kernels_match_the_pytorch_path_bit_for_bit(scale, row):
    """The kernel/reference twin holds for the scaled-first variant: the same bits, output and gradients."""
    q, k, v = _inputs()
    got = {}
    for backend in BACKENDS:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = stable_attn.attention(*leaves, causal=True, scale=scale, backend=backend, block_n=16)
        out.float().sum().backward()
        got[backend] = [out.detach()] + [t.grad for t in leaves]
    same = [torch.equal(a, b) for a, b in zip(got["torch"], got["triton"], strict=True)]
    row("output, dq, dk, dv: the same bits on both backends", f"equal {same}")
    assert all(same)
