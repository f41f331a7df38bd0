"""AttentionStats: what the kernels measure about attention rows, per query head.

The kernels write one value per query row as a side output of the forward pass (no second pass
over the scores); :meth:`AttentionStats.update` reduces them per head and accumulates over batch
and calls until :meth:`reset`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, ClassVar

import torch


def _stat(dtype: torch.dtype, unseen: float) -> Any:
    """A statistic's field: its dtype and its value on a row that sees no key."""
    return field(metadata={"dtype": dtype, "unseen": unseen})


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


#: What a forward collects (the ops' ``with_stats``, the kernels' ``STATS``): nothing, the row statistics
#: without the entropy, or all of them. The entropy is its own level because it costs the kernel's hot loop
#: two fp32 operations per score plus a row reduction (docs/BENCHMARKS.md, "Entropy"), where the other
#: statistics cost a few operations per row and key block.
STATS_OFF, STATS_ROWS, STATS_ENTROPY = 0, 1, 2


def stats_level(stats: AttentionStats | None) -> int:
    """The ``with_stats`` level a forward runs at for ``stats`` (:data:`STATS_OFF` while it is disabled)."""
    if stats is None or not stats.enabled:
        return STATS_OFF
    return STATS_ENTROPY if stats.with_entropy else STATS_ROWS


@dataclass
class RowStats:
    """Per-row side outputs of one attention forward, each shaped ``[B, Hq, Nq]``.

    - ``saturated``: bool, two or more keys lie within the dtype's tie tolerance of the row max
      (their ``P-bar`` would round to 1.0 against the true max; independent of block size);
    - ``fixed_blocks``: int32, key blocks of this row where the stabilization shifted the offset;
    - ``max_logit``: float32, the row's max scaled score (``-inf`` when no key is visible);
    - ``sink_mass``: float32, softmax probability on key 0 (0 when key 0 is masked);
    - ``entropy``: float32, the entropy of the row's attention distribution in nats (0 when no key is
      visible), accumulated online beside the row sum (docs/ALGORITHM.md, "Statistics"); collected only at
      level :data:`STATS_ENTROPY`, else an empty ``(0,)`` placeholder (``entropy=False`` below).

    The fields' order is the order of the ops' statistics outputs (:data:`SCHEMA`) and of the
    constructor's arguments; :data:`DTYPES` holds their dtypes. Everything that allocates or passes the
    tensors goes through :meth:`empty`, :meth:`like`, :meth:`unseen` and :meth:`tensors`.
    """

    saturated: torch.Tensor = _stat(torch.bool, False)
    fixed_blocks: torch.Tensor = _stat(torch.int32, 0)
    max_logit: torch.Tensor = _stat(torch.float32, -math.inf)
    sink_mass: torch.Tensor = _stat(torch.float32, 0.0)
    entropy: torch.Tensor = _stat(torch.float32, 0.0)

    FIELDS: ClassVar[tuple[str, ...]]
    DTYPES: ClassVar[Mapping[str, torch.dtype]]
    SCHEMA: ClassVar[str]  # the ops' results for the statistics, in field order

    @staticmethod
    def _shape(name: str, rows: tuple[int, ...], entropy: bool) -> tuple[int, ...]:
        return rows if entropy or name != "entropy" else (0,)

    @classmethod
    def empty(cls, rows: tuple[int, ...], device: torch.device,
              alloc: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = _empty,
              entropy: bool = True) -> RowStats:
        """Uninitialized statistics of shape ``rows``, each allocated by ``alloc(rows, dtype, device)``
        (``entropy=False``: the entropy an empty placeholder).

        ``saturated`` is allocated as int8 and viewed as bool (one byte per row either way): the Triton
        kernels write it through an int8 pointer (``saturated.view(torch.int8)``).
        """
        return cls(*(alloc(rows, torch.int8, device).view(torch.bool) if dt == torch.bool
                     else alloc(cls._shape(name, rows, entropy), dt, device) for name, dt in cls.DTYPES.items()))

    @classmethod
    def like(cls, q: torch.Tensor, rows: tuple[int, ...] = (0,), entropy: bool = True) -> RowStats:
        """Statistics of shape ``rows`` on q's device, as ``q.new_empty`` makes them: the ops' fake outputs,
        and (``rows=(0,)``, the default) the placeholders the ops return when no statistics are collected."""
        return cls(*(q.new_empty(cls._shape(name, rows, entropy), dtype=dt) for name, dt in cls.DTYPES.items()))

    @classmethod
    def unseen(cls, rows: tuple[int, ...], device: torch.device, entropy: bool = True) -> RowStats:
        """The statistics of rows that see no key: not saturated, no block fixed, ``max_logit = -inf``,
        no probability on key 0, entropy 0."""
        return cls(*(torch.full(cls._shape(f.name, rows, entropy), f.metadata["unseen"], dtype=f.metadata["dtype"],
                                device=device) for f in fields(cls)))

    @property
    def has_entropy(self) -> bool:
        """Whether the entropy was collected (else :attr:`entropy` is an empty placeholder)."""
        return self.entropy.shape == self.max_logit.shape

    @property
    def first_key_prob(self) -> torch.Tensor:
        """Deprecated name of :attr:`sink_mass` (CHANGELOG.md)."""
        return self.sink_mass

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors in field order (the ops' statistics outputs; ``RowStats(*t)`` inverts it)."""
        return tuple(getattr(self, name) for name in self.FIELDS)

    def view(self, *shape: int) -> RowStats:
        entropy = self.has_entropy
        return RowStats(*(t.view(*shape) if entropy or name != "entropy" else t
                          for name, t in zip(self.FIELDS, self.tensors(), strict=True)))

    def write(self, index: object, other: RowStats) -> None:
        """``self.<field>[index] = other.<field>`` for every field (the entropy where both hold it)."""
        for name in self.FIELDS:
            if name != "entropy" or (self.has_entropy and other.has_entropy):
                getattr(self, name)[index] = getattr(other, name)


RowStats.FIELDS = tuple(f.name for f in fields(RowStats))
RowStats.DTYPES = MappingProxyType({f.name: f.metadata["dtype"] for f in fields(RowStats)})
RowStats.SCHEMA = ", ".join("Tensor" for _ in RowStats.FIELDS)


class AttentionStats:
    """Accumulated attention-row statistics, per query head.

    Pass one as ``stats=`` to :func:`stable_attn.attention` (or attach one per layer with
    :func:`stable_attn.integrations.transformers.attach_stats`). Tensors are created lazily on the
    device of the first update and accumulate over batch and calls until :meth:`reset`:

    - ``rows``: query rows that saw at least one key (int64 ``[H]``);
    - ``saturated_rows``: rows with two or more keys whose ``P-bar`` would round to 1.0 against the
      row max in the dtype ``P-bar`` is cast to (int64 ``[H]``);
    - ``fixed_blocks``: (row, key block) pairs where the stabilization shifted the offset (int64 ``[H]``);
    - ``max_logit``: max scaled attention score (float32 ``[H]``, ``-inf`` before any update);
    - ``sink_mass``: mean softmax probability on key 0 (float32 ``[H]``);
    - ``entropy``: mean attention entropy in nats over the rows that see a key (float32 ``[H]``).

    ``enabled`` lets a training loop switch collection off on steps it does not log; integrations
    only pass an instance to the op while it is True. ``with_entropy`` (default True) asks for the entropy
    too; without it the forward runs the cheaper statistics level (:data:`STATS_ROWS`), and ``entropy``
    averages only the rows of the calls that collected it.
    """

    def __init__(self, enabled: bool = True, with_entropy: bool = True) -> None:
        self.enabled = enabled
        self.with_entropy = with_entropy
        self.reset()

    def reset(self) -> None:
        self.rows: torch.Tensor | None = None
        self.saturated_rows: torch.Tensor | None = None
        self.fixed_blocks: torch.Tensor | None = None
        self.max_logit: torch.Tensor | None = None
        self._sink_mass_sum: torch.Tensor | None = None
        self._entropy_sum: torch.Tensor | None = None
        self._entropy_rows: torch.Tensor | None = None  # the rows of the calls that collected the entropy
        # a tensor bumped in place: a Python int would make torch.compile recompile on every call
        self.calls = torch.zeros((), dtype=torch.int64)

    @property
    def empty(self) -> bool:
        return self.rows is None

    @torch.no_grad()
    def update(self, row_stats: RowStats) -> None:
        """Fold one forward's per-row outputs into the per-head totals."""
        sat = row_stats.saturated
        heads = sat.shape[1]
        # rows that see no key (left padding, empty windows) carry no signal and are not counted
        rows = torch.isfinite(row_stats.max_logit).sum(dim=(0, 2), dtype=torch.int64)
        saturated = sat.sum(dim=(0, 2), dtype=torch.int64)
        fixed = row_stats.fixed_blocks.sum(dim=(0, 2), dtype=torch.int64)
        max_logit = row_stats.max_logit.float().amax(dim=(0, 2))
        prob_sum = row_stats.sink_mass.float().sum(dim=(0, 2))
        # rows without a key hold 0 (RowStats.unseen), so the sum runs over the rows counted in ``rows``
        if row_stats.has_entropy:
            entropy_sum, entropy_rows = row_stats.entropy.float().sum(dim=(0, 2)), rows.clone()  # own buffer
        else:
            entropy_sum, entropy_rows = torch.zeros_like(prob_sum), torch.zeros_like(rows)
        if self.rows is None or self.rows.shape != rows.shape:
            if self.rows is not None:
                raise ValueError(
                    f"stats: this AttentionStats holds {self.rows.shape[0]} heads but the update has "
                    f"{heads}; use one AttentionStats per attention layer or call reset()"
                )
            self.rows, self.saturated_rows, self.fixed_blocks = rows, saturated, fixed
            self.max_logit, self._sink_mass_sum = max_logit, prob_sum
            self._entropy_sum, self._entropy_rows = entropy_sum, entropy_rows
        else:
            self.rows += rows
            self.saturated_rows += saturated
            self.fixed_blocks += fixed
            torch.maximum(self.max_logit, max_logit, out=self.max_logit)
            self._sink_mass_sum += prob_sum
            self._entropy_sum += entropy_sum
            self._entropy_rows += entropy_rows
        self.calls += 1  # in place (tensor)

    @property
    def sink_mass(self) -> torch.Tensor | None:
        """Mean softmax probability on key 0, per head."""
        if self.rows is None:
            return None
        return self._sink_mass_sum / self.rows.clamp(min=1)

    @property
    def entropy(self) -> torch.Tensor | None:
        """Mean attention entropy (nats) of the rows that saw a key, per head; None until a call collected it."""
        if self._entropy_rows is None or not bool((self._entropy_rows > 0).any()):
            return None
        return self._entropy_sum / self._entropy_rows.clamp(min=1)

    @property
    def saturation(self) -> torch.Tensor | None:
        """Fraction of query rows that were saturated, per head."""
        if self.rows is None:
            return None
        return self.saturated_rows.double() / self.rows.clamp(min=1)

    @property
    def fixed_rate(self) -> torch.Tensor | None:
        """Stabilization shifts per query row (a row contributes one per key block that fired)."""
        if self.rows is None:
            return None
        return self.fixed_blocks.double() / self.rows.clamp(min=1)

    def summary(self) -> dict[str, float]:
        """Scalars over all heads (for logging): saturation, fixed_rate, max_logit, sink_mass, and entropy
        where a call collected it."""
        if self.rows is None:
            return {}
        rows = self.rows.sum().clamp(min=1).double()
        entropy_rows = self._entropy_rows.sum().double()
        out = {
            "saturation": (self.saturated_rows.sum().double() / rows).item(),
            "fixed_rate": (self.fixed_blocks.sum().double() / rows).item(),
            "max_logit": self.max_logit.max().item(),
            "sink_mass": (self._sink_mass_sum.sum().double() / rows).item(),
        }
        if entropy_rows > 0:  # absent when no call collected it (with_entropy=False)
            out["entropy"] = (self._entropy_sum.sum().double() / entropy_rows).item()
        return out

    def state_dict(self) -> dict:
        return {
            "rows": self.rows,
            "saturated_rows": self.saturated_rows,
            "fixed_blocks": self.fixed_blocks,
            "max_logit": self.max_logit,
            "sink_mass_sum": self._sink_mass_sum,
            "entropy_sum": self._entropy_sum,
            "entropy_rows": self._entropy_rows,
            "calls": self.calls,
        }

    def load_state_dict(self, state: dict) -> None:
        self.rows = state["rows"]
        self.saturated_rows = state["saturated_rows"]
        self.fixed_blocks = state["fixed_blocks"]
        self.max_logit = state["max_logit"]
        # "first_key_prob_sum": the key's name before the statistic was called sink_mass everywhere
        self._sink_mass_sum = state["sink_mass_sum"] if "sink_mass_sum" in state else state["first_key_prob_sum"]
        # a state saved before entropy was a statistic has none: no rows with an entropy
        self._entropy_sum, self._entropy_rows = state.get("entropy_sum"), state.get("entropy_rows")
        if (self._entropy_sum is None or self._entropy_rows is None) and self.rows is not None:
            self._entropy_sum, self._entropy_rows = torch.zeros_like(self._sink_mass_sum), torch.zeros_like(self.rows)
        self.calls = state["calls"]

    def __repr__(self) -> str:
        if self.rows is None:
            return "AttentionStats(empty)"
        s = self.summary()
        return (
            f"AttentionStats(heads={self.rows.shape[0]}, rows={int(self.rows.sum())}, "
            f"saturation={s['saturation']:.4f}, fixed_rate={s['fixed_rate']:.4f}, "
            f"max_logit={s['max_logit']:.3f}, sink_mass={s['sink_mass']:.4f}"
            + (f", entropy={s['entropy']:.4f})" if "entropy" in s else ")")
        )
