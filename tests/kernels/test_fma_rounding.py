"""``P-bar = exp2(fma(x, qk_scale2, -r))``, rounded once, on both backends (docs/ALGORITHM.md, "Rounding points").

``reference.fma_f32`` is checked against exact rational arithmetic (``fractions.Fraction``; this Python has
no ``math.fma``) on random fp32 triples and on constructed double-rounding cases, where rounding the fp64
sum to fp32 gives another answer (asserted, so the check can fail); the interpreter's ``tl.fma`` (what the
kernel uses) against it. Then the forward: its decisions are bit-identical to those of the two-rounding
formula it replaced (the same reference with ``fused_scale`` off, the path softcap keeps), and the kernel's
``P-bar`` has the reference's bits where both take the same ``exp2``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import triton
import triton.language as tl
from test_forward_decisions import CASES, tie_heavy
from triton.runtime import interpreter

from stable_attn import rules
from stable_attn.kernels import reference
from stable_attn.kernels import triton_attention as ta
from stable_attn.kernels import triton_launch as launch
from stable_attn.options import Options

INF = math.inf


def rn32(v: Fraction) -> float:
    """The fp32 nearest to ``v`` (ties to even), with subnormals and overflow to inf: the oracle."""
    if v == 0:
        return 0.0
    sign, a = (-1.0 if v < 0 else 1.0), abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2^e <= a < 2^(e+2)
    if Fraction(2) ** e > a:
        e -= 1
    if Fraction(2) ** (e + 1) <= a:
        e += 1
    ulp = Fraction(2) ** (max(e, -126) - 23)
    n, rest = divmod(a, ulp)
    if 2 * rest > ulp or (2 * rest == ulp and n % 2 == 1):
        n += 1
    out = n * ulp
    return sign * (INF if out >= 2**128 else float(out))


def exact_fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return torch.tensor([rn32(Fraction(x) * Fraction(y) + Fraction(z))
                         for x, y, z in zip(a.tolist(), b.tolist(), c.tolist(), strict=True)])


def naive_fma(a, b, c):
    return (a.double() * b.double() + c.double()).float()


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x.view(torch.int32), y.view(torch.int32))


def random_triples(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
    b = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
    c = torch.randn(n, generator=g) * torch.exp2(torch.randint(-90, 90, (n,), generator=g).float())
    near = torch.rand(n, generator=g) < 0.3  # cancellation: c close to -a*b
    c = torch.where(near, -(a.double() * b.double()).float() * (1 + torch.randn(n, generator=g) * 1e-6), c)
    tiny = torch.rand(n, generator=g) < 0.1  # results in fp32's subnormal range
    a = torch.where(tiny, a * 2.0**-80, a)
    c = torch.where(tiny, c * 2.0**-160, c)
    return a, b, c


def double_rounding_triples(n: int, seed: int):
    """``a * b = ±h (1 + 2^-46)``, ``h`` half an ulp of ``c``, ``c`` with an even significand: the fp64 sum
    is the fp32 midpoint ``c ± h`` (the ``2^-46`` part is lost), which ties to ``c``, while the exact value
    lies just past the midpoint and rounds away from ``c``. ``2^46 + 1 = (2^23 + 2^12 + 1)(2^23 - 2^12 + 1)``."""
    g = torch.Generator().manual_seed(seed)
    mant = (torch.randint(2**22, 2**23, (n,), generator=g) * 2).double()  # even significand, 24 bits
    e = torch.randint(-60, 60, (n,), generator=g)  # a, b and c stay normal
    sign_c = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    sign_p = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    c = sign_c * mant * torch.exp2((e - 23).double())  # |c| in [2^e, 2^(e+1))
    split = torch.randint(-10, 10, (n,), generator=g)
    a = (2.0**23 + 2.0**12 + 1) * torch.exp2((split - 23).double())
    b = sign_p * (2.0**23 - 2.0**12 + 1) * torch.exp2((e - 24 - split - 23).double())
    return a.float(), b.float(), c.float()


def test_fma_f32_is_exactly_rounded_on_random_triples():
    a, b, c = random_triples(3000, seed=1)
    want = exact_fma(a, b, c)
    assert same_bits(reference.fma_f32(a, b, c), want)
    # the rounding-to-odd path, which fma_f32 takes only for midpoints and subnormal results, on every entry
    assert same_bits(reference._fma_f32_round_to_odd(a, b.double(), c), want)


def test_fma_f32_on_double_rounding_cases():
    a, b, c = double_rounding_triples(500, seed=2)
    assert torch.equal((a.double() * b.double()), a.double() * b.double())  # the products are exact in fp64
    want = exact_fma(a, b, c)
    assert (naive_fma(a, b, c) != want).all()  # each case fools fp64-then-fp32 rounding
    assert same_bits(reference.fma_f32(a, b, c), want)
    # exact midpoints (no 2^-46 part) tie to the even neighbour: here fp64-then-fp32 is right too
    a_mid = torch.exp2(torch.frexp(c.abs())[1].double() - 25).float()
    assert same_bits(reference.fma_f32(a_mid, torch.ones_like(c), c), exact_fma(a_mid, torch.ones_like(c), c))


def test_fma_f32_special_values():
    a = torch.tensor([-INF, -INF, INF, INF, math.nan, 1.0, 0.0, -0.0, 2.0**100, -INF])
    b = torch.tensor([0.25, 3.0, 0.5, 1.0, 1.0, math.nan, 5.0, 5.0, 2.0**100, 1.0])
    c = torch.tensor([-7.0, 2.0**120, 1.0, -INF, 0.0, 1.0, -0.0, 0.0, 1.0, INF])
    got = reference.fma_f32(a, b, c)
    want = torch.tensor([-INF, -INF, INF, math.nan, math.nan, math.nan, 0.0, 0.0, INF, math.nan])
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert same_bits(got[ok], want[ok])  # incl. +0 for 0 * 5 + (-0) and (-0) * 5 + 0
    # masked scores: -inf for every finite positive scale and finite offset, never NaN
    masked = reference.fma_f32(torch.full((4,), -INF), 0.3, torch.tensor([0.0, -1e30, 1e30, -0.0]))
    assert torch.equal(masked, torch.full((4,), -INF))
    # a float b is the fp32 kernel argument: rounded to fp32 before the product
    x = torch.tensor([3.0])
    assert same_bits(reference.fma_f32(x, 0.1, torch.zeros(1)), exact_fma(x, torch.tensor([0.1]), torch.zeros(1)))


@triton.jit
def _fma_kernel(A, B, C, Out, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Out + i, tl.fma(tl.load(A + i), tl.load(B + i), tl.load(C + i)))


@pytest.mark.parametrize("kind", ["random", "double_rounding"])
def test_kernel_fma_is_the_reference_twin(kind):
    """The interpreter's ``tl.fma`` rounds once (as the GPU's FFMA): the same bits as ``fma_f32``."""
    a, b, c = random_triples(1024, 3) if kind == "random" else double_rounding_triples(1024, 4)
    out = torch.empty(1024)
    _fma_kernel[(1,)](a, b, c, out, N=1024)
    assert same_bits(out, reference.fma_f32(a, b, c))
    if kind == "double_rounding":
        assert (out != naive_fma(a, b, c)).all()


def test_scale_outside_fp32_normal_range_is_refused():
    """Scaling the block maxima after taking them needs a positive finite fp32 score scale."""
    for bad in (1e-39, 1e39):
        with pytest.raises(ValueError) as info:
            Options.create(head_dim=16, scale=bad)
        assert f"scale={bad!r} must be a finite positive number or None" in str(info.value)
        assert "scale * log2(e) in fp32's normal range" in str(info.value)
    assert Options.create(head_dim=16, scale=1e-30).qk_scale2 > 0


def _recorded_forward(q, k, v, kpm, opts, fused: bool, monkeypatch):
    """The PyTorch forward with its per-block ``(r_new, fire)``; ``fused=False`` walks the two-rounding scores
    (``s2 = fl(x * qk_scale2)``, ``P-bar = exp2(fl(s2 - r))``) the forward used before, as softcap still does."""
    calls = []
    rule = reference.block_offset

    def recording(*args):
        calls.append(rule(*args))
        return calls[-1]

    with monkeypatch.context() as mp:
        mp.setattr(reference, "block_offset", recording)
        if not fused:
            mp.setattr(reference.Problem, "fused_scale", property(lambda self: False))
        out, lse, rs = reference.attention_forward(q, k, v, kpm, None, opts, True)
    return out, lse, rs, calls


DECISION_STATS = ("saturated", "fixed_blocks", "max_logit")


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_decisions_are_those_of_the_two_rounding_formula(case, monkeypatch):
    """Maxima of the unscaled scores, scaled after: every offset, fire and statistic keeps its bits."""
    dtype, mode, level, step, scale, block_n, causal, with_kpm = case
    q, k, v = tie_heavy(1, 2, 130, 16, dtype, seed=7 + block_n, level=level, step=step)
    kpm = (torch.rand(1, 130, generator=torch.Generator().manual_seed(5)) > 0.2) if with_kpm else None
    opts = Options(causal=causal, scale=scale, mode=mode, block_n=block_n)
    out, lse, rs, calls = _recorded_forward(q, k, v, kpm, opts, True, monkeypatch)
    old_out, old_lse, old_rs, old_calls = _recorded_forward(q, k, v, kpm, opts, False, monkeypatch)
    assert len(calls) == len(old_calls)
    for (r_new, fire), (old_r, old_fire) in zip(calls, old_calls, strict=True):
        assert torch.equal(fire, old_fire) and same_bits(r_new, old_r)
    for name in DECISION_STATS:
        a, b = getattr(rs, name), getattr(old_rs, name)
        assert torch.equal(a, b) if a.dtype != torch.float32 else same_bits(a, b), name
    if mode != rules.MODE_OFF:
        assert rs.fixed_blocks.any() and rs.saturated.any()  # the inputs do tie
    # P-bar moved by at most half an ulp of s2 in its exponent; lse and the sink's share follow
    torch.testing.assert_close(lse, old_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rs.sink_mass, old_rs.sink_mass, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.float(), old_out.float(), rtol=0, atol=2 * torch.finfo(dtype).eps)

    _, k_lse, st = ta.forward(q, k, v, kpm, opts, True, config=launch.FwdConfig(block_m=32, num_warps=4, num_stages=1))
    for name in DECISION_STATS:
        a, b = getattr(st, name), getattr(old_rs, name)
        assert torch.equal(a, b) if a.dtype != torch.float32 else same_bits(a, b), name
    torch.testing.assert_close(k_lse, lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", [rules.MODE_EXACT, rules.MODE_OFF])
def test_kernel_p_bar_has_the_reference_bits(mode, monkeypatch):
    """Two visible keys per row, fp32, ``v`` one-hot and ``q.k`` exact: ``out[:, j] = P-bar_j / (P-bar_a + P-bar_b)``
    in any summation order, so with the interpreter's ``exp2`` replaced by ``torch.exp2`` (NumPy's differs in the
    last bit) the kernel's outputs carry the reference's ``P-bar`` bits; the two-rounding formula's differ."""
    g = torch.Generator().manual_seed(11)
    N, D = 64, 64
    q = torch.randint(-8, 9, (1, 1, N, D), generator=g).float() * 0.25  # q.k exact in fp32, any order
    k = torch.randint(-8, 9, (1, 1, N, D), generator=g).float() * 0.25
    v = torch.eye(N, D)[None, None]
    kpm = torch.zeros(1, N, dtype=torch.bool)
    kpm[0, [5, 40]] = True
    opts = Options(scale=0.3, mode=mode, block_n=32)  # qk_scale2 with a full significand: x * c rounds
    out, lse, _, _ = _recorded_forward(q, k, v, kpm, opts, True, monkeypatch)
    old_out, _, _, _ = _recorded_forward(q, k, v, kpm, opts, False, monkeypatch)
    assert not torch.equal(out, old_out)  # the single rounding shows in these bits
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_exp2",
                        lambda self, arg: self.unary_op(arg, lambda a: torch.exp2(torch.from_numpy(a)).numpy()))
    k_out, k_lse, _ = ta.forward(q, k, v, kpm, opts, False,
                                 config=launch.FwdConfig(block_m=32, num_warps=4, num_stages=1))
    assert same_bits(k_out, out)
    torch.testing.assert_close(k_lse, lse, rtol=1e-6, atol=1e-6)
