"""What only the Triton kernels have: tiling, launch configurations, ``lse``, the dropout generator.

The cases every backend shares (ties, huge logits, rows without keys, window, softcap, GQA, padding,
dtypes) are in ``test_correctness.py``. Here the kernels are called directly, with small tiles that
force several query and key blocks, and compared with the PyTorch reference (same partition, same
decisions: every per-row statistic equal, outputs within 2 ulps, gradients within 4) and with the
fp64 oracle. On the CPU the kernels run under ``TRITON_INTERPRET=1`` (set by tests/conftest.py before
Triton is imported); with ``STABLE_ATTN_TEST_DEVICE=cuda`` the same tests run on the GPU. Every
kernel output is poisoned before the launch (tests/kernels/conftest.py), so an element the kernel
forgets to write fails the comparison.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from closeness import close, no_worse_than_reference
from margins import robust_rows_of

from stable_attn import rules
from stable_attn.kernels import naive, reference
from stable_attn.kernels import triton_attention as ta
from stable_attn.kernels import triton_launch as launch
from stable_attn.kernels.philox import keep_mask
from stable_attn.options import Options

DEVICE = os.environ.get("STABLE_ATTN_TEST_DEVICE", "cpu")
SMALL = launch.FwdConfig(block_m=32, num_warps=4, num_stages=1)  # several query blocks at test sizes
SMALL_BWD = launch.BwdConfig(m1=16, n1=32, warps1=4, stages1=1, m2=32, n2=16, warps2=4, stages2=1)


def make(B, Hq, Hkv, Nq, Nk, D, dtype, seed, qk_std=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g) * qk_std
    k = torch.randn(B, Hkv, Nk, D, generator=g) * qk_std
    v = torch.randn(B, Hkv, Nk, D, generator=g)
    do = torch.randn(B, Hq, Nq, D, generator=g)
    return [t.to(dtype).to(DEVICE) for t in (q, k, v, do)]


def visible_rows(B, Hq, Nq, Nk, opts, kpm):
    """Rows that see at least one key (the others output 0 and have lse = +inf)."""
    vis = naive.visibility(Nq, Nk, causal=opts.causal, window=opts.window,
                           key_padding_mask=None if kpm is None else kpm.cpu())
    return vis.any(-1).expand(B, Hq, Nq)


def check_stats(st, rs, seen, keep, what=""):
    """The kernel's row statistics against the reference's: decisions bit-identical on the rows ``keep``
    (margins.robust_rows_of: no fp32 summation order of q.k can flip them; at least 90% of the rows)."""
    assert torch.isin(st.saturated.view(torch.uint8).cpu(), torch.tensor([0, 1], dtype=torch.uint8)).all()
    assert keep.float().mean() >= 0.9, f"only {keep.float().mean():.3f} of the rows have safe margins"
    assert torch.equal(st.saturated.cpu()[keep], rs.saturated.cpu()[keep]), f"saturated differs {what}"
    assert not st.saturated.cpu()[~seen].any()
    assert torch.equal(st.fixed_blocks.cpu()[keep], rs.fixed_blocks.cpu()[keep]), f"fixed_blocks differs {what}"
    torch.testing.assert_close(st.max_logit.cpu(), rs.max_logit.cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st.sink_mass.cpu(), rs.sink_mass.cpu(), rtol=1e-4, atol=1e-6)


def oracle_grads(q, k, v, do, opts, kpm):
    qd, kd, vd = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    o = naive.attention(qd, kd, vd, causal=opts.causal, scale=opts.scale, window=opts.window,
                         softcap=opts.softcap, key_padding_mask=None if kpm is None else kpm.cpu())
    o.backward(do.double().cpu())
    return o.detach(), qd.grad, kd.grad, vd.grad


def run_case(B, Hq, Hkv, Nq, Nk, D, dtype, opts, *, kpm_drop=0.0, seed=0, qk_std=1.0, config=None,
             bwd_config=None, oracle=True, inputs=None):
    q, k, v, do = inputs if inputs is not None else make(B, Hq, Hkv, Nq, Nk, D, dtype, seed, qk_std)
    kpm = None
    if kpm_drop > 0:
        kpm = (torch.rand(B, Nk, generator=torch.Generator().manual_seed(seed + 1)) >= kpm_drop).to(DEVICE)
    out, lse, st = ta.forward(q, k, v, kpm, opts, True, config=config)
    r_out, r_lse, rs = reference.attention_forward(q, k, v, kpm, None, opts, True)
    seen = visible_rows(B, Hq, Nq, Nk, opts, kpm)
    close(out, r_out, 2, dtype, "out")
    torch.testing.assert_close(lse.cpu(), r_lse.cpu(), rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.isinf(lse.cpu()[~seen]).all() and (out.cpu()[~seen] == 0).all()
    check_stats(st, rs, seen, robust_rows_of(q, k, opts, kpm))
    dq, dk, dv = ta.backward(do, q, k, v, out, lse, kpm, opts, config=bwd_config)
    r_dq, r_dk, r_dv = reference.attention_backward(do, q, k, v, r_out, r_lse, kpm, None, opts)
    for name, a, b in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
        close(a, b, 4, dtype, name)
    if oracle and opts.dropout_p == 0:
        o64, dq64, dk64, dv64 = oracle_grads(q, k, v, do, opts, kpm)
        for name, a, b, x in (("out", out, r_out, o64), ("dq", dq, r_dq, dq64), ("dk", dk, r_dk, dk64),
                              ("dv", dv, r_dv, dv64)):
            no_worse_than_reference(a, b, x, dtype, name)
    return out, st, (dq, dk, dv)


def opts_for(D, causal=False, mode=rules.MODE_EXACT, **kw):
    return Options(causal=causal, scale=1.0 / math.sqrt(D), mode=mode, **kw)


# One line per case: a compact cover of dtype x causal x mode x shapes (odd lengths, Nq != Nk both ways,
# GQA, padding, D not a power of two, D = 256); the tiling column forces several query/key blocks.
CASES = [
    # dtype, causal, mode, B, Hq, Hkv, Nq, Nk, D, kpm_drop, small tiles
    (torch.bfloat16, True, rules.MODE_EXACT, 1, 2, 1, 100, 100, 64, 0.0, True),
    (torch.bfloat16, False, rules.MODE_EXACT, 1, 4, 2, 33, 77, 40, 0.2, False),
    (torch.float16, True, rules.MODE_EXACT, 1, 2, 2, 70, 130, 32, 0.1, True),
    (torch.bfloat16, True, rules.MODE_PAPER, 1, 2, 2, 130, 33, 16, 0.0, True),
    (torch.float16, False, rules.MODE_PAPER, 2, 2, 1, 7, 100, 80, 0.3, False),
    (torch.bfloat16, True, rules.MODE_OFF, 1, 3, 1, 48, 48, 128, 0.0, False),
    (torch.float16, True, rules.MODE_OFF, 1, 2, 1, 100, 20, 24, 0.5, True),
    (torch.bfloat16, False, rules.MODE_EXACT, 1, 1, 1, 1, 1, 8, 0.0, False),
    (torch.bfloat16, True, rules.MODE_EXACT, 1, 1, 1, 1, 65, 16, 0.0, False),
    (torch.float16, True, rules.MODE_EXACT, 1, 2, 1, 20, 20, 256, 0.0, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_matches_reference_and_oracle(case):
    dtype, causal, mode, B, Hq, Hkv, Nq, Nk, D, kpm_drop, small = case
    block_n = 16 if small else 0
    opts = opts_for(D, causal, mode, block_n=block_n)
    run_case(B, Hq, Hkv, Nq, Nk, D, dtype, opts, kpm_drop=kpm_drop, seed=Nq * 7 + Nk,
             config=SMALL if small else None, bwd_config=SMALL_BWD if small else None)


def test_rows_that_see_no_key():
    """Fully padded batch row and causal rows above the diagonal: zeros, lse=+inf, zero grads, no stats."""
    dtype, B, H, Nq, Nk, D = torch.bfloat16, 2, 2, 40, 24, 32
    q, k, v, do = make(B, H, H, Nq, Nk, D, dtype, 3)
    kpm = torch.ones(B, Nk, dtype=torch.bool)
    kpm[1] = False
    kpm[0, :5] = False
    kpm = kpm.to(DEVICE)
    opts = opts_for(D, causal=True, block_n=16)
    out, lse, st = ta.forward(q, k, v, kpm, opts, True, config=SMALL)
    r_out, r_lse, rs = reference.attention_forward(q, k, v, kpm, None, opts, True)
    seen = visible_rows(B, H, Nq, Nk, opts, kpm)
    assert (~seen).sum() > Nq  # batch 1 entirely, and the first rows of batch 0
    assert (out.cpu()[~seen] == 0).all() and torch.isinf(lse.cpu()[~seen]).all()
    assert (st.max_logit.cpu()[~seen] == -math.inf).all() and (st.sink_mass.cpu()[~seen] == 0).all()
    check_stats(st, rs, seen, robust_rows_of(q, k, opts, kpm))
    dq, dk, dv = ta.backward(do, q, k, v, out, lse, kpm, opts, config=SMALL_BWD)
    assert (dq.cpu()[~seen] == 0).all() and (dk.cpu()[1] == 0).all() and (dv.cpu()[1] == 0).all()
    r_grads = reference.attention_backward(do, q, k, v, r_out, r_lse, kpm, None, opts)
    for a, b in zip((dq, dk, dv), r_grads):
        close(a, b, 4, dtype, "grad")


def test_window_softcap_gqa():
    dtype = torch.bfloat16
    opts = opts_for(64, causal=True, window=37, softcap=20.0, block_n=16)
    run_case(1, 4, 2, 90, 110, 64, dtype, opts, kpm_drop=0.1, seed=8, qk_std=2.0, config=SMALL,
             bwd_config=SMALL_BWD)


def test_dropout_same_mask_as_reference():
    """Same seed, same keep mask bit for bit: read it off the output with V = identity."""
    dtype, B, H, N, D = torch.bfloat16, 1, 2, 32, 32
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(B, H, N, D, generator=g) * 0.1).to(dtype).to(DEVICE)
    k = (torch.randn(B, H, N, D, generator=g) * 0.1).to(dtype).to(DEVICE)
    v = torch.eye(N, D).expand(B, H, N, D).to(dtype).to(DEVICE)
    opts = Options(scale=1.0, dropout_p=0.3, seed=2**40 + 12345, block_n=16)
    out, _, _ = ta.forward(q, k, v, None, opts, False, config=SMALL)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    h = torch.arange(H)[:, None, None]
    want = keep_mask(opts.seed, (h * N + i) * N + j, opts.dropout_p)[None]
    assert torch.equal(out.cpu() != 0, want)
    assert 0.55 < want.float().mean() < 0.85
    # and the full forward/backward against the reference with the same seed, other shapes
    opts = opts_for(48, causal=True, dropout_p=0.2, seed=77, block_n=16)
    run_case(2, 2, 1, 50, 60, 48, torch.float16, opts, seed=4, config=SMALL, bwd_config=SMALL_BWD)


def test_float32_inputs_use_exact_dots():
    opts = opts_for(24, causal=True)
    run_case(1, 2, 1, 40, 50, 24, torch.float32, opts, seed=6)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", [rules.MODE_OFF, rules.MODE_EXACT, rules.MODE_PAPER])
@pytest.mark.parametrize("shape", [(1, 1, 7), (128, 128, 64), (300, 257, 80), (33, 200, 128), (64, 64, 256)])
def test_exhaustive_matrix(dtype, causal, mode, shape):
    Nq, Nk, D = shape
    opts = opts_for(D, causal, mode)
    run_case(1, 2, 1, Nq, Nk, D, dtype, opts, kpm_drop=0.1, seed=Nq + Nk + D, qk_std=1.5)


def test_forced_block_n_too_wide_is_refused():
    q, k, v, _ = make(1, 1, 1, 8, 8, 256, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="block_n=1024"):
        ta.forward(q, k, v, None, opts_for(256, block_n=1024), False)


@pytest.mark.parametrize("D, causal, Nk", [(128, True, 150), (64, False, 200)])
def test_off_without_statistics_takes_wide_key_tiles(D, causal, Nk, monkeypatch):
    """Stabilize off without statistics: no rule sees the partition, so the sm_90 tiling takes 128-key
    tiles (at D = 128 with K/V through descriptors), whatever the partition. Only the summation order
    changes: the output is the reference's within 2 ulps and no worse than it against fp64."""
    dtype = torch.bfloat16
    chosen = []
    pick = launch.fwd_config
    monkeypatch.setattr(launch, "fwd_config", lambda *a, **kw: chosen.append(pick(*a, **kw)) or chosen[-1])
    opts = opts_for(D, causal, rules.MODE_OFF)
    q, k, v, _ = make(1, 2, 1, 150, Nk, D, dtype, seed=D + Nk)
    out, lse, st = ta.forward(q, k, v, None, opts, False)
    assert st is None and chosen == [launch.FwdConfig(128, 8, 2, block_n=128, tma=D > 64)]
    r_out, r_lse, _ = reference.attention_forward(q, k, v, None, None, opts, False)
    close(out, r_out, 2, dtype, "out")
    torch.testing.assert_close(lse.cpu(), r_lse.cpu(), rtol=1e-5, atol=1e-5)
    qd, kd, vd = (t.double().cpu() for t in (q, k, v))
    o64 = naive.attention(qd, kd, vd, causal=causal, scale=opts.scale)
    no_worse_than_reference(out, r_out, o64, dtype, "out")
    # a rule or statistics see the partition: on the default 128-key partition the same 128 x 128 tile, its
    # key block the partition's (block_n None); a forced 64-key partition keeps its own tiles (with a
    # rule two blocks per K tile at D = 128, one per iteration of a 4-warp, 128-row tile at D = 64)
    for kw in (dict(mode=rules.MODE_EXACT), dict(mode=rules.MODE_EXACT, block_n=64), dict(block_n=64)):
        ta.forward(q, k, v, None, opts_for(D, causal, **{"mode": rules.MODE_OFF, **kw}), False)
    ta.forward(q, k, v, None, opts, True)
    wide = launch.FwdConfig(128, 8, 2, tma=D > 64)
    pair = launch.FwdConfig(128, 8, 2, tma=True, tile_n=128) if D > 64 else launch.FwdConfig(128, 4, 3)
    assert chosen[1:] == [wide, pair, launch.FwdConfig(128, 8, 3), wide]


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("mode", [rules.MODE_EXACT, rules.MODE_PAPER, rules.MODE_OFF])
def test_128_key_partition_takes_the_128_wide_tile(D, mode):
    """The default partition (128 keys) and ``block_n=128`` set by the user get the same sm_90 tile,
    128 x 128 with 8 warps, in every mode, with and without statistics; a forced 64-key partition keeps
    its own tiles (128 x 128 with two 64-key blocks and 8 warps at D = 128, 128 x 64 with 4 warps at D = 64)."""
    assert Options().key_block == 128
    for stats in (False, True):
        tiles = {forced: launch.launch_constants("fwd", D, torch.bfloat16, 90, causal=True, window=False, softcap=False,
                                             dropout=False, kpm=False, mode=mode, stats=stats, block_n=128,
                                             forced_block_n=forced)
                 for forced in (False, True)}
        for consts, compile_opts in tiles.values():
            assert (consts["BLOCK_M"], consts["BLOCK_N"], consts["TILE_N"], consts["TMA"]) == (128, 128, 128, D > 64)
            assert (compile_opts["num_warps"], compile_opts["num_stages"]) == (8, 2)
    if mode != rules.MODE_OFF:
        consts, compile_opts = launch.launch_constants("fwd", D, torch.bfloat16, 90, causal=True, window=False,
                                                   softcap=False, dropout=False, kpm=False, mode=mode, block_n=64,
                                                   forced_block_n=True)
        assert (consts["BLOCK_M"], consts["BLOCK_N"], consts["TILE_N"], compile_opts["num_warps"]) == (
            (128, 64, 128, 8) if D > 64 else (128, 64, 64, 4))


def test_row_sum_in_two_accumulators_on_sm90(monkeypatch):
    """The exact mode's tensor-core row sum: two accumulators (one per half of each key block) on sm_90 with
    16-bit inputs and halves of at least 16 keys, one elsewhere (``row_sum_parts``). Both give the same
    decisions and the same output up to the fp32 summation order of the same rounded P-bar."""
    kw = dict(causal=True, window=False, softcap=False, dropout=False, kpm=False, mode=rules.MODE_EXACT)
    parts = {(cc, dtype, n): launch.launch_constants("fwd", 64, dtype, cc, block_n=n, **kw)[0]["ROW_SUM_PARTS"]
             for cc in (80, 90) for dtype in (torch.bfloat16, torch.float32) for n in (16, 32, 128)}
    assert {key for key, n in parts.items() if n == 2} == {(90, torch.bfloat16, 32), (90, torch.bfloat16, 128)}
    assert set(parts.values()) == {1, 2}
    dtype = torch.bfloat16
    opts = opts_for(64, True)
    q, k, v, _ = make(1, 2, 1, 150, 300, 64, dtype, seed=11, qk_std=2.0)
    runs = {}
    for n in (1, 2):
        monkeypatch.setattr(launch, "row_sum_parts", lambda *a, n=n: n)
        runs[n] = ta.forward(q, k, v, None, opts, True)
    (out1, lse1, st1), (out2, lse2, st2) = runs[1], runs[2]
    assert torch.equal(st1.fixed_blocks, st2.fixed_blocks) and torch.equal(st1.saturated, st2.saturated)
    torch.testing.assert_close(lse2.cpu(), lse1.cpu(), rtol=1e-6, atol=1e-6)
    close(out2, out1, 1, dtype, "out")


def test_descriptor_loads_with_rule_and_statistics():
    """K/V through descriptors with the rule, the statistics (the sink's key picked out of the first
    tile), a padding mask and a padded head dim (40 -> 64): decisions bit for bit the reference's."""
    opts = opts_for(40, True, block_n=16)
    run_case(1, 2, 1, 50, 70, 40, torch.bfloat16, opts, kpm_drop=0.1, seed=5, qk_std=2.0,
             config=launch.FwdConfig(32, 4, 1, tma=True), bwd_config=SMALL_BWD)
