"""One BF16 addition, bit by bit: where the rounding error the paper is about comes from.

BF16 keeps 1 sign bit, 8 exponent bits and 7 stored significand bits (8 significant bits with the
implicit leading 1). When two numbers of the same sign and similar magnitude are added, the exact
sum can need one more significant bit than either operand: the significand overflows, the sum is
renormalised by a one-bit right shift, and the bit shifted out decides the rounding. With
round-to-nearest-even, a shifted-out 1 with nothing behind it is an exact tie, broken towards the
even significand. :func:`explain_add` computes every step with exact integer arithmetic so a test
can check each of them against torch's own BF16 addition.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from fractions import Fraction

import torch

STORED_BITS = 7  # bf16 significand bits after the implicit leading 1
PRECISION = STORED_BITS + 1
EXP_BIAS = 127


def bf16_bits(x: float) -> int:
    """The 16-bit pattern of ``x`` rounded to bfloat16 (round-to-nearest-even, as torch casts)."""
    t = torch.tensor([float(x)], dtype=torch.float32).to(torch.bfloat16)
    return int(t.view(torch.int16).item()) & 0xFFFF


def bits_to_float(bits: int) -> float:
    """The value of a 16-bit bfloat16 pattern (exact: a bf16 is the top half of an fp32)."""
    return struct.unpack(">f", struct.pack(">I", (bits & 0xFFFF) << 16))[0]


def round_bf16(x: Fraction | float) -> Fraction:
    """Round an exact rational to the nearest bfloat16 (ties to even), for normal-range values.

    Independent of torch on purpose: the test compares this against torch's arithmetic.
    """
    x = Fraction(x)
    if x == 0:
        return Fraction(0)
    sign = -1 if x < 0 else 1
    mag = abs(x)
    e = math.floor(math.log2(mag))  # may be off by one for values near a power of two: fix below
    while Fraction(2) ** e > mag:
        e -= 1
    while Fraction(2) ** (e + 1) <= mag:
        e += 1
    step = Fraction(2) ** (e - STORED_BITS)
    q, rem = divmod(mag, step)
    half = step / 2
    if rem > half or (rem == half and q % 2 == 1):
        q += 1
    return sign * q * step


@dataclass(frozen=True)
class Operand:
    """A normal bf16 number split into its fields."""

    value: float
    bits: int  # 16-bit pattern
    sign: int  # 0 or 1
    biased_exponent: int  # 8 bits
    fraction: int  # 7 stored bits
    significand: int  # 8 bits with the implicit leading 1, i.e. 1.fraction * 2^7
    exponent: int  # unbiased: value = (-1)^sign * significand * 2^(exponent - 7)

    def pattern(self) -> str:
        """``s eeeeeeee fffffff``."""
        return f"{self.sign} {self.biased_exponent:08b} {self.fraction:07b}"

    def binary(self) -> str:
        """``-1.0011010 x 2^1``."""
        s = f"{self.significand:08b}"
        return f"{'-' if self.sign else '+'}{s[0]}.{s[1:]} x 2^{self.exponent}"


def decompose(x: float, name: str = "x") -> Operand:
    """Split a bf16-representable normal number into sign, exponent and significand."""
    if not isinstance(x, (int, float)) or not math.isfinite(x) or x == 0:
        raise ValueError(f"{name}={x!r} must be a finite, non-zero number")
    bits = bf16_bits(x)
    if bits_to_float(bits) != x:
        raise ValueError(f"{name}={x!r} is not exactly representable in bfloat16 (nearest is {bits_to_float(bits)!r})")
    sign, biased, frac = bits >> 15, (bits >> 7) & 0xFF, bits & 0x7F
    if biased == 0:
        raise ValueError(f"{name}={x!r} is subnormal in bfloat16; the walk-through covers normal numbers")
    return Operand(float(x), bits, sign, biased, frac, (1 << STORED_BITS) | frac, biased - EXP_BIAS)


@dataclass(frozen=True)
class AdditionTrace:
    """Every step of ``a + b`` in bfloat16 with round-to-nearest-even."""

    a: Operand
    b: Operand
    alignment_shift: int  # how far the smaller operand's significand moves right to align
    exact_sum: Fraction  # a + b, exact
    sum_significand_bits: str  # the exact sum's significand in binary, leading 1 first
    sum_exponent: int  # unbiased exponent of the exact sum
    carry: bool  # the significand overflowed: the exponent grew beyond max(exp a, exp b)
    renormalise_shift: int  # right shifts that bring the exact sum back to 8 significant bits
    kept_bits: str  # the 8 significant bits kept before rounding
    shifted_out: str  # the bits that do not fit (first one = the round bit)
    tie: bool  # exactly half an ulp was shifted out
    rounded_up: bool  # the kept significand was incremented (magnitude grew)
    result: float  # the bf16 result
    error: Fraction  # result - exact_sum
    ulp: Fraction  # spacing of bf16 numbers at the result's exponent (before any rounding carry)

    @property
    def direction(self) -> str:
        """Where the rounding moved the result: "exact", "toward zero" or "away from zero"."""
        if self.error == 0:
            return "exact"
        return "away from zero" if (self.error > 0) == (self.exact_sum > 0) else "toward zero"

    def lines(self) -> list[str]:
        """A printable walk-through."""
        a, b = self.a, self.b
        return [
            f"a = {a.value!r:>12}  bits {a.pattern()}  = {a.binary()}",
            f"b = {b.value!r:>12}  bits {b.pattern()}  = {b.binary()}",
            f"align: shift the smaller significand right by {self.alignment_shift}",
            f"exact sum = {float(self.exact_sum)!r} = {'-' if self.exact_sum < 0 else '+'}"
            f"{self.sum_significand_bits[0]}.{self.sum_significand_bits[1:]} x 2^{self.sum_exponent} "
            f"({len(self.sum_significand_bits)} significant bits)",
            f"significand overflow (carry): {self.carry}; renormalise: shift right by {self.renormalise_shift}",
            f"kept {self.kept_bits[0]}.{self.kept_bits[1:]}  shifted out '{self.shifted_out}'  "
            f"tie: {self.tie}  -> round {'up' if self.rounded_up else 'down'} in magnitude"
            + (" (to even)" if self.tie else ""),
            f"bf16 result = {self.result!r}; error = result - exact = {float(self.error)!r} "
            f"= {self.error / self.ulp} ulp ({self.direction})",
        ]


def explain_add(a: float, b: float) -> AdditionTrace:
    """Walk through ``a + b`` in bfloat16 (round-to-nearest-even) with exact integer arithmetic.

    Both operands must be normal bf16 numbers and the sum must be non-zero. The result agrees with
    ``torch.tensor(a, dtype=torch.bfloat16) + torch.tensor(b, dtype=torch.bfloat16)`` (tested).
    """
    oa, ob = decompose(a, "a"), decompose(b, "b")
    exact = Fraction(a) + Fraction(b)
    if exact == 0:
        raise ValueError(f"a={a!r} and b={b!r} cancel exactly; the walk-through needs a non-zero sum")
    big, small = (oa, ob) if oa.exponent >= ob.exponent else (ob, oa)
    align = big.exponent - small.exponent
    # integer significand of |exact| in units of 2^(small.exponent - 7): exact with no rounding
    unit = Fraction(2) ** (small.exponent - STORED_BITS)
    mag_units = abs(exact) / unit
    assert mag_units.denominator == 1
    mag = int(mag_units)
    width = mag.bit_length()
    sum_exponent = small.exponent + width - PRECISION
    bits = f"{mag:b}"
    shift = max(width - PRECISION, 0)
    kept = bits[:PRECISION] if shift else bits.ljust(PRECISION, "0")
    out = bits[PRECISION:] if shift else ""
    tie = out != "" and out[0] == "1" and set(out[1:]) <= {"0"}
    result = round_bf16(exact)
    ulp = Fraction(2) ** (sum_exponent - STORED_BITS)
    return AdditionTrace(
        a=oa, b=ob, alignment_shift=align, exact_sum=exact, sum_significand_bits=bits.rstrip("0") or "1",
        sum_exponent=sum_exponent, carry=sum_exponent > big.exponent, renormalise_shift=shift,
        kept_bits=kept, shifted_out=out, tie=tie, rounded_up=abs(result) > int(kept, 2) * ulp,
        result=float(result), error=result - exact, ulp=ulp,
    )


def ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at ``|x|`` (elementwise, float64); the smallest normal's for 0."""
    mag = x.abs().double().clamp(min=2.0**-126)
    return torch.exp2(torch.floor(torch.log2(mag)) - STORED_BITS)


if __name__ == "__main__":  # python -m stable_attn.numerics.bf16
    for line in explain_add(-2.40625, -2.296875).lines():
        print(line)
