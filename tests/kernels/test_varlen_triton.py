"""Packed sequences on the Triton kernels: ``forward_varlen`` / ``backward_varlen`` (FlashAttention's layout).

The varlen launch must be, sequence by sequence, the dense launch on that sequence alone: same key
blocks from the sequence's first key, causal and window aligned bottom-right per sequence, dropout
seeded ``seed + b``. So every test runs both and asks for equal bits (output, lse, every row
statistic, gradients) with the same tiling, then compares with the fp64 oracle (no worse than the
PyTorch reference on the same sequence). Lengths are drawn at random (fixed generator seeds, not
tuned), always with a sequence of length 1 and lengths that are no multiple of the blocks. Outputs
are poisoned before every launch (tests/kernels/conftest.py): a row the kernel skips fails.
"""

from __future__ import annotations

import dataclasses
import math
import os

import packing
import pytest
import torch
from closeness import FLOOR, no_worse_than_reference

from stable_attn import rules
from stable_attn.kernels import naive, reference
from stable_attn.kernels import triton_attention as ta
from stable_attn.kernels import triton_launch as launch
from stable_attn.options import Options
from stable_attn.stats import STATS_ENTROPY, RowStats

DEVICE = os.environ.get("STABLE_ATTN_TEST_DEVICE", "cpu")
SMALL = launch.FwdConfig(block_m=32, num_warps=4, num_stages=1)  # several query blocks per sequence
SMALL_BWD = launch.BwdConfig(m1=16, n1=32, warps1=4, stages1=1, m2=32, n2=16, warps2=4, stages2=1)
FIELDS = RowStats.FIELDS  # the entropy included: per sequence the same sums in the same order


def random_lengths(n: int, hi: int, seed: int) -> list[int]:
    """``n`` lengths in [2, hi] from a fresh generator, one of them replaced by 1."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, hi + 1, (n,), generator=g).tolist()
    lens[int(torch.randint(0, n, (1,), generator=g))] = 1
    return lens


def cu(lens: list[int]) -> torch.Tensor:
    return packing.cu(lens, DEVICE)


def packed_inputs(lens_q, lens_k, Hq, Hkv, D, dtype, seed, **kwargs):
    return packing.packed_inputs(lens_q, lens_k, Hq, Hkv, D, dtype, seed, device=DEVICE, **kwargs)


def sequences(cu_q, cu_k):
    for b in range(cu_q.numel() - 1):
        yield b, slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))


def dense(x: torch.Tensor) -> torch.Tensor:
    """One packed sequence ``[n, H, D]`` as a batch of one ``[1, H, n, D]`` (a view)."""
    return x.transpose(0, 1)[None]


def run_varlen(lens_q, lens_k, Hq, Hkv, D, dtype, opts, *, seed=0, qk_std=1.0, tied=False, config=SMALL,
               bwd_config=SMALL_BWD, oracle=True):
    """Varlen forward + backward, checked against the dense launcher and the oracle, sequence by sequence."""
    q, k, v, do = packed_inputs(lens_q, lens_k, Hq, Hkv, D, dtype, seed, qk_std=qk_std, tied=tied)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    mq, mk = max(lens_q), max(lens_k)
    out, lse, st = ta.forward_varlen(q, k, v, cu_q, cu_k, mq, mk, opts, STATS_ENTROPY, config=config)
    dq, dk, dv = ta.backward_varlen(do, q, k, v, out, lse, cu_q, cu_k, mq, mk, opts, config=bwd_config)
    assert lse.shape == (Hq, q.shape[0]) and all(getattr(st, f).shape == (1, Hq, q.shape[0]) for f in FIELDS)
    for b, sq, sk in sequences(cu_q, cu_k):
        ob = dataclasses.replace(opts, seed=opts.seed + b)
        qb, kb, vb, dob = dense(q[sq]), dense(k[sk]), dense(v[sk]), dense(do[sq])
        o1, l1, s1 = ta.forward(qb, kb, vb, None, ob, STATS_ENTROPY, config=config)
        assert torch.equal(out[sq], o1[0].transpose(0, 1)), f"out of sequence {b}"
        assert torch.equal(lse[:, sq], l1[0]), f"lse of sequence {b}"
        for f in FIELDS:
            assert torch.equal(getattr(st, f)[0][:, sq], getattr(s1, f)[0]), f"{f} of sequence {b}"
        g1 = ta.backward(dob, qb, kb, vb, o1, l1, None, ob, config=bwd_config)
        grads = ((dq[sq], g1[0]), (dk[sk], g1[1]), (dv[sk], g1[2]))
        for name, (got, want) in zip(("dq", "dk", "dv"), grads, strict=True):
            assert torch.equal(got, want[0].transpose(0, 1)), f"{name} of sequence {b}"
        seen = naive.visibility(sq.stop - sq.start, sk.stop - sk.start, causal=opts.causal,
                                window=opts.window).any(-1)[0, 0]
        assert (out[sq][~seen] == 0).all() and torch.isinf(lse[:, sq][:, ~seen]).all()
        if oracle and opts.dropout_p == 0:
            check_oracle(qb, kb, vb, dob, ob, dtype, dense(out[sq]), [dense(g[0]) for g in grads])
    return out, lse, st, (dq, dk, dv)


def check_oracle(q, k, v, do, opts, dtype, out, grads):
    """The kernel's error against fp64 is no worse than the PyTorch reference's on the same sequence."""
    r_out, r_lse, _ = reference.attention_forward(q, k, v, None, None, opts, False)
    r_grads = reference.attention_backward(do, q, k, v, r_out, r_lse, None, None, opts)
    qd, kd, vd = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    o64 = naive.attention(qd, kd, vd, causal=opts.causal, scale=opts.scale, window=opts.window, softcap=opts.softcap)
    o64.backward(do.double().cpu())
    for name, a, r, x in zip(("out", "dq", "dk", "dv"), (out, *grads), (r_out, *r_grads),
                             (o64.detach(), qd.grad, kd.grad, vd.grad), strict=True):
        if x.abs().max() > FLOOR:
            no_worse_than_reference(a, r, x, dtype, name)
        else:  # e.g. dq of a sequence with one key: exactly 0, computed as dP - delta, a cancellation of
            # two fp32 dot products of length D (summed in different orders) of magnitude |dO| |V|
            noise = q.shape[-1] * 2.0**-23 * do.abs().max() * v.abs().max() * k.abs().max() * opts.scale
            assert (a.double().cpu() - x).abs().max() <= FLOOR + noise.item(), name


def opts_for(D, causal=False, mode=rules.MODE_EXACT, **kw):
    return Options(causal=causal, scale=1.0 / math.sqrt(D), mode=mode, **kw)


# One line per case; lengths drawn per case (query and key lengths differ per sequence where listed).
CASES = [
    # id, dtype, causal, mode, Hq, Hkv, D, lens_q, lens_k, extra options
    ("bf16-causal-exact", torch.bfloat16, True, rules.MODE_EXACT, 2, 1, 32, random_lengths(4, 80, 1), None, {}),
    ("fp16-full-paper-gqa-q!=k", torch.float16, False, rules.MODE_PAPER, 4, 2, 24, random_lengths(3, 50, 2),
     random_lengths(3, 70, 3), {}),
    ("fp32-causal-off-q!=k", torch.float32, True, rules.MODE_OFF, 2, 2, 16, random_lengths(3, 40, 4),
     random_lengths(3, 40, 5), {}),
    ("bf16-window-softcap-gqa", torch.bfloat16, True, rules.MODE_EXACT, 4, 2, 32, random_lengths(3, 70, 6),
     random_lengths(3, 90, 7), dict(window=19, softcap=15.0)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_varlen_equals_each_sequence_alone(case):
    _, dtype, causal, mode, Hq, Hkv, D, lens_q, lens_k, extra = case
    lens_k = lens_k or lens_q
    opts = opts_for(D, causal, mode, block_n=16, **extra)
    run_varlen(lens_q, lens_k, Hq, Hkv, D, dtype, opts, seed=sum(lens_q), qk_std=1.5)


def test_ties_at_the_max_fire_per_sequence():
    """Exact ties 2 + 2 keys in two key blocks of every sequence: the rule fires where attention() fires
    on the sequence alone, which needs the key blocks to start at each sequence's first key."""
    lens = [1, 23, 40, 7]  # 23 and 7: the second block partial or absent; offsets 1, 24, 64: no multiples of 16
    opts = opts_for(32, True, block_n=16)
    _, _, st, _ = run_varlen(lens, lens, 2, 1, 32, torch.bfloat16, dataclasses.replace(opts, scale=1.0), tied=True)
    assert st.fixed_blocks.sum() > 0 and st.saturated.any()


def test_two_blocks_per_key_tile_through_packed_descriptors():
    """Two blocks of the partition per key tile (``FwdConfig.tile_n``) with K/V through the packed
    descriptors, whose tiles of a short sequence overhang into the next one: out, lse and the
    statistics bit for bit those of one block per tile with pointer loads, on tied sequences."""
    lens = [1, 23, 40, 7, 70]
    q, k, v, _ = packed_inputs(lens, lens, 2, 1, 32, torch.bfloat16, 11, tied=True)
    opts = dataclasses.replace(opts_for(32, True, block_n=16), scale=1.0)
    args = (q, k, v, cu(lens), cu(lens), max(lens), max(lens), opts, True)
    one = ta.forward_varlen(*args, config=SMALL)
    two = ta.forward_varlen(*args, config=dataclasses.replace(SMALL, tile_n=32, tma=True))
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert all(torch.equal(getattr(one[2], f), getattr(two[2], f)) for f in FIELDS)
    assert one[2].fixed_blocks.sum() > 0 and one[2].saturated.any()


def test_rows_that_see_no_key():
    """len_q > len_k with causal and window: the first rows of a sequence see no key (zeros, lse = +inf,
    zero gradients); a sequence without keys and one without queries write what they must."""
    lens_q, lens_k = [30, 12, 5], [9, 12, 40]
    opts = opts_for(16, True, window=6, block_n=16)
    out, lse, st, (dq, _, _) = run_varlen(lens_q, lens_k, 2, 1, 16, torch.float16, opts, seed=3)
    assert (out[:21] == 0).all() and torch.isinf(lse[:, :21]).all() and (dq[:21] == 0).all()
    assert not st.saturated[0][:, :21].any() and (st.max_logit[0][:, :21] == -math.inf).all()
    # empty sequences: no keys (its rows see nothing), no queries (its keys get zero gradients)
    lens_q, lens_k = [4, 0, 6], [0, 5, 6]
    q, k, v, do = packed_inputs(lens_q, lens_k, 2, 2, 16, torch.bfloat16, 9)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    o, lse, st = ta.forward_varlen(q, k, v, cu_q, cu_k, 6, 6, opts, True, config=SMALL)
    dq, dk, dv = ta.backward_varlen(do, q, k, v, o, lse, cu_q, cu_k, 6, 6, opts, config=SMALL_BWD)
    assert (o[:4] == 0).all() and torch.isinf(lse[:, :4]).all() and (st.sink_mass[0][:, :4] == 0).all()
    assert (dq[:4] == 0).all() and (dk[:5] == 0).all() and (dv[:5] == 0).all()
    o1, l1, _ = ta.forward(dense(q[4:]), dense(k[5:]), dense(v[5:]), None, dataclasses.replace(opts, seed=2),
                           False, config=SMALL)
    assert torch.equal(o[4:], o1[0].transpose(0, 1)) and torch.equal(lse[:, 4:], l1[0])


def test_dropout_is_the_dense_mask_seeded_per_sequence():
    """Sequence b draws attention()'s mask on it alone with seed + b: bit-identical to the dense launch,
    and two identical sequences get different masks."""
    lens = [33, 33, 1, 20]
    opts = opts_for(16, True, dropout_p=0.25, seed=2**40 + 7, block_n=16)
    q, k, v, do = packed_inputs(lens, lens, 2, 1, 16, torch.float16, 5)
    q[33:66], k[33:66], v[33:66] = q[:33], k[:33], v[:33]
    cu_q = cu(lens)
    out, _, _ = ta.forward_varlen(q, k, v, cu_q, cu_q, 33, 33, opts, False, config=SMALL)
    assert not torch.equal(out[:33], out[33:66])
    run_varlen(lens, lens, 2, 1, 16, torch.float16, opts, seed=5)


def test_default_tiles():
    """The launchers' own tiling: sm_90's under the interpreter, with the backward's tensor descriptors."""
    lens = random_lengths(3, 150, 11)
    assert launch.bwd_config(64, torch.bfloat16, 90).tma
    run_varlen(lens, lens, 2, 1, 64, torch.bfloat16, opts_for(64, True), seed=11, config=None, bwd_config=None)


def test_off_without_statistics_wide_key_tiles():
    """Stabilize off without statistics: 128-key tiles through descriptors over the packed K/V (D = 128),
    most of them overhanging into the next sequence; each sequence equal to its dense launch and no
    worse than the reference against fp64."""
    lens = random_lengths(3, 150, 14)
    wide = launch.fwd_config(128, 64, torch.bfloat16, 90, mode=rules.MODE_OFF, plain=True)
    assert wide == launch.FwdConfig(128, 8, 2, 128, True)
    opts = opts_for(128, True, rules.MODE_OFF)
    q, k, v, do = packed_inputs(lens, lens, 2, 1, 128, torch.bfloat16, 14)
    cu_q = cu(lens)
    out, lse, st = ta.forward_varlen(q, k, v, cu_q, cu_q, max(lens), max(lens), opts, False)
    assert st is None
    for b, sq, sk in sequences(cu_q, cu_q):
        qb, kb, vb = dense(q[sq]), dense(k[sk]), dense(v[sk])
        o1, l1, _ = ta.forward(qb, kb, vb, None, opts, False)
        assert torch.equal(out[sq], o1[0].transpose(0, 1)) and torch.equal(lse[:, sq], l1[0]), f"sequence {b}"
        r_out, _, _ = reference.attention_forward(qb, kb, vb, None, None, opts, False)
        o64 = naive.attention(*(t.double().cpu() for t in (qb, kb, vb)), causal=True, scale=opts.scale)
        no_worse_than_reference(dense(out[sq]), r_out, o64, torch.bfloat16, "out")


def test_descriptor_tiles_read_past_the_sequence():
    """Small descriptor tiles: most tiles overhang their sequence into the next one (the dense descriptor
    zero-fills there); the overhang must add exact zeros, with GQA and every feature but dropout."""
    lens_q, lens_k = random_lengths(4, 60, 12), random_lengths(4, 60, 13)
    opts = opts_for(32, True, block_n=16, window=21, softcap=10.0)
    run_varlen(lens_q, lens_k, 4, 2, 32, torch.bfloat16, opts, seed=12, qk_std=1.5,
               bwd_config=dataclasses.replace(SMALL_BWD, tma=True))


def test_the_next_sequences_inf_and_nan_keys_stay_out_of_dq():
    """Descriptor tiles of the dQ kernel overhang into the next sequence's keys: NaN keys and inf values
    there must leave this sequence's dQ (and every gradient of the other sequences) finite and bit-equal
    to the clean run's; the overhang is zeroed after the load, not merely multiplied by P = 0."""
    lens = [23, 37, 9, 30]  # 23 and 37 keys: the last 16-key tile of sequences 0 and 1 overhangs
    opts = opts_for(32, True, block_n=16)
    bwd = dataclasses.replace(SMALL_BWD, tma=True)
    q, k, v, do = packed_inputs(lens, lens, 4, 2, 32, torch.bfloat16, 21)
    cu_q = cu(lens)

    def grads(k, v):
        out, lse, _ = ta.forward_varlen(q, k, v, cu_q, cu_q, 37, 37, opts, False, config=SMALL)
        return ta.backward_varlen(do, q, k, v, out, lse, cu_q, cu_q, 37, 37, opts, config=bwd)

    clean = grads(k, v)
    bad_k, bad_v = k.clone(), v.clone()
    bad_k[60:69] = float("nan")  # sequence 2's keys
    bad_v[60:69] = float("inf")
    poisoned = grads(bad_k, bad_v)
    for b, sq, sk in sequences(cu_q, cu_q):
        if b == 2:
            continue
        for name, got, want, rows in zip(("dq", "dk", "dv"), poisoned, clean, (sq, sk, sk), strict=True):
            assert torch.isfinite(got[rows]).all() and torch.equal(got[rows], want[rows]), f"{name} of sequence {b}"


def test_launcher_errors():
    q, k, v, do = packed_inputs([4], [4], 1, 1, 16, torch.bfloat16, 0)
    good = cu([4])
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32"):
        ta.forward_varlen(q, k, v, good.long(), good, 4, 4, opts_for(16), False)
    with pytest.raises(ValueError, match="same length"):
        ta.forward_varlen(q, k, v, good, cu([2, 2]), 4, 4, opts_for(16), False)
    with pytest.raises(ValueError, match="int32 offsets"):
        ta.forward_varlen(q, k, v, good, good, 2**31 // 16, 4, opts_for(16), False)
    many = torch.zeros(launch.MAX_GRID_Z + 2, dtype=torch.int32, device=DEVICE)
    many[-1] = 4
    with pytest.raises(ValueError, match="at most 65535 sequences"):
        ta.forward_varlen(q, k, v, many, many, 4, 4, opts_for(16), False)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", [rules.MODE_OFF, rules.MODE_EXACT, rules.MODE_PAPER])
@pytest.mark.parametrize("extra", [{}, dict(window=33, softcap=30.0)], ids=["plain", "window-softcap"])
def test_exhaustive_matrix(dtype, causal, mode, extra):
    seed = 100 + 7 * int(causal) + mode + len(extra)
    lens_q, lens_k = random_lengths(5, 140, seed), random_lengths(5, 140, seed + 1)
    run_varlen(lens_q, lens_k, 4, 2, 48, dtype, opts_for(48, causal, mode, **extra), seed=seed, qk_std=1.5,
               config=None, bwd_config=None)
