"""The fused backward prototype (``triton_backward_fused.py``) against the two-kernel backward and the fp64 oracle.

dK and dV come out of the same ``dkdv_step`` arithmetic on the same tiles, so under the interpreter
they must equal the two-kernel path's bit for bit; dQ is the same partial products summed per key tile
(the two-kernel dQ accumulates them inside one dot chain), so it is compared within the suite's
margins, and against the fp64 oracle no worse than the two-kernel path. Small tiles (``BwdConfig``)
put several key tiles and query steps into short sequences: causal and not, GQA, odd lengths, Nq != Nk,
a row that sees no key, ties at the row maximum, and the optional features. The launcher's scratch
buffer starts as NaN (conftest.py): a partial the sum reads but no program wrote fails every comparison.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
from closeness import close, no_worse_than_reference

from stable_attn import rules
from stable_attn.kernels import naive, reference
from stable_attn.kernels import triton_attention as ta
from stable_attn.kernels import triton_backward_fused as fused
from stable_attn.kernels import triton_launch as launch
from stable_attn.options import Options

DEVICE = os.environ.get("STABLE_ATTN_TEST_DEVICE", "cpu")
SMALL = launch.BwdConfig(16, 32, 4, 1, 16, 32, 4, 1)  # 16-query steps over 32-key tiles, pointer loads


def inputs(B, Hq, Hkv, Nq, Nk, D, dtype, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g)
    k = torch.randn(B, Hkv, Nk, D, generator=g)
    v = torch.randn(B, Hkv, Nk, D, generator=g)
    do = torch.randn(B, Hq, Nq, D, generator=g)
    if ties:  # keys repeated across key tiles: every row's maximum is reached by several keys
        k[:, :, 1::3] = k[:, :, 0:1]
        q[:, :, :, :] = q.abs()
        k[:, :, 0::3] = k[:, :, 0:1].abs() * 2
    return [t.to(dtype).to(DEVICE) for t in (q, k, v, do)]


def oracle(q, k, v, do, kpm, opts):
    """fp64 autograd of the exact attention: (dq, dk, dv)."""
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
    out = naive.attention(q64, k64, v64, causal=opts.causal, scale=opts.scale, window=opts.window,
                          softcap=opts.softcap, key_padding_mask=None if kpm is None else kpm.cpu())
    out.backward(do.double().cpu())
    return q64.grad, k64.grad, v64.grad


# B, Hq, Hkv, Nq, Nk, D, dtype, causal, extras
CASES = [
    (1, 4, 2, 45, 70, 32, torch.bfloat16, True, {}),  # GQA G = 2, odd lengths, 3 key tiles
    (2, 2, 1, 40, 25, 16, torch.bfloat16, True, {}),  # Nq > Nk causal: the first 15 rows see no key
    (1, 2, 2, 50, 33, 40, torch.float16, False, {}),  # D not a power of two
    (1, 2, 1, 37, 66, 16, torch.bfloat16, False, dict(ties=True)),
    (2, 2, 1, 30, 70, 16, torch.bfloat16, True, dict(window=21, softcap=15.0, kpm=0.3)),
]


def case_id(c):
    return f"{c[6]}-D{c[5]}-{c[3]}x{c[4]}-G{c[1] // c[2]}-{'causal' if c[7] else 'full'}-{'-'.join(c[8]) or 'plain'}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fused_matches_two_kernel_and_oracle(case):
    B, Hq, Hkv, Nq, Nk, D, dtype, causal, extra = case
    extra = dict(extra)
    ties, kpm_drop = extra.pop("ties", False), extra.pop("kpm", 0.0)
    q, k, v, do = inputs(B, Hq, Hkv, Nq, Nk, D, dtype, seed=Nq * Nk, ties=ties)
    kpm = None
    if kpm_drop:
        kpm = (torch.rand(B, Nk, generator=torch.Generator().manual_seed(3)) >= kpm_drop)
        kpm[1] = False  # batch element 1 sees no key at all: every row fully masked
        kpm = kpm.to(DEVICE)
    opts = Options(causal=causal, scale=1.0 / math.sqrt(D), mode=rules.MODE_EXACT, **extra)
    out, lse, _ = reference.attention_forward(q, k, v, kpm, None, opts)
    two = ta.backward(do, q, k, v, out, lse, kpm, opts, config=SMALL)
    one = fused.backward_fused(do, q, k, v, out, lse, kpm, opts, config=SMALL)
    exact = oracle(q, k, v, do, kpm, opts)
    for name, a, b, e in zip(("dq", "dk", "dv"), one, two, exact):
        assert not torch.isnan(a.cpu()).any(), name
        if name != "dq" and DEVICE == "cpu":  # same dkdv_step on the same tiles
            assert torch.equal(a.cpu(), b.cpu()), f"{name}: fused and two-kernel differ"
        close(a, b, 4, dtype, name + " (fused vs two-kernel)")
        no_worse_than_reference(a, b, e, dtype, name + " (vs fp64)")


def test_fully_masked_rows_get_zero_dq():
    q, k, v, do = inputs(1, 2, 1, 40, 25, 16, torch.bfloat16, seed=7)
    opts = Options(causal=True, scale=0.25, mode=rules.MODE_EXACT)
    out, lse, _ = reference.attention_forward(q, k, v, None, None, opts)
    dq, _, _ = fused.backward_fused(do, q, k, v, out, lse, None, opts, config=SMALL)
    assert torch.equal(dq[:, :, :15].cpu(), torch.zeros_like(dq[:, :, :15].cpu()))  # rows 0..14 see no key
    assert dq[:, :, 15:].abs().amax() > 0


def test_default_tiling_and_atomic_opt_in():
    """The launcher's own tiles (one 128-key tile, 64-query steps at D = 64 on sm_90) and the atomic dQ."""
    q, k, v, do = inputs(1, 2, 1, 70, 150, 64, torch.bfloat16, seed=11)
    opts = Options(causal=True, scale=0.125, mode=rules.MODE_EXACT)
    out, lse, _ = reference.attention_forward(q, k, v, None, None, opts)
    two = ta.backward(do, q, k, v, out, lse, None, opts)
    ordered = fused.backward_fused(do, q, k, v, out, lse, None, opts)
    atomic = fused.backward_fused(do, q, k, v, out, lse, None, opts, atomic=True)
    for name, a, b, c in zip(("dq", "dk", "dv"), ordered, two, atomic):
        close(a, b, 4, torch.bfloat16, name + " (fused vs two-kernel)")
        close(c, a, 2, torch.bfloat16, name + " (atomic vs ordered)")


def test_env_var_selects_the_backward(monkeypatch):
    q, k, v, do = inputs(1, 2, 2, 20, 36, 16, torch.bfloat16, seed=5)
    opts = Options(causal=False, scale=0.25, mode=rules.MODE_EXACT)
    out, lse, _ = reference.attention_forward(q, k, v, None, None, opts)
    calls = []
    real = fused.backward_fused
    monkeypatch.setattr(ta, "backward_fused", lambda *a, **kw: calls.append(kw["atomic"]) or real(*a, **kw))
    monkeypatch.delenv(fused.BACKWARD_ENV, raising=False)
    ta.backward(do, q, k, v, out, lse, None, opts, config=SMALL)
    assert calls == []  # the two-kernel path by default
    monkeypatch.setenv(fused.BACKWARD_ENV, "fused")
    got = ta.backward(do, q, k, v, out, lse, None, opts, config=SMALL)
    monkeypatch.setenv(fused.BACKWARD_ENV, "fused-atomic")
    ta.backward(do, q, k, v, out, lse, None, opts, config=SMALL)
    assert calls == [False, True]
    want = real(do, q, k, v, out, lse, None, opts, config=SMALL)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    monkeypatch.setenv(fused.BACKWARD_ENV, "fast")
    with pytest.raises(ValueError, match="STABLE_ATTN_BACKWARD='fast'.*two-kernel, fused, fused-atomic"):
        ta.backward(do, q, k, v, out, lse, None, opts, config=SMALL)


def test_dropout_matches_two_kernel():
    """Dropout's keep mask comes from the same Philox counters in both designs (the fp64 oracle has none)."""
    q, k, v, do = inputs(1, 2, 1, 33, 70, 16, torch.bfloat16, seed=13)
    opts = Options(causal=True, scale=0.25, mode=rules.MODE_EXACT, dropout_p=0.25, seed=9)
    out, lse, _ = reference.attention_forward(q, k, v, None, None, opts)
    two = ta.backward(do, q, k, v, out, lse, None, opts, config=SMALL)
    one = fused.backward_fused(do, q, k, v, out, lse, None, opts, config=SMALL)
    want = reference.attention_backward(do, q, k, v, out, lse, None, None, opts)
    for name, a, b, r in zip(("dq", "dk", "dv"), one, two, want):
        if name != "dq" and DEVICE == "cpu":
            assert torch.equal(a.cpu(), b.cpu()), f"{name}: fused and two-kernel differ"
        close(a, b, 4, torch.bfloat16, name + " (fused vs two-kernel)")
        close(a, r, 4, torch.bfloat16, name + " (fused vs reference)")


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "descriptors"])
@pytest.mark.parametrize("atomic", [False, True], ids=["ordered", "atomic"])
def test_varlen_is_each_sequence_alone(monkeypatch, tma, atomic):
    """Packed sequences through STABLE_ATTN_BACKWARD: sequence by sequence the dense fused backward on
    that sequence alone (bit for bit), and the two-kernel varlen backward's dK/dV bit for bit, its dQ
    within 4 ulps. Lengths cut tiles, one sequence's rows partly see no key (causal, Nq > Nk)."""
    lens_q, lens_k = [5, 40, 23], [30, 12, 70]
    Hq, Hkv, D, dtype = 4, 2, 16, torch.bfloat16
    cfg = launch.BwdConfig(16, 32, 4, 1, 16, 32, 4, 1, tma=tma)
    g = torch.Generator().manual_seed(21)
    q, do = (torch.randn(sum(lens_q), Hq, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(sum(lens_k), Hkv, D, generator=g).to(dtype) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(x)], dtype=torch.int32) for x in (lens_q, lens_k))
    opts = Options(causal=True, scale=0.25, mode=rules.MODE_EXACT)
    out, lse, _ = ta.forward_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), opts, False)
    args = (do, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k), opts)
    two = ta.backward_varlen(*args, config=cfg)
    monkeypatch.setenv(fused.BACKWARD_ENV, "fused-atomic" if atomic else "fused")
    one = ta.backward_varlen(*args, config=cfg)
    for name, a, b in zip(("dq", "dk", "dv"), one, two):
        assert not torch.isnan(a).any(), name
        if name != "dq":
            assert torch.equal(a, b), f"{name}: fused and two-kernel differ"
        close(a, b, 4, dtype, name + " (fused vs two-kernel)")
    for s in range(len(lens_q)):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        alone = fused.backward_fused(*(x[qs].transpose(0, 1)[None] for x in (do, q)),
                                     *(x[ks].transpose(0, 1)[None] for x in (k, v)),
                                     out[qs].transpose(0, 1)[None], lse[:, qs][None], None, opts, atomic=atomic,
                                     config=cfg)
        for name, a, b in zip(("dq", "dk", "dv"), alone, one):
            part = b[qs] if name == "dq" else b[ks]
            assert torch.equal(a[0].transpose(0, 1), part), f"sequence {s}, {name}: varlen differs from alone"
