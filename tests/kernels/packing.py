"""Packed (varlen) test inputs shared by test_varlen.py (the op) and test_varlen_triton.py (the launchers)."""

from __future__ import annotations

import torch
from margins import on_grid


def cu(lens: list[int], device: str = "cpu") -> torch.Tensor:
    """cu_seqlens (int32) of sequences of these lengths."""
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)


def packed_inputs(lens_q, lens_k, Hq, Hkv, D, dtype, seed, *, tied=False, qk_std=1.0, device="cpu"):
    """q ``[total_q, Hq, D]``, k, v ``[total_k, Hkv, D]``, do. ``tied``: in every sequence, copies of one key
    at local positions 1, 3, 17, 20 (two key blocks of 16) tie exactly at every row's max, with negative
    values (P-bar V rounds in one direction), q and k on a grid where every score is exact in fp32.
    ``qk_std`` scales q and k (8: scaled scores of std 64 at D=16, softmax rows close to one-hot)."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, Hq, D, generator=g) * qk_std
    k = torch.randn(tk, Hkv, D, generator=g) * qk_std
    v = torch.randn(tk, Hkv, D, generator=g)
    do = torch.randn(tq, Hq, D, generator=g)
    if tied:
        u = torch.randn(D, generator=g)
        u = u / u.norm()
        q = 4 * u + 0.1 * torch.randn(tq, Hq, D, generator=g)
        k = 0.3 * torch.randn(tk, Hkv, D, generator=g)
        start = 0
        for n in lens_k:
            for j in (1, 3, 17, 20):
                if j < n:
                    k[start + j] = 2 * u
            start += n
        # on the grid 2^-5: the scores are exact in fp32 in any summation order (tests/kernels/margins.py)
        q, k = on_grid(q), on_grid(k)
        v = -(torch.rand(tk, Hkv, D, generator=g) + 2.0)
    return [t.to(dtype).to(device) for t in (q, k, v, do)]
