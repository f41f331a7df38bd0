"""``stable_attn.attention_varlen``, the op: packed sequences, FlashAttention's varlen layout.

Sequence by sequence, the varlen op must be ``attention()`` on that sequence alone, on the same
backend: the same bits for the output, the gradients and every row statistic. Every case runs on the
PyTorch path (one reference call per sequence); a subset runs on the Triton kernels under the
interpreter (the launchers' own tests are in test_varlen_triton.py). Then the whole
packed call is compared with the fp64 oracle, one sequence at a time, so a token that saw another
document fails. Lengths are drawn from fixed, untuned generator seeds, always with a sequence of
length 1 and lengths that are no multiple of the key block (16 here).
"""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
from closeness import rel_max
from margins import score_error_output_bound
from packing import cu, packed_inputs

import stable_attn
from stable_attn import varlen
from stable_attn.kernels import naive, reference, reference_varlen
from stable_attn.options import Options
from stable_attn.stats import STATS_ENTROPY, RowStats

FIELDS = RowStats.FIELDS  # the entropy included: per sequence the same sums in the same order
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# fp64 oracle tolerances (outputs: absolute/relative; gradients: max error relative to the largest entry)
OUT_TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-6}
GRAD_TOL = {torch.bfloat16: 4e-2, torch.float16: 6e-3, torch.float32: 2e-5}


def random_lengths(n: int, hi: int, seed: int) -> list[int]:
    """``n`` lengths in [2, hi] from a fresh generator, one of them replaced by 1."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, hi + 1, (n,), generator=g).tolist()
    lens[int(torch.randint(0, n, (1,), generator=g))] = 1
    return lens


class RowCapture(stable_attn.AttentionStats):
    """AttentionStats that also keeps the per-row statistics of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls_rows: list[RowStats] = []

    def update(self, rows: RowStats) -> None:
        self.calls_rows.append(RowStats(*(getattr(rows, f).detach().clone() for f in FIELDS)))
        super().update(rows)


def run_varlen(q, k, v, do, lens_q, lens_k, backend="torch", **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    st = RowCapture()
    out = stable_attn.attention_varlen(*leaves, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), stats=st,
                                       backend=backend, **kw)
    out.backward(do)
    return out.detach(), [t.grad for t in leaves], st


def run_per_sequence(q, k, v, do, lens_q, lens_k, backend="torch", **kw):
    """attention() on each sequence's rows viewed as [1, H, N, D]; results put back in the packed layout."""
    out, grads = torch.zeros_like(q), [torch.zeros_like(t) for t in (q, k, v)]
    st = RowCapture()
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    for b in range(len(lens_q)):
        (qs, qe), (ks, ke) = (cq[b], cq[b + 1]), (ck[b], ck[b + 1])
        leaves = [t[s:e].detach().transpose(0, 1)[None].requires_grad_()
                  for t, s, e in ((q, qs, qe), (k, ks, ke), (v, ks, ke))]
        o = stable_attn.attention(*leaves, stats=st, backend=backend, **kw)
        o.backward(do[qs:qe].transpose(0, 1)[None])
        out[qs:qe] = o.detach()[0].transpose(0, 1)
        for g, leaf, (s, e) in zip(grads, leaves, ((qs, qe), (ks, ke), (ks, ke)), strict=True):
            g[s:e] = leaf.grad[0].transpose(0, 1)
    return out, grads, st


CASES = {
    "causal-gqa": dict(lens=random_lengths(5, 40, seed=1), Hq=4, Hkv=2, kw=dict(causal=True)),
    "full-mqa": dict(lens=random_lengths(4, 33, seed=2), Hq=4, Hkv=1, kw={}),
    "causal-unequal-lengths": dict(lens=[1, 9, 30, 5], lens_k=[1, 17, 30, 2], Hq=2, Hkv=2, kw=dict(causal=True)),
    "window-softcap": dict(lens=random_lengths(4, 45, seed=3), Hq=2, Hkv=2,
                           kw=dict(causal=True, window=7, softcap=5.0, scale=0.9)),
    "window-not-causal": dict(lens=random_lengths(3, 40, seed=4), Hq=2, Hkv=1, kw=dict(window=5)),
    "paper": dict(lens=random_lengths(4, 40, seed=5), Hq=2, Hkv=2, kw=dict(causal=True, stabilize="paper")),
    "off": dict(lens=random_lengths(4, 40, seed=6), Hq=2, Hkv=2, kw=dict(stabilize=False)),
    "tied": dict(lens=random_lengths(3, 40, seed=7) + [24], Hq=2, Hkv=2, kw=dict(), tied=True),
    "huge-logits": dict(lens=random_lengths(4, 40, seed=15), Hq=2, Hkv=1, kw=dict(causal=True), qk_std=8.0),
}


def _case(name, dtype):
    c = CASES[name]
    lens_q = c["lens"]
    lens_k = c.get("lens_k", lens_q)
    q, k, v, do = packed_inputs(lens_q, lens_k, c["Hq"], c["Hkv"], 16, dtype, seed=len(name), tied=c.get("tied", False),
                                qk_std=c.get("qk_std", 1.0))
    return q, k, v, do, lens_q, lens_k, dict(block_n=16, **c["kw"])


def on_backends(torch_cases, triton_cases):
    """``backend, name, dtype``: every case on torch; on Triton (the interpreter, ~100x slower) a subset
    that covers each feature once (the launchers' own tests are in test_varlen_triton.py)."""
    rows = [("torch", *c) for c in torch_cases] + [("triton", *c) for c in triton_cases]
    return pytest.mark.parametrize(("backend", "name", "dtype"), rows,
                                   ids=["-".join(str(x).replace("torch.", "") for x in r) for r in rows])


ALL = [(n, dt) for n in CASES for dt in DTYPES]
TRITON = [("causal-gqa", torch.bfloat16), ("causal-unequal-lengths", torch.float32),
          ("window-softcap", torch.float16), ("window-not-causal", torch.bfloat16), ("tied", torch.bfloat16),
          ("huge-logits", torch.bfloat16)]


@on_backends(ALL, TRITON + [("paper", torch.bfloat16)])
def test_varlen_is_attention_on_each_sequence_bit_for_bit(backend, name, dtype):
    q, k, v, do, lens_q, lens_k, kw = _case(name, dtype)
    out, grads, st = run_varlen(q, k, v, do, lens_q, lens_k, backend, **kw)
    out1, grads1, st1 = run_per_sequence(q, k, v, do, lens_q, lens_k, backend, **kw)
    assert torch.equal(out, out1), "out"
    for what, a, b in zip(("dq", "dk", "dv"), grads, grads1, strict=True):
        assert torch.equal(a, b), what
    (rows,) = st.calls_rows
    for f in FIELDS:  # [1, Hq, total_q]: the per-sequence rows side by side
        assert torch.equal(getattr(rows, f), torch.cat([getattr(r, f) for r in st1.calls_rows], dim=2)), f
    for f in ("rows", "saturated_rows", "fixed_blocks", "max_logit"):
        assert torch.equal(getattr(st, f), getattr(st1, f)), f
    torch.testing.assert_close(st.sink_mass, st1.sink_mass, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(st.entropy, st1.entropy, rtol=1e-6, atol=1e-7)
    if name == "tied":  # the case exercises the rule: rows saturate and it fires
        assert st.saturated_rows.sum() > 0 and st.fixed_blocks.sum() > 0


def _oracle(q, k, v, do, lens_q, lens_k, kw):
    """fp64 output and gradients, and per output element the first-order effect of the fp32 score
    errors (margins.score_error_output_bound: any summation order of q.k stays within it)."""
    mask_kw = {a: kw[a] for a in ("causal", "scale", "window", "softcap") if a in kw}
    out, grads = torch.zeros(q.shape, dtype=torch.float64), [torch.zeros(t.shape, dtype=torch.float64)
                                                             for t in (q, k, v)]
    bound = torch.zeros(q.shape, dtype=torch.float64)
    scale = kw.get("scale", q.shape[-1] ** -0.5)
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    for b in range(len(lens_q)):
        (qs, qe), (ks, ke) = (cq[b], cq[b + 1]), (ck[b], ck[b + 1])
        leaves = [t[s:e].double().transpose(0, 1)[None].requires_grad_()
                  for t, s, e in ((q, qs, qe), (k, ks, ke), (v, ks, ke))]
        o = naive.attention(*leaves, **mask_kw)
        o.backward(do[qs:qe].double().transpose(0, 1)[None])
        out[qs:qe] = o.detach()[0].transpose(0, 1)
        for g, leaf, (s, e) in zip(grads, leaves, ((qs, qe), (ks, ke), (ks, ke)), strict=True):
            g[s:e] = leaf.grad[0].transpose(0, 1)
        qb, kb, vb = (t.detach() for t in leaves)
        p = _probabilities(qb, kb, scale, mask_kw)
        bound[qs:qe] = score_error_output_bound(qb, kb, vb, p, o.detach(), scale)[0].transpose(0, 1)
    return out, grads, bound


def _probabilities(q, k, scale, mask_kw):
    """The oracle's attention weights ``[1, Hq, Nq, Nk]`` (fp64) of one sequence."""
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ kk.transpose(-1, -2) * scale
    if mask_kw.get("softcap") is not None:
        s = mask_kw["softcap"] * torch.tanh(s / mask_kw["softcap"])
    vis = naive.visibility(q.shape[2], k.shape[2], causal=mask_kw.get("causal", False), window=mask_kw.get("window"))
    return naive.probabilities(s.masked_fill(~vis, float("-inf")))


@on_backends([(n, dt) for n, dt in ALL if n not in ("paper", "off")], TRITON)
def test_varlen_matches_the_fp64_oracle(backend, name, dtype):
    q, k, v, do, lens_q, lens_k, kw = _case(name, dtype)
    out, grads, _ = run_varlen(q, k, v, do, lens_q, lens_k, backend, **kw)
    o64, g64, score_err = _oracle(q, k, v, do, lens_q, lens_k, kw)
    tol = OUT_TOL[dtype]
    # the tolerance of the dtype, plus what the fp32 scores' summation order alone may move (large
    # logits: fp32's ~1e-6 is below that on some CPUs)
    err = (out.double() - o64).abs()
    allowed = tol + tol * o64.abs() + score_err
    assert (err <= allowed).all(), f"max excess {(err - allowed).max():.3g} (err {err.max():.3g})"
    for what, a, x in zip(("dq", "dk", "dv"), grads, g64, strict=True):
        assert rel_max(a, x) <= GRAD_TOL[dtype], (what, rel_max(a, x))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sequences_without_queries_or_keys(backend):
    """Zero-length sequences are allowed (as in FlashAttention): queries without keys output zeros and get
    zero gradients, keys without queries get zero gradients; the others are attention() on their own."""
    lens_q, lens_k = [3, 0, 5, 2, 4], [4, 6, 0, 3, 4]
    q, k, v, do = packed_inputs(lens_q, lens_k, 2, 1, 16, torch.float32, seed=8)
    out, (dq, dk, dv), st = run_varlen(q, k, v, do, lens_q, lens_k, backend, causal=True)
    assert (out[3:8] == 0).all() and (dq[3:8] == 0).all()  # sequence 2: 5 queries, no key
    assert (dk[4:10] == 0).all() and (dv[4:10] == 0).all()  # sequence 1: 6 keys, no query
    rows = st.calls_rows[0]
    assert (rows.max_logit[..., 3:8] == -torch.inf).all() and not rows.saturated[..., 3:8].any()
    assert st.rows.tolist() == [sum(lens_q) - 5] * 2
    keep_q = [i for i in range(sum(lens_q)) if not 3 <= i < 8]
    keep_k = [j for j in range(sum(lens_k)) if not 4 <= j < 10]
    sub_q, sub_k = [3, 2, 4], [4, 3, 4]
    out1, (dq1, dk1, dv1), _ = run_per_sequence(q[keep_q], k[keep_k], v[keep_k], do[keep_q], sub_q, sub_k,
                                                backend, causal=True)
    assert torch.equal(out[keep_q], out1) and torch.equal(dq[keep_q], dq1)
    assert torch.equal(dk[keep_k], dk1) and torch.equal(dv[keep_k], dv1)


def test_dropout_draws_each_sequences_mask_with_seed_plus_b(monkeypatch):
    lens = random_lengths(4, 40, seed=9)
    q, k, v, do = packed_inputs(lens, lens, 2, 2, 16, torch.bfloat16, seed=9)
    seed = 2**40 + 77
    monkeypatch.setattr(sys.modules["stable_attn.varlen"], "draw_seed",
                        lambda p: torch.tensor(seed, dtype=torch.int64) if p > 0 else None)
    out, grads, _ = run_varlen(q, k, v, do, lens, lens, causal=True, dropout_p=0.3, block_n=16)
    c = cu(lens).tolist()
    for b in range(len(lens)):
        s, e = c[b], c[b + 1]
        opts = Options(causal=True, scale=0.25, dropout_p=0.3, seed=seed + b, block_n=16)
        qb, kb, vb, dob = (t[s:e].transpose(0, 1)[None] for t in (q, k, v, do))
        o, lse, _ = reference.attention_forward(qb, kb, vb, None, None, opts)
        assert torch.equal(out[s:e], o[0].transpose(0, 1)), b
        for g, want in zip(grads, reference.attention_backward(dob, qb, kb, vb, o, lse, None, None, opts),
                           strict=True):
            assert torch.equal(g[s:e], want[0].transpose(0, 1)), b
    no_drop, _, _ = run_varlen(q, k, v, do, lens, lens, causal=True, block_n=16)
    assert not torch.equal(out, no_drop)


def test_reference_varlen_returns_what_the_triton_launchers_return():
    """C2's shapes: lse [Hq, total_q] (base 2, +inf for rows without keys), statistics [1, Hq, total_q]."""
    lens_q, lens_k = [2, 7, 0], [3, 0, 4]
    q, k, v, _ = packed_inputs(lens_q, lens_k, 4, 2, 8, torch.float16, seed=10)
    out, lse, rs = reference_varlen.forward_varlen(q, k, v, cu(lens_q), cu(lens_k), 7, 4, Options(scale=0.3),
                                                   STATS_ENTROPY)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (4, 9) and lse.dtype == torch.float32
    assert (lse[:, 2:] == torch.inf).all() and torch.isfinite(lse[:, :2]).all()
    for f in FIELDS:
        assert getattr(rs, f).shape == (1, 4, 9), f
    _, lse1, _ = reference.attention_forward(q[:2].transpose(0, 1)[None], k[:3].transpose(0, 1)[None],
                                             v[:3].transpose(0, 1)[None], None, None, Options(scale=0.3))
    assert torch.equal(lse[:, :2], lse1[0])


def test_torch_compile_has_no_graph_break_and_matches_eager():
    torch._dynamo.reset()
    st = stable_attn.AttentionStats()

    def call(q, k, v, cu_q, max_q, p=0.0):
        return stable_attn.attention_varlen(q, k, v, cu_q, cu_q, max_q, max_q, causal=True, stats=st, block_n=16,
                                            dropout_p=p)

    fn = torch.compile(call, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    packings = [random_lengths(3, 30, seed=11), random_lengths(5, 20, seed=12), random_lengths(4, 25, seed=14)]
    for i, lens in enumerate(packings):
        # the second packing made the lengths dynamic: a third one must not recompile (config.patch, not
        # monkeypatch, which would hide the config entry from later tests)
        with torch._dynamo.config.patch(error_on_recompile=i == 2):
            _compiled_matches_eager(fn, call, lens, seed=i)
    assert int(st.calls) == 9


def _compiled_matches_eager(fn, call, lens, seed):
    q, k, v, do = packed_inputs(lens, lens, 4, 2, 16, torch.float32, seed=seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fn(*leaves, cu(lens), max(lens)).backward(do)
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    call(*eager, cu(lens), max(lens)).backward(do)
    for a, b in zip(leaves, eager, strict=True):
        assert torch.equal(a.grad, b.grad)
    fn(q, k, v, cu(lens), max(lens), 0.2)  # dropout: the seed is drawn inside the graph


def _inputs():
    lens = [3, 1, 6]
    q, k, v, _ = packed_inputs(lens, lens, 4, 2, 16, torch.float32, seed=0)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu(lens), cu_seqlens_k=cu(lens), max_seqlen_q=6, max_seqlen_k=6)


BAD = [
    ("q must have rank 3 [total, H, D]", lambda a: dict(q=a["q"][None]), ValueError),
    ("batched [B, H, N, D] inputs go to stable_attn.attention", lambda a: dict(q=a["q"][None]), ValueError),
    ("Hq=4 must be a multiple of k/v heads Hkv=3", lambda a: dict(k=torch.randn(10, 3, 16), v=torch.randn(10, 3, 16)),
     ValueError),
    ("k head dim 8", lambda a: dict(k=a["k"][..., :8], v=a["v"][..., :8]), ValueError),
    ("cu_seqlens_q must be an int32 tensor", lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"].long()), ValueError),
    ("cu_seqlens_k must be an int32 tensor", lambda a: dict(cu_seqlens_k=a["cu_seqlens_k"][None]), ValueError),
    ("cu_seqlens_q must be an int32 tensor [batch + 1], got list", lambda a: dict(cu_seqlens_q=[0, 3, 4, 10]),
     TypeError),
    ("cu_seqlens_q is on meta", lambda a: dict(cu_seqlens_q=a["cu_seqlens_q"].to("meta")), ValueError),
    ("the same number of sequences", lambda a: dict(cu_seqlens_k=cu([4, 6])), ValueError),
    ("cu_seqlens_q must start at 0, got [1, 4, 5, 10]",
     lambda a: dict(cu_seqlens_q=torch.tensor([1, 4, 5, 10], dtype=torch.int32)), ValueError),
    ("cu_seqlens_k must end at the number of packed tokens 10, got [0, 3, 4, 9]",
     lambda a: dict(cu_seqlens_k=torch.tensor([0, 3, 4, 9], dtype=torch.int32)), ValueError),
    ("cu_seqlens_q must be non-decreasing",
     lambda a: dict(cu_seqlens_q=torch.tensor([0, 5, 4, 10], dtype=torch.int32)), ValueError),
    ("max_seqlen_k=5 is smaller than the longest sequence (6 tokens)", lambda a: dict(max_seqlen_k=5), ValueError),
    ("max_seqlen_q=6.0 must be a positive int", lambda a: dict(max_seqlen_q=6.0), ValueError),
    ("max_seqlen_q=True must be a positive int", lambda a: dict(max_seqlen_q=True), ValueError),
    ("stabilize='yes'", lambda a: dict(stabilize="yes"), ValueError),
    ("window=0", lambda a: dict(window=0), ValueError),
    ("stats must be an AttentionStats", lambda a: dict(stats={}), TypeError),
]


@pytest.mark.parametrize("needle,change,exc", BAD, ids=[b[0][:40] for b in BAD])
def test_bad_input_names_the_argument(needle, change, exc):
    args = _inputs()
    args.update(change(args))
    pos = [args.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
    with pytest.raises(exc) as info:
        stable_attn.attention_varlen(*pos, **args)
    assert needle in str(info.value), str(info.value)


def test_strided_views_give_the_same_bits():
    """q/k/v as transformers hands them over ([B, H, N, D] viewed as [B*N, H, D]) or any unit-last-stride view."""
    lens = random_lengths(4, 20, seed=13)
    total = sum(lens)
    g = torch.Generator().manual_seed(13)
    q4, k4, v4 = torch.randn(1, 4, total, 16, generator=g), torch.randn(1, 2, total, 16, generator=g), \
        torch.randn(1, 2, total, 16, generator=g)
    views = [t.transpose(1, 2).reshape(-1, t.shape[1], 16) for t in (q4, k4, v4)]
    assert views[0].stride() == (16, total * 16, 1)  # a view, not a copy
    do = torch.randn(total, 4, 16, generator=g)
    got = run_varlen(*views, do, lens, lens, causal=True)
    want = run_varlen(*(t.contiguous() for t in views), do, lens, lens, causal=True)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)


class HostReads:
    """Counts the op's device-to-host reads of cu_seqlens (varlen._host_values)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        real = varlen._host_values

        def counted(t):
            self.count += 1
            return real(t)

        monkeypatch.setattr(varlen, "_host_values", counted)


def _layers(n, cu_q, cu_k, lens, dtype=torch.float32):
    """``n`` attention layers on one packing, forward and backward, like a model's layers in one step."""
    q, k, v, do = packed_inputs(lens, lens, 2, 1, 16, dtype, seed=16)
    x = q.clone().requires_grad_()
    h = x
    for _ in range(n):
        h = stable_attn.attention_varlen(h, k, v, cu_q, cu_k, max(lens), max(lens), causal=True, block_n=16)
    h.backward(do)
    return h.detach(), x.grad


def test_one_host_read_per_cu_seqlens_tensor_not_per_call(monkeypatch):
    lens = [3, 1, 6]
    reads = HostReads(monkeypatch)
    shared = cu(lens)
    out, grad = _layers(4, shared, shared, lens)
    assert reads.count == 1  # q's and k's offsets are one tensor: one read for 4 layers, forward and backward
    _layers(4, shared, shared, lens)
    assert reads.count == 1  # the next step with the same, unchanged tensor reads nothing
    _layers(3, cu(lens), cu(lens), lens)
    assert reads.count == 3  # two new tensors: one read each
    reads.count = 0
    out1, grad1 = _layers(4, cu(lens), cu(lens), lens)
    assert torch.equal(out, out1) and torch.equal(grad, grad1)  # remembering changes no result


def test_in_place_change_or_other_lengths_are_checked_again(monkeypatch):
    lens = [3, 1, 6]
    reads = HostReads(monkeypatch)
    c = cu(lens)
    _layers(2, c, c, lens)
    c.add_(0)  # same values, but written: read again
    _layers(2, c, c, lens)
    assert reads.count == 2
    c[1] = 5  # [0, 5, 4, 10]
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing \(sequence lengths >= 0\), got "
                                         r"\[0, 5, 4, 10\]"):
        _layers(1, c, c, lens)
    c[1] = 3
    _layers(1, c, c, lens)
    assert reads.count == 4
    q, k, v, _ = packed_inputs(lens, lens, 2, 1, 16, torch.float32, seed=16)
    with pytest.raises(ValueError, match=r"max_seqlen_k=5 is smaller than the longest sequence \(6 tokens\)"):
        stable_attn.attention_varlen(q, k, v, c, c, 6, 5)  # checked before, against another max_seqlen
    with pytest.raises(ValueError, match="cu_seqlens_q must end at the number of packed tokens 9"):
        stable_attn.attention_varlen(q[:9], k, v, c, c, 6, 6)  # and another token count


def test_a_new_tensor_with_bad_values_still_raises(monkeypatch):
    """A checked tensor that died is forgotten (nothing kept alive); one born at its address is read."""
    lens = [3, 1, 6]
    reads = HostReads(monkeypatch)
    for i in range(4):
        good = cu(lens)
        _layers(1, good, good, lens)
        alive = weakref.ref(good)
        del good
        gc.collect()
        assert alive() is None
        bad = torch.tensor([0, 4, 3, 10], dtype=torch.int32)
        with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing"):
            _layers(1, bad, bad, lens)
        assert reads.count == 2 * (i + 1)
    assert len(varlen._CHECKED) <= varlen._MAX_CHECKED


def test_inference_tensors_are_read_at_every_call(monkeypatch):
    """Inference-mode tensors have no version counter: an in-place change could not be seen."""
    lens = [3, 1, 6]
    reads = HostReads(monkeypatch)
    q, k, v, _ = packed_inputs(lens, lens, 2, 1, 16, torch.float32, seed=16)
    with torch.inference_mode():
        c = cu(lens)
        for _ in range(3):
            stable_attn.attention_varlen(q, k, v, c, c, 6, 6)
    assert reads.count == 3


def test_torch_compile_reads_once_at_run_time_not_while_tracing(monkeypatch):
    torch._dynamo.reset()
    lens = [3, 1, 6]
    reads = HostReads(monkeypatch)
    fn = torch.compile(_layers_forward, fullgraph=True, backend="aot_eager")
    q, k, v, _ = packed_inputs(lens, lens, 2, 1, 16, torch.float32, seed=16)
    c = cu(lens)
    torch.testing.assert_close(fn(q, k, v, c), _layers_forward(q, k, v, c), rtol=0, atol=0)
    assert reads.count == 1  # tracing (fake tensors) read nothing; 3 layers compiled and 3 eager read once
    bad = torch.tensor([0, 4, 3, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        fn(q, k, v, bad)


def _layers_forward(q, k, v, c):
    for _ in range(3):
        q = stable_attn.attention_varlen(q, k, v, c, c, 6, 6, causal=True, block_n=16)
    return q
