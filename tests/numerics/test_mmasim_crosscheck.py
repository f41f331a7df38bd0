"""Our tensor-core models against MMA-Sim's (the ``mmasim`` package, arXiv 2511.10909), bit for bit.

MMA-Sim models NVIDIA's matrix instructions independently of the Khattak & Mikaitis sources our
``a100``/``h100`` specs were built from, and is the only source of ``b200`` (Blackwell ``tcgen05.mma``).
Each case draws random inputs of mixed signs and magnitudes (exponents spread over most of the format's
normal range, some zeros, an fp32 C of mixed magnitude), K = 64 so that several fused blocks chain, and
counts the outputs where the two disagree. The test needs ``mmasim`` (``pip install -e .[numerics]``);
without it, it skips and says so.
"""

from __future__ import annotations

import pytest
import torch

from stable_attn.numerics.tensor_core import mma

mmasim_ptx = pytest.importorskip("mmasim.nv_ptx", reason="mmasim (MMA-Sim) is not installed: "
                                 "pip install -e .[numerics] to cross-check the tensor-core models against it")

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# (our model, input format) -> MMA-Sim's operation for it (fp32 C and D; N = 8)
CASES = {
    ("a100", "bf16"): lambda: mmasim_ptx.MMA("Ampere", "m16n8k16.f32.bf16.bf16.f32"),
    ("a100", "f16"): lambda: mmasim_ptx.MMA("Ampere", "m16n8k16.f32.f16.f16.f32"),
    ("h100", "bf16"): lambda: mmasim_ptx.WGMMA("Hopper", "m64n8k16.f32.bf16.bf16"),
    ("h100", "f16"): lambda: mmasim_ptx.WGMMA("Hopper", "m64n8k16.f32.f16.f16"),
    ("h100", "e4m3"): lambda: mmasim_ptx.WGMMA("Hopper", "m64n8k32.f32.e4m3.e4m3"),
    ("h100", "e5m2"): lambda: mmasim_ptx.WGMMA("Hopper", "m64n8k32.f32.e5m2.e5m2"),
    ("b200", "bf16"): lambda: mmasim_ptx.TCGen05MMA("Blackwell", "m64n8k16.kind::f16.f32.bf16.bf16"),
    ("b200", "f16"): lambda: mmasim_ptx.TCGen05MMA("Blackwell", "m64n8k16.kind::f16.f32.f16.f16"),
    ("b200", "e4m3"): lambda: mmasim_ptx.TCGen05MMA("Blackwell", "m64n8k32.kind::f8f6f4.f32.e4m3.e4m3"),
    ("b200", "e5m2"): lambda: mmasim_ptx.TCGen05MMA("Blackwell", "m64n8k32.kind::f8f6f4.f32.e5m2.e5m2"),
}
# exponent range of the random inputs (within the format's normal range, so products stay finite)
EXP_RANGE = {"bf16": 20, "f16": 6, "e4m3": 4, "e5m2": 6}


def mixed_inputs(fmt: str, m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``a [m, k]``, ``b [k, n]`` in ``fmt`` and fp32 ``c [m, n]``: random signs, spread magnitudes, ~1/16 zeros."""
    gen = torch.Generator().manual_seed(seed)
    r = EXP_RANGE[fmt]

    def draw(*shape: int) -> torch.Tensor:
        exps = torch.randint(-r, r + 1, shape, generator=gen).double()
        mag = torch.exp2(exps) * (1 + torch.rand(shape, generator=gen))
        sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
        keep = torch.rand(shape, generator=gen) >= 1 / 16
        return (sign * mag * keep).to(DTYPES[fmt])

    c = (torch.randn(m, n, generator=gen, dtype=torch.float64) * torch.exp2(
        torch.randint(-2 * r, 2 * r + 1, (m, n), generator=gen).double())).float()
    return draw(m, k), draw(k, n), c


@pytest.mark.parametrize("model,fmt", sorted(CASES))
def test_model_equals_mmasim_bit_for_bit(model, fmt):
    op = CASES[(model, fmt)]()
    differ = total = 0
    for seed in range(4):
        a, b, c = mixed_inputs(fmt, 64, 64, 8, seed)
        ours = mma(a, b, c, model=model)
        theirs = op(a, b, c)
        differ += int((ours.view(torch.int32) != theirs.view(torch.int32)).sum())
        total += ours.numel()
    assert differ == 0, f"{model} {fmt}: {differ} of {total} outputs differ from MMA-Sim"
