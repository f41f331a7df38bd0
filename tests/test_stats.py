"""stats.py: RowStats owns the statistics' names, order and dtypes (what the ops and launchers allocate)."""

from __future__ import annotations

import math

import torch

from stable_attn.stats import RowStats


def test_fields_order_dtypes_and_schema():
    assert RowStats.FIELDS == ("saturated", "fixed_blocks", "max_logit", "sink_mass")
    assert tuple(RowStats.DTYPES.values()) == (torch.bool, torch.int32, torch.float32, torch.float32)
    assert RowStats.SCHEMA == "Tensor, Tensor, Tensor, Tensor"
    rs = RowStats.empty((2, 3, 4), torch.device("cpu"))
    assert all(a is b for a, b in zip(RowStats(*rs.tensors()).tensors(), rs.tensors(), strict=True))


def test_constructors():
    q = torch.randn(2, 3, 4, 8, dtype=torch.bfloat16)
    for rs, shape in ((RowStats.empty((2, 3, 4), q.device), (2, 3, 4)), (RowStats.like(q, (1, 3, 8)), (1, 3, 8)),
                      (RowStats.like(q), (0,)), (RowStats.unseen((2, 5), q.device), (2, 5))):
        assert [t.dtype for t in rs.tensors()] == list(RowStats.DTYPES.values())
        assert all(t.shape == shape for t in rs.tensors())
    unseen = RowStats.unseen((2, 5), q.device)
    assert not unseen.saturated.any() and not unseen.fixed_blocks.any() and not unseen.sink_mass.any()
    assert (unseen.max_logit == -math.inf).all()


def test_empty_allocates_the_saturation_as_bytes_and_views_it_as_bool():
    seen = []

    def alloc(shape, dtype, device):
        seen.append(dtype)
        return torch.full(shape, 2 if dtype == torch.int8 else 0, dtype=dtype, device=device)

    rs = RowStats.empty((3,), torch.device("cpu"), alloc=alloc)
    assert seen == [torch.int8, torch.int32, torch.float32, torch.float32]
    assert rs.saturated.dtype == torch.bool and rs.saturated.view(torch.int8).tolist() == [2, 2, 2]


def test_view_and_write():
    rs = RowStats.unseen((1, 2, 6), torch.device("cpu"))
    part = RowStats(torch.ones(1, 2, 3, dtype=torch.bool), torch.full((1, 2, 3), 4, dtype=torch.int32),
                    torch.zeros(1, 2, 3), torch.full((1, 2, 3), 0.5))
    rs.write((..., slice(1, 4)), part)
    assert rs.saturated[0, 0].tolist() == [False, True, True, True, False, False]
    assert rs.fixed_blocks[0, 1, 1:4].tolist() == [4, 4, 4] and rs.max_logit[0, 0, 0] == -math.inf
    assert rs.view(2, 6).sink_mass.shape == (2, 6)
