"""Head dim 512 (Gemma 4's global layers) on the Triton kernels, under ``TRITON_INTERPRET=1``.

Above 256 columns the forward and decode kernels walk Q and K in column chunks and split V's head dim over
programs (``triton_launch.wide_tiles``); every program of a row block computes the same scores, maxima, decisions
and row sums and owns its slice of the output, the first one writing lse and the statistics. Checked here against
the PyTorch path (the same partition and decisions: ``run_case`` compares every statistic on the rows whose
decisions no summation order can flip) and the fp64 oracle, on fresh random inputs: ties at the max, rows that see
no key, huge logits, odd lengths, GQA, causal and sliding window, softcap, dropout, learned sinks, packed
sequences, the decode kernel and the gradients. Sequences stay short: the interpreter is slow at D = 512.
The same machinery at small head dims with tiny chunks and V blocks (a tiling given by ``config``) checks that
the split changes no decision: the statistics and lse are the bits of the unsplit kernel's.
"""

from __future__ import annotations

import math

import pytest
import torch
from closeness import close
from test_triton_attention import SMALL_BWD, make, opts_for, run_case

import stable_attn
from stable_attn import rules
from stable_attn.kernels import naive, reference, reference_decode, triton_decode
from stable_attn.kernels import triton_attention as ta
from stable_attn.kernels import triton_launch as launch
from stable_attn.options import Options
from stable_attn.stats import STATS_ENTROPY

BF16, FP32 = torch.bfloat16, torch.float32
EXACT, PAPER, OFF = rules.MODE_EXACT, rules.MODE_PAPER, rules.MODE_OFF


def tied(q, k, rows_at=3.0):
    """Two identical keys at the max of every row (exact ties in any summation order: equal products)."""
    q, k = q.clone(), k.clone()
    q[..., 0] = rows_at + q[..., 0].abs()
    k[:, :, 2, 0] = 4.0
    k[:, :, 7] = k[:, :, 2]
    return q, k


def test_the_launcher_tiles_head_dim_512_in_chunks_and_value_blocks():
    """What the routing promises: chunked Q and K, V split over programs, the wide tiles on sm_90 and sm_80."""
    consts, opts = launch.launch_constants("fwd", 512, BF16, 90, causal=True, window=False, softcap=False,
                                           dropout=False, kpm=False)
    assert (consts["HEAD_D"], consts["BLOCK_D"], consts["HEAD_DV"], consts["BLOCK_DV"]) == (512, 128, 512, 128)
    assert (consts["BLOCK_M"], consts["BLOCK_N"], consts["TMA"], opts["num_warps"]) == (64, 128, False, 8)
    assert launch.dv_blocks(consts) == 4
    consts, _ = launch.launch_constants("fwd", 512, BF16, 90, causal=True, window=True, softcap=False,
                                        dropout=False, kpm=False, value_dim=320)
    assert (consts["BLOCK_D"], consts["BLOCK_DV"], consts["BLOCK_M"], launch.dv_blocks(consts)) == (64, 64, 32, 5)
    consts, _ = launch.launch_constants("fwd", 64, BF16, 80, causal=True, window=False, softcap=False,
                                        dropout=False, kpm=False, value_dim=512)
    assert (consts["BLOCK_D"], consts["BLOCK_DV"], launch.dv_blocks(consts)) == (64, 128, 4)
    # the backward holds whole rows in small tiles; below 256 nothing changes
    consts, _ = launch.launch_constants("bwd_dq", 512, BF16, 90, causal=True, window=False, softcap=False,
                                        dropout=False, kpm=False)
    assert (consts["BLOCK_D"], consts["BLOCK_M"], consts["BLOCK_N"]) == (512, 16, 16)
    consts, _ = launch.launch_constants("fwd", 256, BF16, 90, causal=True, window=False, softcap=False,
                                        dropout=False, kpm=False)
    assert (consts["BLOCK_D"], consts["BLOCK_DV"], launch.dv_blocks(consts)) == (256, 256, 1)


SPLIT = launch.FwdConfig(16, 4, 1, head_chunk=16, dv_block=16)


@pytest.mark.parametrize("D, Dv, mode", [(48, 48, EXACT), (40, 24, PAPER), (24, 40, EXACT)])
def test_the_split_changes_no_decision(D, Dv, mode):
    """Chunks of 16 columns (40: a partial last chunk) and 16-column V blocks against the kernel that holds
    whole rows: scores exact in any order (quarter integers), so lse and every statistic are the same bits,
    the output within fp32 summation order; both match the oracle, the entropy the PyTorch path's (a padding mask
    hides keys of the unmasked stretch)."""
    g = torch.Generator().manual_seed(D * Dv)
    q = (torch.randn(2, 4, 13, D, generator=g) * 2).round() / 4
    k = (torch.randn(2, 2, 37, D, generator=g) * 2).round() / 4
    q, k = tied(q, k)
    v = torch.randn(2, 2, 37, Dv, generator=g)
    kpm = torch.ones(2, 37, dtype=torch.bool)
    kpm[1, :9] = False
    opts = Options.create(head_dim=D, causal=True, block_n=16, stabilize=mode == EXACT or "paper")
    whole = launch.FwdConfig(16, 4, 1)
    for dtype, tol in ((FP32, 2), (BF16, 2)):
        args = [t.to(dtype) for t in (q, k, v)]
        got, lse, st = ta.forward(*args, kpm, opts, STATS_ENTROPY, config=SPLIT)
        want, want_lse, want_st = ta.forward(*args, kpm, opts, STATS_ENTROPY, config=whole)
        assert torch.equal(lse, want_lse)
        for name, a, b in zip(st.FIELDS, st.tensors(), want_st.tensors(), strict=True):
            assert torch.equal(a, b), name
        assert want_st.fixed_blocks.sum() > 0
        # the entropy skips padded keys in the unmasked stretch too (0 * -inf would be NaN)
        _, _, ref_st = reference.attention_forward(*args, kpm, None, opts, STATS_ENTROPY)
        torch.testing.assert_close(st.entropy, ref_st.entropy, rtol=1e-5, atol=1e-5)
        close(got, want, tol, dtype, "out")
        close(got, naive.attention(*args, causal=True, key_padding_mask=kpm), 4, dtype, "out vs oracle")


# dtype, causal, mode, B, Hq, Hkv, Nq, Nk, kpm_drop, qk_std: odd lengths, GQA, Nq > Nk (rows without keys)
CASES = [
    (BF16, True, EXACT, 1, 4, 2, 37, 29, 0.0, 1.0),
    (FP32, False, PAPER, 2, 2, 1, 9, 21, 0.3, 1.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_matches_reference_and_oracle(case):
    dtype, causal, mode, B, Hq, Hkv, Nq, Nk, kpm_drop, qk_std = case
    run_case(B, Hq, Hkv, Nq, Nk, 512, dtype, opts_for(512, causal, mode, block_n=16), kpm_drop=kpm_drop,
             seed=Nq + Nk, qk_std=qk_std, bwd_config=SMALL_BWD)


def test_ties_huge_logits_and_rows_without_keys():
    """Exact ties at the max of every row, logits in the hundreds (the shift's cap), padded keys and causal rows
    above the diagonal (Nq > Nk): zeros and lse +inf where no key is seen, the fix fires."""
    q, k, v, do = make(2, 2, 1, 23, 17, 512, BF16, 5, qk_std=1.0)
    q, k = tied(q * 16, k * 16)
    opts = opts_for(512, causal=True, block_n=16)
    out, st, _ = run_case(2, 2, 1, 23, 17, 512, BF16, opts, kpm_drop=0.2, inputs=(q, k, v, do),
                          bwd_config=SMALL_BWD)
    assert st.max_logit.max() > 300 and st.fixed_blocks.sum() > 0
    assert (out[:, :, :6] == 0).all()


def test_window_softcap_and_dropout():
    """The optional features take the narrower wide tiles (64-column chunks and V blocks); dropout draws the
    PyTorch path's mask (the same Philox counters in every program of a row block)."""
    opts = opts_for(512, causal=True, window=11, softcap=30.0, block_n=16)
    run_case(1, 2, 2, 27, 30, 512, BF16, opts, kpm_drop=0.2, seed=3, qk_std=1.5, bwd_config=SMALL_BWD)
    opts = opts_for(512, causal=True, dropout_p=0.25, seed=99, block_n=16)
    run_case(1, 2, 1, 19, 19, 512, BF16, opts, seed=4, bwd_config=SMALL_BWD)


def test_learned_sinks_and_the_entropy():
    """gpt-oss's learned sinks at head dim 512 and the entropy statistic: the PyTorch path's values."""
    q, k, v, _ = make(1, 4, 2, 21, 21, 512, FP32, 6)
    sinks = torch.tensor([0.5, -1.0, 2.0, float("-inf")])
    opts = opts_for(512, causal=True, block_n=16)
    out, lse, st = ta.forward(q, k, v, None, opts, STATS_ENTROPY, sinks=sinks)
    r_out, r_lse, rs = reference.attention_forward(q, k, v, None, None, opts, STATS_ENTROPY, sinks=sinks)
    close(out, naive.attention(q, k, v, causal=True, scale=opts.scale, sinks=sinks), 4, FP32, "out")
    close(out, r_out, 2, FP32, "out vs reference")
    torch.testing.assert_close(lse, r_lse, rtol=1e-6, atol=1e-6)
    for name, a, b in zip(st.FIELDS, st.tensors(), rs.tensors(), strict=True):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("D, Dv", [(512, 512), pytest.param(512, 320, marks=pytest.mark.slow),
                                   pytest.param(320, 512, marks=pytest.mark.slow)])
def test_decode_kernel(D, Dv):
    """The decode kernel: the PyTorch decode path's per-split offsets and maxima (the decisions) bit for bit,
    the oracle's output; G = 4 query heads per KV head, two queries, a window and learned sinks."""
    g = torch.Generator().manual_seed(D + Dv)
    q = (torch.randn(1, 8, 2, D, generator=g) * 4).round() / 8  # exact products: the decisions' bits must agree
    k = (torch.randn(1, 2, 70, D, generator=g) * 4).round() / 8
    q, k = tied(q, k)
    v = torch.randn(1, 2, 70, Dv, generator=g)
    sinks = torch.linspace(-1, 1, 8)
    for window in (None, 30):
        opts = Options.create(head_dim=D, causal=True, block_n=16, window=window)
        got, lse, _, parts = triton_decode.forward(q, k, v, None, opts, split=32, return_partials=True, sinks=sinks)
        ref_parts = reference_decode.partials(q, k, v, None, opts, 32, sinks=sinks)
        _, ref_lse, _ = reference_decode.attention_forward(q, k, v, None, opts, split=32, sinks=sinks)
        assert torch.equal(parts[2], ref_parts[2]) and torch.equal(parts[3], ref_parts[3])
        want = naive.attention(q, k, v, causal=True, window=window, sinks=sinks)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)


def test_packed_sequences_are_each_sequence_alone():
    """Packed sequences (a window, GQA 2 / 1): each sequence's output and gradients bit for bit the dense kernels'
    on that sequence alone."""
    q, k, v, do = make(1, 2, 1, 19, 19, 512, BF16, 8)
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v, do)]
    leaves = [t.clone().requires_grad_() for t in packed[:3]]
    cu = torch.tensor([0, 7, 7, 19], dtype=torch.int32)
    kw = dict(causal=True, window=5, block_n=16, backend="triton")
    out = stable_attn.attention_varlen(*leaves, cu, cu, 12, 12, **kw)
    out.backward(packed[3])
    for s, e in ((0, 7), (7, 19)):
        alone = [t[s:e].transpose(0, 1)[None].clone().requires_grad_() for t in packed[:3]]
        want = stable_attn.attention(*alone, **kw)
        want.backward(packed[3][s:e].transpose(0, 1)[None])
        assert torch.equal(out[s:e].detach(), want[0].detach().transpose(0, 1))
        for p, a in zip(leaves, alone, strict=True):
            assert torch.equal(p.grad[s:e], a.grad[0].transpose(0, 1))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [BF16, torch.float16, FP32])
@pytest.mark.parametrize("mode", [OFF, EXACT, PAPER])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", [(512, 512), (512, 320), (320, 512), (512, 64)])
def test_exhaustive(dtype, mode, causal, dims):
    """Every mode, dtype, both causal settings and head-dim pairs with partial chunks and V blocks, against the
    PyTorch path (outputs, gradients, statistics) and the oracle."""
    D, Dv = dims
    g = torch.Generator().manual_seed(D + Dv + mode)
    q = torch.randn(1, 4, 33, D, generator=g)
    k = torch.randn(1, 2, 45, D, generator=g)  # untied: run_case compares the decisions on rows with margins
    v = torch.randn(1, 2, 45, Dv, generator=g)
    do = torch.randn(1, 4, 33, Dv, generator=g)
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    opts = Options(causal=causal, scale=1.0 / math.sqrt(D), mode=mode, block_n=16)
    run_case(1, 4, 2, 33, 45, D, dtype, opts, kpm_drop=0.2, seed=D + Dv, inputs=(q, k, v, do))
