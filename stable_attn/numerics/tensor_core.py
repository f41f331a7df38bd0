"""Bit-level models of one GPU tensor-core instruction ``D = A B + C`` (fp32 accumulator).

:func:`mma` computes ``D = A B + C`` for ``a`` ``[M, K]``, ``b`` ``[K, N]`` (bf16, fp16, or fp8
where the sources model it) and ``c`` ``[M, N]`` fp32 the way one GPU's tensor cores do, as an
explicit sequence of integer steps on the significands. Every numerical feature is a named field of
:class:`TensorCoreSpec`; the per-model values and their sources are in :data:`SPECS`.

Sources (read, not copied):

- [FHMP21] M. Fasi, N. J. Higham, M. Mikaitis, S. Pranesh, "Numerical behavior of NVIDIA tensor
  cores", PeerJ Comput. Sci. 7:e330 (2021), and its test suite
  ``north-numerical-computing/tensor-cores-numerical-behavior`` (``tc_test_numerics-A100-bf16.cu``,
  sections A-D).
- [KM25] F. A. Khattak, M. Mikaitis, "Accurate Models of NVIDIA Tensor Cores", arXiv 2512.07004
  (2025; ACM TACO), and its parameterised models ``north-numerical-computing/MATLAB-tensor-core``:
  ``models/A100TC.m``, ``models/H100TC.m`` (the parameter values), ``models/tools/Generic_BFMA_TC.m``
  (what the parameters do: ``GlobalAlignmentSum``, ``AlignSignficand``, ``norm_helper``) and
  ``models/tools/GEMM.m`` (K split into blocks of ``fma`` products, each block's D the next block's
  C; NaN/Inf screening). Its ``model_validation/`` holds GPU-measured vectors (tests use a subset).
- [MMA-Sim] the ``mmasim`` package (arXiv 2511.10909): bit-accurate models of Ampere ``mma``, Hopper
  ``wgmma`` and Blackwell ``tcgen05.mma``; ``mmasim/nv_ptx/sim.py`` (per-architecture parameters) and
  ``mmasim/arithmetic/fdpa.py`` (the truncated fused dot product). The source of model ``"b200"``;
  tests/numerics/test_mmasim_crosscheck.py compares every model with it.

The steps of one block (``fused_size`` products, [KM25] ``Generic_BFMA_TC.m`` global-alignment path):

1. each product ``a_k b_k`` is exact: integer significands ``Ma Mb`` with the *unnormalised*
   exponent ``ea + eb`` (``e = max(floor(log2|x|), emin)``; the product significand lies in [1, 4));
   zero products drop out;
2. the alignment exponent ``E`` is the largest of those exponents and, if ``C != 0``, C's exponent
   (floored at ``align_exponent_floor``);
3. every term (products and C) is truncated toward zero to ``23 + extra_alignment_bits`` fraction
   bits below ``2^E`` (sign-magnitude: positive terms round down, negative ones up);
4. the integers are summed exactly (no carry-out limit);
5. the sum is normalised once and truncated (round toward zero) to ``1 + output_mantissa_bits``
   significant bits, or to the fp32 subnormal grid below ``2^-126``; exponent >= 128 gives +-inf.

Implementation: integer-significand arithmetic, vectorised over ``[M, N, fused_size]``, with the
integers carried in float64 tensors, where every step is exact (products of <= 11-bit significands,
power-of-two scaling, ``trunc`` for the alignment, sums of integers below 2^40): bit-identical to an
int64 version (this module's first commit) and 1.4-7x faster on CPU, since torch's float64
``trunc``/``ldexp`` replace int64 shifts with per-element shift counts. Python loops run over K
blocks only.

``model="ieee"`` is the reference: exact products, one fp32 round-to-nearest-even addition each, in
k order, starting from C (a correctly rounded fused multiply-add per product).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["TensorCoreSpec", "SPECS", "MODELS", "FORMATS", "spec_for", "mma"]

# input formats: torch dtype -> (name, stored mantissa bits t, minimum normal exponent emin)
FORMATS: dict[torch.dtype, tuple[str, int, int]] = {
    torch.bfloat16: ("bf16", 7, -126),
    torch.float16: ("fp16", 10, -14),
    torch.float8_e4m3fn: ("e4m3", 3, -6),
    torch.float8_e5m2: ("e5m2", 2, -14),
}
_FP32_EMIN = -126
_FP32_EMAX = 127
_ZERO_EXP = -(1 << 20)  # exponent given to zero terms so they never set the alignment exponent


@dataclass(frozen=True)
class TensorCoreSpec:
    """Numerical features of one tensor-core MMA (one input format, fp32 C and D)."""

    model: str
    input_format: str  # "bf16", "fp16", "e4m3", "e5m2"
    # products a_k*b_k exact (full 2(t+1)-bit significand product)
    exact_products: bool
    # products summed in one step (one alignment, one normalisation); K is split into blocks of
    # this size, block j's D is block j+1's C
    fused_size: int
    # "max_incl_c": the alignment exponent is the largest unnormalised product exponent ea+eb and,
    # when C != 0, C's exponent; "sequential": IEEE-style one term at a time (model "ieee" only)
    align_to: str
    # the alignment exponent is at least this (products of tiny numbers are aligned to it)
    align_exponent_floor: int
    # fraction bits kept below the alignment exponent, beyond fp32's 23 (negative: fewer than 23)
    extra_alignment_bits: int
    # carry-out bits above the aligned significands; None: the block sum is held exactly
    carry_out_bits: int | None
    # rounding of the aligned terms' lost bits: "truncate" (toward zero, per term, no sticky bit)
    alignment_rounding: str
    # rounding at the single normalisation of the block sum: "rz" (toward zero) or "rne"
    normalisation_rounding: str
    # significand bits (after the leading one) the block result is rounded to
    output_mantissa_bits: int
    # "with_products": C is aligned and summed in the same step as the products
    c_joins: str
    # input subnormals used as they are (not flushed)
    input_subnormals: bool
    # fp32 subnormal results produced (on the 2^-149 grid) rather than flushed
    output_subnormals: bool

    def __post_init__(self) -> None:
        if self.carry_out_bits is not None:
            raise ValueError(f"carry_out_bits={self.carry_out_bits!r}: only None (exact block sum) is modelled")
        if self.align_to not in ("max_incl_c", "sequential"):
            raise ValueError(f"align_to={self.align_to!r}; use 'max_incl_c' or 'sequential'")
        if self.normalisation_rounding not in ("rz", "rne"):
            raise ValueError(f"normalisation_rounding={self.normalisation_rounding!r}; use 'rz' or 'rne'")
        if self.alignment_rounding != "truncate":
            raise ValueError(f"alignment_rounding={self.alignment_rounding!r}; only 'truncate' is modelled")
        if self.c_joins != "with_products":
            raise ValueError(f"c_joins={self.c_joins!r}; only 'with_products' is modelled")
        if not (self.input_subnormals and self.output_subnormals):
            raise ValueError("subnormal flushing is not modelled (all modelled GPUs keep subnormals)")

    @property
    def accumulator_fraction_bits(self) -> int:
        """Fraction bits of an aligned term below ``2^E``: ``23 + extra_alignment_bits``."""
        return 23 + self.extra_alignment_bits


def _a100(fmt: str) -> TensorCoreSpec:
    return TensorCoreSpec(
        model="a100",
        input_format=fmt,
        # [FHMP21] sec. B "Products are computed exactly"; [KM25] Generic_BFMA_TC.m prod_sig = a_sig.*b_sig
        exact_products=True,
        # [KM25] A100TC.m def_params.fma = 8 (fp16 and bf16 in, fp32 out)
        fused_size=8,
        # [KM25] A100TC.m global_alignment = 1, denorm_prd = 1 (exponent ea+eb, significand in [1,4));
        # [FHMP21] sec. B "Sum starts from largest element" (alignment to the largest magnitude, C included)
        align_to="max_incl_c",
        # [KM25] A100TC.m min_exp_limit = -132
        align_exponent_floor=-132,
        # [KM25] A100TC.m neab = 1; [FHMP21] sec. D1 "Extra bits in the significand alignment"
        extra_alignment_bits=1,
        # [KM25] Generic_BFMA_TC.m sums the aligned integers exactly (dot in double); [FHMP21] sec. D4
        # shows at least 3 carry-out bits for A100
        carry_out_bits=None,
        # [KM25] stkbitenabled = 0, bitshift right; [FHMP21] sec. C "Round-down for positive values",
        # "Round-up for negative values"
        alignment_rounding="truncate",
        # [KM25] A100TC.m frmode = 'rz' for fp32 output; [FHMP21] sec. D4 round-down/-up in normalisation
        normalisation_rounding="rz",
        # fp32 output ([KM25] GEMM.m NoManBitsOut from fpformatinfo('fp32'))
        output_mantissa_bits=23,
        # [KM25] A100TC.m late_partial_sum = 0
        c_joins="with_products",
        # [KM25] A100TC.m in_subnormals = 1, out_subnormals = 1; [FHMP21] sec. A
        input_subnormals=True,
        output_subnormals=True,
    )


def _h100(fmt: str) -> TensorCoreSpec:
    fp8 = fmt in ("e4m3", "e5m2")
    return TensorCoreSpec(
        model="h100",
        input_format=fmt,
        exact_products=True,  # [KM25] Generic_BFMA_TC.m prod_sig = a_sig.*b_sig
        # [KM25] H100TC.m def_params.fma = 16 (fp16, bf16); fp8: fma = 32 ("FMA size is 16, but
        # interleaved pattern is used to join two 16-element vectors")
        fused_size=32 if fp8 else 16,
        align_to="max_incl_c",  # [KM25] H100TC.m global_alignment = 1, denorm_prd = 1
        align_exponent_floor=-133,  # [KM25] H100TC.m min_exp_limit = -133
        # [KM25] H100TC.m neab = 2; fp8: neab = -10 (13 fraction bits, and the output significand is
        # cut to 13 bits as well: GEMM.m "NoManBitsOut = NoManBitsOut + neab" when neab < 0)
        extra_alignment_bits=-10 if fp8 else 2,
        carry_out_bits=None,  # [KM25] Generic_BFMA_TC.m: exact integer sum of the aligned terms
        alignment_rounding="truncate",  # [KM25] H100TC.m stkbitenabled = 0
        normalisation_rounding="rz",  # [KM25] H100TC.m frmode = 'rz' (fp32 output)
        output_mantissa_bits=13 if fp8 else 23,  # see extra_alignment_bits
        c_joins="with_products",  # [KM25] H100TC.m late_partial_sum = 0
        input_subnormals=True,  # [KM25] H100TC.m in_subnormals = 1
        output_subnormals=True,  # [KM25] H100TC.m out_subnormals = 1
    )


def _b200(fmt: str) -> TensorCoreSpec:
    # [MMA-Sim] ``mmasim.nv_ptx.sim.TCGen05MMA`` (Blackwell ``tcgen05.mma``, kind::f16 and kind::f8f6f4 with
    # f32 D): one truncated fused dot product ``MMA_T_FDPA`` with F = 25 fraction bits for every input format,
    # L_max = 32 bytes of inputs a block, e_zero = -133, "RZ-FP32" output. For bf16/fp16 that is Hopper's
    # arithmetic; for fp8 it keeps 25 fraction bits and a full fp32 output where Hopper keeps 13.
    fp8 = fmt in ("e4m3", "e5m2")
    return dataclasses.replace(_h100(fmt), model="b200", fused_size=32 if fp8 else 16, extra_alignment_bits=2,
                               output_mantissa_bits=23)


def _ieee(fmt: str) -> TensorCoreSpec:
    # the reference arithmetic, by definition (IEEE 754 binary32, roundTiesToEven), no hardware source
    return TensorCoreSpec(
        model="ieee", input_format=fmt, exact_products=True, fused_size=1, align_to="sequential",
        align_exponent_floor=_FP32_EMIN, extra_alignment_bits=0, carry_out_bits=None,
        alignment_rounding="truncate",  # unused: the sequential path rounds each sum exactly once
        normalisation_rounding="rne", output_mantissa_bits=23, c_joins="with_products",
        input_subnormals=True, output_subnormals=True,
    )


# (model, input format) -> spec. A100 has no fp8 tensor cores; [KM25] model H100 fp8 with fp32 output.
SPECS: dict[tuple[str, str], TensorCoreSpec] = {}
for _fmt in ("bf16", "fp16"):
    SPECS[("a100", _fmt)] = _a100(_fmt)
for _fmt in ("bf16", "fp16", "e4m3", "e5m2"):
    SPECS[("h100", _fmt)] = _h100(_fmt)
    SPECS[("b200", _fmt)] = _b200(_fmt)
    SPECS[("ieee", _fmt)] = _ieee(_fmt)
MODELS = ("a100", "h100", "b200", "ieee")


def spec_for(model: str, dtype: torch.dtype) -> TensorCoreSpec:
    """The spec of ``model`` for inputs of ``dtype``; ValueError naming what is accepted otherwise."""
    if model not in MODELS:
        raise ValueError(f"model={model!r} is not modelled; accepted values: {MODELS}")
    if dtype not in FORMATS:
        names = tuple(str(d) for d in FORMATS)
        raise ValueError(f"a.dtype={dtype} is not a tensor-core input format; accepted values: {names}")
    fmt = FORMATS[dtype][0]
    if (model, fmt) not in SPECS:
        ok = tuple(str(d) for d, f in FORMATS.items() if (model, f[0]) in SPECS)
        raise ValueError(f"a.dtype={dtype} is not modelled for model={model!r} (no source models it); "
                         f"accepted values: {ok}")
    return SPECS[(model, fmt)]


def _exponents(x: torch.Tensor, emin: int) -> torch.Tensor:
    """``e = max(floor(log2|x|), emin)`` of float64 ``x`` (int32); zeros get ``_ZERO_EXP``.

    With ``t`` stored mantissa bits, ``x = M 2^(e - t)`` with an integer significand ``|M| < 2^(t+1)``
    (``< 2^t`` for subnormals): the representation the alignment works on.
    """
    _, ex = torch.frexp(x)
    e = torch.clamp(ex - 1, min=emin)
    return torch.where(x == 0, torch.full_like(e, _ZERO_EXP), e)


def _round_block(s: torch.Tensor, lsb_exp: torch.Tensor, spec: TensorCoreSpec) -> torch.Tensor:
    """Normalise the exact block sum ``s 2^lsb_exp`` and round it to the output format (float64 out).

    ``s`` is float64 holding an integer (``|s| < 2^40``, so every step below is exact).
    """
    mag = s.abs()
    _, nb = torch.frexp(mag)  # bit length of |s|
    lead = lsb_exp + nb - 1  # exponent of the leading bit
    keep_lsb = torch.clamp(lead - spec.output_mantissa_bits, min=_FP32_EMIN - spec.output_mantissa_bits)
    drop = (keep_lsb - lsb_exp).clamp(min=0)
    q = torch.ldexp(mag, -drop.double())
    q = torch.floor(q) if spec.normalisation_rounding == "rz" else torch.round(q)  # round: ties to even
    val = torch.copysign(torch.ldexp(q, (lsb_exp + drop).double()), s)
    val = torch.where(s == 0, torch.zeros_like(val), val)
    big = val.abs() >= 2.0 ** (_FP32_EMAX + 1)
    return torch.where(big, torch.copysign(torch.full_like(val, float("inf")), val), val)


def _block_model(av, ea, bv, eb, c, spec: TensorCoreSpec) -> torch.Tensor:
    """One fused block: values ``av`` ``[..., M, F]`` / ``bv`` ``[..., F, N]`` (float64, finite) with
    their exponents ``ea``, ``eb`` (int32), finite ``c`` ``[..., M, N]`` (float64 holding fp32 values).

    The arithmetic is integer arithmetic carried in float64, where each value is exact: a product of
    two <= 11-bit significands is exact, scaling by a power of two is exact, and ``trunc`` of
    ``|v| 2^(facc - E)`` is the aligned integer significand (< 2^28) rounded toward zero.
    """
    facc = spec.accumulator_fraction_bits
    p = av[..., :, None, :] * bv.transpose(-1, -2)[..., None, :, :]  # [..., M, N, F] exact products
    ep = ea[..., :, None, :] + eb.transpose(-1, -2)[..., None, :, :]  # unnormalised exponents (zeros: very low)
    ec = _exponents(c, _FP32_EMIN)
    emax = torch.maximum(ep.amax(dim=-1), ec).clamp(min=spec.align_exponent_floor)  # [M, N]
    lsb_exp = emax - facc
    scale = torch.ldexp(torch.ones_like(c), -lsb_exp.double())
    s = torch.trunc(p * scale[..., None]).sum(dim=-1) + torch.trunc(c * scale)
    return _round_block(s, lsb_exp, spec)


def _two_sum(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + y
    bp = s - x
    return s, (x - (s - bp)) + (y - bp)


def _ieee_mma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Exact products, one RNE fp32 addition each, k = 0, 1, ... from C (float64 out)."""
    ad, bd = a.double(), b.double()
    d = c.double()
    for k in range(a.shape[-1]):
        prod = ad[..., :, k:k + 1] * bd[..., k:k + 1, :]  # exact in float64 for <= 11-bit significands
        s, err = _two_sum(d, prod)
        # round to odd in float64, then one rounding to fp32 is the correctly rounded d + prod
        bits = s.view(torch.int64)
        fix = torch.isfinite(s) & (err != 0) & ((bits & 1) == 0)
        toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, -float("inf")))
        s = torch.where(fix, torch.nextafter(s, toward), s)
        d = s.float().double()
    return d


def mma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, model: str | TensorCoreSpec = "h100") -> torch.Tensor:
    """``D = A B + C`` as ``model``'s tensor cores compute it: ``a`` ``[M, K]``, ``b`` ``[K, N]``
    (same dtype: bf16, fp16, or fp8 E4M3/E5M2 where modelled), ``c`` ``[M, N]`` fp32; returns fp32 ``[M, N]``.
    Leading batch dimensions (the same on all three) give independent products: ``[..., M, K]`` etc.
    ``model`` is a name of :data:`MODELS` or a :class:`TensorCoreSpec` (e.g. ``dataclasses.replace``
    of a GPU's spec, to ask what one feature changes); its ``input_format`` must be ``a``'s. Inputs
    on another device are computed on the CPU; the result is a CPU tensor.

    ``K`` is split into blocks of ``fused_size`` products (the last one may be shorter: padding with
    zeros changes nothing, zero products drop out), each block's ``D`` the next block's ``C``.
    """
    if a.dim() < 2 or b.dim() != a.dim() or a.shape[-1] != b.shape[-2] or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"a must be [..., M, K] and b [..., K, N] (same batch dims); got a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"a.dtype={a.dtype} and b.dtype={b.dtype} must be the same input format")
    want = (*a.shape[:-1], b.shape[-1])
    if c.dtype != torch.float32 or tuple(c.shape) != want:
        raise ValueError(f"c must be float32 [..., M, N] = {list(want)}; got {c.dtype} {tuple(c.shape)}")
    if isinstance(model, TensorCoreSpec):
        spec = model
        if a.dtype not in FORMATS or FORMATS[a.dtype][0] != spec.input_format:
            raise ValueError(f"a.dtype={a.dtype} does not match the spec's input_format={spec.input_format!r}")
    else:
        spec = spec_for(model, a.dtype)
    a, b, c = a.cpu(), b.cpu(), c.cpu()
    if spec.model == "ieee":
        return _ieee_mma(a, b, c).float()
    _, _, emin = FORMATS[a.dtype]
    ad, bd = a.double(), b.double()
    nfa, nfb = ~torch.isfinite(ad), ~torch.isfinite(bd)
    av = torch.where(nfa, 0.0, ad) if bool(nfa.any()) else ad
    bv = torch.where(nfb, 0.0, bd) if bool(nfb.any()) else bd
    ea, eb = _exponents(av, emin), _exponents(bv, emin)
    d = c.double()
    f = spec.fused_size
    inputs_finite = not (bool(nfa.any()) or bool(nfb.any()))
    for k0 in range(0, a.shape[-1], f):
        blk = slice(k0, k0 + f)
        special = ~torch.isfinite(d)
        if not inputs_finite:
            special = special | nfa[..., blk].any(dim=-1)[..., :, None] | nfb[..., blk, :].any(dim=-2)[..., None, :]
        d_new = _block_model(av[..., blk], ea[..., blk], bv[..., blk, :], eb[..., blk, :],
                             torch.where(special, torch.zeros_like(d), d), spec)
        if bool(special.any()):
            # [KM25] GEMM.m: a NaN among the products or C gives NaN, +Inf with -Inf gives NaN,
            # otherwise the infinity (float64 products and sums have exactly these semantics)
            d_new = torch.where(special, ad[..., blk] @ bd[..., blk, :] + d, d_new)
        d = d_new
    return d.float()
