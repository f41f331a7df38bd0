"""Counter-based random numbers for attention dropout, bit-identical to Triton's ``tl.rand``.

Dropout must draw the same keep mask in the forward and in the backward, and the PyTorch path must
draw the same mask as the Triton kernel, so both derive it from ``(seed, offset)`` with Philox-4x32-10
(Salmon et al., SC'11), the generator behind ``tl.rand``. The element at ``(b, h, i, j)`` of the
attention matrix (query head ``h``) uses ``offset = ((b * H + h) * Nq + i) * Nk + j``.

This module does the 32-bit arithmetic in int64 tensors: a 32x32-bit product does not fit in a
signed 64-bit integer, so the high and low words are formed from 16-bit halves.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_ROUNDS = 10
# tl.rand's int32 -> [0, 1) scale (2^-31 rounded to float32).
_UNIFORM_SCALE = 4.6566127342e-10


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * b`` for a 32-bit constant ``a`` and 32-bit values ``b``."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    t_lo = b * a_lo  # < 2^48
    t_hi = b * a_hi  # < 2^48
    hi = (t_hi + (t_lo >> 16)) >> 16
    lo = (((t_hi & 0xFFFF) << 16) + t_lo) & _MASK32
    return hi, lo


def philox_uint32(seed: int, offset: torch.Tensor) -> torch.Tensor:
    """First 32-bit output of Philox-4x32-10 for counters ``(offset_lo, offset_hi, 0, 0)``.

    Same as ``tl.randint(seed, offset)`` with an int64 ``offset``. Returned as int64 in [0, 2^32).
    """
    offset = offset.to(torch.int64)
    c0 = offset & _MASK32
    c1 = (offset >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0 = seed & _MASK32
    k1 = (seed >> 32) & _MASK32
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    return c0


def philox_uniform(seed: int, offset: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in [0, 1), equal to ``tl.rand(seed, offset)`` for an int64 ``offset``."""
    x = philox_uint32(seed, offset)
    x = torch.where(x >= 2**31, x - 2**32, x)  # reinterpret as int32
    x = torch.where(x < 0, -x - 1, x)  # ~x, as tl.rand folds the sign
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def keep_mask(seed: int, offset: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Boolean keep mask: an element is kept when its uniform draw is ``>= dropout_p``."""
    return philox_uniform(seed, offset) >= dropout_p
