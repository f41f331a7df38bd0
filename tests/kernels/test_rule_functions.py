"""The stabilization rule is one function per backend, and both give the same bits.

``triton_forward.shifted_offset`` / ``block_offset`` / ``row_top2`` (the kernel's) and
``rules.shifted_offset`` / ``reference.block_offset`` / ``reference.row_top2`` (the PyTorch path's)
are called on constructed rows: maxima above, below and at zero, tiny and huge, ``-inf`` (no key
seen), and second maxima exactly at the tie threshold and one fp32 step either side of it. Under
``TRITON_INTERPRET=1`` the Triton functions run through NumPy in fp32, the arithmetic the GPU does
for these per-row operations; the one place where GPU and interpreter could round differently
(multiply-add contraction) is pinned off and checked on the compiled kernel below.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from stable_attn import rules
from stable_attn.kernels import reference
from stable_attn.kernels import triton_attention as ta
from stable_attn.kernels import triton_forward as tf
from stable_attn.options import Options

MODES = (rules.MODE_EXACT, rules.MODE_PAPER, rules.MODE_OFF)
INF = math.inf


@triton.jit
def _shifted_offset_kernel(M, Out, beta, min_shift2, max_shift2, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Out + i, tf.shifted_offset(tl.load(M + i), beta, min_shift2, max_shift2))


@triton.jit
def _block_offset_kernel(R, Mnew, Mblk, M2blk, Rnew, Fire, tie2, min_shift2, max_shift2, beta,
                         N: tl.constexpr, MODE: tl.constexpr):
    i = tl.arange(0, N)
    r_new, fire = tf.block_offset(tl.load(R + i), tl.load(Mnew + i), tl.load(Mblk + i), tl.load(M2blk + i),
                                  tie2, min_shift2, max_shift2, beta, MODE)
    tl.store(Rnew + i, r_new)
    tl.store(Fire + i, fire.to(tl.int8))


@triton.jit
def _top2_kernel(S, Top, Second, N: tl.constexpr, BN: tl.constexpr, BY_COUNT: tl.constexpr):
    s = tl.load(S + tl.arange(0, N)[:, None] * BN + tl.arange(0, BN)[None, :])
    if BY_COUNT:  # the form the interpreter runs inside the forward kernel
        top, second = tf.row_top2_by_count(s)
    else:  # the pairwise reduction the GPU runs
        top, second = tf.row_top2(s)
    tl.store(Top + tl.arange(0, N), top)
    tl.store(Second + tl.arange(0, N), second)


@triton.jit
def _halves_top2_kernel(S, Top, Second, N: tl.constexpr, BN: tl.constexpr):
    s = tl.load(S + tl.arange(0, N)[:, None] * (2 * BN) + tl.arange(0, 2 * BN)[None, :])
    top_a, second_a, top_b, second_b = tf.halves_top2(s, BN)
    rows = tl.arange(0, N) * 2
    tl.store(Top + rows, top_a)
    tl.store(Top + rows + 1, top_b)
    tl.store(Second + rows, second_a)
    tl.store(Second + rows + 1, second_b)


def _pad(x: torch.Tensor, fill: float) -> tuple[torch.Tensor, int]:
    n = triton.next_power_of_2(max(16, x.numel()))
    return torch.cat([x, torch.full((n - x.numel(),), fill)]).contiguous(), n


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as fp32 bit patterns, every NaN counting as the same value."""
    a, b = a.float(), b.float()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def constructed_maxima() -> torch.Tensor:
    """Row maxima (base 2) where the rule's branches and clamps change: sign, zero, tiny, huge, -inf."""
    tiny = [1e-30, 1e-38, 1.4e-45]  # the last is fp32's smallest subnormal
    huge = [1e4, 3e38, INF]
    mid = [0.25, 0.7213, 1.0, 3.0, 40.0, 92.3, 200.0]
    vals = [0.0, -0.0, -INF] + tiny + huge + mid
    vals += [-v for v in tiny + huge + mid if v != INF]
    return torch.tensor(vals, dtype=torch.float32)


def constants():
    """(tie2, min_shift2, max_shift2, beta) of every dtype and mode, with betas whose beta - 1 rounds in fp32."""
    out = {(*rules.rule_constants(dtype, mode), beta)
           for dtype, mode, beta in itertools.product(rules.SUPPORTED_DTYPES, MODES, (2.0, 1.3, 8.0, 1.0000001))}
    return sorted(out)


@pytest.mark.parametrize("c", constants(), ids=lambda c: f"tie{c[0]:.3g}-min{c[1]:.3g}-max{c[2]:.3g}-beta{c[3]}")
def test_shifted_offset_twins_give_the_same_bits(c):
    _, min_shift2, max_shift2, beta = c
    m = constructed_maxima()
    want = rules.shifted_offset(m, beta, min_shift2, max_shift2)
    mp, n = _pad(m, 0.0)
    got = torch.empty(n)
    _shifted_offset_kernel[(1,)](mp, got, beta, min_shift2, max_shift2, N=n)
    assert same_bits(got[:m.numel()], want), (m, got[:m.numel()], want)
    # and the offset lies where ALGORITHM.md says: m + clamp(shift, MIN, MAX) for finite m
    fin = torch.isfinite(m) & (m.abs() < 1e30)
    shift = (want - m)[fin].double()
    assert (shift >= min_shift2 - 1e-5 * (1 + m[fin].abs().double())).all()
    assert (shift <= max_shift2 + 1e-5 * (1 + m[fin].abs().double())).all()


def constructed_rows(tie2: float) -> tuple[torch.Tensor, ...]:
    """``(r, m_new, m_blk, m2_blk)`` per row: block maxima from constructed_maxima, running states before
    them (no key yet, a lower max, a higher max, an offset already shifted), and second maxima at the
    tie threshold of the offset the rule would use, one fp32 step either side, equal to the max, absent.
    Before a row's first key its offset is -FP32_MAX, as both backends start it."""
    rows = []
    for m_blk in constructed_maxima().tolist():
        for m_old, r_shift in ((-INF, None), (m_blk - 1.0, 0.0), (m_blk + 2.0, 0.0), (m_blk, 0.5), (m_blk, 64.0)):
            r_old = -rules.FP32_MAX if r_shift is None else m_old + r_shift
            if not math.isfinite(m_old) and r_shift is not None:
                continue
            m_new = max(m_old, m_blk)
            r_cand = max(r_old, m_blk)
            thresholds = {r_cand - tie2, m_blk - tie2}  # exact mode's and paper mode's
            seconds = {m_blk, -INF}
            for t in thresholds:
                t32 = torch.tensor(t, dtype=torch.float32)
                seconds |= {float(t32), float(torch.nextafter(t32, torch.tensor(INF))),
                            float(torch.nextafter(t32, torch.tensor(-INF)))}
            for m2 in seconds:
                if m2 <= m_blk or math.isnan(m2):
                    rows.append((r_old, m_new, m_blk, m2))
    return tuple(torch.tensor(col, dtype=torch.float32) for col in zip(*rows))


@pytest.mark.parametrize("mode", MODES, ids=["exact", "paper", "off"])
@pytest.mark.parametrize("dtype", rules.SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("beta", [2.0, 1.3])
def test_block_offset_twins_give_the_same_bits(mode, dtype, beta):
    tie2, min_shift2, max_shift2 = rules.rule_constants(dtype, mode)
    r, m_new, m_blk, m2 = constructed_rows(tie2)
    want_r, want_fire = reference.block_offset(r, m_new, m_blk, m2, tie2, min_shift2, max_shift2, beta, mode)
    padded = [_pad(x, -INF)[0] for x in (r, m_new, m_blk, m2)]
    n = padded[0].numel()
    got_r, got_fire = torch.empty(n), torch.empty(n, dtype=torch.int8)
    _block_offset_kernel[(1,)](*padded, got_r, got_fire, tie2, min_shift2, max_shift2, beta, N=n, MODE=mode)
    k = r.numel()
    assert same_bits(got_r[:k], want_r)
    assert torch.equal(got_fire[:k].bool(), want_fire)
    if mode == rules.MODE_OFF:
        assert not want_fire.any()
        return
    # the constructed rows reach both sides of the trigger, and the trigger is the documented one
    assert want_fire.any() and (~want_fire).any()
    t = (torch.maximum(r, m_blk) if mode == rules.MODE_EXACT else m_blk) - tie2
    assert torch.equal(want_fire, (m2 >= t) & (m_blk > -INF) & ((m_blk != 0) | (mode == rules.MODE_EXACT)))
    fired = want_fire & (mode == rules.MODE_EXACT)
    assert same_bits(want_r[fired], rules.shifted_offset(m_new, beta, min_shift2, max_shift2)[fired])


@pytest.mark.parametrize("by_count", [False, True])
@pytest.mark.parametrize("bn", [16, 64])
def test_top2_twins_and_the_per_element_count(bn, by_count):
    """Second-largest with multiplicity: ``second >= t`` iff ``count(s >= t) >= 2``, on tie-heavy rows;
    both kernel forms (GPU: pairwise reduction; interpreter: built-in reductions) select the same values."""
    g = torch.Generator().manual_seed(bn)
    n = 64
    s = torch.randint(-3, 4, (n, bn), generator=g).float() * 0.5  # many exact ties
    s[::3, ::2] = -INF  # masked keys
    s[5] = -INF  # a row that sees nothing
    s[6, :] = -INF
    s[6, 7] = 2.0  # a single visible key
    s[7] += torch.rand(bn, generator=g) * 1e-3  # near-ties
    got_top, got_second = torch.empty(n), torch.empty(n)
    _top2_kernel[(1,)](s.contiguous(), got_top, got_second, N=n, BN=bn, BY_COUNT=by_count)
    top, second = reference.row_top2(s)
    assert same_bits(got_top, top) and same_bits(got_second, second)
    assert same_bits(top, s.amax(-1))
    for t in torch.unique(s[torch.isfinite(s)]).tolist() + [-INF]:
        assert torch.equal(second >= t, (s >= t).sum(-1) >= 2)


@pytest.mark.parametrize("bn", [16, 64])
def test_top2_of_both_halves_at_once(bn):
    """``halves_top2`` (the two-block key tile's reduction on the GPU; the interpreter's forward takes
    ``row_top2_by_count`` per block instead) gives ``row_top2`` of each ``bn``-key half, bit for bit,
    on tie-heavy rows: ties inside one half, across the halves only, masked halves, one key."""
    g = torch.Generator().manual_seed(bn + 1)
    n = 32
    s = torch.randint(-3, 4, (n, 2 * bn), generator=g).float() * 0.5
    s[::3, ::2] = -INF
    s[4, :bn] = -INF  # first half sees nothing
    s[5, bn:] = -INF  # second half sees nothing
    s[6, :] = -INF
    s[6, 3] = 1.0
    s[6, bn + 3] = 1.0  # one key per half, equal across the halves: neither half ties
    s[7] += torch.rand(2 * bn, generator=g) * 1e-3
    top, second = torch.empty(2 * n), torch.empty(2 * n)
    _halves_top2_kernel[(1,)](s.contiguous(), top, second, N=n, BN=bn)
    want_top, want_second = reference.row_top2(s.view(n * 2, bn))  # rows (i, half)
    assert same_bits(top, want_top) and same_bits(second, want_second)
    assert second[12] == -INF and second[13] == -INF and top[12] == top[13] == 1.0


def _fused_ops_in_forward_loop(fusion: bool | None, mode: int = rules.MODE_EXACT) -> int:
    """FFMAs in the steady-state loop of the bf16 D=128 forward for sm_90 (compiled in a child process:
    this one runs the interpreter). ``fusion=None``: the launcher's options."""
    code = f"""
import json, torch
from stable_attn import rules
from stable_attn.kernels import triton_aot as aot, triton_launch as launch
import triton
from triton.backends.compiler import GPUTarget
v = aot.Variant("fwd", torch.bfloat16, 128, True, {mode!r}, False, 90)
src, opts = aot.source(v)
opts.update(launch.FWD_COMPILE_OPTIONS if {fusion!r} is None else dict(enable_fp_fusion={fusion!r}))
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
instrs = aot.parse_sass(aot.sass_of(k.asm["cubin"]))
loop = aot.steady_loop(instrs)
print(sum(1 for a, i in instrs if loop.start <= a <= loop.end and i.split()[0].startswith("FFMA")))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.strip().splitlines()[-1])


def test_forward_rounds_like_the_reference_on_the_gpu(monkeypatch):
    """``P-bar = exp2(fma(x, scale, -r))`` is the loop's only FFMA, one per score element of a thread
    (128 x 128 tiles, 8 warps: 64, for exact mode's two 64-key blocks per tile as for stabilize off's
    128-key blocks), in every block and as reference.fma_f32 rounds; contraction would fuse more
    (stabilize off's row-sum update), so the launch options pin it off."""
    assert _fused_ops_in_forward_loop(None) == 64
    assert _fused_ops_in_forward_loop(None, rules.MODE_OFF) == 64
    assert _fused_ops_in_forward_loop(True, rules.MODE_OFF) > 64  # the check sees contraction where it happens
    launched = {}

    class Kernel:  # the launcher's call, recorded instead of run
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.update(kwargs)

    monkeypatch.setattr(ta, "attn_fwd_kernel", Kernel())
    q = torch.zeros(1, 1, 16, 16, dtype=torch.bfloat16)
    ta.forward(q, q, q, None, Options(), False)
    assert launched["enable_fp_fusion"] is False

