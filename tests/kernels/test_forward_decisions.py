"""The forward's decisions, bit for bit, against the per-element tie count they replaced.

Both backends now test ties with each block's top two scores (``row_top2``). Here the test itself
walks the key blocks with the rule as first written, counting per element (``count(s2 >= t) >= 2``
for the trigger, ``min(2, count(s2 >= m - tau))`` for saturation), on inputs built to tie: scores on
a coarse grid (many exact ties at the max), near-ties around the exact window, maxima above, below
and at zero, masked keys. The PyTorch path must take the same decision and the same offset in
every (row, block); the Triton kernel must report the same ``saturated_rows`` and ``fixed_blocks`` and
the same ``lse`` within fp32 summation-order differences.
"""

from __future__ import annotations

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
MODES = (rules.MODE_EXACT, rules.MODE_PAPER, rules.MODE_OFF)


def tie_heavy(B, H, N, D, dtype, seed, level, step):
    """q, k with entries on a grid: scores are small integers times ``scale`` plus ``level`` (the sign of the
    max), many tied exactly; ``step`` nudges some keys by one bf16 step, for ties at the window's edge."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-1, 2, (B, H, N, D), generator=g).float()
    k = torch.randint(-1, 2, (B, H, N, D), generator=g).float()
    q[..., 0], k[..., 0] = level, 1.0
    nudge = torch.rand(B, H, N, generator=g) < 0.3
    k[..., 1] = torch.where(nudge, k[..., 1] * (1 + step), k[..., 1])
    v = torch.randn(B, H, N, D, generator=g)
    return [t.to(dtype).to(DEVICE) for t in (q, k, v)]


def per_element_decisions(q, k, opts, kpm):
    """The rule walked with per-element counts: ``(offsets, fires)`` per block ``[B, H, Nq]``, and the stats."""
    p = reference.Problem(q, k, k, kpm, None, opts)
    dtype = q.dtype
    tie2, min2, max2 = rules.rule_constants(dtype, opts.mode)
    sat2 = rules.sat_tolerance2(dtype)
    B, H, Nq, D = q.shape
    q_c = q.float().reshape(B, p.Hkv, p.G * Nq, D)
    row = (B, p.Hkv, p.G, Nq)
    m = torch.full(row, -math.inf)
    r = torch.full(row, -math.inf)
    near = torch.zeros(row, dtype=torch.int32)
    fixed = torch.zeros(row, dtype=torch.int32)
    offsets, fires = [], []
    for j0, j1 in p.key_blocks(0, Nq):
        s2, _ = p.scores(q_c, k[:, :, j0:j1].float(), 0, Nq, j0, j1)
        s2 = s2.cpu()
        m_blk = s2.amax(-1)
        m_new = torch.maximum(m, m_blk)
        has_key = m_blk > -math.inf
        if opts.mode == rules.MODE_EXACT:
            r_cand = torch.maximum(r, m_blk)
            fire = ((s2 >= (r_cand - tie2)[..., None]).sum(-1) >= 2) & has_key
            r_new = torch.where(fire, rules.shifted_offset(m_new, opts.beta, min2, max2), r_cand)
        elif opts.mode == rules.MODE_PAPER:
            fire = ((s2 >= (m_blk - tie2)[..., None]).sum(-1) > 1) & has_key
            m_adj = torch.where(fire & (m_blk > 0), opts.beta * m_blk,
                                torch.where(fire & (m_blk < 0), torch.zeros_like(m_blk), m_blk))
            fire = fire & (m_blk != 0)
            r_new = torch.maximum(r, m_adj)
        else:
            fire = torch.zeros_like(has_key)
            r_new = torch.maximum(r, m_blk)
        in_blk = (s2 >= (m_new - sat2)[..., None]).sum(-1, dtype=torch.int32)
        carried = torch.where(m_new == m, near, (m >= m_new - sat2).to(torch.int32))
        near = torch.clamp(carried + in_blk, max=2)
        fixed += fire.to(torch.int32)
        offsets.append(r_new)
        fires.append(fire)
        m, r = m_new, r_new
    seen = m > -math.inf
    shape = (B, H, Nq)
    return offsets, fires, ((near >= 2) & seen).view(shape), fixed.view(shape)


CASES = [
    # dtype, mode, level (sign of the max), step (near-tie nudge), scale, block_n, causal, kpm
    # (scale 0.125 with step 2^-7: nudged scores sit ~1e-3 nats from the grid, inside the bf16 tie window)
    (torch.bfloat16, rules.MODE_EXACT, 3.0, 2.0**-7, 0.125, 16, False, False),
    (torch.bfloat16, rules.MODE_EXACT, -3.0, 2.0**-7, 0.5, 16, True, True),
    (torch.bfloat16, rules.MODE_EXACT, 0.0, 2.0**-6, 0.125, 64, True, False),
    (torch.float16, rules.MODE_EXACT, 1.0, 2.0**-10, 0.5, 16, False, True),
    (torch.bfloat16, rules.MODE_PAPER, 3.0, 2.0**-7, 0.125, 16, False, False),
    (torch.bfloat16, rules.MODE_PAPER, -2.0, 2.0**-7, 0.5, 16, True, True),
    (torch.float16, rules.MODE_PAPER, 0.0, 2.0**-10, 0.125, 64, False, False),
    (torch.bfloat16, rules.MODE_OFF, 2.0, 2.0**-7, 0.5, 16, True, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_decisions_match_the_per_element_count(case, monkeypatch):
    dtype, mode, level, step, scale, block_n, causal, with_kpm = case
    B, H, N, D = 1, 2, 130, 16
    q, k, v = tie_heavy(B, H, N, D, dtype, seed=N + block_n, level=level, step=step)
    kpm = None
    if with_kpm:
        kpm = (torch.rand(B, N, generator=torch.Generator().manual_seed(3)) > 0.2).to(DEVICE)
    opts = Options(causal=causal, scale=scale, mode=mode, block_n=block_n)
    offsets, fires, sat, fixed = per_element_decisions(q, k, opts, kpm)

    calls = []
    rule = reference.block_offset

    def recording(*args):
        calls.append(rule(*args))
        return calls[-1]

    monkeypatch.setattr(reference, "block_offset", recording)
    _, r_lse, rs = reference.attention_forward(q, k, v, kpm, None, opts, True)
    monkeypatch.setattr(reference, "block_offset", rule)
    assert len(calls) == len(offsets)
    for (r_new, fire), want_r, want_fire in zip(calls, offsets, fires):
        assert torch.equal(fire.cpu(), want_fire)
        # before its first key a row's offset is -FP32_MAX in both backends (ALGORITHM.md), -inf in the walk
        want_r = torch.where(want_r == -math.inf, -rules.FP32_MAX, want_r)
        assert torch.equal(r_new.cpu().view(torch.int32), want_r.view(torch.int32))
    assert torch.equal(rs.saturated.cpu(), sat) and torch.equal(rs.fixed_blocks.cpu(), fixed)
    if mode != rules.MODE_OFF:
        assert fixed.any() and sat.any()  # the inputs do tie

    _, lse, st = ta.forward(q, k, v, kpm, opts, True,
                            config=launch.FwdConfig(block_m=32, num_warps=4, num_stages=1))
    assert torch.equal(st.saturated.cpu(), sat)
    assert torch.equal(st.fixed_blocks.cpu(), fixed)
    torch.testing.assert_close(lse.cpu(), r_lse.cpu(), rtol=1e-6, atol=1e-6)


PAIRED = [
    # dtype, level, step, scale, block_n, causal, window, kpm, Nq, Nk, tma
    (torch.bfloat16, 3.0, 2.0**-7, 0.125, 16, True, None, False, 150, 137, False),
    (torch.bfloat16, -3.0, 2.0**-7, 0.5, 16, False, None, True, 77, 201, True),
    (torch.float16, 0.0, 2.0**-10, 0.125, 16, True, 70, False, 150, 150, False),
    (torch.bfloat16, 1.0, 2.0**-7, 0.125, 64, True, None, False, 331, 331, True),
]


@pytest.mark.parametrize("case", PAIRED, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_two_blocks_per_key_tile_decide_block_by_block(case):
    """The exact mode's 128-key tile (``FwdConfig.tile_n``: two blocks of the partition per K tile, the
    rule per block): on tie-heavy inputs with odd lengths (unmasked stretches of odd and even block
    counts, a partial last block, the window's masked left edge) every decision is the per-element
    count's, and out, lse and all four statistics are bit for bit those of one block per tile."""
    dtype, level, step, scale, block_n, causal, window, with_kpm, Nq, Nk, tma = case
    q, k, v = tie_heavy(1, 2, max(Nq, Nk), 16, dtype, seed=Nq + Nk, level=level, step=step)
    q, k, v = q[:, :, :Nq], k[:, :, :Nk].contiguous(), v[:, :, :Nk].contiguous()
    kpm = None
    if with_kpm:
        kpm = (torch.rand(1, Nk, generator=torch.Generator().manual_seed(5)) > 0.2).to(DEVICE)
    opts = Options(causal=causal, scale=scale, mode=rules.MODE_EXACT, block_n=block_n, window=window)
    one = ta.forward(q, k, v, kpm, opts, True, config=launch.FwdConfig(32, 4, 1, tma=tma))
    two = ta.forward(q, k, v, kpm, opts, True, config=launch.FwdConfig(32, 4, 1, tma=tma, tile_n=2 * block_n))
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    for name in ("saturated", "fixed_blocks", "max_logit", "sink_mass"):
        assert torch.equal(getattr(one[2], name), getattr(two[2], name)), name
    _, _, sat, fixed = per_element_decisions(q, k, opts, kpm)
    assert torch.equal(two[2].saturated.cpu(), sat) and torch.equal(two[2].fixed_blocks.cpu(), fixed)
    assert fixed.any() and sat.any()  # the inputs do tie


def test_key_tile_of_other_widths_is_refused():
    q, k, v = tie_heavy(1, 1, 40, 16, torch.bfloat16, seed=0, level=1.0, step=0.0)
    opts = Options(mode=rules.MODE_EXACT, block_n=16)
    with pytest.raises(ValueError, match="config.tile_n=64"):
        ta.forward(q, k, v, None, opts, False, config=launch.FwdConfig(32, 4, 1, tile_n=64))


def test_running_second_max_gives_the_count_verdict():
    """Saturation as both backends now keep it (the row's running second-largest score, merged with each
    block's top two) against the count it replaced (``near = min(2, carried + in_blk)``, reset when the
    max moves), walked over block sequences built to hit every branch of the count: maxima that rise by
    less and by more than the window, ties with the running max, blocks without keys (-inf), rows
    that never see a key. The count reads the block's elements; the new form only its top two."""
    g = torch.Generator().manual_seed(11)
    sat2 = rules.sat_tolerance2(torch.bfloat16)
    rows, blocks, width = 4000, 6, 3
    grid = torch.tensor([-math.inf, -3.0, 0.0, sat2 / 2, sat2, 1.5 * sat2, 2 * sat2, 3.0])
    m = torch.full((rows,), -math.inf)
    m2 = torch.full((rows,), -math.inf)
    near = torch.zeros(rows, dtype=torch.int32)
    for _ in range(blocks):
        s2 = grid[torch.randint(0, len(grid), (rows, width), generator=g)]
        s2 = s2 + torch.randint(0, 3, (rows, 1), generator=g) * sat2  # the level moves between blocks
        s2 = torch.where(torch.rand(rows, 1, generator=g) < 0.15, -math.inf, s2)  # blocks without keys
        s2[:50] = -math.inf  # rows without any key
        m_blk, m2_blk = reference.row_top2(s2)
        m_new = torch.maximum(m, m_blk)
        in_blk = (s2 >= (m_new - sat2)[:, None]).sum(-1, dtype=torch.int32)
        carried = torch.where(m_new == m, near, (m >= m_new - sat2).to(torch.int32))
        near = torch.clamp(carried + in_blk, max=2)
        m2 = torch.maximum(torch.minimum(m, m_blk), torch.maximum(m2, m2_blk))
        m = m_new
    seen = m > -math.inf
    by_count = (near >= 2) & seen
    by_second = (m2 >= m - sat2) & seen
    assert torch.equal(by_second, by_count)
    assert 0.2 < by_count.float().mean() < 0.9 and (~seen).any()  # both verdicts occur, and unseen rows


@pytest.mark.parametrize("mode", [rules.MODE_EXACT, rules.MODE_PAPER])
def test_default_partition_is_128_keys_in_both_backends(mode):
    """The default key partition is 128 keys in the PyTorch path and in the kernel on the tile
    the launcher picks: a tie between keys 60 and 70 (one 128-key block, two 64-key blocks) fires the
    rule by default and with ``block_n=128``, never with ``block_n=64``; both backends count the same
    fixed blocks."""
    Nq, Nk, D = 8, 200, 16
    q = torch.zeros(1, 1, Nq, D)
    k = torch.zeros(1, 1, Nk, D)
    q[..., 0] = 1.0
    k[..., 0] = -(1.0 + torch.arange(Nk) / 32)  # distinct, exact in bf16: no tie among them
    k[0, 0, [60, 70], 0] = 2.0  # the two tied maxima, at least 3 above every other score
    v = torch.randn(1, 1, Nk, D, generator=torch.Generator().manual_seed(0))
    q, k, v = (t.to(torch.bfloat16).to(DEVICE) for t in (q, k, v))
    fixed = {}
    for block_n in (0, 128, 64):
        opts = Options(scale=1.0, mode=mode, block_n=block_n)
        _, r_lse, rs = reference.attention_forward(q, k, v, None, None, opts, True)
        _, lse, st = ta.forward(q, k, v, None, opts, True)
        assert torch.equal(st.fixed_blocks.cpu(), rs.fixed_blocks.cpu())
        assert torch.equal(st.saturated.cpu(), rs.saturated.cpu())
        torch.testing.assert_close(lse.cpu(), r_lse.cpu(), rtol=1e-6, atol=1e-6)
        fixed[block_n] = rs.fixed_blocks.cpu()
    assert (fixed[0] == 1).all() and torch.equal(fixed[0], fixed[128])
    assert (fixed[64] == 0).all()
