"""``P-bar = exp2(fma(x, qk_scale2, -r))``, rounded once, on both backends (docs/ALGORITHM.md, "Rounding points").

``reference.fma_f32`` is checked against exact rational arithmetic (``fractions.Fraction``; this Python has
no ``math.fma``) on random fp32 triples and on constructed double-rounding cases, where rounding the fp64
sum to fp32 gives another answer (asserted, so the check can fail); the interpreter's ``tl.fma`` (what the
kernel uses) against it.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import triton
import triton.language as tl

from stable_attn.kernels import reference
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
    assert same_bits(reference.fma_f32(a, b, c), exact_fma(a, b, c))


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
