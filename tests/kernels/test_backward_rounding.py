"""The backward recomputes ``P = exp2(fma(x, qk_scale2, -lse2))``, rounded once, as the forward forms P-bar.

At base-2 scores ``|s2| ~ 5e6`` (ulp 0.5) ``fl(x * qk_scale2)`` moves a score by up to a quarter in the
exponent: keys whose exact products differ tie, and ``exp2(fl(x * qk_scale2) - lse2)`` no longer sums
to 1 over the row the forward normalised. The inputs are small integers (every ``q.k`` is an exact
fp32 integer below 2^24, whatever the summation order), and each row's exact ``lse2`` is within
about 1e-6 of an fp32 number (chosen by a per-row shift of all its products): saved in fp32, ``lse2``
is off by up to a quarter too, the same for every key of the row, which no formula for P can undo
(docs/ALGORITHM.md, "Rounding points"); these rows leave the per-key rounding of P alone to be seen.
The oracle is fp64 autograd of ``softmax2(x * qk_scale2)`` with the scale the kernels hold (fp32; at
these scores its rounding alone moves the exponent by 0.06).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from closeness import EPS, close

from stable_attn import rules
from stable_attn.kernels import reference
from stable_attn.kernels import triton_attention as ta
from stable_attn.options import Options

DEVICE = os.environ.get("STABLE_ATTN_TEST_DEVICE", "cpu")
NQ, NK, D = 6, 20, 16
OPTS = Options(causal=False, scale=1.0 / math.sqrt(D), mode=rules.MODE_EXACT)
C32 = float(torch.tensor(OPTS.qk_scale2, dtype=torch.float32))  # the scale a kernel argument holds


def huge_tied_inputs(seed: int = 1):
    """fp64 ``q [NQ, D], k [NK, D], v, do``: q.k = 3072 * 4096 + t_i + small, s2 in [4.5e6, 5e6]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (NQ, D), generator=g).double()
    k = torch.randint(-2, 3, (NK, D), generator=g).double()
    q[:, 0], k[:, 0], k[:, 1] = 3072, 4096, 1
    shifts = torch.arange(0, 1 << 20, dtype=torch.float64)
    for i in range(NQ):  # q[i, 1] shifts every product of row i: pick the shift that puts lse2 on an fp32 number
        q[i, 1] = 0
        lse = torch.logsumexp(k @ q[i] * C32 * math.log(2), 0) / math.log(2) + C32 * shifts
        q[i, 1] = shifts[(lse - lse.float().double()).abs().argmin()]
    v = torch.randn(NK, D, generator=g, dtype=torch.float64)
    do = torch.randn(NQ, D, generator=g, dtype=torch.float64)
    return q, k, v, do


def oracle_grads(q, k, v, do):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    p = torch.softmax((leaves[0] @ leaves[1].T) * C32 * math.log(2), -1)
    (p @ leaves[2]).backward(do)
    return p.detach(), [t.grad for t in leaves]


def run_varlen(problems):
    """The packed Triton path on several problems at once (one sequence each): per sequence ``(lse2, grads)``."""
    q, k, v, do = (torch.cat([pr[i] for pr in problems]).float()[:, None].to(DEVICE) for i in range(4))
    cu_q = torch.tensor([i * NQ for i in range(len(problems) + 1)], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([i * NK for i in range(len(problems) + 1)], dtype=torch.int32, device=DEVICE)
    out, lse2, _ = ta.forward_varlen(q, k, v, cu_q, cu_k, NQ, NK, OPTS, False)
    grads = ta.backward_varlen(do, q, k, v, out, lse2, cu_q, cu_k, NQ, NK, OPTS)
    return [(lse2[0, i * NQ:(i + 1) * NQ].cpu(),
             [g[i * n:(i + 1) * n, 0].double().cpu() for g, n in zip(grads, (NQ, NK, NK))])
            for i in range(len(problems))]


def run(backend, q, k, v, do):
    if backend == "triton-varlen":  # behind a second sequence, so that the packed offsets are not 0
        return run_varlen([huge_tied_inputs(seed=2), (q, k, v, do)])[1]
    q4, k4, v4, do4 = (t.float()[None, None].to(DEVICE) for t in (q, k, v, do))
    if backend == "torch":
        out, lse2, _ = reference.attention_forward(q4, k4, v4, None, None, OPTS)
        grads = reference.attention_backward(do4, q4, k4, v4, out, lse2, None, None, OPTS)
    else:
        out, lse2, _ = ta.forward(q4, k4, v4, None, OPTS, False)
        grads = ta.backward(do4, q4, k4, v4, out, lse2, None, OPTS)
    return lse2[0, 0].cpu(), [g[0, 0].double().cpu() for g in grads]


def test_the_inputs_are_what_the_test_needs():
    q, k, v, do = huge_tied_inputs()
    x = q @ k.T
    assert x.abs().max() < 2**24 and torch.equal(x.float().double(), x)  # exact fp32 products
    s2 = x.float() * torch.tensor(C32)
    assert s2.min() > 2**22 and s2.max() < 2**23  # ulp 0.5
    p, _ = oracle_grads(q, k, v, do)
    for i in range(NQ):  # in every row keys that matter share fl(x * c) but not x
        seen = p[i] > 1e-6
        assert torch.unique(x[i][seen]).numel() > torch.unique(s2[i][seen]).numel()


def test_recomputed_p_sums_to_one_where_the_two_rounding_p_does_not():
    q, k, v, do = huge_tied_inputs()
    lse2, _ = run("torch", q, k, v, do)
    x = (q @ k.T).float()
    p_one = torch.exp2(reference.fma_f32(x, OPTS.qk_scale2, -lse2[:, None])).double()
    p_two = torch.exp2(x * torch.tensor(C32) - lse2[:, None]).double()  # the formula before this change
    tol = 64 * 2.0**-24
    assert (p_one.sum(1) - 1).abs().max() <= tol
    assert (p_two.sum(1) - 1).abs().max() > 100 * tol  # a few percent: the test can fail
    p, grads = oracle_grads(q, k, v, do)
    close(p_one, p, 4, torch.float32, "P")
    with pytest.raises(AssertionError):  # and dV = P^T dO with the old P is off by percents
        close(p_two.T @ do, grads[2], 4, torch.float32, "dv from the two-rounding P")


@pytest.mark.parametrize("backend", ["torch", "triton", "triton-varlen"])
def test_gradients_match_the_fp64_oracle_at_huge_tied_logits(backend):
    q, k, v, do = huge_tied_inputs()
    p, (dq_x, dk_x, dv_x) = oracle_grads(q, k, v, do)
    _, (dq, dk, dv) = run(backend, q, k, v, do)
    close(dv, dv_x, 4, torch.float32, "dv")
    close(dk, dk_x, 4, torch.float32, "dk")
    # every key has k[:, 0] = 4096, so the exact dq[:, 0] = 4096 * scale * sum_j dS_ij is 0, and fp32 can
    # only give the rounding of that sum: bounded by NK fp32 roundings of the largest |dS * scale * k|
    close(dq[:, 1:], dq_x[:, 1:], 4, torch.float32, "dq")
    ds = p * (do @ v.T - (do * (p @ v)).sum(-1, keepdim=True))
    bound = NK * EPS[torch.float32] * (ds.abs().max() * OPTS.scale * 4096)
    assert dq[:, 0].abs().max() <= bound


def test_an_additive_mask_keeps_two_roundings_in_both_passes():
    """The PyTorch path does not fuse the scale where an additive ``attn_mask`` joins the scores (the
    forward's ``fused_scale``): the backward's P is then ``exp2(fl(s2) - lse2)``, as the forward's P-bar."""
    q, k, v, do = huge_tied_inputs()
    q4, k4, v4, do4 = (t.float()[None, None] for t in (q, k, v, do))
    zero = torch.zeros(1, 1, NQ, NK)
    out, lse2, _ = reference.attention_forward(q4, k4, v4, None, zero, OPTS)
    dv = reference.attention_backward(do4, q4, k4, v4, out, lse2, None, zero, OPTS)[2][0, 0].double()
    x = (q @ k.T).float()
    p_two = torch.exp2(x * torch.tensor(C32) - lse2[0, 0][:, None])
    close(dv, p_two.double().T @ do.float().double(), 4, torch.float32, "dv with an additive mask")
