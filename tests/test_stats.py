"""stats.py: RowStats owns the statistics' names, order and dtypes (what the ops and launchers allocate)."""

from __future__ import annotations

import math

import torch

from stable_attn.stats import RowStats


def test_fields_order_dtypes_and_schema():
    assert RowStats.FIELDS == ("saturated", "fixed_blocks", "max_logit", "sink_mass", "entropy")
    assert tuple(RowStats.DTYPES.values()) == (torch.bool, torch.int32, torch.float32, torch.float32, torch.float32)
    assert RowStats.SCHEMA == "Tensor, Tensor, Tensor, Tensor, Tensor"
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
    assert not unseen.entropy.any()
    assert (unseen.max_logit == -math.inf).all()


def test_empty_allocates_the_saturation_as_bytes_and_views_it_as_bool():
    seen = []

    def alloc(shape, dtype, device):
        seen.append(dtype)
        return torch.full(shape, 2 if dtype == torch.int8 else 0, dtype=dtype, device=device)

    rs = RowStats.empty((3,), torch.device("cpu"), alloc=alloc)
    assert seen == [torch.int8, torch.int32, torch.float32, torch.float32, torch.float32]
    assert rs.saturated.dtype == torch.bool and rs.saturated.view(torch.int8).tolist() == [2, 2, 2]


def test_view_and_write():
    rs = RowStats.unseen((1, 2, 6), torch.device("cpu"))
    part = RowStats(torch.ones(1, 2, 3, dtype=torch.bool), torch.full((1, 2, 3), 4, dtype=torch.int32),
                    torch.zeros(1, 2, 3), torch.full((1, 2, 3), 0.5), torch.full((1, 2, 3), 1.5))
    rs.write((..., slice(1, 4)), part)
    assert rs.saturated[0, 0].tolist() == [False, True, True, True, False, False]
    assert rs.fixed_blocks[0, 1, 1:4].tolist() == [4, 4, 4] and rs.max_logit[0, 0, 0] == -math.inf
    assert rs.view(2, 6).sink_mass.shape == (2, 6)


def _rows(entropy: torch.Tensor, max_logit: torch.Tensor) -> RowStats:
    shape = entropy.shape
    return RowStats(torch.zeros(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.int32), max_logit,
                    torch.zeros(shape), entropy)


def test_entropy_is_the_mean_over_rows_that_see_a_key():
    from stable_attn import AttentionStats

    st = AttentionStats()
    # head 0: rows 1.0, 3.0 and one row without keys (entropy 0, max_logit -inf); head 1: rows 2.0, 2.0, 5.0
    st.update(_rows(torch.tensor([[[1.0, 3.0, 0.0], [2.0, 2.0, 5.0]]]),
                    torch.tensor([[[1.0, 1.0, -math.inf], [0.0, 0.0, 0.0]]])))
    assert torch.allclose(st.entropy, torch.tensor([2.0, 3.0]))
    # a call without the entropy (placeholder) adds rows to the other statistics only
    no_entropy = _rows(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))
    no_entropy.entropy = torch.empty(0)
    assert not no_entropy.has_entropy
    st.update(no_entropy)
    assert st.rows.tolist() == [5, 6] and torch.allclose(st.entropy, torch.tensor([2.0, 3.0]))
    assert st.summary()["entropy"] == (1.0 + 3.0 + 2.0 + 2.0 + 5.0) / 5
    restored = AttentionStats()
    restored.load_state_dict(st.state_dict())
    assert torch.equal(restored.entropy, st.entropy)


def test_entropy_absent_until_a_call_collects_it():
    from stable_attn import AttentionStats

    st = AttentionStats(with_entropy=False)
    rows = _rows(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
    rows.entropy = torch.empty(0)
    st.update(rows)
    assert st.entropy is None and "entropy" not in st.summary()
    old = st.state_dict()
    del old["entropy_sum"], old["entropy_rows"]  # a state saved before the entropy existed
    st.load_state_dict(old)
    assert st.entropy is None and st.rows.tolist() == [2]


def test_levels_and_placeholders():
    from stable_attn import AttentionStats
    from stable_attn.stats import STATS_ENTROPY, STATS_OFF, STATS_ROWS, stats_level

    assert stats_level(None) == STATS_OFF and stats_level(AttentionStats(enabled=False)) == STATS_OFF
    assert stats_level(AttentionStats()) == STATS_ENTROPY
    assert stats_level(AttentionStats(with_entropy=False)) == STATS_ROWS
    rs = RowStats.unseen((2, 3), torch.device("cpu"), entropy=False)
    assert rs.entropy.shape == (0,) and not rs.has_entropy and rs.view(6).max_logit.shape == (6,)
    full = RowStats.unseen((2, 3), torch.device("cpu"))
    full.write((..., slice(0, 3)), rs)  # the placeholder leaves the entropy as it was
    assert (full.entropy == 0).all()
