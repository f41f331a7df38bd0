"""Learned attention sinks (gpt-oss's ``sinks``): the oracle against transformers' own definition, both ops
against the fp64 oracle (outputs, every gradient, ``d sinks``), the rule's decisions with a sink, the
statistics' conventions, the decode and varlen paths, and the argument checks.

The sink is one more logit per query head that joins every row's softmax denominator and multiplies no
value; the rule sees it as the row's first entry in a key block of its own (docs/ALGORITHM.md, "Learned
sinks"). Every case runs on ``backend="torch"`` and ``backend="triton"`` (the kernels under
``TRITON_INTERPRET=1``, their outputs poisoned first: tests/kernels/conftest.py); on Triton the decisions
(``fixed_blocks``, ``saturated``) must also be the PyTorch path's.
"""

from __future__ import annotations

import math

import pytest
import torch
from closeness import close
from margins import on_grid

import stable_attn
from stable_attn import rules
from stable_attn.kernels import naive, reference, reference_decode, triton_decode
from stable_attn.options import Options
from stable_attn.stats import RowStats


class Rows(stable_attn.AttentionStats):
    last: RowStats

    def update(self, rows: RowStats) -> None:
        self.last = RowStats(*(t.detach().clone() for t in rows.tensors()))
        super().update(rows)


def _inputs(B=2, Hq=4, Hkv=2, Nq=13, Nk=29, D=16, Dv=None, dtype=torch.float32, seed=0, logit=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g) * logit
    k = torch.randn(B, Hkv, Nk, D, generator=g)
    v = torch.randn(B, Hkv, Nk, Dv or D, generator=g)
    do = torch.randn(B, Hq, Nq, Dv or D, generator=g)
    sinks = torch.randn(Hq, generator=g) * 2
    return [t.to(dtype) for t in (q, k, v, do)] + [sinks]


BACKENDS = ["torch", "triton"]


def _ours(q, k, v, do, sinks, backend="torch", **kw):
    """The op's output, gradients (q, k, v, sinks) and row statistics; on Triton also: the PyTorch path's
    decisions, and its outputs within a few ulps."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    st = Rows()
    out = stable_attn.attention(*leaves[:3], sinks=leaves[3], stats=st, backend=backend, **kw)
    out.backward(do)
    result = out.detach(), [t.grad for t in leaves], st.last
    if backend == "triton":
        ref = _ours(q, k, v, do, sinks, "torch", **kw)
        assert torch.equal(result[2].fixed_blocks, ref[2].fixed_blocks)
        assert torch.equal(result[2].saturated, ref[2].saturated)
        close(result[0], ref[0], 2, q.dtype, "out against the PyTorch path")
    return result


def _exact(q, k, v, do, sinks, **kw):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    kw = {a: kw[a] for a in ("causal", "scale", "key_padding_mask", "window", "softcap") if a in kw}
    out = naive.attention(*leaves[:3], sinks=leaves[3], **kw)
    out.backward(do.double())
    return out.detach(), [t.grad for t in leaves]


def test_the_oracle_is_gpt_oss_eager_definition():
    """naive.attention with sinks equals transformers' gpt-oss eager attention (GQA, an additive causal mask)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v, _, sinks = (t.double() for t in _inputs(Nq=11, Nk=11))
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sinks, 2, False
    causal = torch.full((11, 11), -math.inf, dtype=torch.float64).triu(1)
    want, _ = eager_attention_forward(module, q, k, v, causal[None, None], scaling=0.25)
    got = naive.attention(q, k, v, causal=True, scale=0.25, sinks=sinks)
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-12, atol=1e-12)
    # and the weights plus the sink's share sum to one
    s = naive.scores(q, k, causal=True, scale=0.25)[0]
    total = naive.probabilities(s, sinks).sum(-1) + naive.sink_probabilities(s, sinks)
    torch.testing.assert_close(total, torch.ones_like(total), rtol=1e-12, atol=1e-12)


KWS = {"causal": dict(causal=True), "window": dict(window=5), "softcap": dict(causal=True, softcap=2.0)}
# the interpreter is ~100x slower than the PyTorch path: Triton runs bf16 (the rounding point that matters)
CASES = [("torch", dt, name) for dt in (torch.float32, torch.bfloat16, torch.float16) for name in KWS] + [
    ("triton", torch.bfloat16, name) for name in KWS]


@pytest.mark.parametrize("backend, dtype, name", CASES, ids=[f"{b}-{str(d)[6:]}-{n}" for b, d, n in CASES])
def test_forward_and_every_gradient_match_the_oracle(backend, dtype, name):
    """Odd lengths, GQA, bottom-right causal with Nq < Nk, a padded batch element: out, dq, dk, dv, d sinks."""
    q, k, v, do, sinks = _inputs(dtype=dtype)
    kpm = torch.ones(2, 29, dtype=torch.bool)
    kpm[1, :9] = False
    kw = dict(KWS[name], key_padding_mask=kpm, block_n=16)
    out, grads, _ = _ours(q, k, v, do, sinks, backend, **kw)
    want, want_grads = _exact(q, k, v, do, sinks, **kw)
    ulps = 2 if dtype == torch.float32 else 4
    close(out, want, ulps, dtype, "out")
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads, strict=True):
        close(a, b, 16 * ulps, dtype, name, floor=1e-5)
    assert grads[3].dtype == sinks.dtype and grads[3].abs().max() > 1e-3  # the sinks really learn


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_keys_output_zero_and_give_their_sink_nothing(backend):
    """A padded-out batch element and causal rows before their first key: zeros, zero gradients (as without a
    sink), and d sinks from the other rows only."""
    q, k, v, do, sinks = _inputs(Nq=20, Nk=12)
    kpm = torch.ones(2, 12, dtype=torch.bool)
    kpm[1] = False
    out, grads, rows = _ours(q, k, v, do, sinks, backend, causal=True, key_padding_mask=kpm, block_n=16)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[0, :, :8], torch.zeros_like(out[0, :, :8]))
    assert torch.equal(grads[0][1], torch.zeros_like(grads[0][1]))
    want, want_grads = _exact(q[:1, :, 8:], k[:1], v[:1], do[:1, :, 8:], sinks, causal=True)
    torch.testing.assert_close(out[0, :, 8:].double(), want[0], rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(grads[3].double(), want_grads[3], rtol=1e-5, atol=2e-6)
    assert torch.equal(rows.max_logit[1], torch.full_like(rows.max_logit[1], -math.inf))
    assert not rows.saturated[1].any() and torch.equal(rows.entropy[1], torch.zeros_like(rows.entropy[1]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_huge_logits_and_huge_sinks_stay_finite(sign, backend):
    """Scores of hundreds of nats and sinks of +-1e4: the offset follows the true max (the sink's when larger), so
    nothing overflows; the oracle's answer within fp32 rounding of huge products."""
    q, k, v, do, _ = _inputs(D=8, logit=60.0)
    for sinks in (torch.full((4,), sign * 1e4), torch.tensor([1e4, -1e4, 0.0, 30.0])):
        out, grads, _ = _ours(q, k, v, do, sinks, backend, causal=True, scale=1.0, block_n=16)
        want, want_grads = _exact(q, k, v, do, sinks, causal=True, scale=1.0)
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
        torch.testing.assert_close(out.double(), want, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(grads[3].double(), want_grads[3], rtol=1e-3, atol=1e-3)


def _tie_inputs(sink: float, dtype=torch.bfloat16):
    """One row per head, 32 keys in two blocks of 16: keys 3 and 5 tie at the max score 2 (others -4); exact on
    a dyadic grid. Head h has sink ``sink`` (base-e units)."""
    q = torch.zeros(1, 2, 1, 16)
    q[..., 0] = 1.0
    k = torch.zeros(1, 2, 32, 16)
    k[..., 0] = -4.0
    k[:, :, [3, 5], 0] = 2.0
    v = on_grid(torch.randn(1, 2, 32, 16, generator=torch.Generator().manual_seed(3)))
    return [t.to(dtype) for t in (q, k, v)], torch.full((2,), sink)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sink, fires", [(-30.0, True), (1.0, True), (2.0, True), (2.5, False), (40.0, False)])
def test_the_rule_sees_the_sink_as_a_key_of_its_own_block(sink, fires, backend):
    """Two keys tie at the max (2): they fire while their P-bar against the running offset rounds to 1.0, i.e.
    while the sink (the row's first key, in its own block) is not above them by more than the tie tolerance;
    a sink equal to them is one more key at the max, but in another block, and the tied pair still fires."""
    (q, k, v), sinks = _tie_inputs(sink)
    st = Rows()
    stable_attn.attention(q, k, v, sinks=sinks, scale=1.0, block_n=16, stats=st, backend=backend)
    assert st.last.fixed_blocks.eq(1 if fires else 0).all(), st.last.fixed_blocks
    # saturation: two keys within the tolerance of the row max, the sink counting in that max
    assert st.last.saturated.all() == fires


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_key_tied_with_the_sink_alone_does_not_fire(backend):
    """One key at the sink's value: two entries of the row at the max, but in two blocks (the sink's and the
    key's), so no block holds two P-bar = 1.0 and nothing multiplies V twice at 1.0: no fire, no saturation."""
    (q, k, v), sinks = _tie_inputs(2.0)
    k[:, :, 5, 0] = -4.0
    st = Rows()
    stable_attn.attention(q, k, v, sinks=sinks, scale=1.0, block_n=16, stats=st, backend=backend)
    assert st.last.fixed_blocks.eq(0).all() and not st.last.saturated.any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_minus_inf_sink_is_no_sink_bit_for_bit(backend):
    q, k, v, do, _ = _inputs(dtype=torch.bfloat16)
    none = stable_attn.attention(q, k, v, causal=True, block_n=16, backend=backend)
    minus_inf = stable_attn.attention(q, k, v, causal=True, block_n=16, sinks=torch.full((4,), -math.inf),
                                      backend=backend)
    assert torch.equal(none, minus_inf)


@pytest.mark.parametrize("backend", BACKENDS)
def test_statistics_conventions(backend):
    """max_logit is the keys' (not the sink's); sink_mass is key 0's probability with the sink in the
    denominator; entropy counts the sink as one more outcome (docs/ALGORITHM.md, "Learned sinks")."""
    q, k, v, do, sinks = _inputs()
    sinks = sinks + 3.0
    _, _, rows = _ours(q, k, v, do, sinks, backend, causal=True, block_n=16)
    s = torch.stack(naive.scores(q, k, causal=True))  # [B, Hq, Nq, Nk], masked -inf
    torch.testing.assert_close(rows.max_logit.double(), s.amax(-1), rtol=1e-6, atol=1e-6)
    p = torch.stack([naive.probabilities(x, sinks) for x in s])
    torch.testing.assert_close(rows.sink_mass.double(), p[..., 0], rtol=1e-5, atol=1e-7)
    want = naive.entropy(q, k, causal=True, sinks=sinks)
    torch.testing.assert_close(rows.entropy.double(), want, rtol=1e-5, atol=2e-5)
    assert (want - naive.entropy(q, k, causal=True)).abs().max() > 0.1  # so the sink's outcome really counts


def test_decode_counts_the_sink_once():
    """The decode path (split keys): the sink joins the first split only, so several splits give the oracle."""
    q, k, v, _, sinks = _inputs(Nq=3, Nk=70)
    opts = Options.create(head_dim=16, causal=True, block_n=16)
    want = naive.attention(q, k, v, causal=True, sinks=sinks)
    for split in (16, 32, 80):
        out, lse, _ = reference_decode.attention_forward(q, k, v, None, opts, split=split, sinks=sinks)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-6)
        # the decode kernel: the same splits, the same partials' offsets (the decisions), the same output
        t_out, t_lse, _ = triton_decode.forward(q, k, v, None, opts, split=split, sinks=sinks)
        torch.testing.assert_close(t_out, out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(t_lse, lse, rtol=1e-6, atol=1e-6)
    for backend in BACKENDS:
        with torch.no_grad():  # the public op takes the decode path here
            out = stable_attn.attention(q, k, v, causal=True, block_n=16, sinks=sinks, backend=backend)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_is_each_sequence_alone(backend):
    """attention_varlen with sinks: out, dq, dk, dv bit for bit the dense op on each sequence; d sinks the sum."""
    g = torch.Generator().manual_seed(4)
    lens = [5, 0, 12, 13]
    cu = torch.tensor([0, 5, 5, 17, 30], dtype=torch.int32)
    q, k = torch.randn(30, 4, 24, generator=g), torch.randn(30, 2, 24, generator=g)
    v, do = torch.randn(30, 2, 24, generator=g), torch.randn(30, 4, 24, generator=g)
    sinks = torch.randn(4, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = stable_attn.attention_varlen(*leaves[:3], cu, cu, 13, 13, causal=True, sinks=leaves[3], block_n=16,
                                       backend=backend)
    out.backward(do)
    dsinks = torch.zeros(4, dtype=torch.float64)
    for s, n in zip(cu[:-1].tolist(), lens):
        if n == 0:
            continue
        dense = [t[s:s + n].transpose(0, 1)[None] for t in (q, k, v, do)]
        o, grads, _ = _ours(*dense, sinks, backend, causal=True, block_n=16)
        assert torch.equal(out[s:s + n].detach(), o[0].transpose(0, 1))
        for packed, one in zip(leaves[:3], grads[:3]):
            assert torch.equal(packed.grad[s:s + n], one[0].transpose(0, 1))
        dsinks += grads[3].double()
    torch.testing.assert_close(leaves[3].grad.double(), dsinks, rtol=1e-5, atol=1e-6)


def test_sink_gradient_formula():
    """reference.sink_gradient against autograd of the oracle on a tiny case (d sinks = -sum P_sink delta)."""
    q, k, v, do, sinks = _inputs(B=1, Nq=5, Nk=5)
    want = _exact(q, k, v, do, sinks, causal=True)[1][3]
    out, lse2, _ = reference.attention_forward(q, k, v, None, None, Options.create(head_dim=16, causal=True), False,
                                               sinks)
    got = reference.sink_gradient(sinks, lse2, reference.row_delta(do, out))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert rules.LOG2E > 1  # base-2 units inside: lse2 and the sink's logit share them


BAD_SINKS = [
    (torch.zeros(3), ValueError, r"sinks must have shape \[Hq\] = \(4,\).*got \(3,\)"),
    (torch.zeros(4, dtype=torch.int64), TypeError, r"sinks.dtype=torch.int64 is not supported"),
    (torch.zeros(4, device="meta"), ValueError, r"sinks is on meta, q on cpu"),
    ([0.0] * 4, TypeError, r"sinks must be a tensor \[Hq\].*got list"),
]


@pytest.mark.parametrize("sinks, error, words", BAD_SINKS, ids=["shape", "dtype", "device", "list"])
def test_bad_sinks_name_the_argument(sinks, error, words):
    q, k, v, _, _ = _inputs()
    with pytest.raises(error, match=words):
        stable_attn.attention(q, k, v, sinks=sinks)
    with pytest.raises(error, match=words):
        stable_attn.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                     torch.tensor([0, 13], dtype=torch.int32), torch.tensor([0, 29], dtype=torch.int32),
                                     13, 29, sinks=sinks)


def test_compiled_op_with_sinks_and_a_value_head_dim():
    """torch.compile(fullgraph=True) keeps the op whole (its fake implementation: output [..., Dv], d sinks shaped
    like sinks): the compiled forward and every gradient equal the eager call's bits, dense and packed."""
    q, k, _, _, sinks = _inputs(Nq=9, Nk=9)
    v = torch.randn(2, 2, 9, 8, generator=torch.Generator().manual_seed(9))
    do = torch.randn(2, 4, 9, 8, generator=torch.Generator().manual_seed(10))

    def dense(q, k, v, s):
        return stable_attn.attention(q, k, v, causal=True, sinks=s, block_n=16)

    def packed(q, k, v, s):
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        flat = [t[0].transpose(0, 1) for t in (q, k, v)]
        return stable_attn.attention_varlen(*flat, cu, cu, 5, 5, causal=True, sinks=s, block_n=16)

    for fn, grad_out in ((dense, do), (packed, do[0].transpose(0, 1))):
        results = []
        for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
            leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
            out = f(*leaves)
            out.backward(grad_out)
            results.append((out.detach(), *(t.grad for t in leaves)))
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b)
        assert results[0][0].shape[-1] == 8 and results[0][4].shape == (4,)
