"""Device check of the tensor-core models: Triton's ``tl.dot(a, b, c)`` on the GPU against :func:`mma`.

Runs only with ``STABLE_ATTN_TEST_DEVICE=cuda`` on an A100 (sm_80, model "a100") or an H100/H200
(sm_90, model "h100"; [KM25] ``models/H200TC.m`` is the H100 model). One tile, bf16 or fp16 inputs
with a wide exponent spread (alignment and truncation matter), fp32 C, K = 64: four k16 MMA
instructions chained C -> D, the way the attention kernel's ``fwd_pv`` issues them. It reports how
many of the tile's entries differ from the model; the KM25 vectors were measured with
``wmma``/``mma.sync``, and on sm_90 Triton may issue ``wgmma`` for this tile, so this is also the
check that the two instruction families share the arithmetic.

Not collected by the CPU suite (no test_ prefix): benchmarks/gpu_check.sh runs it on a GPU machine.
Not yet run on a GPU (written in a session without one).
"""

from __future__ import annotations

import os

import pytest
import torch

from stable_attn.numerics.tensor_core import mma

DEVICE = os.environ.get("STABLE_ATTN_TEST_DEVICE", "cpu")


def _model_of_device() -> str | None:
    if DEVICE != "cuda" or not torch.cuda.is_available():
        return None
    return {(8, 0): "a100", (9, 0): "h100"}.get(torch.cuda.get_device_capability())


@pytest.mark.skipif(_model_of_device() is None, reason="needs STABLE_ATTN_TEST_DEVICE=cuda on sm_80 or sm_90")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_dot_matches_model_bit_for_bit(dtype):
    import triton
    import triton.language as tl

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, c_ptr, d_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        om, on, ok = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(a_ptr + om[:, None] * K + ok[None, :])
        b = tl.load(b_ptr + ok[:, None] * N + on[None, :])
        c = tl.load(c_ptr + om[:, None] * N + on[None, :])
        tl.store(d_ptr + om[:, None] * N + on[None, :], tl.dot(a, b, c))

    model = _model_of_device()
    M, N, K = 64, 32, 64
    g = torch.Generator().manual_seed(23)
    lo, hi = (-8, 8) if dtype == torch.bfloat16 else (-4, 4)  # fp16: keep products and sums in range
    a = (torch.randn(M, K, generator=g) * torch.exp2(torch.randint(lo, hi, (M, K), generator=g).float())).to(dtype)
    b = (torch.randn(K, N, generator=g) * torch.exp2(torch.randint(lo, hi, (K, N), generator=g).float())).to(dtype)
    c = torch.randn(M, N, generator=g) * torch.exp2(torch.randint(lo, hi, (M, N), generator=g).float())
    d_gpu = torch.empty(M, N, device="cuda")
    dot_kernel[(1,)](a.cuda(), b.cuda(), c.cuda(), d_gpu, M=M, N=N, K=K, num_warps=4)
    d_model = mma(a, b, c, model=model)
    diff = (d_gpu.cpu().view(torch.int32) != d_model.view(torch.int32)).sum().item()
    assert diff == 0, f"{diff} of {M * N} entries differ from model {model!r} ({torch.cuda.get_device_name()})"
