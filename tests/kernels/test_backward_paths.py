"""The two load paths of the Triton backward: tensor descriptors (TMA, sm_90) and pointers.

The launcher streams Q/dO (dK/dV kernel) and K/V (dQ kernel) through TMA descriptors when it can
(``bwd_config(..., tma=True)``: sm_90, 16-bit, D <= 128, TMA-compatible strides) and through
pointer loads otherwise. With the same tiles both paths load the same zero-padded tiles and do the
same arithmetic, so under the interpreter their gradients must agree bit for bit; both must match
the PyTorch reference. Inputs TMA cannot address must take the pointer path.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from stable_attn import rules
from stable_attn.kernels import reference
from stable_attn.kernels import triton_attention as ta
from stable_attn.kernels import triton_launch as launch
from stable_attn.options import Options

DEVICE = os.environ.get("STABLE_ATTN_TEST_DEVICE", "cpu")
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def inputs(B, Hq, Hkv, Nq, Nk, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g)
    k = torch.randn(B, Hkv, Nk, D, generator=g)
    v = torch.randn(B, Hkv, Nk, D, generator=g)
    do = torch.randn(B, Hq, Nq, D, generator=g)
    return [t.to(dtype).to(DEVICE) for t in (q, k, v, do)]


def close(got, want, dtype, what, tol_ulps=4):
    got, want = got.double().cpu(), want.double().cpu()
    scale = want.abs().max().clamp(min=1e-30)
    err = (got - want).abs().max()
    assert err <= tol_ulps * EPS[dtype] * scale + 1e-6, f"{what}: max err {err:.3g} (scale {scale:.3g})"


# B, Hq, Hkv, Nq, Nk, D, dtype, causal, extras; lengths cut tiles, Nq != Nk both ways, GQA, D not a
# power of two, and the optional features (window, softcap, padding mask, dropout)
CASES = [
    (1, 4, 2, 100, 100, 64, torch.bfloat16, True, {}),
    (2, 2, 1, 70, 150, 128, torch.float16, True, {}),
    (1, 2, 2, 130, 33, 40, torch.bfloat16, False, {}),
    (1, 2, 1, 90, 90, 128, torch.bfloat16, True, dict(window=37, softcap=20.0, dropout_p=0.2, seed=5, kpm=0.3)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[6]}-D{c[5]}-{c[3]}x{c[4]}-G{c[1] // c[2]}-{len(c[8])}")
def test_descriptors_and_pointers_agree(case):
    B, Hq, Hkv, Nq, Nk, D, dtype, causal, extra = case
    extra = dict(extra)
    kpm_drop = extra.pop("kpm", 0.0)
    q, k, v, do = inputs(B, Hq, Hkv, Nq, Nk, D, dtype, seed=Nq + Nk)
    kpm = None
    if kpm_drop:
        kpm = (torch.rand(B, Nk, generator=torch.Generator().manual_seed(1)) >= kpm_drop).to(DEVICE)
    opts = Options(causal=causal, scale=1.0 / math.sqrt(D), mode=rules.MODE_EXACT, **extra)
    out, lse, _ = reference.attention_forward(q, k, v, kpm, None, opts)
    heavy = "dropout_p" in extra or "softcap" in extra  # the launcher's narrower tiles for these
    tma_cfg = launch.bwd_config(launch.head_block(D), dtype, 90, tma=True, heavy=heavy)
    assert tma_cfg.tma
    with_tma = ta.backward(do, q, k, v, out, lse, kpm, opts, config=tma_cfg)
    with_ptrs = ta.backward(do, q, k, v, out, lse, kpm, opts, config=dataclasses.replace(tma_cfg, tma=False))
    want = reference.attention_backward(do, q, k, v, out, lse, kpm, None, opts)
    for name, a, b, r in zip(("dq", "dk", "dv"), with_tma, with_ptrs, want):
        if DEVICE == "cpu":  # the interpreter does the same arithmetic on the same tiles
            assert torch.equal(a.cpu(), b.cpu()), f"{name}: descriptor and pointer paths differ"
        else:  # on a GPU the two compiled kernels may schedule differently: compare against each other
            close(a, b, dtype, name + " (descriptors vs pointers)")
        assert not torch.isnan(a.cpu()).any(), name
        close(a, r, dtype, name)


def test_which_strides_tma_takes():
    x = torch.zeros(2, 3, 10, 64, dtype=torch.bfloat16)
    assert launch.tma_compatible(x, x.transpose(1, 2).contiguous().transpose(1, 2))  # [B, N, H, D] storage
    assert not launch.tma_compatible(torch.zeros(2, 3, 10, 4, dtype=torch.bfloat16))  # 8-byte rows
    shifted = torch.zeros(2 * 3 * 10 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 3, 10, 64)
    assert not launch.tma_compatible(x, shifted)  # base not 16-byte aligned
    assert not launch.bwd_config(64, torch.bfloat16, 90, tma=False).tma
    assert not launch.bwd_config(64, torch.bfloat16, 80).tma  # no TMA before Hopper
    assert not launch.bwd_config(64, torch.float32, 90).tma
    assert not launch.bwd_config(256, torch.bfloat16, 90).tma


def test_inputs_tma_cannot_address_take_the_pointer_path(monkeypatch):
    B, Hq, Nq, D, dtype = 1, 2, 50, 64, torch.bfloat16
    q, k, v, do = inputs(B, Hq, Hq, Nq, Nq, D, dtype, seed=3)
    flat = torch.empty(q.numel() + 1, dtype=dtype, device=q.device)
    q_shifted = flat[1:].view_as(q).copy_(q)  # same values, base 2 bytes past an aligned address

    def refuse(*args):
        raise AssertionError("a descriptor was built for inputs TMA cannot address")

    opts = Options(causal=True, scale=1.0 / math.sqrt(D), mode=rules.MODE_EXACT)
    out, lse, _ = reference.attention_forward(q, k, v, None, None, opts)
    want = reference.attention_backward(do, q, k, v, out, lse, None, None, opts)
    monkeypatch.setattr(launch, "descriptor", refuse)
    got = ta.backward(do, q_shifted, k, v, out, lse, None, opts)
    for name, a, r in zip(("dq", "dk", "dv"), got, want):
        close(a, r, dtype, name)
