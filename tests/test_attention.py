"""The op of attention.py: argument checks, backend choice, autocast, torch.compile, the stats plumbing.

What the op computes is tested on both backends in tests/kernels/test_correctness.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

import stable_attn
from stable_attn import _checks


def test_autocast_runs_in_lower_precision():
    q, k, v = (torch.randn(1, 2, 20, 16, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = stable_attn.attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32


def test_torch_compile_has_no_graph_break():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.proj(x).view(1, 20, 3, 1, 16).permute(2, 0, 3, 1, 4)
            return stable_attn.attention(q, k, v, causal=True).sum()

    torch._dynamo.reset()
    block = Block()
    x = torch.randn(1, 20, 16)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")  # fullgraph: a break raises
    loss = compiled(x)
    loss.backward()
    torch.testing.assert_close(loss, block(x), atol=1e-5, rtol=1e-5)


BAD = [
    ("q", lambda q, k, v: dict(q=q[0]), ValueError),
    ("batch", lambda q, k, v: dict(k=k[:1], v=v[:1]), ValueError),
    ("head dim", lambda q, k, v: dict(k=k[..., :8], v=v[..., :8]), ValueError),
    ("Hq=4", lambda q, k, v: dict(k=torch.randn(2, 3, 10, 16), v=torch.randn(2, 3, 10, 16)), ValueError),
    ("key_padding_mask must have shape", lambda q, k, v: dict(key_padding_mask=torch.ones(2, 5, dtype=torch.bool)),
     ValueError),
    ("key_padding_mask must be a bool", lambda q, k, v: dict(key_padding_mask=torch.ones(2, 10)), TypeError),
    ("q.dtype=torch.float64", lambda q, k, v: dict(q=q.double(), k=k.double(), v=v.double()), TypeError),
    ("share a dtype", lambda q, k, v: dict(k=k.half()), TypeError),
    ("one device", lambda q, k, v: dict(k=k.to("meta")), ValueError),
    ("beta=1.0", lambda q, k, v: dict(beta=1.0), ValueError),
    ("backend='cuda'", lambda q, k, v: dict(backend="cuda"), ValueError),
    ("stabilize='yes'", lambda q, k, v: dict(stabilize="yes"), ValueError),
    ("dropout_p=1.5", lambda q, k, v: dict(dropout_p=1.5), ValueError),
    ("window=0", lambda q, k, v: dict(window=0), ValueError),
    ("window=True", lambda q, k, v: dict(window=True), ValueError),
    ("scale=True", lambda q, k, v: dict(scale=True), ValueError),
    ("softcap=inf", lambda q, k, v: dict(softcap=float("inf")), ValueError),
    ("head dim D=600", lambda q, k, v: dict(q=torch.randn(2, 4, 10, 600), k=torch.randn(2, 2, 10, 600),
                                            v=torch.randn(2, 2, 10, 600)), ValueError),
    ("attn_mask requires grad", lambda q, k, v: dict(attn_mask=torch.zeros(10, 10, requires_grad=True)), ValueError),
    ("attn_mask of shape", lambda q, k, v: dict(attn_mask=torch.ones(3, 1, 10, 10, dtype=torch.bool)), ValueError),
]


@pytest.mark.parametrize("needle,change,exc", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(needle, change, exc):
    q, k, v = torch.randn(2, 4, 10, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    args = dict(q=q, k=k, v=v)
    args.update(change(q, k, v))
    with pytest.raises(exc, match=None) as info:
        stable_attn.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    assert needle in str(info.value), str(info.value)


def test_shape_errors_name_the_layout_and_spot_flash_attention_inputs():
    """[B, N, H, D] inputs (FlashAttention's layout) that cannot be [B, H, N, D] say so and point at
    flash_attn_func; inputs valid as [B, H, N, D] (GQA, Nq != Nk, decoding) are served."""
    g = torch.Generator().manual_seed(0)
    bnhd_q, bnhd_k = torch.randn(2, 10, 4, 16, generator=g), torch.randn(2, 7, 2, 16, generator=g)
    with pytest.raises(ValueError, match=r"Hq=10 must be a multiple of k/v heads Hkv=7") as info:
        stable_attn.attention(bnhd_q, bnhd_k, bnhd_k)
    assert "as [B, H, N, D]" in str(info.value) and "stable_attn.flash_attn_func" in str(info.value)
    square = torch.randn(2, 12, 4, 16, generator=g)  # N=12, H=4: fits both layouts, the masks tell
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \[B, Nk\] = \(2, 4\)") as info:
        stable_attn.attention(square, square, square, key_padding_mask=torch.ones(2, 12, dtype=torch.bool))
    assert "flash_attn_func" in str(info.value)
    with pytest.raises(ValueError, match="attn_mask of shape") as info:
        stable_attn.attention(square, square, square, attn_mask=torch.ones(12, 12, dtype=torch.bool))
    assert "flash_attn_func" in str(info.value)
    with pytest.raises(ValueError, match=r"rank 4 \[B, H, N, D\].*stable_attn.attention_varlen"):
        stable_attn.attention(square[0], square[0], square[0])
    # no hint where the [B, N, H, D] reading does not fit either
    with pytest.raises(ValueError, match="Hkv=3") as info:
        stable_attn.attention(torch.randn(1, 4, 10, 16), torch.randn(1, 3, 7, 16), torch.randn(1, 3, 7, 16))
    assert "flash_attn_func" not in str(info.value)
    for hq, hkv, nq, nk in ((8, 2, 5, 9), (32, 8, 1, 40), (4, 1, 40, 3), (12, 12, 4, 4)):
        q = torch.randn(1, hq, nq, 16, generator=g)
        k = torch.randn(1, hkv, nk, 16, generator=g)
        assert stable_attn.attention(q, k, k, causal=True).shape == q.shape


def _hf_layout(b=1, n=24, h=2, d=16, seed=0):
    """q/k/v as transformers hands them over: a [B, N, H, D] projection viewed as [B, H, N, D]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, d, generator=g).transpose(1, 2).requires_grad_() for _ in range(3)]


def test_torch_compile_inductor_with_transposed_inputs():
    torch._dynamo.reset()
    q, k, v = _hf_layout()
    fn = torch.compile(lambda a, b, c: stable_attn.attention(a, b, c, causal=True), fullgraph=True)
    out = fn(q, k, v)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    stable_attn.attention(q, k, v, causal=True).sum().backward()
    for a, t in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(a, t.grad, atol=1e-5, rtol=1e-5)


def test_torch_compile_stats_and_dropout_neither_break_the_graph_nor_recompile():
    torch._dynamo.reset()
    st = stable_attn.AttentionStats()
    q, k, v = _hf_layout(seed=1)
    call = lambda a, b, c: stable_attn.attention(a, b, c, causal=True, stats=st, dropout_p=0.2)  # noqa: E731
    call(q, k, v)  # the stats allocate their tensors on the first update (a different code path)
    fn = torch.compile(call, fullgraph=True, backend="aot_eager")
    # config.patch, not monkeypatch: pytest's undo deletes the entry (it is not in the module's __dict__),
    # which hides torch._dynamo.config.error_on_recompile from every later test in the process
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(4):
            fn(q, k, v).sum().backward()
    assert int(st.calls) == 5 and st.rows.tolist() == [5 * 24] * 2


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_counts_the_statistics_once(reentrant, monkeypatch):
    """The forward recomputed in the backward (torch.utils.checkpoint) folds no statistics: one step's
    forward is counted once, and the gradients are those of the plain call."""
    from torch.utils.checkpoint import checkpoint

    from stable_attn import _ops

    q, k, v = _hf_layout(seed=2)
    # an op after the attention that saves a tensor: the non-reentrant recompute runs past the attention
    # (it stops once the last tensor the backward needs is recomputed)
    call = lambda a, b, c, st: stable_attn.attention(a, b, c, causal=True, stats=st).square()  # noqa: E731
    plain_stats, ckpt_stats = stable_attn.AttentionStats(), stable_attn.AttentionStats()
    call(q, k, v, plain_stats).sum().backward()
    plain = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    checkpoint(call, q, k, v, ckpt_stats, use_reentrant=reentrant).sum().backward()
    for a, t in zip(plain, (q, k, v), strict=True):
        torch.testing.assert_close(t.grad, a, rtol=0, atol=0)
    for name in ("rows", "saturated_rows", "calls"):
        assert torch.equal(getattr(ckpt_stats, name), getattr(plain_stats, name)), name
    # the same call, were the recompute counted: the test above would see every row twice
    monkeypatch.setattr(_ops, "recomputing", lambda: False)
    twice = stable_attn.AttentionStats()
    checkpoint(call, q, k, v, twice, use_reentrant=reentrant).sum().backward()
    assert torch.equal(twice.rows, 2 * plain_stats.rows)


def test_disabled_stats_are_not_collected():
    st = stable_attn.AttentionStats(enabled=False)
    q = torch.randn(1, 1, 8, 8)
    stable_attn.attention(q, q, q, stats=st)
    assert st.empty


def test_problems_too_large_for_32_bit_kernel_offsets_go_to_the_pytorch_path(monkeypatch):
    from stable_attn.attention import resolve_backend

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # resolve as for CPU tensors under the interpreter

    big = torch.empty(1, 64, 2**18, 128, device="meta")  # 2^31 elements in one batch element
    small = torch.empty(1, 64, 2**10, 128, device="meta")
    assert resolve_backend("triton", big, False, small) == "torch"
    assert resolve_backend("triton", small, False, big) == "torch"
    assert resolve_backend("triton", small, False, small) == "triton"


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_an_empty_batch_gives_empty_outputs_and_gradients(backend, monkeypatch):
    """Batch size 0 returns empty tensors as SDPA does (it raised IndexError), with or without statistics."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = (torch.randn(0, 4, 8, 16, requires_grad=True) for _ in range(3))
    st = stable_attn.AttentionStats()
    out = stable_attn.attention(q, k[:, :2], v[:, :2], causal=True, stats=st, backend=backend,
                                key_padding_mask=torch.ones(0, 8, dtype=torch.bool))
    assert out.shape == (0, 4, 8, 16) and out.dtype == q.dtype
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert st.empty  # no rows were seen


def _layout_warnings(caplog, q, k, causal):
    from stable_attn import _ops

    _ops._logged_once.clear()
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        caplog.clear()
        out = stable_attn.attention(q, k, k, causal=causal)
        stable_attn.attention(q, k, k, causal=causal)  # the same shape again: logged once
    return out, [r.getMessage() for r in caplog.records if "reads q" in r.getMessage()]


def test_flash_attention_layout_passed_as_bhnd_warns_once_naming_both_layouts(caplog):
    # FlashAttention's GQA tensors [B, N, H, D] = q 2x128x4, k 2x128x2: read as 128 heads of 4 queries over 2
    # keys, bottom-right causal leaves 2 of each head's 4 rows (512 of 1024) without a key
    q, k = torch.randn(2, 128, 4, 8), torch.randn(2, 128, 2, 8)
    out, warned = _layout_warnings(caplog, q, k, causal=True)
    assert int((out.abs().sum(-1) == 0).sum()) == 512
    assert len(warned) == 1, warned
    assert "[B, H, N, D]" in warned[0] and "128 heads of 4 queries over 2 keys" in warned[0]
    assert "2 of every head's 4 query rows without a key" in warned[0]
    assert "layout='bnhd'" in warned[0] and "batch 2, 128 tokens, 4 heads" in warned[0]
    # multi-head tensors of the same mistake leave no row without a key: the head count gives them away
    for shape in ((2, 128, 4, 8), (1, 1024, 16, 8), (1, 4096, 8, 8), (1, 256, 32, 8)):
        t = torch.randn(*shape)
        assert len(_layout_warnings(caplog, t, t, causal=True)[1]) == 1, shape
        assert len(_layout_warnings(caplog, t, t, causal=False)[1]) == 1, shape
    # the right layout of the same tensors is silent
    assert _layout_warnings(caplog, q.transpose(1, 2), k.transpose(1, 2), causal=True)[1] == []


def test_bhnd_tensors_passed_to_flash_attn_func_warn_once_in_its_terms(caplog):
    from stable_attn import _ops, flash_attn_func

    q, k = torch.randn(2, 4, 128, 8), torch.randn(2, 2, 128, 8)  # [B, H, N, D] given to the [B, N, H, D] function
    _ops._logged_once.clear()
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        flash_attn_func(q, k, k, causal=True)
        flash_attn_func(q, k, k, causal=True)
    (warned,) = [r.getMessage() for r in caplog.records if "reads q" in r.getMessage()]
    assert warned.startswith("stable_attn.flash_attn_func reads q (2, 4, 128, 8) and k (2, 2, 128, 8) as "
                             "[B, N, H, D]: 128 heads of 4 queries over 2 keys")
    assert "If they are [B, H, N, D] (batch 2, 4 heads, 128 tokens), call stable_attn.attention" in warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), causal=True)
    assert not [r for r in caplog.records if "reads q" in r.getMessage()]


@pytest.mark.parametrize("q_shape, k_shape, causal", [
    ((1, 32, 1, 8), (1, 8, 40, 8), True),     # decoding one token with GQA
    ((1, 32, 1, 8), (1, 32, 1, 8), True),     # decoding from a one-token prompt, MHA
    ((1, 128, 1, 8), (1, 128, 7, 8), True),   # decoding, 128 heads
    ((1, 32, 5, 8), (1, 8, 5, 8), True),      # a short GQA prompt
    ((1, 32, 4, 8), (1, 32, 4, 8), True),     # a short MHA prompt, 32 heads
    ((1, 64, 4, 8), (1, 64, 4, 8), False),    # 64 heads, 4 tokens (an encoder)
    ((1, 4, 4096, 8), (1, 4, 4096, 8), True),  # a long sequence with few heads
    ((1, 2, 2048, 8), (1, 1, 2048, 8), True),  # long, MQA
    ((2, 12, 128, 8), (2, 12, 128, 8), True),  # GPT-2
    ((1, 32, 16, 8), (1, 32, 80, 8), True),    # chunked prefill over a cache
])
def test_legitimate_shapes_do_not_warn_about_the_layout(caplog, q_shape, k_shape, causal):
    q, k = torch.empty(q_shape, device="meta"), torch.empty(k_shape, device="meta")
    assert _checks.dense_problem(q, k, k) is None
    assert _checks.layout_doubt(q, k, causal) is None  # what attention() warns on, shapes only
    # and the warning's wiring stays silent on a short prompt of the same kind
    small_q, small_k = (*q_shape[:2], min(q_shape[2], 16), 8), (*k_shape[:2], min(k_shape[2], 16), 8)
    assert _layout_warnings(caplog, torch.randn(small_q), torch.randn(small_k), causal)[1] == []


def test_the_layout_check_does_not_break_a_compiled_graph():
    # logging inside a traced function would break the graph: compiled calls skip the (eager-only) warning
    q, k = torch.randn(2, 128, 4, 8), torch.randn(2, 128, 2, 8)
    compiled = torch.compile(lambda q, k: stable_attn.attention(q, k, k, causal=True), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k), stable_attn.attention(q, k, k, causal=True))


def test_layout_bnhd_is_the_same_op_on_the_transposes_and_says_so_in_its_errors():
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 24, h, 8, generator=g) for h in (4, 2, 2))  # [B, N, H, D], GQA
    mask = torch.rand(2, 24, generator=g) > 0.2
    out = stable_attn.attention(q, k, v, layout="bnhd", causal=True, key_padding_mask=mask)
    want = stable_attn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                 key_padding_mask=mask)
    assert out.shape == (2, 24, 4, 8)
    assert torch.equal(out, want.transpose(1, 2))
    with pytest.raises(ValueError, match=r"layout='bshd' is not supported; use 'bhnd' \(\[B, H, N, D\].*'bnhd'"):
        stable_attn.attention(q, k, v, layout="bshd")
    with pytest.raises(ValueError, match=r"layout='bnhd'\): q, k, v given as \[B, N, H, D\].*key_padding_mask"):
        stable_attn.attention(q, k, v, layout="bnhd", key_padding_mask=mask[:, :5])


def test_a_declared_layout_is_not_second_guessed(caplog):
    q, k = torch.randn(2, 128, 4, 8), torch.randn(2, 128, 2, 8)  # the doubt of the test above, declared
    from stable_attn import _ops

    _ops._logged_once.clear()
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        stable_attn.attention(q, k, k, causal=True, layout="bhnd")
    assert not [r for r in caplog.records if "reads q" in r.getMessage()]


def test_the_strict_mode_raises_on_a_doubt_and_on_shapes_that_fit_both_layouts():
    with pytest.raises(ValueError, match=r"mode='strict' is not supported; use one of 'warn', 'error', 'off'"):
        stable_attn.set_layout_check("strict")
    square = torch.randn(1, 32, 16, 8)  # [B, N=32, H=16, D] read as 32 heads of 16 tokens: no shape rule tells
    assert _checks.layout_doubt(square, square, True) is None
    previous = stable_attn.set_layout_check("error")
    try:
        q, k = torch.randn(2, 128, 4, 8), torch.randn(2, 128, 2, 8)
        with pytest.raises(ValueError, match=r"reads q \(2, 128, 4, 8\).*set_layout_check\('error'\)"):
            stable_attn.attention(q, k, k, causal=True)
        with pytest.raises(ValueError, match=r"fit both layouts \(32 heads of 16 tokens.*or 16 heads of 32 tokens"):
            stable_attn.attention(square, square, square, causal=True)
        for layout in ("bhnd", "bnhd"):  # said: served
            assert stable_attn.attention(square, square, square, causal=True, layout=layout).shape == square.shape
        decode = torch.randn(1, 32, 1, 8)  # one query: fits one layout only
        assert stable_attn.attention(decode, square, square, causal=True).shape == decode.shape
        # the FlashAttention-compatible function's layout is its API's: only a doubt raises
        assert stable_attn.flash_attn_func(square, square, square, causal=True).shape == square.shape
        with pytest.raises(ValueError, match=r"flash_attn_func reads q \(2, 4, 128, 8\)"):
            stable_attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), causal=True)
    finally:
        assert stable_attn.set_layout_check(previous) == "error"


def test_a_non_causal_gqa_call_in_the_other_layout_warns(caplog):
    q, k = torch.randn(1, 64, 8, 8), torch.randn(1, 64, 2, 8)  # [B, N, H, D], an encoder with GQA
    out, warned = _layout_warnings(caplog, q, k, causal=False)
    assert len(warned) == 1 and "fewer keys than queries in every head" in warned[0], warned
    # cross-attention with fewer heads than queries stays silent
    assert _layout_warnings(caplog, torch.randn(1, 8, 64, 8), torch.randn(1, 8, 16, 8), causal=False)[1] == []
