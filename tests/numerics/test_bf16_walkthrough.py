"""The bit-level walk-through of one BF16 addition, checked against torch's own BF16 arithmetic."""

from fractions import Fraction

import pytest
import torch

from stable_attn.numerics.bf16 import bf16_bits, bits_to_float, decompose, explain_add, round_bf16, ulp_bf16


def torch_add(a: float, b: float) -> float:
    return (torch.tensor(a, dtype=torch.bfloat16) + torch.tensor(b, dtype=torch.bfloat16)).item()


def test_paper_example_step_by_step():
    tr = explain_add(-2.40625, -2.296875)
    # operands: both -1.xxxxxxx * 2^1, sign 1, biased exponent 128
    assert tr.a.pattern() == "1 10000000 0011010"
    assert tr.b.pattern() == "1 10000000 0010011"
    assert tr.a.bits == 0xC01A and tr.b.bits == 0xC013
    assert (tr.a.significand, tr.b.significand) == (0b10011010, 0b10010011)
    assert tr.a.exponent == tr.b.exponent == 1
    assert tr.alignment_shift == 0
    # exact sum needs 9 significant bits: 1.00101101 * 2^2
    assert tr.exact_sum == Fraction(-4703125, 1000000) == Fraction(-301, 64)
    assert tr.sum_significand_bits == "100101101"
    assert tr.sum_exponent == 2
    assert tr.carry  # significand overflow: exponent 1 -> 2
    assert tr.renormalise_shift == 1
    assert tr.kept_bits == "10010110"
    assert tr.shifted_out == "1"
    assert tr.tie  # exactly half an ulp shifted out
    assert not tr.rounded_up  # the kept significand is already even: ties-to-even rounds down
    assert tr.result == -4.6875
    assert tr.ulp == Fraction(1, 32)
    assert tr.error == Fraction(1, 64)  # +half an ulp: the result is above the exact sum
    assert tr.direction == "toward zero"
    # and torch's bf16 addition agrees with every bit of it
    assert torch_add(-2.40625, -2.296875) == tr.result == -4.6875
    assert bf16_bits(torch_add(-2.40625, -2.296875)) == 0xC096
    assert len(tr.lines()) == 7


def test_walkthrough_matches_torch_on_random_pairs():
    gen = torch.Generator().manual_seed(7)
    a = (torch.randn(1500, generator=gen) * torch.exp2(torch.randint(-6, 7, (1500,), generator=gen))).to(torch.bfloat16)
    b = (torch.randn(1500, generator=gen) * torch.exp2(torch.randint(-6, 7, (1500,), generator=gen))).to(torch.bfloat16)
    ties = carries = 0
    for x, y, s in zip(a.tolist(), b.tolist(), (a + b).tolist()):
        if x == 0 or y == 0 or x + y == 0:
            continue
        tr = explain_add(x, y)
        assert tr.result == s, (x, y)
        assert tr.exact_sum == Fraction(x) + Fraction(y)
        assert abs(tr.error) <= tr.ulp / 2
        assert tr.tie == (abs(tr.error) == tr.ulp / 2 and tr.error != 0)
        ties += tr.tie
        carries += tr.carry
    assert ties > 50 and carries > 100  # the sample exercises both cases


def test_round_bf16_matches_torch_cast():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5000, generator=gen, dtype=torch.float64) * 100
    for v, r in zip(x.tolist(), x.float().to(torch.bfloat16).tolist()):
        # float64 -> float32 is exact enough here: a double rounding would need a value within
        # 2^-24 relative of a bf16 midpoint, which the assertion would expose
        assert float(round_bf16(Fraction(v))) == r


def test_bits_round_trip_and_ulp():
    for v in (1.0, -2.40625, 3.0e-5, 1.5e30):
        assert bits_to_float(bf16_bits(v)) == torch.tensor(v).to(torch.bfloat16).item()
    u = ulp_bf16(torch.tensor([1.0, 1.99, 2.0, -4.7, 0.0]))
    assert u[:4].tolist() == [2**-7, 2**-7, 2**-6, 2**-5]
    assert u[4].item() == 2.0**-133


@pytest.mark.parametrize("a,b,match", [
    (0.1, 1.0, "not exactly representable"),
    (float("nan"), 1.0, "finite"),
    (1.0, 0.0, "non-zero"),
    (1.0, -1.0, "cancel"),
])
def test_bad_operands(a, b, match):
    with pytest.raises(ValueError, match=match):
        explain_add(a, b)


def test_decompose_fields():
    op = decompose(-2.40625, "a")
    assert (op.sign, op.biased_exponent, op.fraction) == (1, 128, 0b0011010)
    assert op.binary() == "-1.0011010 x 2^1"
