"""stable_attn.numerics.tensor_core: published feature tests, GPU-measured vectors, an exact-rational property test.

Sources of expected values (no value here is invented):
- [FHMP21] ``tc_test_numerics-A100-bf16.cu`` of north-numerical-computing/tensor-cores-numerical-behavior
  (Fasi, Higham, Mikaitis, Pranesh, PeerJ CS 7:e330, 2021): each test's inputs and the value its
  PASS condition requires on the A100, section and item names as printed by that program.
- [KM25] GPU-measured vectors of north-numerical-computing/MATLAB-tensor-core ``model_validation/``
  (Khattak & Mikaitis, arXiv 2512.07004): 1000 rows per GPU and format, tests/numerics/data/.
- Vectors marked "spec" take their expected value from the spec's own definition (tensor_core.py),
  worked out in the comment.
"""

from __future__ import annotations

import dataclasses
import math
import random
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from stable_attn.numerics import tensor_core as tc
from stable_attn.numerics.tensor_core import mma

BF16 = torch.bfloat16
DATA = Path(__file__).parent / "data" / "km25_validation_subset.npz"
X = math.ldexp


def _dot(a_vals, b_vals, c: float, model: str, k: int = 16, dtype=BF16) -> float:
    """One dot product of a ``k``-long row (zero padded) with a column, plus ``c``, as in the wmma 16x16x16 tests."""
    a = torch.zeros(1, k, dtype=dtype)
    b = torch.zeros(k, 1, dtype=dtype)
    for i, v in enumerate(a_vals):
        a[0, i] = v
    for i, v in enumerate(b_vals):
        b[i, 0] = v
    assert all(float(a[0, i]) == v for i, v in enumerate(a_vals)), "inputs must be representable"
    assert all(float(b[i, 0]) == v for i, v in enumerate(b_vals)), "inputs must be representable"
    cc = torch.tensor([[c]], dtype=torch.float32)
    assert float(cc) == c or math.isnan(c)
    return float(mma(a, b, cc, model=model)[0, 0])


BELOW1_BF16 = 1 - X(1, -8)
BELOW1 = 1 - X(1, -24)  # nextafterf(1, 0)


# ---- [FHMP21] A100 bf16 suite: (name, a, b, c, value the A100 returns) ------------------------------
FHMP21_A100_BF16 = [
    # A. Support for subnormal numbers
    ("A bf16 subnormal input", [X(1, -133)], [X(1, 7)], 0.0, X(1, -126)),
    ("A binary32 subnormal input", [], [], X(1, -149), X(1, -149)),
    ("A subnormal output (1)", [X(1, -126)], [X(1, -1)], 0.0, X(1, -127)),
    ("A subnormal output (2)", [X(1, -126)], [1.0], -X(1, -127), X(1, -127)),
    # B. Accuracy of the dot products
    ("B products exact (1)", [BELOW1_BF16], [BELOW1_BF16], 0.0, 1 - X(1, -7) + X(1, -16)),
    ("B products exact (4)", [BELOW1_BF16] * 4, [BELOW1_BF16] * 4, 0.0, 4 * (1 - X(1, -7) + X(1, -16))),
    ("B accumulated in binary32", [0.5] * 4, [X(1, -24)] * 4, 1.0, 1.0),
    # C. Rounding modes
    ("C round-down positive", [1.0] * 4, [2.0, X(1, -23) + X(1, -24)], 0.0, 2.0),
    ("C round-up negative", [1.0] * 4, [-2.0, -X(1, -23) - X(1, -24)], 0.0, -2.0),
    # D. Features of the accumulator
    ("D1 extra alignment bits", [1.0], [1.0], -BELOW1, X(1, -24)),
    ("D2 normalisation in addition", [1.0] * 4, [X(1, -24)] * 4, 1 - X(1, -24), 1 + X(1, -23)),
    ("D3 normalisation in subtraction", [1.0, 1.0], [1.0, -X(1, -24)], -1 + X(1, -24), 0.0),
    ("D4 carry out, third bit", [1.0] * 4, [1.0, 1.5, 1.75, 1.875], 1.875, 8.0),
    ("D4 round-down in normalisation", [1.0] * 4, [1.0] * 4, 1 + X(1, -22) + X(1, -23), 5.0),
    ("D4 round-up in normalisation", [1.0] * 4, [-1.0] * 4, -1 - X(1, -22) - X(1, -23), -5.0),
]
# D4 "Extra bits for carry out": the 2^-23 in position j = 0..3, the others 1, c = 1 + 2^-22 + 2^-23
for _j in range(4):
    _b = [1.0] * 4
    _b[_j] = X(1, -23)
    FHMP21_A100_BF16.append((f"D4 carry out, 2^-23 at {_j}", [1.0] * 4, _b, 1 + X(1, -22) + X(1, -23), 4 + X(1, -21)))
# B "Sum starts from largest element": 1*1 at position j, 0.5*2^-24 elsewhere, c = 2^-24 -> 1
for _j in range(4):
    _a, _b = [0.5] * 4, [X(1, -24)] * 4
    _a[_j], _b[_j] = 1.0, 1.0
    FHMP21_A100_BF16.append((f"B sum starts from largest, 1 at {_j}", _a, _b, X(1, -24), 1.0))


@pytest.mark.parametrize("name,a,b,c,expected", FHMP21_A100_BF16, ids=[t[0] for t in FHMP21_A100_BF16])
def test_fhmp21_a100_bf16_suite(name, a, b, c, expected):
    assert _dot(a, b, c, "a100") == expected


def test_fhmp21_a100_monotonicity():
    # [FHMP21] D5 "Monotonicity of dot product": the same products with c = 1 - 2^-24 and c = 1;
    # PASS (on the A100) is d(c = 1) < d(c = 1 - 2^-24): the dot product is not monotonic
    a = [0.5] * 4
    b = [X(1, -24)] * 3 + [X(1, -23) + X(1, -24)]
    partial = _dot(a, b, 1 - X(1, -24), "a100")
    assert _dot(a, b, 1.0, "a100") < partial
    # the ieee reference is monotonic on the same vectors
    assert _dot(a, b, 1.0, "ieee") >= _dot(a, b, 1 - X(1, -24), "ieee")


def test_fhmp21_features_that_separate_ieee():
    # the A100 truncates where IEEE rounds to nearest: [FHMP21] C "Round-down for positive values"
    # exact 2 + 1.5*2^-23 rounds to 2 + 2^-22 in RNE (sequentially: 2 + 1.5*2^-23 -> nearest)
    assert _dot([1.0] * 4, [2.0, X(1, -23) + X(1, -24)], 0.0, "ieee") == 2 + X(1, -22)
    # and D4 round-down: 5 + 2^-22 + 2^-23 -> RNE in fp32 (ulp 2^-21 at 4..8) gives 5 + 2^-21
    assert _dot([1.0] * 4, [1.0] * 4, 1 + X(1, -22) + X(1, -23), "ieee") == 5 + X(1, -21)


# ---- spec-derived vectors that separate the A100 and H100 models -------------------------------------
def test_h100_two_extra_alignment_bits():
    # spec: H100 keeps 23 + 2 fraction bits below 2^E. [FHMP21] B "accumulated in binary32" vectors:
    # c = 1 and four products 0.5 * 2^-24 = 2^-25 each; E = 0, so each 2^-25 survives alignment on the
    # H100 (LSB 2^-25) but not on the A100 (LSB 2^-24). Sum 1 + 2^-23 is exact in fp32.
    assert _dot([0.5] * 4, [X(1, -24)] * 4, 1.0, "h100") == 1 + X(1, -23)
    assert _dot([0.5] * 4, [X(1, -24)] * 4, 1.0, "a100") == 1.0


def test_fused_block_size_8_vs_16():
    # spec: 16 products 2^-25 (0.5 * 2^-24) with c = 1. A100: two blocks of 8, each truncates every
    # 2^-25 at E = 0 (LSB 2^-24) -> 1. H100: one block of 16, LSB 2^-25: 1 + 16 * 2^-25 = 1 + 2^-21.
    # Moving the products to the first 8 only: H100 1 + 8 * 2^-25 = 1 + 2^-22.
    assert _dot([0.5] * 16, [X(1, -24)] * 16, 1.0, "a100") == 1.0
    assert _dot([0.5] * 16, [X(1, -24)] * 16, 1.0, "h100") == 1 + X(1, -21)
    # spec: with c = 0 the first A100 block aligns to its own largest product 2^-25 and sums exactly:
    # 8 * 2^-25 = 2^-22; block 2 then aligns to 2^-22 (C), LSB 2^-46: + 8 * 2^-25 -> 2^-21 exactly.
    assert _dot([0.5] * 16, [X(1, -24)] * 16, 0.0, "a100") == X(1, -21)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_b200_fp8_keeps_25_fraction_bits_where_h100_keeps_13(dtype):
    # spec ([MMA-Sim] TCGen05MMA: F = 25, RZ-FP32 for fp8; WGMMA fp8: F = 13, RZ-E8M13): products 1 * 1 and
    # 2^-8 * 2^-8 = 2^-16 (2^-8 is an E4M3 subnormal and an E5M2 normal), c = 0; E = 0. H100 keeps 13 fraction
    # bits below 2^0 (LSB 2^-13): the 2^-16 is truncated away -> 1. B200 keeps 25 (LSB 2^-25): 1 + 2^-16.
    assert _dot([1.0, X(1, -8)], [1.0, X(1, -8)], 0.0, "h100", k=32, dtype=dtype) == 1.0
    assert _dot([1.0, X(1, -8)], [1.0, X(1, -8)], 0.0, "b200", k=32, dtype=dtype) == 1 + X(1, -16)
    # bf16 on B200 is H100's arithmetic ([MMA-Sim] F = 25, 16 products a block for both)
    assert _dot([0.5] * 16, [X(1, -24)] * 16, 1.0, "b200") == 1 + X(1, -21)


# ---- [KM25] GPU-measured vectors ----------------------------------------------------------------------
_DTYPES = {"bf16": (BF16, torch.int16), "fp16": (torch.float16, torch.int16),
           "e4m3": (torch.float8_e4m3fn, torch.uint8), "e5m2": (torch.float8_e5m2, torch.uint8)}
_SETS = [("a100", "bf16"), ("a100", "fp16"), ("h100", "bf16"), ("h100", "fp16"), ("h100", "e4m3"), ("h100", "e5m2")]


def _load(gpu: str, fmt: str):
    z = np.load(DATA)
    dt, iv = _DTYPES[fmt]
    key = f"{gpu}_{fmt}"
    a = torch.from_numpy(z[key + "_a"]).view(dt)
    b = torch.from_numpy(z[key + "_b"]).view(dt)
    c = torch.from_numpy(z[key + "_c"].view(np.float32))
    d = torch.from_numpy(z[key + "_d"].view(np.float32))
    return a, b, c, d


def _rowwise(a, b, c, model, chunk=50):
    """d_i = a_i . b_i + c_i for every row i, through mma on chunks (the diagonal of a chunk's product)."""
    out = []
    for i in range(0, a.shape[0], chunk):
        ai, bi, ci = a[i:i + chunk], b[i:i + chunk], c[i:i + chunk]
        n = ai.shape[0]
        cm = torch.zeros(n, n)
        cm[range(n), range(n)] = ci
        out.append(torch.diagonal(mma(ai, bi.t().contiguous(), cm, model=model)))
    return torch.cat(out)


@pytest.mark.parametrize("gpu,fmt", _SETS, ids=[f"{g}-{f}" for g, f in _SETS])
def test_km25_gpu_vectors_bit_exact(gpu, fmt):
    a, b, c, d_gpu = _load(gpu, fmt)
    d = _rowwise(a, b, c, gpu)
    same = d.view(torch.int32) == d_gpu.view(torch.int32)
    bad = (~same).nonzero().flatten().tolist()
    assert not bad, f"{len(bad)} of {same.numel()} rows differ from the GPU, first {bad[:5]}"


@pytest.mark.parametrize("gpu,fmt,other", [("h100", "bf16", "a100"), ("a100", "bf16", "h100"),
                                            ("h100", "bf16", "ieee"), ("h100", "e4m3", "ieee")])
def test_km25_vectors_reject_other_models(gpu, fmt, other):
    # the data would catch a wrong model: the other GPU's spec, or IEEE arithmetic, misses many rows
    a, b, c, d_gpu = _load(gpu, fmt)
    a, b, c, d_gpu = a[:300], b[:300], c[:300], d_gpu[:300]
    d = _rowwise(a, b, c, other)
    assert int((d.view(torch.int32) != d_gpu.view(torch.int32)).sum()) >= 10


# ---- exact-rational reference of the spec's steps --------------------------------------------------------
def _exp_of(v: Fraction, emin: int) -> int:
    """``max(floor(log2|v|), emin)`` for v != 0, exactly."""
    e = v.numerator.bit_length() - v.denominator.bit_length()
    if Fraction(2) ** e > abs(v):
        e -= 1
    return max(e, emin)


def _floor_log2(v: Fraction) -> int:
    return _exp_of(v, -10**9)


def _ref_block(av, bv, c: Fraction, spec: tc.TensorCoreSpec, emin_in: int):
    exps, vals = [], []
    for x, y in zip(av, bv):
        if x == 0 or y == 0:
            continue
        exps.append(_exp_of(x, emin_in) + _exp_of(y, emin_in))  # unnormalised product exponent
        vals.append(x * y)  # exact product
    if c != 0:
        exps.append(_exp_of(c, -126))
        vals.append(c)
    if not vals:
        return Fraction(0)
    e = max(max(exps), spec.align_exponent_floor)
    unit = Fraction(2) ** (e - 23 - spec.extra_alignment_bits)
    s = sum((1 if v > 0 else -1) * math.floor(abs(v) / unit) for v in vals)  # truncate each term, sum exactly
    if s == 0:
        return Fraction(0)
    val = s * unit
    lsb = max(_floor_log2(abs(val)) - spec.output_mantissa_bits, -126 - spec.output_mantissa_bits)
    if spec.normalisation_rounding == "rz":
        q = math.floor(abs(val) / Fraction(2) ** lsb)  # round toward zero
    else:
        q = round(abs(val) / Fraction(2) ** lsb)  # Fraction.__round__: nearest, ties to even
    out = (1 if val > 0 else -1) * q * Fraction(2) ** lsb
    return out


def _ref_mma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, spec: tc.TensorCoreSpec) -> list[list[float]]:
    _, _, emin = tc.FORMATS[a.dtype]
    M, K = a.shape
    N = b.shape[1]
    out = []
    for i in range(M):
        row = []
        for j in range(N):
            d = Fraction(float(c[i, j]))
            for k0 in range(0, K, spec.fused_size):
                av = [Fraction(float(a[i, k])) for k in range(k0, min(K, k0 + spec.fused_size))]
                bv = [Fraction(float(b[k, j])) for k in range(k0, min(K, k0 + spec.fused_size))]
                d = _ref_block(av, bv, d, spec, emin)
                assert abs(d) < 2**128, "keep the property test inside the finite range"
            row.append(float(d))
        out.append(row)
    return out


def _random_value(rng: random.Random, fmt: str) -> float:
    """A random representable value of ``fmt`` biased to the hard cases: ties, near-cancellation,
    subnormals, mixed signs, wide exponent spread."""
    dt = _DTYPES[fmt][0]
    kind = rng.random()
    sign = -1.0 if rng.random() < 0.5 else 1.0
    info = {"bf16": (7, -126), "fp16": (10, -14), "e4m3": (3, -6), "e5m2": (2, -14)}[fmt]
    t, emin = info
    if kind < 0.15:
        return 0.0
    if kind < 0.3:  # subnormal
        v = rng.randint(1, 2**t - 1) * X(1, emin - t)
    elif kind < 0.55:  # 1 + small pattern: lands exactly on alignment/rounding boundaries
        v = X(1.0 + rng.choice([f for f in (0.0, 0.5, 0.25, 0.75, 0.125, 2**-t, 1 - 2**-t) if f * 2**t % 1 == 0]),
              rng.randint(-3, 2))
    else:  # anything, over a spread of exponents
        v = X(1.0 + rng.randint(0, 2**t - 1) * 2.0**-t, rng.randint(max(emin, -30), 6))
    v = sign * v
    got = float(torch.tensor(v).to(dt))
    assert got == v, (v, fmt)
    return v


def _random_case(rng: random.Random, fmt: str, M: int, K: int, N: int):
    dt = _DTYPES[fmt][0]
    a = torch.tensor([[_random_value(rng, fmt) for _ in range(K)] for _ in range(M)]).to(dt)
    b = torch.tensor([[_random_value(rng, fmt) for _ in range(N)] for _ in range(K)]).to(dt)
    # c: zero, subnormal, the negated exact dot product of row 0 with column j (cancellation), or random
    c = torch.zeros(M, N)
    exact = a.double() @ b.double()
    for i in range(M):
        for j in range(N):
            r = rng.random()
            if r < 0.2:
                c[i, j] = 0.0
            elif r < 0.35:
                c[i, j] = rng.choice([-1, 1]) * rng.randint(1, 2**23 - 1) * X(1, -149)
            elif r < 0.6:
                c[i, j] = -float(exact[i, j])  # rounded to fp32: cancellation down to the last bits
            else:
                c[i, j] = rng.choice([-1, 1]) * X(1.0 + rng.randint(0, 2**23 - 1) * 2.0**-23, rng.randint(-30, 6))
    return a, b, c


@pytest.mark.parametrize("model,fmt", [("a100", "bf16"), ("a100", "fp16"), ("h100", "bf16"), ("h100", "fp16"),
                                       ("h100", "e4m3"), ("h100", "e5m2"), ("b200", "bf16"), ("b200", "e4m3"),
                                       ("b200", "e5m2")])
def test_matches_exact_rational_steps(model, fmt):
    rng = random.Random(f"{model}-{fmt}")
    spec = tc.spec_for(model, _DTYPES[fmt][0])
    for _ in range(12):
        K = rng.choice([1, 3, spec.fused_size - 1, spec.fused_size, spec.fused_size + 5, 2 * spec.fused_size + 3])
        a, b, c = _random_case(rng, fmt, 3, K, 2)
        got = mma(a, b, c, model=model).tolist()
        assert got == _ref_mma(a, b, c, spec), (K, a, b, c)


def test_exact_rational_tie_and_cancellation_cases():
    # hand-picked vectors run through both the vectorised model and the Fraction reference
    spec = tc.spec_for("h100", BF16)
    cases = [
        ([1.0, 1.0], [1.0, -1.0], 0.0),  # exact cancellation -> +0
        ([1.0, X(1, -25)], [1.0, 1.0], 0.0),  # product on the last kept bit (LSB 2^-25)
        ([1.0, X(1, -26)], [1.0, 1.0], 0.0),  # product just below it: truncated away
        ([-1.0, X(1, -26)], [1.0, 1.0], 0.0),  # negative sum: truncation toward zero
        ([X(1, -133)] * 3, [X(1, -10)] * 3, 0.0),  # subnormal products below the 2^-133 alignment floor
        ([X(1, -126)], [X(1, -1)], -X(1, -149)),  # subnormal output
    ]
    for av, bv, c in cases:
        a = torch.tensor([av]).to(BF16)
        b = torch.tensor([bv]).t().contiguous().to(BF16)
        cc = torch.tensor([[c]])
        assert mma(a, b, cc, "h100").tolist() == _ref_mma(a, b, cc, spec), (av, bv, c)


def test_custom_spec_with_rne_normalisation_matches_exact_rational_steps():
    # a what-if spec: the H100's alignment with round-to-nearest-even at the normalisation
    spec = dataclasses.replace(tc.spec_for("h100", BF16), normalisation_rounding="rne")
    rng = random.Random("rne")
    for _ in range(12):
        a, b, c = _random_case(rng, "bf16", 3, rng.choice([5, 16, 21, 40]), 2)
        assert mma(a, b, c, model=spec).tolist() == _ref_mma(a, b, c, spec)
    # spec: 1 + 2^-24 (the exact sum, kept with 25 fraction bits) is a tie at fp32: RNE gives 1, and
    # 1 + 3*2^-25 rounds up to 1 + 2^-23 where RZ gives 1
    one = torch.ones(1, 1, dtype=BF16)
    assert float(mma(one, one, torch.tensor([[X(1, -24)]]), model=spec)) == 1.0
    two = torch.tensor([[1.0, 1.0]], dtype=BF16)
    col = torch.tensor([[1.0], [X(1, -24) + X(1, -25)]], dtype=BF16)
    assert float(mma(two, col, torch.zeros(1, 1), model=spec)) == 1 + X(1, -23)
    assert float(mma(two, col, torch.zeros(1, 1), model="h100")) == 1.0
    with pytest.raises(ValueError, match="input_format"):
        mma(one.half(), one.half(), torch.zeros(1, 1), model=spec)


@pytest.mark.slow
@pytest.mark.parametrize("model,fmt", [("a100", "bf16"), ("h100", "bf16"), ("h100", "e4m3")])
def test_matches_exact_rational_steps_long(model, fmt):
    rng = random.Random(f"long-{model}-{fmt}")
    spec = tc.spec_for(model, _DTYPES[fmt][0])
    for _ in range(150):
        K = rng.randint(1, 3 * spec.fused_size + 1)
        a, b, c = _random_case(rng, fmt, 4, K, 3)
        assert mma(a, b, c, model=model).tolist() == _ref_mma(a, b, c, spec)


# ---- ieee reference --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_ieee_equals_plain_fp32_loop(dtype):
    g = torch.Generator().manual_seed(5)
    M, K, N = 7, 37, 5
    a = torch.randn(M, K, generator=g).mul(4).to(dtype)
    b = torch.randn(K, N, generator=g).to(dtype)
    c = torch.randn(M, N, generator=g)
    d = c.clone()
    for k in range(K):  # products of bf16/fp16 numbers in this range are exact in fp32
        d = d + a[:, k:k + 1].float() * b[k:k + 1, :].float()
    assert torch.equal(mma(a, b, c, model="ieee"), d)


def test_ieee_rounds_to_nearest_even_once_per_product():
    # spec ("ieee" = fp32 RNE per addition): 1 + 2^-24 is a tie -> 1 (even); 1 + 2^-24 + 2^-40 -> 1 + 2^-23
    a = torch.tensor([[1.0, X(1, -24)]]).to(BF16)
    b = torch.tensor([[1.0], [1.0]]).to(BF16)
    assert float(mma(a, b, torch.zeros(1, 1), "ieee")) == 1.0
    assert float(mma(a[:, :1], b[:1], torch.tensor([[X(1, -24) + X(1, -40)]]), "ieee")) == 1 + X(1, -23)


# ---- special values, errors ------------------------------------------------------------------------------
def test_nan_and_inf_follow_the_km25_gemm_screen():
    # [KM25] GEMM.m: any NaN among the products or C -> NaN; +Inf and -Inf -> NaN; otherwise the infinity
    inf = float("inf")
    for model in ("a100", "h100"):
        assert math.isnan(_dot([inf, 1.0], [1.0, 1.0], -inf, model))
        assert math.isnan(_dot([inf], [0.0], 0.0, model))  # inf * 0
        assert _dot([inf, 1.0], [1.0, 1.0], 1.0, model) == inf
        assert _dot([2.0], [-inf], 0.0, model) == -inf
        assert math.isnan(_dot([1.0], [1.0], float("nan"), model))
        # a non-finite entry only poisons the dot products it enters
        a = torch.tensor([[inf, 1.0], [1.0, 1.0]]).to(BF16)
        b = torch.ones(2, 2).to(BF16)
        d = mma(a, b, torch.zeros(2, 2), model)
        assert torch.isinf(d[0]).all() and d[1].tolist() == [2.0, 2.0]


def test_overflow_gives_inf():
    # [KM25] Generic_BFMA_TC.m: a biased exponent of 255 after normalisation gives +-Inf (not max finite)
    big = X(1, 127)
    assert _dot([big, big], [1.0, 1.0], 0.0, "h100") == float("inf")
    assert _dot([big, big], [-1.0, -1.0], 0.0, "a100") == -float("inf")


def test_rejects_unmodelled_inputs():
    a = torch.ones(2, 3, dtype=BF16)
    b = torch.ones(3, 2, dtype=BF16)
    c = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"model='v100'.*accepted values.*a100"):
        mma(a, b, c, model="v100")
    with pytest.raises(ValueError, match=r"a\.dtype=torch\.float8_e4m3fn.*model='a100'.*accepted values"):
        mma(a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn), c, model="a100")
    with pytest.raises(ValueError, match=r"a\.dtype=torch\.float32.*accepted values"):
        mma(a.float(), b.float(), c, model="h100")
    with pytest.raises(ValueError, match="same input format"):
        mma(a, b.half(), c)
    with pytest.raises(ValueError, match="float32"):
        mma(a, b, c.double())
    with pytest.raises(ValueError, match=r"\[\.\.\., M, K\]"):
        mma(a, b.t(), c)


def test_batched_equals_one_by_one():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(4, 3, 40, generator=g).to(BF16)
    b = torch.randn(4, 40, 5, generator=g).to(BF16)
    c = torch.randn(4, 3, 5, generator=g)
    for model in ("a100", "h100", "b200", "ieee"):
        d = mma(a, b, c, model)
        for i in range(4):
            assert torch.equal(d[i], mma(a[i], b[i], c[i], model))


def test_every_spec_field_is_set_and_sourced():
    src = Path(tc.__file__).read_text()
    for key, spec in tc.SPECS.items():
        assert spec.exact_products and spec.fused_size >= 1, key
    # each field of the dataclass has a comment line above it in the spec definition
    for field in tc.TensorCoreSpec.__dataclass_fields__:
        assert f"    {field}:" in src, field
    assert "[KM25]" in src and "[FHMP21]" in src
