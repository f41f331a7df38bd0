"""Every kernel variant compiles for A100 (sm_80) and H100/H200 (sm_90), and the common ones for B200 (sm_100) and
RTX 50-series (sm_120), and fits in shared memory.

Compilation runs the whole Triton -> PTX -> cubin pipeline on the CPU (no GPU needed), so this
catches compile errors and shared-memory overflow of the block configurations the launchers pick.
A representative subset runs in CI; the full matrix is marked slow. Register use and spills are
reported by benchmarks/kernel_resources.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from stable_attn import rules
from stable_attn.kernels import triton_launch as launch
from stable_attn.kernels.triton_aot import SHARED_LIMIT, Variant, describe_in_subprocess

BF16, FP16 = torch.bfloat16, torch.float16
EXACT, PAPER, OFF = rules.MODE_EXACT, rules.MODE_PAPER, rules.MODE_OFF

# The variants users run most (bf16 causal D=128 with stats on Hopper) and the tightest fits
# (D=256 on A100's smaller shared memory), forward and both backward kernels.
REPRESENTATIVE = [
    Variant("fwd", BF16, 128, True, EXACT, True, 90),
    Variant("fwd", FP16, 256, False, PAPER, False, 80),
    Variant("bwd_pre", BF16, 80, True, cc=90),
    Variant("bwd_dkdv", BF16, 256, True, cc=80),
    Variant("bwd_dq", FP16, 64, False, cc=90),
    # every optional feature at once (window, softcap, padding mask, dropout, stats)
    Variant("fwd", BF16, 64, True, EXACT, True, 90, features=True),
    # packed sequences (the varlen kernels): the common Hopper case, and every feature on A100
    Variant("fwd", BF16, 128, True, EXACT, True, 90, varlen=True),
    Variant("bwd_pre", BF16, 80, True, cc=90, varlen=True),
    Variant("bwd_dkdv", BF16, 128, True, cc=90, varlen=True),
    Variant("bwd_dq", FP16, 64, True, cc=80, features=True, varlen=True),
    # multi-head latent attention: DeepSeek-V3's q/k head dim 192 against v head dim 128 (V tiled at 128)
    Variant("fwd", BF16, 192, True, EXACT, True, 90, value_dim=128),
    # Gemma 4's global layers: head dim 512 (Q and K in column chunks, V split over programs)
    Variant("fwd", BF16, 512, True, EXACT, True, 90),
]

FULL = [Variant("fwd", dt, d, causal, mode, False, cc)
        for dt, d, causal, mode, cc in itertools.product((BF16, FP16), (64, 128, 256), (False, True),
                                                         (OFF, EXACT, PAPER), (80, 90))]
FULL += [Variant(kind, dt, d, causal, cc=cc)
         for kind, dt, d, causal, cc in itertools.product(("bwd_dkdv", "bwd_dq"), (BF16, FP16), (64, 128, 256),
                                                           (False, True), (80, 90))]
FULL += [Variant(kind, dt, d, True, EXACT, True, cc, features=True)
         for kind, dt, d, cc in itertools.product(("fwd", "bwd_dkdv", "bwd_dq"), (BF16, FP16), (64, 128, 256),
                                                  (80, 90))]
FULL += [Variant(kind, dt, d, causal, EXACT, kind == "fwd", cc, features=causal, varlen=True)
         for kind, dt, d, causal, cc in itertools.product(("fwd", "bwd_pre", "bwd_dkdv", "bwd_dq"), (BF16, FP16),
                                                          (64, 128, 256), (False, True), (80, 90))]
# a value head dim apart from the query's, both ways round, dense and packed, every feature on the packed ones
FULL += [Variant(kind, BF16, d, True, EXACT, kind == "fwd", cc, features=varlen, varlen=varlen, value_dim=dv)
         for kind, (d, dv), cc, varlen in itertools.product(("fwd", "bwd_pre", "bwd_dkdv", "bwd_dq"),
                                                           ((24, 16), (16, 40), (192, 128)), (80, 90), (False, True))]
FULL += [Variant("decode", BF16, d, True, EXACT, cc=cc, value_dim=dv)
         for (d, dv), cc in itertools.product(((24, 16), (192, 128)), (80, 90))]
# head dim 512 and partial chunks or V blocks beside it, every kernel, dense and packed (decode: dense)
FULL += [Variant(kind, dt, d, True, EXACT, kind == "fwd", cc, features=varlen, varlen=varlen, value_dim=dv)
         for kind, dt, (d, dv), cc, varlen in itertools.product(("fwd", "bwd_dkdv", "bwd_dq"), (BF16, FP16),
                                                               ((512, None), (512, 320), (320, 512)), (80, 90),
                                                               (False, True))]
FULL += [Variant("decode", BF16, d, True, EXACT, cc=cc, value_dim=dv)
         for (d, dv), cc in itertools.product(((512, None), (320, 512)), (80, 90))]


def check(v: Variant, r: dict) -> None:
    assert r["variant"] == v.name and r["cubin_bytes"] > 0
    assert r["shared"] <= SHARED_LIMIT[v.cc], f"{v.name}: {r['shared']} B shared > {SHARED_LIMIT[v.cc]}"
    if v.cc == 90 and v.kind == "fwd" and v.head_dim <= 128 and v.value_dim is None:
        assert r["wgmma"], f"{v.name}: no Hopper warpgroup MMA in the PTX"


@pytest.fixture(scope="module")
def representative():
    # one child process compiles them all (the tests' own process runs Triton's interpreter)
    return describe_in_subprocess(REPRESENTATIVE)


@pytest.mark.parametrize("i", range(len(REPRESENTATIVE)), ids=[v.name for v in REPRESENTATIVE])
def test_representative_variants_compile(representative, i):
    check(REPRESENTATIVE[i], representative[i])


# The backward's static targets on Hopper (bf16, causal): wgmma, no spills, and at D=128
# an issue-to-tensor clock ratio R (triton_aot.describe) of at most 0.80 for both gradient kernels.
BACKWARD_TARGETS = [Variant(kind, BF16, d, True, cc=90) for kind in ("bwd_dkdv", "bwd_dq") for d in (64, 128)]


@pytest.fixture(scope="module")
def backward_targets():
    return describe_in_subprocess(BACKWARD_TARGETS)


@pytest.mark.parametrize("i", range(len(BACKWARD_TARGETS)), ids=[v.name for v in BACKWARD_TARGETS])
def test_backward_on_wgmma_without_spills(backward_targets, i):
    v, r = BACKWARD_TARGETS[i], backward_targets[i]
    check(v, r)
    assert r["wgmma"] and r["spill_bytes"] == 0, f"{v.name}: wgmma={r['wgmma']}, {r['spill_bytes']} B spilled"
    assert r["loop_mma"] > 0 and r["R"] == pytest.approx(r["issue_clk"] / r["mma_clk"])
    if v.head_dim == 128:
        assert r["R"] <= 0.80, f"{v.name}: R = {r['R']:.2f} > 0.80 (loop of {r['loop_sass']} SASS per warp)"


# The fused backward prototype (opt-in): compiles on both targets, dense and packed, with the dK/dV kernel's tiles,
# fits in shared memory, runs on wgmma on sm_90, and its steady loop holds the fifth product (dS K) beside
# the dK/dV kernel's four: more tensor-core instructions in the same loop (24 against 16 HGMMA, D = 64).
FUSED = [Variant("bwd_fused", BF16, 64, True, cc=90), Variant("bwd_fused_atomic", BF16, 128, False, cc=80),
         Variant("bwd_dkdv", BF16, 64, True, cc=90), Variant("bwd_fused", BF16, 128, True, cc=90, varlen=True)]


def test_fused_backward_compiles():
    rows = describe_in_subprocess(FUSED)
    for v, r in zip(FUSED, rows, strict=True):
        check(v, r)
    fused, _, dkdv, _ = rows
    assert fused["wgmma"] and (fused["block_m"], fused["block_n"]) == (dkdv["block_m"], dkdv["block_n"])
    assert fused["mma_clk"] == pytest.approx(dkdv["mma_clk"] * 5 / 4)
    assert fused["loop_mma"] > dkdv["loop_mma"], (fused["loop_mma"], dkdv["loop_mma"])


# The Blackwell targets: B200/B300 (sm_100) take the sm_90 tiles (227 KiB of shared memory per block, as H100),
# RTX 50-series (sm_120, 99 KiB per block) the sm_80 ones, which fit there (but for the forward where a rule
# decides or statistics are kept: 32 query rows, where the sm_80 tiles spill); the sm_90 tiles would not (the
# D = 128 forward's 128 x 128 tile takes 162 KiB). One forward and one gradient kernel each, and sm_120's decode
# kernel at D = 256, checked against the target's own limit, without spills (sm_100's dK/dV kernel spills on the
# sm_90 tiles: docs/BENCHMARKS.md); the whole table is benchmarks/kernel_resources.py --cc 80 90 100 120
# --generations.
BLACKWELL = [Variant("fwd", BF16, 128, True, EXACT, True, 120), Variant("bwd_dq", BF16, 128, True, cc=120),
             Variant("fwd", BF16, 128, True, EXACT, False, 100), Variant("bwd_dq", BF16, 64, True, cc=100),
             # the decode kernel's pipeline at D = 256: one K/V stage on sm_120 (two took 140 KiB there)
             Variant("decode", BF16, 256, True, EXACT, cc=120)]


def test_blackwell_targets_fit_their_shared_memory():
    assert [launch.tile_generation(cc) for cc in (80, 86, 89, 90, 100, 103, 110, 120, 121)] == [80, 80, 80, 90, 90,
                                                                                              90, 90, 120, 120]
    wide = launch.launch_constants("fwd", 128, BF16, 90, causal=True, window=False, softcap=False, dropout=False,
                                   kpm=False)
    assert launch.launch_constants("fwd", 128, BF16, 100, causal=True, window=False, softcap=False, dropout=False,
                                   kpm=False) == wide
    kw = dict(causal=True, window=False, softcap=False, dropout=False, kpm=False)
    # stabilize off without statistics: the sm_80 tile; where a rule decides or statistics are kept, 32 query
    # rows (the sm_80 tiles' 64 / 128 spill on sm_120)
    off = launch.launch_constants("fwd", 128, BF16, 120, mode=OFF, **kw)
    assert off == launch.launch_constants("fwd", 128, BF16, 80, mode=OFF, **kw) and not off[0]["TMA"]
    for d, warps in ((128, 8), (64, 4)):
        for stats in (False, True):
            consts, opts = launch.launch_constants("fwd", d, BF16, 120, mode=EXACT, stats=stats, **kw)
            assert (consts["BLOCK_M"], opts["num_warps"], consts["TMA"]) == (32, warps, False), (d, stats)
    for v, r in zip(BLACKWELL, describe_in_subprocess(BLACKWELL), strict=True):
        check(v, r)
        assert r["limit"] == launch.SHARED_LIMIT[v.cc] and r["spill_bytes"] == 0, f"{v.name}: {r}"


# The off target (bf16, sm_90): stabilize off without statistics, 128-key tiles whatever the
# partition (no rule sees it), R <= 0.65 at D = 128, wgmma and no spills at D = 64 / 128 either way.
OFF_TARGETS = [Variant("fwd", BF16, 128, True, OFF, False, 90), Variant("fwd", BF16, 64, False, OFF, False, 90)]


def test_forward_off_wide_key_tiles():
    for v, r in zip(OFF_TARGETS, describe_in_subprocess(OFF_TARGETS), strict=True):
        check(v, r)
        assert r["block_n"] == 128 and r["spill_bytes"] == 0, f"{v.name}: {r['block_n']} keys, {r['spill_bytes']} B"
        if v.head_dim == 128:
            assert r["R"] <= 0.65, f"{v.name}: R = {r['R']:.2f} > 0.65 (loop of {r['loop_sass']} SASS per warp)"


# The forward's targets on Hopper (bf16, causal and not, D = 64 / 128): the default 128-key partition
# on the 128 x 128 tile, 8 warps, in every mode; zero spills and wgmma; R(exact) <= 1.20 R(off) at both
# (docs/BENCHMARKS.md), R(exact + stats) <= 1.05 R(exact), and the absolute targets: exact R <= 0.80
# / 1.25, exact + stats <= 0.88 / 1.35, off <= 0.65 at D = 128.
RATIO_TARGET = 1.20
WIDE = [Variant("fwd", BF16, d, causal, mode, stats, 90)
        for d in (64, 128) for causal in (True, False)
        for mode, stats in ((OFF, False), (EXACT, False), (EXACT, True), (PAPER, False))]
WIDE += [Variant("fwd", BF16, 128, True, EXACT, False, 90, varlen=True),
         Variant("fwd", BF16, 64, True, EXACT, True, 90, varlen=True)]


@pytest.fixture(scope="module")
def wide():
    return {v.name: r for v, r in zip(WIDE, describe_in_subprocess(WIDE), strict=True)}


@pytest.mark.parametrize("v", WIDE, ids=lambda v: v.name)
def test_forward_128_key_partition_targets(wide, v):
    r = wide[v.name]
    check(v, r)
    assert (r["block_m"], r["block_n"], r["warps"]) == (128, 128, 8), f"{v.name}: {r['block_m']} x {r['block_n']}"
    assert r["wgmma"] and r["spill_bytes"] == 0, f"{v.name}: wgmma={r['wgmma']}, {r['spill_bytes']} B spilled"
    assert r["loop_mma"] > 0 and r["R"] == pytest.approx(r["issue_clk"] / r["mma_clk"])
    big = v.head_dim == 128
    if v.mode == OFF and big:
        assert r["R"] <= 0.65, f"{v.name}: R = {r['R']:.3f} > 0.65"
    if v.mode == EXACT:
        bound = (0.88 if big else 1.35) if v.stats else (0.80 if big else 1.25)
        assert r["R"] <= bound, f"{v.name}: R = {r['R']:.3f} > {bound} (loop of {r['loop_sass']} SASS per warp)"
    if v.mode == EXACT and not v.varlen:
        off = wide[Variant("fwd", BF16, v.head_dim, v.causal, OFF, False, 90).name]
        exact = wide[Variant("fwd", BF16, v.head_dim, v.causal, EXACT, False, 90).name]
        assert exact["R"] <= RATIO_TARGET * off["R"], (
            f"{v.name}: R(exact) = {exact['R']:.3f} > {RATIO_TARGET} x R(off) {off['R']:.3f}")
        if v.stats:
            assert r["R"] <= 1.05 * exact["R"], f"{v.name}: R = {r['R']:.3f} > 1.05 x {exact['R']:.3f}"


# D = 64 is the tightest case: without the row sum's two accumulators (triton_launch.row_sum_parts) its exact
# mode exceeds the bound (1.21x / 1.22x causal / not; docs/lab/forward-issue-rate.md)
@pytest.mark.parametrize("causal", [True, False])
def test_forward_d64_exact_within_20_percent_of_off(wide, causal):
    off, exact = (wide[Variant("fwd", BF16, 64, causal, mode, False, 90).name] for mode in (OFF, EXACT))
    assert exact["R"] <= RATIO_TARGET * off["R"], f"R(exact) {exact['R']:.3f} > {RATIO_TARGET} x R(off) {off['R']:.3f}"


# A 64-key partition set by the user keeps its own tiles (bf16, sm_90): at D = 128 two 64-key blocks
# per 128-key tile, the rule per block; at D = 64 one warpgroup over 128 query rows and one 64-key block
# per iteration; wgmma, no spills; the absolute bounds (exact 0.80 / 1.25, exact + stats 0.88 / 1.35).
FORCED_64 = [Variant("fwd", BF16, 128, True, EXACT, False, 90, block_n=64),
             Variant("fwd", BF16, 128, True, EXACT, True, 90, block_n=64),
             Variant("fwd", BF16, 64, True, EXACT, False, 90, block_n=64),
             Variant("fwd", BF16, 64, True, EXACT, True, 90, block_n=64)]


def test_forward_forced_64_key_partition_keeps_its_tiles():
    for v, r in zip(FORCED_64, describe_in_subprocess(FORCED_64), strict=True):
        check(v, r)
        tile = (128, 128, 8) if v.head_dim == 128 else (128, 64, 4)
        assert (r["block_m"], r["block_n"], r["warps"]) == tile and r["spill_bytes"] == 0, (
            f"{v.name}: {r['block_m']} x {r['block_n']}, {r['warps']} warps, {r['spill_bytes']} B")
        bound = (0.88 if v.head_dim == 128 else 1.35) if v.stats else (0.80 if v.head_dim == 128 else 1.25)
        assert r["R"] <= bound, f"{v.name}: R = {r['R']:.3f} > {bound}"


# sm_80 with the default 128-key partition (bf16, causal and not, D = 64 / 128, every mode, with and without
# statistics): no spills (fwd_config's table for it).
SM80 = [Variant("fwd", BF16, d, causal, mode, stats, 80)
        for d in (64, 128) for causal in (True, False) for mode in (OFF, EXACT, PAPER) for stats in (False, True)]


@pytest.mark.slow
def test_forward_sm80_without_spills():
    for v, r in zip(SM80, describe_in_subprocess(SM80), strict=True):
        check(v, r)
        assert r["spill_bytes"] == 0, f"{v.name}: {r['spill_bytes']} B spilled"


# DeepSeek-V3's 192 / 128 on sm_90: every kernel it runs, spill-free (docs/BENCHMARKS.md, "A value head dim")
MLA_SM90 = [Variant("fwd", BF16, 192, True, EXACT, stats, 90, value_dim=128) for stats in (False, True)]
MLA_SM90 += [Variant(kind, BF16, 192, True, EXACT, cc=90, value_dim=128) for kind in ("bwd_dkdv", "bwd_dq", "decode")]


@pytest.mark.slow
def test_unequal_head_dims_without_spills_on_sm90():
    for v, r in zip(MLA_SM90, describe_in_subprocess(MLA_SM90), strict=True):
        check(v, r)
        assert r["spill_bytes"] == 0, f"{v.name}: {r['spill_bytes']} B spilled"


@pytest.mark.slow
@pytest.mark.parametrize("variant", FULL, ids=lambda v: v.name)
def test_every_variant_compiles(variant):
    check(variant, describe_in_subprocess([variant])[0])


# Gemma 4's head dim 512 on sm_90: every kernel the launchers pick for it (the forward and decode in column chunks
# and V blocks, every mode, with and without statistics and the optional features; the backward's 16-row tiles),
# spill-free (triton_launch.wide_tiles, bwd_config; docs/lab/head-dim-512-kernels.md)
WIDE_SM90 = [Variant("fwd", BF16, 512, True, mode, stats, 90, features=f)
             for mode, stats, f in itertools.product((OFF, EXACT, PAPER), (False, True), (False, True))
             if not stats or mode == EXACT]
WIDE_SM90 += [Variant(kind, BF16, 512, True, cc=90, features=f) for kind in ("bwd_dkdv", "bwd_dq")
              for f in (False, True)]
WIDE_SM90 += [Variant("decode", BF16, 512, True, mode, cc=90, features=f) for mode in (OFF, EXACT, PAPER)
              for f in (False, True)]


@pytest.mark.slow
def test_head_dim_512_without_spills_on_sm90():
    for v, r in zip(WIDE_SM90, describe_in_subprocess(WIDE_SM90), strict=True):
        check(v, r)
        assert r["spill_bytes"] == 0, f"{v.name}: {r['spill_bytes']} B spilled"
