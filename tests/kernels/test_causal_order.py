"""The causal kernels hand out their query blocks longest first (kernels/triton_order.py): the same bits as in the
natural order.

The dense forward and dQ kernels run twice on the same inputs under the interpreter: with
``triton_order.query_block`` as the kernels have it and with the natural order patched in (``program_id(0)``);
every output (out, lse, row statistics, dq, dk, dv) must be equal bit for bit. The launch allocations start as
NaN (conftest.py), so a block the reversed order skipped would fail the comparison. Shapes: several query blocks
with a partial last one, ``Nq < Nk`` (bottom-right alignment), a window, GQA, padding, huge logits.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from stable_attn.kernels import triton_attention as ta
from stable_attn.kernels import triton_backward, triton_forward, triton_order
from stable_attn.kernels import triton_launch as launch
from stable_attn.options import Options

DEVICE = os.environ.get("STABLE_ATTN_TEST_DEVICE", "cpu")
SMALL = launch.FwdConfig(block_m=16, num_warps=4, num_stages=1)
SMALL_BWD = launch.BwdConfig(m1=16, n1=16, warps1=4, stages1=1, m2=16, n2=16, warps2=4, stages2=1)


@triton.jit
def natural_block(Nq, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr):
    return tl.program_id(0)


def run(q, k, v, do, kpm, opts, natural, monkeypatch, varlen=False):
    with monkeypatch.context() as m:
        if natural:
            m.setattr(triton_forward, "query_block", natural_block)
            m.setattr(triton_backward, "query_block", natural_block)
        if varlen:
            B, H, N, D = q.shape
            cu = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device=DEVICE)
            cuk = torch.arange(0, (B + 1) * k.shape[2], k.shape[2], dtype=torch.int32, device=DEVICE)
            pq, pk, pv, pdo = (t.transpose(1, 2).reshape(-1, t.shape[1], D).contiguous() for t in (q, k, v, do))
            out, lse, st = ta.forward_varlen(pq, pk, pv, cu, cuk, N, k.shape[2], opts, True, config=SMALL)
            grads = ta.backward_varlen(pdo, pq, pk, pv, out, lse, cu, cuk, N, k.shape[2], opts, config=SMALL_BWD)
        else:
            out, lse, st = ta.forward(q, k, v, kpm, opts, True, config=SMALL)
            grads = ta.backward(do, q, k, v, out, lse, kpm, opts, config=SMALL_BWD)
    return [out, lse, *st.tensors(), *grads]


@pytest.mark.parametrize(("Hq", "Hkv", "Nq", "Nk", "window", "kpm", "varlen"), [
    (2, 1, 75, 75, None, False, False),
    (2, 2, 50, 83, None, True, False),
    (1, 1, 70, 70, 24, False, False),
    (2, 1, 45, 45, None, False, True),  # varlen: the natural order (triton_order.causal_constant), the same bits
])
def test_the_longest_first_order_gives_the_natural_orders_bits(Hq, Hkv, Nq, Nk, window, kpm, varlen, monkeypatch):
    g = torch.Generator().manual_seed(Nq)
    q, do = (torch.randn(2, Hq, Nq, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(2, Hkv, Nk, 16, generator=g) for _ in range(2))
    k[0, 0, 7] *= 60  # huge logits for the rows that see key 7
    q, k, v, do = (t.to(torch.bfloat16).to(DEVICE) for t in (q, k, v, do))
    mask = None
    if kpm:
        mask = torch.rand(2, Nk, generator=g) > 0.3
        mask[1, :] = False  # rows without keys
        mask = mask.to(DEVICE)
    opts = Options(causal=True, scale=0.25, window=window, block_n=16)
    got = run(q, k, v, do, mask, opts, False, monkeypatch, varlen)
    want = run(q, k, v, do, mask, opts, True, monkeypatch, varlen)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a, b), f"output {i}"
    assert not torch.isnan(got[0][..., :1]).all()


def test_which_launches_hand_out_the_longest_blocks_first():
    flags = dict(window=False, softcap=False, dropout=False)
    for kind in ("fwd", "bwd_dq", "bwd_dkdv"):
        for cc, kpm, causal, want in [(90, False, True, kind != "bwd_dkdv"), (100, False, True, kind != "bwd_dkdv"),
                                      (80, False, True, False), (120, False, True, False), (90, None, True, False),
                                      (90, False, False, False)]:
            consts, _ = launch.launch_constants(kind, 64, torch.bfloat16, cc, causal=causal, kpm=kpm, **flags)
            assert (consts["CAUSAL"] == triton_order.HEAVY_FIRST) == want, (kind, cc, kpm, causal)
            assert bool(consts["CAUSAL"]) == causal
