"""The FlashAttention-compatible interface: FlashAttention 2's arguments and layouts over stable_attn.

The window mapping is checked against FlashAttention's own definition written out here (keys
``p - left <= j <= p + right``), not against the mapping it tests; outputs and gradients against the
fp64 oracle and against :func:`stable_attn.attention` on the transposed tensors. Sequence-length pairs
as FlashAttention's own tests use them (Nq > Nk, Nq = 1, Nk tiny). The big shapes run on the PyTorch
path; the interpreter takes a small Triton subset.
"""

from __future__ import annotations

import math

import pytest
import torch

import stable_attn
from stable_attn import flash_attn_func, flash_attn_varlen_func
from stable_attn.integrations import flash_compat as fc
from stable_attn.integrations.flash_compat import window_arguments
from stable_attn.kernels import naive


def flash_visibility(nq: int, nk: int, causal: bool, window_size: tuple[int, int]) -> torch.Tensor:
    """FlashAttention 2's mask as its docstring defines it: ``[Nq, Nk]`` bool, True = attend."""
    left, right = window_size
    if causal:
        right = 0  # FlashAttention: causal means right = 0 whatever window_size says
    p = torch.arange(nq)[:, None] + (nk - nq)
    j = torch.arange(nk)[None, :]
    vis = torch.ones(nq, nk, dtype=torch.bool)
    if left >= 0:
        vis &= j >= p - left
    if right >= 0:
        vis &= j <= p + right
    return vis


def bnhd(B, n, h, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, n, h, d, generator=g).to(dtype).requires_grad_()


def oracle_bnhd(q, k, v, vis, **kw):
    """The fp64 oracle on [B, N, H, D] tensors with an explicit FlashAttention mask."""
    out = naive.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=vis, **kw)
    return out.transpose(1, 2)


@pytest.mark.parametrize("window_size", [(-1, -1), (0, -1), (3, -1), (5, 0), (-1, 0), (0, 0), (1000, -1), (-3, -1),
                                         (4, -2)])
@pytest.mark.parametrize("causal", [False, True])
def test_window_mapping_is_flash_attention_semantics(causal, window_size):
    for nq, nk in ((7, 7), (3, 11), (11, 3)):
        c, w = window_arguments(window_size, causal)
        ours = naive.visibility(nq, nk, causal=c, window=w)[0, 0]
        assert torch.equal(ours, flash_visibility(nq, nk, causal, window_size)), (nq, nk)


@pytest.mark.parametrize("window_size", [(2, 3), (-1, 5)])
def test_causal_ignores_the_right_bound_as_flash_attention_does(window_size):
    assert window_arguments(window_size, True) == window_arguments((window_size[0], 0), True)
    ours = naive.visibility(6, 9, **dict(zip(("causal", "window"), window_arguments(window_size, True))))[0, 0]
    assert torch.equal(ours, flash_visibility(6, 9, True, window_size))


@pytest.mark.parametrize(("window_size", "causal", "error"), [
    ((2, 3), False, "right bound > 0"), ((-1, 4), False, "right bound > 0"), ((1,), False, "pair of ints"),
    ((1.0, -1), False, "pair"), ((True, -1), False, "pair"),
    (None, False, "pair of ints"),
])
def test_unsupported_windows_are_refused(window_size, causal, error):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises((ValueError, TypeError), match=error):
        flash_attn_func(q, q, q, causal=causal, window_size=window_size)


def test_refusals_name_the_argument():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_attn_func(q, q, q, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="return_attn_probs"):
        flash_attn_func(q, q, q, return_attn_probs=True)
    with pytest.raises(ValueError, match=r"rank 4 \[B, N, H, D\]"):
        flash_attn_func(q[0], q[0], q[0])
    with pytest.raises(ValueError, match=r"batch B and head dim D in the layout \[B, N, H, D\]"):
        flash_attn_func(q, torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8))
    with pytest.raises(ValueError, match=r"flash_attn_func \(q, k, v given as \[B, N, H, D\].*Hkv=3"):
        flash_attn_func(q, torch.randn(1, 6, 3, 8), torch.randn(1, 6, 3, 8))  # 2 query heads on 3 kv heads


@pytest.mark.parametrize("softcap", [-1.0, float("inf"), float("nan"), True])
def test_softcap_refused_in_flash_attention_terms(softcap):
    """FlashAttention's softcap: > 0 caps, 0.0 is off; anything else names both."""
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"^flash_attn_func: softcap=.* use a finite number > 0 .* or 0.0 \(off\)"):
        flash_attn_func(q, q, q, softcap=softcap)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^flash_attn_varlen_func: softcap="):
        flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, softcap=softcap)


@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan"), "0.1"])
def test_softmax_scale_refused_by_its_own_name(scale):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"^flash_attn_func: softmax_scale=.* use a finite number > 0 or None"):
        flash_attn_func(q, q, q, softmax_scale=scale)


def test_softcap_zero_is_off():
    q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))
    assert torch.equal(flash_attn_func(q, k, v, softcap=0.0), flash_attn_func(q, k, v))
    assert torch.equal(flash_attn_func(q, k, v, softcap=0), flash_attn_func(q, k, v))


# (Nq, Nk, causal, window_size, softcap, Hq, Hkv, D): FlashAttention-style length pairs, GQA, windows, softcap
TORCH_CASES = [
    (113, 203, False, (-1, -1), 0.0, 4, 2, 16),
    (113, 203, True, (-1, -1), 0.0, 4, 1, 32),
    (1, 239, True, (-1, -1), 0.0, 2, 2, 8),
    (1, 239, False, (17, -1), 0.0, 2, 1, 8),
    (799, 3, True, (-1, -1), 0.0, 2, 2, 16),
    (799, 3, False, (-1, -1), 0.0, 2, 1, 16),
    (256, 256, True, (31, 0), 0.0, 4, 2, 16),
    (108, 256, False, (40, 0), 30.0, 2, 1, 64),
    (200, 127, False, (-1, -1), 2.0, 2, 2, 24),
]
TRITON_CASES = [
    (17, 33, True, (-1, -1), 0.0, 2, 1, 16),
    (1, 39, False, (5, -1), 2.0, 2, 2, 8),
    (40, 3, False, (6, 0), 0.0, 2, 1, 16),
]


def _check_against_oracle(backend, nq, nk, causal, window_size, softcap, hq, hkv, d, dtype=torch.float32):
    B = 2
    q, k, v = bnhd(B, nq, hq, d, dtype, 1), bnhd(B, nk, hkv, d, dtype, 2), bnhd(B, nk, hkv, d, dtype, 3)
    do = torch.randn(B, nq, hq, d, generator=torch.Generator().manual_seed(4)).to(dtype)
    scale = 0.9 / math.sqrt(d)
    out = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window_size, softcap=softcap,
                          deterministic=True, backend=backend)
    assert out.shape == (B, nq, hq, d) and out.is_contiguous()  # FlashAttention's layout, no copy needed
    grads = torch.autograd.grad(out, (q, k, v), do)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape

    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    vis = flash_visibility(nq, nk, causal, window_size)
    want = oracle_bnhd(*leaves, vis, scale=scale, softcap=softcap or None)
    want_grads = torch.autograd.grad(want, leaves, do.double())
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6 * max(want.abs().max().item(), 1))
    for name, g, w in zip("qkv", grads, want_grads):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=2e-6 * max(w.abs().max().item(), 1),
                                   msg=lambda m, name=name: f"d{name}: {m}")

    # the same numbers as stable_attn.attention on the [B, H, N, D] transposes: only the layout differs
    c, w = window_arguments(window_size, causal)
    ref = stable_attn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=c, window=w,
                                scale=scale, softcap=softcap or None, backend=backend).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize(("nq", "nk", "causal", "window_size", "softcap", "hq", "hkv", "d"), TORCH_CASES)
def test_flash_attn_func_matches_oracle_torch(nq, nk, causal, window_size, softcap, hq, hkv, d):
    _check_against_oracle("torch", nq, nk, causal, window_size, softcap, hq, hkv, d)


@pytest.mark.parametrize(("nq", "nk", "causal", "window_size", "softcap", "hq", "hkv", "d"), TRITON_CASES)
def test_flash_attn_func_matches_oracle_triton(nq, nk, causal, window_size, softcap, hq, hkv, d):
    _check_against_oracle("triton", nq, nk, causal, window_size, softcap, hq, hkv, d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attn_func_16_bit_within_attention_error(dtype):
    """16-bit inputs: the same result as attention() on the transposes, close to the fp64 oracle."""
    q, k, v = bnhd(1, 113, 2, 16, dtype, 5), bnhd(1, 203, 2, 16, dtype, 6), bnhd(1, 203, 2, 16, dtype, 7)
    out = flash_attn_func(q, k, v, causal=True)
    assert out.dtype == dtype
    ref = stable_attn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=0, atol=0)
    want = oracle_bnhd(q.double(), k.double(), v.double(), flash_visibility(113, 203, True, (-1, -1)))
    assert (out.double() - want).abs().max() < 4 * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-11)


def test_dropout_is_attention_dropout_under_the_same_seed():
    q, k, v = bnhd(2, 30, 2, 8, torch.float32, 8), bnhd(2, 30, 2, 8, torch.float32, 9), bnhd(2, 30, 2, 8,
                                                                                             torch.float32, 10)
    torch.manual_seed(3)
    out = flash_attn_func(q, k, v, dropout_p=0.25, causal=True)
    torch.manual_seed(3)
    ref = stable_attn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.25, causal=True)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=0, atol=0)
    assert (out - flash_attn_func(q, k, v, causal=True)).abs().max() > 1e-2  # dropout did act


def test_options_and_stats_reach_the_kernel():
    q = bnhd(1, 64, 2, 16, torch.bfloat16, 11) * 40  # large logits so that the rule fires
    stats = stable_attn.AttentionStats()
    on = flash_attn_func(q, q, q, causal=True, stats=stats)
    off = flash_attn_func(q, q, q, causal=True, stabilize=False)
    assert stats.calls == 1
    ref_off = stable_attn.attention(*(q.transpose(1, 2),) * 3, causal=True, stabilize=False).transpose(1, 2)
    torch.testing.assert_close(off, ref_off, rtol=0, atol=0)
    assert on.shape == off.shape
    with pytest.raises(ValueError, match="beta"):
        flash_attn_func(q, q, q, beta=0.5)


# (pairs of (len_q, len_k) packed in one call, causal, window_size, softcap, Hq, Hkv, D)
VARLEN_TORCH = [
    (((113, 203), (1, 239), (799, 3)), True, (-1, -1), 0.0, 4, 2, 16),
    (((113, 203), (1, 239), (799, 3)), False, (-1, -1), 0.0, 2, 1, 8),
    (((113, 203), (1, 239), (799, 3), (64, 64)), False, (23, 0), 5.0, 2, 2, 32),
    (((17, 17), (40, 90), (5, 1)), False, (6, -1), 0.0, 4, 1, 16),
]
VARLEN_TRITON = [
    (((13, 29), (1, 39), (35, 3)), True, (-1, -1), 0.0, 2, 1, 16),
    (((9, 9), (20, 33)), False, (4, 0), 2.0, 2, 2, 8),
]


def _check_varlen(backend, pairs, causal, window_size, softcap, hq, hkv, d):
    g = torch.Generator().manual_seed(21)
    lq, lk = [p[0] for p in pairs], [p[1] for p in pairs]
    q = torch.randn(sum(lq), hq, d, generator=g).requires_grad_()
    k = torch.randn(sum(lk), hkv, d, generator=g).requires_grad_()
    v = torch.randn(sum(lk), hkv, d, generator=g).requires_grad_()
    do = torch.randn(sum(lq), hq, d, generator=g)
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, window_size=window_size,
                                 softcap=softcap, deterministic=True, backend=backend)
    assert out.shape == q.shape
    grads = torch.autograd.grad(out, (q, k, v), do)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    wants = []
    for b, (nq, nk) in enumerate(pairs):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        vis = flash_visibility(nq, nk, causal, window_size)
        wants.append(oracle_bnhd(leaves[0][None, qs], leaves[1][None, ks], leaves[2][None, ks], vis,
                                 softcap=softcap or None)[0])
    want = torch.cat(wants)
    want_grads = torch.autograd.grad(want, leaves, do.double())
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-6 * want.abs().max().item())
    for name, got, w in zip("qkv", grads, want_grads):
        torch.testing.assert_close(got.double(), w, rtol=0, atol=2e-6 * max(w.abs().max().item(), 1),
                                   msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize(("pairs", "causal", "window_size", "softcap", "hq", "hkv", "d"), VARLEN_TORCH)
def test_flash_attn_varlen_func_matches_oracle_torch(pairs, causal, window_size, softcap, hq, hkv, d):
    _check_varlen("torch", pairs, causal, window_size, softcap, hq, hkv, d)


@pytest.mark.parametrize(("pairs", "causal", "window_size", "softcap", "hq", "hkv", "d"), VARLEN_TRITON)
def test_flash_attn_varlen_func_matches_oracle_triton(pairs, causal, window_size, softcap, hq, hkv, d):
    _check_varlen("triton", pairs, causal, window_size, softcap, hq, hkv, d)


def test_flash_attn_varlen_func_refusals():
    q = torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="right bound"):
        flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, window_size=(2, 2))
    with pytest.raises(ValueError, match=r"rank 3 \[total, H, D\]"):
        flash_attn_varlen_func(q[None], q[None], q[None], cu, cu, 6, 6)

def test_packed_variants_are_the_unpacked_functions_on_views():
    """qkv / kv stacked in one tensor: the same output as the unpacked call, gradients into the stack."""
    g = torch.Generator().manual_seed(31)
    qkv = torch.randn(2, 37, 3, 4, 16, generator=g).requires_grad_()
    out = fc.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(9, 0))
    q, k, v = (qkv[:, :, i].detach().requires_grad_() for i in range(3))
    want = flash_attn_func(q, k, v, causal=True, window_size=(9, 0))
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    do = torch.randn(out.shape, generator=g)
    (dqkv,) = torch.autograd.grad(out, qkv, do)
    torch.testing.assert_close(dqkv, torch.stack(torch.autograd.grad(want, (q, k, v), do), dim=2), rtol=0, atol=0)

    kv = qkv[:, :20, 1:, :2].detach()  # GQA: 2 kv heads for 4 query heads, Nk != Nq
    out = fc.flash_attn_kvpacked_func(qkv[:, :, 0].detach(), kv, softcap=3.0, stabilize=False)
    want = flash_attn_func(qkv[:, :, 0].detach(), kv[:, :, 0], kv[:, :, 1], softcap=3.0, stabilize=False)
    torch.testing.assert_close(out, want, rtol=0, atol=0)

    flat = qkv.detach().reshape(74, 3, 4, 16)
    cu = torch.tensor([0, 30, 74], dtype=torch.int32)
    out = fc.flash_attn_varlen_qkvpacked_func(flat, cu, 44, causal=True)
    want = flash_attn_varlen_func(flat[:, 0], flat[:, 1], flat[:, 2], cu, cu, 44, 44, causal=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out = fc.flash_attn_varlen_kvpacked_func(flat[:, 0], flat[:, 1:], cu, cu, 44, 44, window_size=(5, -1))
    want = flash_attn_varlen_func(flat[:, 0], flat[:, 1], flat[:, 2], cu, cu, 44, 44, window_size=(5, -1))
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"flash_attn_qkvpacked_func: qkv must have the layout \[B, N, 3, H, D\]"):
        fc.flash_attn_qkvpacked_func(qkv[:, :, :2])
    with pytest.raises(ValueError, match=r"kv must have the layout \[total, 2, H, D\]"):
        fc.flash_attn_varlen_kvpacked_func(flat[:, 0], flat, cu, cu, 44, 44)

def test_torch_compile_keeps_both_functions_in_one_graph():
    q = torch.randn(2, 17, 4, 16, requires_grad=True)
    dense = torch.compile(lambda q: flash_attn_func(q, q, q, causal=True, window_size=(5, 0)), fullgraph=True,
                          backend="aot_eager")  # fullgraph: a graph break raises
    torch.testing.assert_close(dense(q), flash_attn_func(q, q, q, causal=True, window_size=(5, 0)), rtol=0, atol=0)
    packed = torch.randn(30, 4, 16, requires_grad=True)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    varlen = torch.compile(lambda q: flash_attn_varlen_func(q, q, q, cu, cu, 20, 20, causal=True), fullgraph=True,
                           backend="aot_eager")
    out = varlen(packed)
    torch.testing.assert_close(out, flash_attn_varlen_func(packed, packed, packed, cu, cu, 20, 20, causal=True),
                               rtol=0, atol=0)
    out.sum().backward()
    assert packed.grad is not None and torch.isfinite(packed.grad).all()

def test_readme_block_runs():
    """README's FlashAttention-compatible block runs as written and means what its comments say."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "flash_attn_varlen_func(" in b)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    q, k, v, out, out1 = (scope[n] for n in ("q", "k", "v", "out", "out1"))
    assert out.shape == q.shape and out1.shape == (256, 4, 64)
    want = stable_attn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, window=64)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=0, atol=0)
    second = stable_attn.attention(*(t[None, 100:].transpose(1, 2) for t in (scope["q1"], scope["k1"], scope["v1"])),
                                   causal=True)
    torch.testing.assert_close(out1[100:], second[0].transpose(0, 1), rtol=0, atol=0)


def test_an_empty_batch_gives_empty_outputs_and_gradients():
    """flash_attn_func with batch size 0: empty output and gradients (it raised IndexError)."""
    q, k, v = (torch.randn(0, 8, 2, 16, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    assert out.shape == (0, 8, 2, 16)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
