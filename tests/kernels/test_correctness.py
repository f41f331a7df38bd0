"""One correctness suite for both backends: every case runs on the PyTorch path and on the Triton kernels.

``backend="triton"`` runs the kernels on the CPU under ``TRITON_INTERPRET=1`` (set by tests/conftest.py),
or on the GPU with ``STABLE_ATTN_TEST_DEVICE=cuda``. Each case calls the public op and compares it with
the fp64 oracle (:mod:`stable_attn.kernels.naive`) and with what the case itself determines (which rows
saturate, which blocks fire). On the Triton backend the same call also runs on the PyTorch path, and
the two must take the same decision in every (row, key block) whose margin no summation order of
``q.k`` can overturn (every row on the tie inputs, which are exact in fp32: tests/kernels/margins.py)
and agree within a few ulps: the kernels follow the reference's partition and decisions exactly. What
only one backend has (tiling, launch configurations, ``lse``, arbitrary masks, memory bounds) is tested
in ``test_triton_attention.py`` and ``test_reference.py``.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from closeness import FLOOR, close, no_worse_than_reference, rel_max, rel_rms
from margins import on_grid, robust_rows, scores_exact_in_fp32

import stable_attn
from stable_attn import rules
from stable_attn.kernels import naive
from stable_attn.numerics import arithmetic
from stable_attn.stats import RowStats

DEVICE = os.environ.get("STABLE_ATTN_TEST_DEVICE", "cpu")
BACKENDS = ["torch", "triton"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
MASK_ARGS = ("causal", "scale", "key_padding_mask", "attn_mask", "window", "softcap")


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def on_backends(names, torch_cases, triton_cases=None):
    """Parametrize ``backend`` and ``names``: every case on torch, ``triton_cases`` (default: all) on Triton.

    The interpreter is ~100x slower than the PyTorch path: where a case repeats a variant already
    covered, Triton runs a subset (its tiling is covered by test_triton_attention.py).
    """
    triton_cases = torch_cases if triton_cases is None else triton_cases
    rows = [("torch", *c) for c in torch_cases] + [("triton", *c) for c in triton_cases]
    return pytest.mark.parametrize(("backend", *names), rows,
                                   ids=["-".join(str(x).replace("torch.", "") for x in r) for r in rows])


class RowCapture(stable_attn.AttentionStats):
    """AttentionStats that also keeps the per-row statistics of the last call."""

    last: RowStats

    def update(self, rows: RowStats) -> None:
        self.last = RowStats(*(t.detach().cpu() for t in rows.tensors()))
        super().update(rows)


@dataclass
class Result:
    out: torch.Tensor
    grads: tuple[torch.Tensor, ...] | None
    stats: RowCapture

    @property
    def rows(self) -> RowStats:
        return self.stats.last


def attend(backend, q, k, v, do=None, **kw) -> Result:
    """``stable_attn.attention`` on ``backend`` (forward, and backward when ``do`` is given)."""
    leaves = [t.detach().to(DEVICE).requires_grad_(do is not None) for t in (q, k, v)]
    if kw.get("key_padding_mask") is not None:
        kw["key_padding_mask"] = kw["key_padding_mask"].to(DEVICE)
    st = RowCapture()
    out = stable_attn.attention(*leaves, stats=st, backend=backend, **kw)
    grads = None
    if do is not None:
        out.backward(do.to(DEVICE))
        grads = tuple(t.grad.cpu() for t in leaves)
    return Result(out.detach().cpu(), grads, st)


def oracle(q, k, v, do=None, **kw):
    """The fp64 output (and gradients for ``do``) of the same problem; op-only options are ignored."""
    leaves = [t.detach().double().cpu().requires_grad_(do is not None) for t in (q, k, v)]
    mask_kw = {a: kw[a] for a in MASK_ARGS if kw.get(a) is not None}
    if "key_padding_mask" in mask_kw:
        mask_kw["key_padding_mask"] = mask_kw["key_padding_mask"].cpu()
    o = naive.attention(*leaves, **mask_kw)
    if do is None:
        return o.detach(), None
    o.backward(do.double().cpu())
    return o.detach(), tuple(t.grad for t in leaves)


def run(backend, q, k, v, do=None, exact=None, grad_ulps=4, grad_floor=1e-6, **kw) -> Result:
    """The op on ``backend``; on Triton also: the same decisions and results as the PyTorch path.

    Outputs within 2 ulps, gradients within ``grad_ulps`` ulps (+ ``grad_floor``) of the reference's.
    ``exact`` (the oracle's output and gradients), when given, bounds the kernel's error by the
    reference's: at most 1.5x, plus two ulps.
    """
    res = attend(backend, q, k, v, do, **kw)
    if backend == "triton":
        ref = attend("torch", q, k, v, do, **kw)
        dtype = q.dtype
        close(res.out, ref.out, 2, dtype, "out")
        names = ("dq", "dk", "dv")
        if do is not None:
            for name, a, b in zip(names, res.grads, ref.grads, strict=True):
                close(a, b, grad_ulps, dtype, name, floor=grad_floor)
        # decisions: bit-identical wherever no fp32 summation order can flip them (margins.py); on scores
        # exact in fp32 (every tie case) that is every row
        keep = robust_rows(q, k, **kw)
        assert keep.float().mean() >= 0.9, f"only {keep.float().mean():.3f} of the rows have safe margins"
        assert torch.equal(res.rows.saturated[keep], ref.rows.saturated[keep]), "saturated differs"
        assert torch.equal(res.rows.fixed_blocks[keep], ref.rows.fixed_blocks[keep]), "fixed_blocks differs"
        torch.testing.assert_close(res.rows.max_logit, ref.rows.max_logit, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res.rows.sink_mass, ref.rows.sink_mass, rtol=1e-4, atol=1e-6)
        # the same sum of the same terms in another order (rows whose decisions agree: the same offsets).
        # Not where the published rule's offset (beta m, or 0 for m < 0) sends P-bar below fp32's normal
        # range (|m| from about 60 nats: e^-87 is the smallest normal): subnormals carry a few bits, and
        # that output is wrong anyway (test_paper_mode_is_the_published_rule)
        keep_e = keep
        if kw.get("stabilize") == "paper":
            keep_e = keep & (ref.rows.max_logit.abs() * max(kw.get("beta", 2.0) - 1.0, 1.0) < 60.0)
        diff = (res.rows.entropy[keep_e].double() - ref.rows.entropy[keep_e].double()).abs()
        bound = entropy_tolerance(q, k, ref.rows, **kw)[keep_e]
        assert (diff <= bound).all(), f"entropy: backends differ by {diff.max():.3g} (bound {bound.min():.3g})"
        if exact is not None:
            o64, g64 = exact
            no_worse_than_reference(res.out, ref.out, o64, dtype, "out")
            if do is not None:
                for name, a, b, x in zip(names, res.grads, ref.grads, g64, strict=True):
                    no_worse_than_reference(a, b, x, dtype, name)
    return res


# ------------------------------------------------------------------------------------------- entropy


def entropy_tolerance(q, k, rows: RowStats, **kw) -> torch.Tensor:
    """Per row, how far a computed entropy (nats) may lie from the fp64 oracle's, or from another fp32
    summation order's. The statistic is the entropy of the fp32 ``P-bar`` over its own fp32 sum (not of the
    rounded weights), so no 16-bit rounding enters:

    - the scores' summation-order error ``E <= 2 gamma_D sum_d |q_d k_d| * scale`` (margins.py):
      ``|dH| <= sum_j |dH/ds_j| E = sum_j p_j |ln p_j + H| E <= 2 H E``;
    - the fp32 running sums: about ``Nk`` roundings of terms of size ``(H + shift + ln Nk)``, the shift
      being the stabilization's (at most ``MAX_SHIFT``, paper mode ``|m|``).
    """
    scale = kw.get("scale") or 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    qa = q.detach().double().cpu().abs()
    ka = k.detach().double().cpu().abs().repeat_interleave(group, dim=1)
    d = q.shape[-1]
    gamma = d * 2.0**-24 / (1 - d * 2.0**-24)
    err = 2 * gamma * torch.matmul(qa, ka.transpose(-1, -2)).amax(-1) * scale
    h = rows.entropy.double().abs()
    nk = k.shape[2]
    shift = max(rules.MAX_SHIFT.values()) + rows.max_logit.double().abs().nan_to_num(0.0, 0.0, 0.0)
    fp32_sums = (nk * 2.0**-24 + 2.0**-20) * (2 + h + shift + math.log(nk))
    return 2 * h * err + 2 * fp32_sums + 1e-6


def assert_entropy_matches_oracle(res: Result, q, k, **kw) -> None:
    """The rows' entropies against the fp64 oracle's (0 where a row sees no key), and AttentionStats.entropy
    against the oracle's mean over the rows that see a key."""
    mask_kw = {a: kw[a] for a in MASK_ARGS if kw.get(a) is not None}
    want = naive.entropy(q.double(), k.double(), **mask_kw)
    got = res.rows.entropy.double()
    bound = entropy_tolerance(q, k, res.rows, **kw)
    worst = ((got - want).abs() - bound).max()
    assert worst <= 0, f"entropy off the oracle by {worst:.3g} more than the bound"
    seen = torch.isfinite(res.rows.max_logit)
    assert (got[~seen] == 0).all()
    mean = (want * seen).sum(dim=(0, 2)) / seen.sum(dim=(0, 2)).clamp(min=1)
    bound_mean = (bound * seen).sum(dim=(0, 2)) / seen.sum(dim=(0, 2)).clamp(min=1)
    assert ((res.stats.entropy.double().cpu() - mean).abs() <= bound_mean + 1e-6).all()


# Triton: one 16-bit and one fp32 case (every dtype's rounding point is exercised on torch)
@on_backends(("dtype", "nq", "nk", "stabilize"),
             [(dt, 77, 77, True) for dt in DTYPES] + [(torch.bfloat16, 33, 131, False),
                                                      (torch.bfloat16, 33, 131, "paper")],
             [(torch.bfloat16, 77, 77, True), (torch.float32, 33, 131, True)])
def test_entropy_matches_the_oracle_on_random_inputs(backend, dtype, nq, nk, stabilize):
    """Fresh inputs (seed used nowhere else), sharp rows (q x 3), GQA, odd lengths, bottom-right causal."""
    g = torch.Generator().manual_seed(2511 + nq)
    q = (3 * torch.randn(2, 4, nq, 24, generator=g)).to(dtype)
    k, v = (torch.randn(2, 2, nk, 24, generator=g).to(dtype) for _ in range(2))
    kw = dict(causal=True, block_n=32, stabilize=stabilize)
    res = run(backend, q, k, v, **kw)
    assert_entropy_matches_oracle(res, q, k, **kw)
    assert res.rows.entropy.max() > 1.0 and res.rows.entropy[..., -1].min() < 0.9 * math.log(nk)  # not flat


def test_entropy_of_uniform_attention_is_log_of_the_keys_seen(backend):
    """q = 0: every visible key has the same score, so row i (causal, Nq = Nk) has entropy ln(i + 1) exactly;
    all keys tie at the max, so the stabilization fires (ties at 0) and the shift must cancel out."""
    n = 70
    q = torch.zeros(1, 2, n, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, n, 16, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16)
            for s in (1, 2))
    res = run(backend, q, k, v, causal=True, block_n=16)
    want = torch.log(torch.arange(1, n + 1, dtype=torch.float64)).expand(1, 2, n)
    assert (res.rows.fixed_blocks[..., 1:] > 0).all()  # row 0 sees one key: no tie
    torch.testing.assert_close(res.rows.entropy.double(), want, atol=2e-5, rtol=2e-6)
    torch.testing.assert_close(res.stats.entropy.double(), want.mean(-1)[0], atol=2e-5, rtol=2e-6)


# ---------------------------------------------------------------------------------------------- ties


TIED = (5, 9, 17, 30)  # two copies in key block 0 and two in block 1 (blocks of 16)


def tied_inputs(sign: str, dtype, B=1, H=2, N=48, D=32, seed=11):
    """Copies of one key tie exactly at every row's max: about +8 (positive), -4 (negative) or 0 (zero).

    Identical key vectors give bit-identical scores; the other keys score ~N(0, 1.2) below +8, or
    about -12 below the negative and zero ties. Values are mostly negative, the paper's bad case.
    q and k lie on the grid 2^-5 (margins.on_grid): every score is exact in fp32 whatever the
    summation order, so the ties are ties on every CPU and in both backends.
    """
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(D, generator=g)
    u = u / u.norm()
    q = 4 * u + 0.1 * torch.randn(B, H, N, D, generator=g)
    tied = torch.tensor(TIED)
    if sign == "positive":
        k = 0.3 * torch.randn(B, H, N, D, generator=g)
        k[:, :, tied] = 2 * u
    else:
        k = -3 * u + 0.1 * torch.randn(B, H, N, D, generator=g)
        k[:, :, tied] = -u if sign == "negative" else torch.zeros(D)
    q, k = on_grid(q), on_grid(k)
    v = -(torch.rand(B, H, N, D, generator=g) + 2.0)
    do = torch.randn(B, H, N, D, generator=g)
    out = [t.to(dtype) for t in (q, k, v, do)]
    assert scores_exact_in_fp32(out[0], out[1])
    return out


SIGNS = ("positive", "negative", "zero")


# Triton: bf16 (fp16 ties on Triton: CASES of test_triton_attention.py run every mode in fp16)
@on_backends(("sign", "dtype"), [(sg, dt) for sg in SIGNS for dt in (torch.bfloat16, torch.float16)],
             [(sg, torch.bfloat16) for sg in SIGNS])
def test_ties_at_the_max(backend, sign, dtype):
    q, k, v, do = tied_inputs(sign, dtype)
    kw = dict(scale=1.0, block_n=16)
    exact = oracle(q, k, v, do, **kw)
    res = {s: run(backend, q, k, v, do, exact=exact, stabilize=s, **kw) for s in (True, False, "paper")}
    for r in res.values():
        assert r.rows.saturated.all()  # four keys exactly at every row's max
    # ours fires in block 0 whatever the sign; block 1 then already has every P-bar < 1
    assert (res[True].rows.fixed_blocks == 1).all()
    assert (res[False].rows.fixed_blocks == 0).all()
    # the published rule compares with each block's own max (fires in blocks 0 and 1) and skips m == 0
    # (block 2 holds no copy but may hold a near-tie of its own)
    paper = res["paper"].rows.fixed_blocks
    assert (paper <= 1).all() if sign == "zero" else (paper >= 2).all()
    for h in range(q.shape[1]):
        assert torch.equal(paper[0, h], published_rule(q[0, h], k[0, h], v[0, h], **kw)[1])
    on, off = res[True], res[False]
    for r in (on, off):  # four tied keys, the rest far below: ties at the max, with the shift and without
        assert_entropy_matches_oracle(r, q, k, **kw)
    assert torch.isfinite(on.out).all() and all(torch.isfinite(g).all() for g in on.grads)
    e_on, e_off = rel_rms(on.out, exact[0]), rel_rms(off.out, exact[0])
    assert e_on <= 1.25 * e_off + FLOOR, (e_on, e_off)


def huge_inputs(dtype, B=1, H=2, N=42, D=16, seed=5):
    """Rows of three kinds: max +1e4 tied at keys 3, 7, 21 (others 0); max -1e4 tied (others -1.5e4); many ties at 0.

    Only two coordinates of q are non-zero, so the scores are exact products of representable numbers.
    """
    g = torch.Generator().manual_seed(seed)
    tied = [3, 7, 21]
    kind = torch.arange(N) % 3
    q = torch.zeros(B, H, N, D)
    q[..., 0] = torch.where(kind == 0, 100.0, -100.0)
    q[..., 1] = torch.where(kind == 1, -150.0, 0.0)
    k = torch.zeros(B, H, N, D)
    k[..., 2:] = torch.randn(B, H, N, D - 2, generator=g)  # q is 0 there
    k[..., 1] = 100.0
    k[:, :, tied, 0], k[:, :, tied, 1] = 100.0, 0.0
    v = torch.randn(B, H, N, D, generator=g)
    do = torch.randn(B, H, N, D, generator=g)
    return [t.to(dtype) for t in (q, k, v, do)], kind


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_huge_logits_with_ties(backend, dtype):
    """Logits of +-1e4 with ties: our rule stays finite and correct, the published rule underflows."""
    (q, k, v, do), kind = huge_inputs(dtype)
    kw = dict(scale=1.0, block_n=16)
    exact = oracle(q, k, v, do, **kw)
    ours = run(backend, q, k, v, do, exact=exact, **kw)
    assert torch.isfinite(ours.out).all() and all(torch.isfinite(g).all() for g in ours.grads)
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(ours.out.double(), exact[0], atol=tol, rtol=tol)
    assert_entropy_matches_oracle(ours, q, k, **kw)
    paper = run(backend, q, k, v, do, stabilize="paper", **kw)
    # the published rule's offset is 2e4 or 0: every P-bar underflows where the tied max is +-1e4, and
    # its floored row sum (1e-10) makes those rows 0: finite and wrong, where ours is right
    huge = (kind != 2).expand(paper.out.shape[:-1])
    assert torch.isfinite(paper.out).all() and all(torch.isfinite(g).all() for g in paper.grads)
    assert (paper.out[huge] == 0).all() and (exact[0][huge].abs().amax(-1) > 0.1).all()
    torch.testing.assert_close(paper.out[~huge].double(), exact[0][~huge], atol=tol, rtol=tol)  # max 0: as FA2


# ------------------------------------------------------------------------------------ rows without keys


@on_backends(("nq", "nk"), [(1, 37), (5, 130), (64, 200), (40, 17)], [(5, 130), (40, 17)])
def test_causal_bottom_right_for_unequal_lengths(backend, nq, nk):
    g = torch.Generator().manual_seed(nq + nk)
    q = torch.randn(2, 2, nq, 32, generator=g)
    k, v = (torch.randn(2, 2, nk, 32, generator=g) for _ in range(2))
    do = torch.ones(2, 2, nq, 32)
    res = run(backend, q, k, v, do, causal=True)
    torch.testing.assert_close(res.out.double(), oracle(q, k, v, causal=True)[0], atol=2e-6, rtol=1e-5)
    assert_entropy_matches_oracle(res, q, k, causal=True)
    if nq > nk:  # the first nq - nk queries see no key: zeros, and no gradient
        assert (res.out[:, :, : nq - nk] == 0).all()
        assert (res.grads[0][:, :, : nq - nk] == 0).all()
        assert torch.isfinite(res.grads[1]).all() and torch.isfinite(res.grads[2]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_key_padding_with_fully_masked_rows(backend, dtype):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 2, 45, 16, generator=g).to(dtype) for _ in range(3))
    kpm = torch.rand(3, 45, generator=g) > 0.3
    kpm[1] = False  # batch 1 sees no key at all
    do = torch.randn(3, 2, 45, 16, generator=g).to(dtype)
    res = run(backend, q, k, v, do, key_padding_mask=kpm)
    ref = oracle(q, k, v, key_padding_mask=kpm)[0]
    assert torch.isfinite(res.out).all()
    assert (res.out[1] == 0).all()
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-6}[dtype]
    torch.testing.assert_close(res.out.double(), ref, atol=tol, rtol=tol)
    dq, dk, dv = res.grads
    for t in (dq, dk, dv):
        assert torch.isfinite(t).all()
    assert (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    assert (dk[~kpm[:, None, :, None].expand_as(dk)] == 0).all()  # masked keys get no gradient
    assert (res.rows.max_logit[1] == -math.inf).all() and not res.rows.saturated[1].any()
    assert_entropy_matches_oracle(res, q, k, key_padding_mask=kpm)


def test_rows_that_see_no_key_are_neither_counted_nor_saturated(backend):
    q = torch.randn(1, 1, 4, 8, generator=torch.Generator().manual_seed(0)) * 0.01
    kpm = torch.tensor([[False, False, True, True]])
    res = run(backend, q, q, q, causal=True, key_padding_mask=kpm)
    assert res.stats.rows.tolist() == [2]  # rows 0 and 1 see no key (left padding)
    assert res.stats.saturated_rows.tolist() == [0]


def test_nan_in_a_key_makes_the_rows_that_see_it_nan_as_sdpa(backend):
    """A NaN in a key gives the rows that see it NaN (output, lse-dependent gradients), as SDPA does; on the
    PyTorch path they used to come out as rows that see no key (exact zeros, lse = +inf): a finite and wrong
    answer. Rows that do not see the key (causal: the rows before it), and the other head, are unchanged."""
    g = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(4))
    bad = k.clone()
    bad[0, 0, 13, 5] = math.nan  # key 13 of head 0: seen by causal rows 13..23, in key block 0 (block_n 16)
    got = attend(backend, q, bad, v, do, causal=True, block_n=16)
    clean = attend(backend, q, k, v, do, causal=True, block_n=16)
    leaves = [t.clone().requires_grad_() for t in (q, bad, v)]
    want = F.scaled_dot_product_attention(*leaves, is_causal=True)
    want.backward(do)
    assert got.out[0, 0, 13:].isnan().all()
    assert torch.equal(got.out.isnan(), want.isnan())
    assert torch.equal(got.out[0, 0, :13], clean.out[0, 0, :13]) and torch.equal(got.out[0, 1], clean.out[0, 1])
    # gradients: NaN where SDPA's are, which includes the blind-key case both share: a row that does not see
    # the key still multiplies its zero weight by the key's NaN in dq (0 * NaN), column 5 of rows 0..12
    for name, a, b in zip(("dq", "dk", "dv"), got.grads, (t.grad for t in leaves), strict=True):
        assert torch.equal(a.isnan(), b.isnan()), name
    assert not got.grads[0][0, 1].isnan().any()


# --------------------------------------------------------------------------------- window, softcap, GQA


@on_backends(("window", "softcap"), [(w, c) for w in (1, 5, 40) for c in (None, 5.0)], [(1, 5.0), (40, None)])
def test_window_and_softcap_match_oracle(backend, window, softcap):
    g = torch.Generator().manual_seed(window)
    q, k, v, do = (torch.randn(2, 2, 70, 16, generator=g) for _ in range(4))
    kw = dict(causal=True, window=window, softcap=softcap, scale=0.9, block_n=16)
    # window=1: one key per query, so dq is 0 and both backends return fp32 cancellation noise (~3e-6)
    res = run(backend, q, k, v, do, grad_floor=1e-5, **kw)
    o64, g64 = oracle(q, k, v, do, **kw)
    torch.testing.assert_close(res.out.double(), o64, atol=3e-6, rtol=1e-5)
    assert_entropy_matches_oracle(res, q, k, **kw)
    for a, b in zip(res.grads, g64, strict=True):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4)


def test_window_without_causal_bounds_only_the_left_side(backend):
    """With ``causal=False`` the query at position p sees keys ``j > p - window``: all keys to its right too."""
    g = torch.Generator().manual_seed(9)
    Nq, Nk, W = 70, 70, 20
    q, k = (1.5 * torch.randn(1, 2, n, 32, generator=g) for n in (Nq, Nk))
    v = torch.randn(1, 1, Nk, 32, generator=g)
    q, k, v, do = (t.half() for t in (q, k[:, :1], v, torch.randn(1, 2, Nq, 32, generator=g)))
    kw = dict(window=W, stabilize="paper")
    exact = oracle(q, k, v, do, **kw)
    res = run(backend, q, k, v, do, exact=exact, **kw)
    j, p = torch.arange(Nk)[None, :], torch.arange(Nq)[:, None] + (Nk - Nq)
    left_only = j > p - W  # the documented visibility, as an explicit mask
    masked = oracle(q, k, v, attn_mask=left_only)[0]
    torch.testing.assert_close(exact[0], masked, atol=0, rtol=0)
    torch.testing.assert_close(res.out.double(), masked, atol=3e-3, rtol=3e-3)
    causal = oracle(q, k, v, causal=True, window=W)[0]
    assert (res.out.double() - causal).abs().amax() > 0.1  # keys right of p do contribute


def _run_grad(fn, q, k, v, do, dtype):
    qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))  # fresh leaves, cached inputs
    o = fn(qq, kk, vv)
    o.backward(do.to(dtype))
    return o.detach(), qq.grad, kk.grad, vv.grad


def compare_with_sdpa(backend, q, k, v, dtype, sdpa, truth=None, **kw):
    """Our relative RMS error (output and each gradient) is at most 1.25x SDPA's, our max error 2x."""
    gen_do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7))
    o64, g64 = truth or oracle(q, k, v, gen_do, **kw)
    got = attend(backend, q.to(dtype), k.to(dtype), v.to(dtype), gen_do.to(dtype), **kw)
    base = _run_grad(sdpa, q, k, v, gen_do, dtype)
    for name, g_, b, t in zip(("out", "dq", "dk", "dv"), (got.out, *got.grads), base, (o64, *g64), strict=True):
        assert torch.isfinite(g_).all(), name
        e_ours, e_sdpa = rel_rms(g_, t), rel_rms(b, t)
        assert e_ours <= 1.25 * e_sdpa + FLOOR, f"{name}: rms error {e_ours:.3e} vs sdpa {e_sdpa:.3e}"
        m_ours, m_sdpa = rel_max(g_, t), rel_max(b, t)
        assert m_ours <= 2.0 * m_sdpa + FLOOR, f"{name}: max error {m_ours:.3e} vs sdpa {m_sdpa:.3e}"


# The interpreter is slow: Triton takes the small shapes; its tiling is covered by test_triton_attention.py.
SHAPES_CI = [(1, 16), (7, 64), (128, 80), (300, 128), (1024, 64), (128, 256)]
SHAPES_ALL = [(n, d) for n in (1, 7, 128, 300, 1024) for d in (16, 64, 80, 128, 256)]
TRITON_CI = [(7, 64)]


@functools.lru_cache(maxsize=16)
def _accuracy_problem(causal, n, d, seed):
    """Inputs and the oracle's answer, shared by the dtypes and backends of one case."""
    g = torch.Generator().manual_seed(seed)
    b, h = (2, 3) if n < 1024 else (1, 2)  # keep the fp64 oracle of the long cases cheap
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7))
    return q, k, v, oracle(q, k, v, do, causal=causal)


def _accuracy_case(backend, dtype, causal, n, d, seed):
    q, k, v, truth = _accuracy_problem(causal, n, d, seed)
    sdpa = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal)  # noqa: E731
    # the kernels' float32 K and V tiles at D = 256 fit 64-key blocks; with the default 128 the PyTorch path
    # serves the call (test_head_dims.py), and this case is about the kernels
    kw = {"block_n": 64} if backend == "triton" and dtype == torch.float32 and d > 128 else {}
    compare_with_sdpa(backend, q, k, v, dtype, sdpa, truth=truth, causal=causal, **kw)


@pytest.mark.parametrize("causal", [False, True])
@on_backends(("dtype", "n", "d"), [(dt, n, d) for dt in DTYPES for n, d in SHAPES_CI],
             [(torch.bfloat16, n, d) for n, d in TRITON_CI])
def test_accuracy_vs_sdpa(backend, dtype, causal, n, d):
    _accuracy_case(backend, dtype, causal, n, d, seed=n * 1000 + d)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,d", SHAPES_ALL)
def test_accuracy_vs_sdpa_full_matrix(backend, dtype, causal, n, d):
    _accuracy_case(backend, dtype, causal, n, d, seed=n * 1000 + d + 1)


# Triton: GQA against the reference and the oracle in test_triton_attention.py (CASES, window/softcap/GQA)
@on_backends(("dtype", "hq", "hkv"), [(dt, hq, hkv) for dt in (torch.bfloat16, torch.float32)
                                       for hq, hkv in ((4, 2), (6, 1))], [])
def test_gqa_matches_sdpa_without_repeating_kv(backend, dtype, hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    q = torch.randn(2, hq, 70, 32, generator=g)
    k, v = (torch.randn(2, hkv, 70, 32, generator=g) for _ in range(2))
    compare_with_sdpa(backend, q, k, v, dtype,
                      lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True),
                      causal=True)


# ------------------------------------------------------------------------------------------ statistics


def test_stats_exact_on_constructed_inputs(backend):
    g = torch.Generator().manual_seed(0)
    n = 50
    q = torch.zeros(1, 2, n, 16)
    q[..., 0] = 1.0 + torch.rand(1, 2, n, generator=g)
    k = torch.randn(1, 2, n, 16, generator=g)
    k[..., 0] = 2.0 - 0.5 - torch.rand(1, 2, n, generator=g) * 2  # all below the tie
    k[..., 1:4, 0] = 2.0  # head 0: keys 1..3 tie at the max
    k[:, 1, 7, 0] = 5.0  # head 1: a single, untied, larger max at key 7
    v = torch.randn(1, 2, n, 16, generator=g)
    q, k, v = (t.to(DEVICE) for t in (q, k, v))
    st = stable_attn.AttentionStats()
    for _ in range(2):  # accumulates
        stable_attn.attention(q, k, v, scale=1.0, stats=st, block_n=16, backend=backend)
    assert st.rows.tolist() == [100, 100]
    assert st.saturated_rows.tolist() == [100, 0]
    s = (q[0, :, :, 0:1] * k[0, :, :, 0].unsqueeze(1)).cpu()  # [H, N, N] exact scores
    torch.testing.assert_close(st.max_logit.cpu(), s.amax(dim=(1, 2)).float())
    p0 = torch.softmax(s.double(), -1)[..., 0].mean(-1)
    torch.testing.assert_close(st.sink_mass.double().cpu(), p0, atol=1e-6, rtol=1e-5)
    st.reset()
    assert st.empty


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_saturation_does_not_depend_on_block_size(backend, dtype):
    g = torch.Generator().manual_seed(11)
    # coarse scores (few distinct values) make near-ties common, also across block boundaries
    q = torch.randint(-2, 3, (2, 3, 90, 8), generator=g).to(dtype)
    k = torch.randint(-2, 3, (2, 3, 150, 8), generator=g).to(dtype)
    v = torch.randn(2, 3, 150, 8, generator=g).to(dtype)
    if backend == "triton":  # the interpreter pays per program and key block: one (batch, head), two partitions
        q, k, v = q[:1, :1], k[:1, :1], v[:1, :1]
    counts = set()
    q, k, v = (t.to(DEVICE) for t in (q, k, v))
    for bn in (16, 32, 64, 128, 256) if backend == "torch" else (32, 256):
        st = stable_attn.AttentionStats()
        stable_attn.attention(q, k, v, stats=st, block_n=bn, causal=True, backend=backend)
        counts.add(tuple(st.saturated_rows.tolist()))
    assert len(counts) == 1
    s = (q.double().cpu() @ k.double().cpu().transpose(-1, -2)) / math.sqrt(8)
    s = s.masked_fill(~naive.visibility(90, 150, causal=True), -math.inf)
    near = (s >= s.amax(-1, keepdim=True) - rules.tie_tolerance(dtype)).sum(-1) >= 2
    assert counts.pop() == tuple(near.sum(dim=(0, 2)).tolist())


def test_stabilization_does_not_change_fp32_results(backend):
    q, k, v, _ = tied_inputs("positive", torch.float32)
    outs = [run(backend, q, k, v, stabilize=s).out for s in (True, False, "paper")]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(outs[2], outs[1], atol=1e-6, rtol=1e-5)


def test_key_padding_mask_of_any_stride_gives_the_same_result(backend):
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 40, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    kpm = (torch.rand(40, 2, generator=g) > 0.3).t()  # transposed: stride (1, 2)
    want = attend("torch", q, k, v, key_padding_mask=kpm.contiguous()).out
    torch.testing.assert_close(attend(backend, q, k, v, key_padding_mask=kpm).out.float(), want.float(),
                               atol=1e-2, rtol=1e-2)


# ------------------------------------------------------------------------------------ stabilize="paper"


def published_rule(q, k, v, *, scale, block_n, beta=2.0):
    """The published rule (paper, section 4, and its reference code's behaviour), written out by us.

    One head ``q [Nq, D]``, ``k, v [Nk, D]``, no masks; our arithmetic (fp32 scores, ``P-bar`` cast
    to the input dtype before ``P-bar V``, fp32 sums). Per key block: the block max ``m``; if more
    than one score lies within 1e-3 of it, the "max" becomes ``beta*m`` (m > 0) or 0 (m < 0), m == 0
    stays; the running offset is the largest "max" so far; the block's row sum is floored at 1e-10
    before it enters the running sum. Returns the output (float32 ``[Nq, D]``) and, per row, the
    blocks where the offset was changed.
    """
    s = (q.float() @ k.float().T) * scale
    r = torch.full((q.shape[0],), -math.inf)
    l = torch.zeros(q.shape[0])
    acc = torch.zeros(q.shape[0], v.shape[1])
    fired = torch.zeros(q.shape[0], dtype=torch.int32)
    for j in range(0, k.shape[0], block_n):
        sb = s[:, j : j + block_n]
        mb = sb.amax(-1)
        tied = (sb >= mb[:, None] - 1e-3).sum(-1) > 1
        fired += (tied & (mb != 0)).int()
        mb = torch.where(tied & (mb > 0), beta * mb, torch.where(tied & (mb < 0), torch.zeros_like(mb), mb))
        r_new = torch.maximum(r, mb)
        p = torch.exp(sb - r_new[:, None])
        alpha = torch.exp(r - r_new)
        l = l * alpha + p.sum(-1).clamp(min=1e-10)
        acc = acc * alpha[:, None] + p.to(q.dtype).float() @ v[j : j + block_n].float()
        r = r_new
    return acc / l[:, None], fired


def tied_scores(top: float, dtype=torch.bfloat16, B=1, H=2, N=100, D=16, seed=0):
    """q, k, v whose scores are exact products ``a_i * c_j``: keys 1..4 tie at ``c = top``, the row max.

    ``a_i`` in [1, 1.25], the other ``c_j`` between ``top - 2.5`` and ``top - 0.5``; rounded to
    ``dtype`` these repeat, so later key blocks hold ties of their own. q is zero beyond coordinate
    0, so the noise in k's other coordinates changes no score.
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.zeros(B, H, N, D)
    q[..., 0] = 1.0 + 0.25 * torch.rand(B, H, N, generator=g)
    k = torch.randn(B, H, N, D, generator=g)
    k[..., 0] = top - 0.5 - 2.0 * torch.rand(B, H, N, generator=g)
    k[..., 1:5, 0] = top
    v = torch.randn(B, H, N, D, generator=g) - 1.0
    return [t.to(dtype) for t in (q, k, v)]


@pytest.mark.parametrize("top", [3.0, -3.0, 30.0, -30.0, 100.0, -100.0])
def test_paper_mode_is_the_published_rule(backend, top):
    """The same blocks fire as in our transcription of the published rule, and the same output.

    From |max| ~ 23 on, the published offset leaves a row sum below the floor: the output shrinks
    towards 0 (at 30: by ~1e3) and is exactly 0 once every P-bar underflows (100); never NaN.
    """
    q, k, v = tied_scores(top, H=1)
    res = run(backend, q, k, v, scale=1.0, stabilize="paper", block_n=32)
    assert torch.isfinite(res.out).all()
    for h in range(q.shape[1]):
        want, fired = published_rule(q[0, h], k[0, h], v[0, h], scale=1.0, block_n=32)
        assert torch.equal(res.rows.fixed_blocks[0, h], fired)
        want = want.to(torch.bfloat16).float()
        torch.testing.assert_close(res.out[0, h].float(), want, rtol=2e-2, atol=1e-2 * float(want.abs().max()))
    exact = oracle(q, k, v, scale=1.0)[0]
    shrunk = res.out.double().abs().amax() < 1e-2 * exact.abs().amax()
    assert bool(shrunk) == (abs(top) >= 30)
    # finite where the published code is: an emulation of its all-bf16 arithmetic (numerics/arithmetic.py, b)
    scores = (q[0, :, :, :1].float() * k[0, :, None, :, 0].float()).reshape(-1, q.shape[2])  # [H * N, N]
    values = v[0, :, None].expand(-1, q.shape[2], -1, -1).reshape(-1, q.shape[2], q.shape[3])
    published = arithmetic.blockwise_bf16_model(scores.to(torch.bfloat16), values, "paper", block_n=32).out
    assert torch.isfinite(published).all()
