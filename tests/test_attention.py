"""The op against the fp64 oracle and against torch's own SDPA, on the PyTorch path.

Accuracy criterion: on the same inputs and dtype, our relative RMS error of the output and of each
gradient is at most 1.25x SDPA's (plus an fp32-noise floor), and our max error at most 2x SDPA's.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from oracle import oracle_attention

import stable_attn
from stable_attn.kernels import reference, rules

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FLOOR = 16 * 2.0**-24  # fp32 noise: below this no error ratio is meaningful


def _rel_rms(a, b):
    # relative to the truth, or absolute when the truth is below 1 (e.g. dq = 0 for a single key)
    return ((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp(min=1.0)).item()


def _rel_max(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


def _run(fn, q, k, v, do, dtype):
    qq, kk, vv = (t.to(dtype).requires_grad_() for t in (q, k, v))
    o = fn(qq, kk, vv)
    o.backward(do.to(dtype))
    return o, qq.grad, kk.grad, vv.grad


def _compare_with_sdpa(q, k, v, dtype, ours, sdpa, oracle_kwargs):
    gen_do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7))
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = oracle_attention(qd, kd, vd, **oracle_kwargs)
    ref.backward(gen_do.double())
    truth = (ref, qd.grad, kd.grad, vd.grad)
    got = _run(ours, q, k, v, gen_do, dtype)
    base = _run(sdpa, q, k, v, gen_do, dtype)
    for name, g, b, t in zip(("out", "dq", "dk", "dv"), got, base, truth, strict=True):
        assert torch.isfinite(g).all(), name
        e_ours, e_sdpa = _rel_rms(g, t), _rel_rms(b, t)
        assert e_ours <= 1.25 * e_sdpa + FLOOR, f"{name}: rms error {e_ours:.3e} vs sdpa {e_sdpa:.3e}"
        m_ours, m_sdpa = _rel_max(g, t), _rel_max(b, t)
        assert m_ours <= 2.0 * m_sdpa + FLOOR, f"{name}: max error {m_ours:.3e} vs sdpa {m_sdpa:.3e}"


SHAPES_CI = [(1, 16), (7, 64), (128, 80), (300, 128), (1024, 64), (128, 256)]
SHAPES_ALL = [(n, d) for n in (1, 7, 128, 300, 1024) for d in (16, 64, 80, 128, 256)]


def _accuracy_case(dtype, causal, n, d, seed):
    g = torch.Generator().manual_seed(seed)
    b, h = (2, 3) if n < 1024 else (1, 2)  # keep the fp64 oracle of the long cases cheap
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    _compare_with_sdpa(
        q, k, v, dtype,
        lambda a, b, c: stable_attn.attention(a, b, c, causal=causal, backend="torch"),
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal),
        {"causal": causal},
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,d", SHAPES_CI)
def test_accuracy_vs_sdpa(dtype, causal, n, d):
    _accuracy_case(dtype, causal, n, d, seed=n * 1000 + d)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,d", SHAPES_ALL)
def test_accuracy_vs_sdpa_full_matrix(dtype, causal, n, d):
    _accuracy_case(dtype, causal, n, d, seed=n * 1000 + d + 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 1)])
def test_gqa_matches_sdpa_without_repeating_kv(dtype, hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    q = torch.randn(2, hq, 70, 32, generator=g)
    k, v = (torch.randn(2, hkv, 70, 32, generator=g) for _ in range(2))
    _compare_with_sdpa(
        q, k, v, dtype,
        lambda a, b, c: stable_attn.attention(a, b, c, causal=True),
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True),
        {"causal": True},
    )


@pytest.mark.parametrize("nq,nk", [(1, 37), (5, 130), (64, 200), (40, 17)])
def test_causal_bottom_right_for_unequal_lengths(nq, nk):
    g = torch.Generator().manual_seed(nq + nk)
    q = torch.randn(2, 2, nq, 32, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, nk, 32, generator=g, requires_grad=True) for _ in range(2))
    out = stable_attn.attention(q, k, v, causal=True)
    ref = oracle_attention(q.detach(), k.detach(), v.detach(), causal=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    if nq > nk:  # the first nq - nk queries see no key: zeros, and no gradient
        assert (out[:, :, : nq - nk] == 0).all()
        out.sum().backward()
        assert (q.grad[:, :, : nq - nk] == 0).all()
        assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_key_padding_with_fully_masked_rows(dtype):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 2, 45, 16, generator=g).to(dtype).requires_grad_() for _ in range(3))
    kpm = torch.rand(3, 45, generator=g) > 0.3
    kpm[1] = False  # batch 1 sees no key at all
    out = stable_attn.attention(q, k, v, key_padding_mask=kpm)
    ref = oracle_attention(q.detach(), k.detach(), v.detach(), key_padding_mask=kpm)
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all()
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-6}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    out.backward(torch.randn_like(out))
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[1] == 0).all() and (k.grad[1] == 0).all() and (v.grad[1] == 0).all()
    assert (k.grad[~kpm[:, None, :, None].expand_as(k)] == 0).all()  # masked keys get no gradient


def _tied_inputs(sign: str, n: int = 96, d: int = 64, ties: int = 4, magnitude: float = 3.0, seed: int = 0,
                 dtype=torch.bfloat16):
    """Scores with ``ties`` keys tied exactly at each row's max (keys 1..ties), of the given sign.

    q = [a_i, 0, ...], k = [c_j, noise...]: s_ij = a_i * c_j * scale exactly, so duplicated c_j tie
    exactly; the tied value c_top is the row max for every row (a_i > 0).
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.zeros(1, 2, n, d)
    q[..., 0] = 1.0 + torch.rand(1, 2, n, generator=g)
    k = torch.randn(1, 2, n, d, generator=g)
    c_top = {"positive": magnitude, "negative": -magnitude, "zero": 0.0}[sign]
    k[..., 0] = c_top - 0.5 - torch.rand(1, 2, n, generator=g) * 2  # all below the tie
    k[..., 1 : 1 + ties, 0] = c_top
    v = torch.randn(1, 2, n, d, generator=g) - 1.0  # mostly negative values, the paper's trigger
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("sign", ["positive", "negative", "zero"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_ties_at_the_max_fire_the_fix_and_stay_exact(sign, dtype):
    q, k, v = _tied_inputs(sign, dtype=dtype)
    scale = 1.0  # keep the scores exact multiples: a_i * c_j
    st_on, st_off = stable_attn.AttentionStats(), stable_attn.AttentionStats()
    on = stable_attn.attention(q, k, v, scale=scale, stats=st_on, block_n=32)
    off = stable_attn.attention(q, k, v, scale=scale, stats=st_off, stabilize=False, block_n=32)
    ref = oracle_attention(q, k, v, scale=scale)
    rows = q.shape[1] * q.shape[2]
    # every row has its 4 tied keys (keys 1..4) in key block 0
    assert int(st_on.saturated_rows.sum()) == rows == int(st_off.saturated_rows.sum())
    assert int(st_on.fixed_blocks.sum()) == rows  # fires once per row, in block 0
    assert int(st_off.fixed_blocks.sum()) == 0
    e_on, e_off = _rel_rms(on, ref), _rel_rms(off, ref)
    assert e_on <= 1.25 * e_off + FLOOR
    assert torch.isfinite(on).all()


def test_tie_tolerance_is_the_exact_rounding_boundary():
    for dtype in rules.SUPPORTED_DTYPES:
        tau = rules.tie_tolerance(dtype)
        inside = torch.exp(torch.tensor(-tau * 0.999, dtype=torch.float64)).to(dtype)
        outside = torch.exp(torch.tensor(-tau * 1.001, dtype=torch.float64)).to(dtype)
        assert inside.item() == 1.0 and outside.item() < 1.0, dtype


def test_shifted_offset_is_monotone_bounded_and_the_paper_rule_in_between():
    m = torch.linspace(-200, 200, 40001, dtype=torch.float64)
    for dtype in rules.SUPPORTED_DTYPES:
        _, lo, hi = rules.rule_constants(dtype, rules.MODE_EXACT)
        r = rules.shifted_offset(m, 2.0, lo, hi)
        assert (r[1:] >= r[:-1]).all()
        shift = r - m
        assert (shift >= lo - 1e-12).all() and (shift <= hi + 1e-12).all()
        paper = torch.where(m > 0, 2.0 * m, torch.zeros_like(m))
        mid = ((paper - m) > lo) & ((paper - m) < hi)
        torch.testing.assert_close(r[mid], paper[mid])


@pytest.mark.parametrize("sign", ["positive", "negative"])
def test_huge_logits_with_ties_stay_finite_while_the_paper_rule_gives_nan(sign):
    q, k, v = _tied_inputs(sign, magnitude=1e4, dtype=torch.bfloat16, n=40)
    ours = stable_attn.attention(q, k, v, scale=1.0)
    paper = stable_attn.attention(q, k, v, scale=1.0, stabilize="paper")
    ref = oracle_attention(q, k, v, scale=1.0)
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours.double(), ref, atol=2e-2, rtol=2e-2)
    assert torch.isnan(paper).all()
    q16, k16, v16 = (t.half() for t in (q, k, v))
    ours16 = stable_attn.attention(q16, k16, v16, scale=1.0)
    torch.testing.assert_close(ours16.double(), oracle_attention(q16, k16, v16, scale=1.0), atol=3e-3, rtol=3e-3)


def _paper_forward(q, k, v, block_n, scale):
    """The published rule written out from the paper's description, for one head, no masks."""
    s = (q.float() @ k.float().T) * scale
    m = torch.full((q.shape[0],), -math.inf)
    l = torch.zeros(q.shape[0])
    acc = torch.zeros(q.shape[0], v.shape[1])
    for j in range(0, k.shape[0], block_n):
        sb = s[:, j : j + block_n]
        mb = sb.amax(-1)
        tied = (sb >= mb[:, None] - 1e-3).sum(-1) > 1
        mb = torch.where(tied & (mb > 0), 2 * mb, torch.where(tied & (mb < 0), torch.zeros_like(mb), mb))
        m_new = torch.maximum(m, mb)
        p = torch.exp(sb - m_new[:, None])
        alpha = torch.exp(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[:, None] + p.to(q.dtype).float() @ v[j : j + block_n].float()
        m = m_new
    return acc / l[:, None]


def test_paper_mode_reproduces_the_published_rule():
    q, k, v = _tied_inputs("positive", magnitude=2.0, n=100, dtype=torch.bfloat16)
    ours = stable_attn.attention(q, k, v, scale=1.0, stabilize="paper", block_n=32)
    for h in range(q.shape[1]):
        expect = _paper_forward(q[0, h], k[0, h], v[0, h], 32, 1.0)
        torch.testing.assert_close(ours[0, h].float(), expect.to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)


def test_stats_exact_on_constructed_inputs():
    q, k, v = _tied_inputs("positive", magnitude=2.0, n=50, ties=3, dtype=torch.float32)
    k[..., 7, 0] = 5.0  # a single, untied, larger max at key 7 for half of the rows' heads: head 1 only
    k[:, 0, 7, 0] = 1.0
    st = stable_attn.AttentionStats()
    stable_attn.attention(q, k, v, scale=1.0, stats=st, block_n=16)
    stable_attn.attention(q, k, v, scale=1.0, stats=st, block_n=16)  # accumulates
    assert st.rows.tolist() == [100, 100]
    # head 0: keys 1..3 tie at the max -> saturated; head 1: key 7 alone at the max -> not
    assert st.saturated_rows.tolist() == [100, 0]
    s = q[0, :, :, 0:1] * k[0, :, :, 0].unsqueeze(1)  # [H, N, N] exact scores
    torch.testing.assert_close(st.max_logit, s.amax(dim=(1, 2)).float())
    p0 = torch.softmax(s.double(), -1)[..., 0].mean(-1)
    torch.testing.assert_close(st.sink_mass.double(), p0, atol=1e-6, rtol=1e-5)
    st.reset()
    assert st.empty


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_saturation_does_not_depend_on_block_size(dtype):
    g = torch.Generator().manual_seed(11)
    # coarse scores (few distinct values) make near-ties common, also across block boundaries
    q = torch.randint(-2, 3, (2, 3, 90, 8), generator=g).to(dtype)
    k = torch.randint(-2, 3, (2, 3, 150, 8), generator=g).to(dtype)
    v = torch.randn(2, 3, 150, 8, generator=g).to(dtype)
    counts = set()
    for bn in (16, 32, 64, 128, 256):
        st = stable_attn.AttentionStats()
        stable_attn.attention(q, k, v, stats=st, block_n=bn, causal=True)
        counts.add(tuple(st.saturated_rows.tolist()))
    assert len(counts) == 1
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(8)
    vis = torch.arange(150)[None, :] <= torch.arange(90)[:, None] + 60
    s = s.masked_fill(~vis, -math.inf)
    near = (s >= s.amax(-1, keepdim=True) - rules.tie_tolerance(dtype)).sum(-1) >= 2
    assert counts.pop() == tuple(near.sum(dim=(0, 2)).tolist())


@pytest.mark.parametrize("window", [1, 5, 40])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_window_and_softcap_match_oracle(window, softcap):
    g = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(2, 2, 70, 16, generator=g, dtype=torch.float64).float().requires_grad_() for _ in range(3))
    out = stable_attn.attention(q, k, v, causal=True, window=window, softcap=softcap, scale=0.9, block_n=16)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = oracle_attention(qd, kd, vd, causal=True, window=window, softcap=softcap, scale=0.9)
    torch.testing.assert_close(out.double(), ref, atol=3e-6, rtol=1e-5)
    do = torch.randn_like(out)
    out.backward(do)
    ref.backward(do.double())
    for a, b in ((q, qd), (k, kd), (v, vd)):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=2e-5, rtol=1e-4)


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
    ref = oracle_attention(qd, kd, vd, attn_mask=mask)
    torch.testing.assert_close(out.double(), ref, atol=3e-6, rtol=1e-5)
    out.backward(torch.ones_like(out))
    ref.backward(torch.ones_like(ref))
    for a, b in ((q, qd), (k, kd), (v, vd)):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=3e-5, rtol=1e-4)


def test_stabilization_does_not_change_fp32_results():
    q, k, v = _tied_inputs("positive", magnitude=4.0, dtype=torch.float32)
    outs = [stable_attn.attention(q, k, v, stabilize=s) for s in (True, False, "paper")]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(outs[2], outs[1], atol=1e-6, rtol=1e-5)


def test_memory_is_bounded_by_the_tile_not_the_score_matrix(monkeypatch):
    monkeypatch.setattr(reference, "TILE_ELEMENTS", 4096)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=g) for _ in range(3))
    opts = reference.Options(block_n=32, scale=0.25)
    p = reference._Problem(q, k, None, None, opts)
    assert p.chunk == 64  # 4096 / (1 * 2 * 32): a [1, 2, 64, 32] tile, not [1, 2, 300, 300]
    out, _, _ = reference.attention_forward(q, k, v, opts=opts)
    torch.testing.assert_close(out.double(), oracle_attention(q, k, v), atol=2e-6, rtol=1e-5)


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
    ("head dim D=300", lambda q, k, v: dict(q=torch.randn(2, 4, 10, 300), k=torch.randn(2, 2, 10, 300),
                                            v=torch.randn(2, 2, 10, 300)), ValueError),
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


def test_rows_that_see_no_key_are_neither_counted_nor_saturated():
    q = torch.randn(1, 1, 4, 8, generator=torch.Generator().manual_seed(0)) * 0.01
    st = stable_attn.AttentionStats()
    stable_attn.attention(q, q, q, causal=True, key_padding_mask=torch.tensor([[False, False, True, True]]), stats=st)
    assert st.rows.tolist() == [2]  # rows 0 and 1 see no key (left padding)
    assert st.saturated_rows.tolist() == [0]


def test_key_padding_mask_of_any_stride_gives_the_same_result_on_both_backends():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 40, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    kpm_t = torch.rand(40, 2, generator=g) > 0.3  # transposed: stride (1, 2)
    kpm = kpm_t.t()
    ref = stable_attn.attention(q, k, v, key_padding_mask=kpm.contiguous(), backend="torch")
    for backend in ("torch", "triton"):
        out = stable_attn.attention(q, k, v, key_padding_mask=kpm, backend=backend)
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


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


def test_torch_compile_stats_and_dropout_neither_break_the_graph_nor_recompile(monkeypatch):
    torch._dynamo.reset()
    st = stable_attn.AttentionStats()
    q, k, v = _hf_layout(seed=1)
    call = lambda a, b, c: stable_attn.attention(a, b, c, causal=True, stats=st, dropout_p=0.2)  # noqa: E731
    call(q, k, v)  # the stats allocate their tensors on the first update (a different code path)
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    fn = torch.compile(call, fullgraph=True, backend="aot_eager")
    for _ in range(4):
        fn(q, k, v).sum().backward()
    assert int(st.calls) == 5 and st.rows.tolist() == [5 * 24] * 2


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
