"""A NaN in a query gives its row NaN on every path (training forward and backward, forward only, decode, varlen),
as SDPA and the PyTorch path do; rows that see no key still give zeros; the other rows are unchanged. The Triton
cases run the kernels under TRITON_INTERPRET=1 (tests/conftest.py)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

import stable_attn
from stable_attn.kernels import triton_decode

BACKENDS = ["torch", "triton"]
DEVICE = os.environ.get("STABLE_ATTN_TEST_DEVICE", "cpu")  # benchmarks/gpu_check.sh runs these on CUDA too


def _inputs(nq: int = 24, nk: int = 24, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).to(DEVICE, dtype) for n in (nq, nk, nk))
    if nq > 5:
        q[0, 0, 5, 3] = math.nan  # one element of row 5, head 0
    return q, k, v


def _nan_rows(x: torch.Tensor) -> list[tuple[int, int]]:
    """(head, row) of the rows holding a NaN."""
    return [tuple(i) for i in x[0].isnan().any(-1).nonzero().tolist()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_forward_and_backward(backend, row):
    q, k, v = _inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = stable_attn.attention(*leaves, causal=True, backend=backend, block_n=16)
    out.backward(torch.ones_like(out))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]  # SDPA on the same device
    want = F.scaled_dot_product_attention(*ref, is_causal=True)
    want.backward(torch.ones_like(want))
    row("row (0, 5) NaN as in SDPA, other rows finite", f"NaN rows {_nan_rows(out.detach())}")
    assert torch.equal(out.isnan(), want.isnan()) and _nan_rows(out.detach()) == [(0, 5)]
    clean = stable_attn.attention(*(t.nan_to_num(0.0) for t in (q, k, v)), causal=True, backend=backend, block_n=16)
    assert torch.equal(out[0, 1], clean[0, 1]) and torch.equal(out[0, 0, :5], clean[0, 0, :5])
    assert leaves[0].grad[0, 0, 5].isnan().all() and not leaves[0].grad[0, 1].isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_only_keeps_fully_masked_rows_zero(backend, row):
    q, k, v = _inputs()
    q[0, 0, 1] = math.nan  # a NaN row that sees no key stays a row that sees no key: zeros
    kpm = torch.ones(1, 24, dtype=torch.bool, device=DEVICE)
    kpm[0, :2] = False  # causal: rows 0 and 1 see no key
    with torch.no_grad():
        out = stable_attn.attention(q, k, v, causal=True, key_padding_mask=kpm, backend=backend, block_n=16)
    row("row (0, 5) NaN; rows 0-1 zeros (they see no key)",
        f"NaN rows {_nan_rows(out)}; rows 0-1 zero {bool((out[0, :, :2] == 0).all())}")
    assert _nan_rows(out) == [(0, 5)] and (out[0, :, :2] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode(backend, row, monkeypatch):
    calls = []
    real = triton_decode.forward
    monkeypatch.setattr(triton_decode, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = _inputs(nq=1, nk=100)
    q[0, 0, 0, 3] = math.nan
    kpm = torch.ones(1, 100, dtype=torch.bool, device=DEVICE)
    kpm[0, 90:] = False  # a padded cache: the decode path
    with torch.no_grad():
        out = stable_attn.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), key_padding_mask=kpm,
                                    backend=backend, block_n=16)
    row("head 0 NaN, head 1 finite", f"NaN rows {_nan_rows(out)}; decode kernel calls {len(calls)}")
    assert _nan_rows(out) == [(0, 0)] and len(calls) == (backend == "triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen(backend, row):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(30, 2, 16, generator=g).to(DEVICE) for _ in range(3))
    q[12, 1, 0] = math.nan  # sequence 1 (rows 10..29), its row 2, head 1
    cu = torch.tensor([0, 10, 30], dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        out = stable_attn.attention_varlen(q, k, v, cu, cu, 20, 20, causal=True, backend=backend, block_n=16)
    nan = out.isnan().any(-1).nonzero().tolist()
    row("packed row 12, head 1 NaN", f"NaN (row, head) {nan}")
    assert nan == [[12, 1]]

