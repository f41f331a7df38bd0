"""Per-layer attention statistics for the callback: switched on only on monitored steps, reduced
across ranks, and remembered over a short window to say which layers moved before an alert.

The kernels fill each layer's :class:`~stable_attn.AttentionStats` as a side output of the forward
pass, and the transformers integration passes the stats object only while ``stats.enabled`` is True,
so steps that are not monitored pay nothing.

:attr:`LayerStats.recent` keeps, for the alerts' evidence (:mod:`stable_attn.monitor.alerts.evidence`), each monitored
step's reduced values and rank zero's own per-head values (heads are not gathered across ranks), over the same
window; it is not saved in checkpoints.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping

import torch

from ..stats import AttentionStats
from .names import LAYER_STATS

__all__ = ["HEAD_STATS", "LayerStats", "STAT_NAMES"]

STAT_NAMES = LAYER_STATS  # the order of the logged per-layer metrics
# Columns of the tensor gathered across ranks: the sums are summed over ranks, the max (last) is maxed.
_ROWS, _SATURATED, _FIXED, _FIRST_KEY_PROB, _ENTROPY, _ENTROPY_ROWS, _MAX_LOGIT = range(7)
_COLUMNS = _MAX_LOGIT + 1
#: The per-head statistics :attr:`LayerStats.recent` keeps (rank zero's own), in this order.
HEAD_STATS = ("max_logit", "saturation", "sink_mass", "entropy")


class LayerStats:
    """The attention layers of a model, by name (``"layer0"``, ...), and their recent statistics.

    Args:
        stats: layer name -> the AttentionStats its attention module fills.
        window: monitored steps remembered for :meth:`most_changed`.
    """

    def __init__(self, stats: Mapping[str, AttentionStats], window: int = 10) -> None:
        self.stats = dict(stats)
        self.history: deque[dict[str, dict[str, float]]] = deque(maxlen=window)
        #: ``(step, per-layer values as in history, {layer: {stat: [per-head values]}})`` of the monitored steps
        #: in the window, oldest first (per-head: this rank's own statistics, :data:`HEAD_STATS`, NaN where none)
        self.recent: deque[tuple[int, dict[str, dict[str, float]], dict[str, dict[str, list[float]]]]] = \
            deque(maxlen=window)
        self.enable(False)

    def __len__(self) -> int:
        return len(self.stats)

    def enable(self, on: bool) -> None:
        for s in self.stats.values():
            s.enabled = on

    def reset(self) -> None:
        for s in self.stats.values():
            s.reset()

    def _local_sums(self, device: torch.device) -> torch.Tensor:
        """``[layers, 7]`` float64: rows, saturated rows, fixed blocks, sum of key-0 probability, sum of the
        entropy and the rows it was collected on, max logit.

        Built with a handful of stacked operations rather than a few per layer: on a GPU each small
        operation is a kernel launch, and a 48-layer model would otherwise pay hundreds per monitored step.
        """
        out = torch.zeros(len(self.stats), _COLUMNS, dtype=torch.float64, device=device)
        out[:, _MAX_LOGIT] = -math.inf
        filled = [(i, s.state_dict()) for i, s in enumerate(self.stats.values()) if not s.empty]
        if not filled:
            return out
        index = torch.tensor([i for i, _ in filled], device=device)
        fields = ("rows", "saturated_rows", "fixed_blocks", "sink_mass_sum", "entropy_sum", "entropy_rows")
        same_heads = len({st["rows"].shape for _, st in filled}) == 1
        for col, field in enumerate(fields):
            tensors = [st[field] for _, st in filled]
            sums = (torch.stack(tensors).sum(dim=1) if same_heads else torch.stack([t.sum() for t in tensors]))
            out[index, col] = sums.to(device=device, dtype=torch.float64)
        max_logits = [st["max_logit"] for _, st in filled]
        maxes = torch.stack(max_logits).amax(dim=1) if same_heads else torch.stack([t.max() for t in max_logits])
        out[index, _MAX_LOGIT] = maxes.to(device=device, dtype=torch.float64)
        return out

    def _local_heads(self) -> dict[str, dict[str, list[float]]]:
        """This rank's per-head :data:`HEAD_STATS` of the filled layers (one host copy; stacked operations when
        every layer has the same heads)."""
        filled = [(name, s.state_dict()) for name, s in self.stats.items() if not s.empty]
        if not filled:
            return {}

        def per_head(st: Mapping[str, torch.Tensor]) -> torch.Tensor:  # [4, ..., H] float64
            rows = st["rows"].double().clamp(min=1)
            entropy_rows = st["entropy_rows"].double()
            entropy = torch.where(entropy_rows > 0, st["entropy_sum"].double() / entropy_rows.clamp(min=1),
                                  torch.full_like(entropy_rows, math.nan))
            return torch.stack([st["max_logit"].double(), st["saturated_rows"].double() / rows,
                                st["sink_mass_sum"].double() / rows, entropy])

        if len({st["rows"].shape for _, st in filled}) == 1:
            stacked = {k: torch.stack([st[k] for _, st in filled]) for k in
                       ("rows", "max_logit", "saturated_rows", "sink_mass_sum", "entropy_sum", "entropy_rows")}
            values = per_head(stacked).cpu().tolist()  # [4, layers, H]
            return {name: {stat: values[j][i] for j, stat in enumerate(HEAD_STATS)}
                    for i, (name, _) in enumerate(filled)}
        out = {}
        for name, st in filled:
            values = per_head(st).cpu().tolist()
            out[name] = {stat: values[j] for j, stat in enumerate(HEAD_STATS)}
        return out

    def collect(self, step: int, all_gather: Callable[[torch.Tensor], torch.Tensor] | None,
                device: torch.device) -> dict[str, dict[str, float]]:
        """Reduce this step's statistics over heads, calls and ranks, remember them, reset the stats.

        ``all_gather`` (the strategy's) is called exactly once, on every rank, whatever the local stats
        hold: ranks must issue the same collectives. Layers that saw no rows are left out.
        """
        local = self._local_sums(device)
        if all_gather is not None:
            gathered = all_gather(local).reshape(-1, *local.shape)
            sums = gathered[..., :_MAX_LOGIT].sum(dim=0)
            max_logit = gathered[..., _MAX_LOGIT].amax(dim=0)
        else:
            sums, max_logit = local[:, :_MAX_LOGIT], local[:, _MAX_LOGIT]
        sums, max_logit = sums.cpu().tolist(), max_logit.cpu().tolist()
        heads = self._local_heads()
        self.reset()
        result: dict[str, dict[str, float]] = {}
        for name, row, mx in zip(self.stats, sums, max_logit):
            rows = row[_ROWS]
            if rows <= 0:
                continue
            result[name] = {
                "saturation": row[_SATURATED] / rows,
                "fixed_rate": row[_FIXED] / rows,
                "max_logit": mx,
                "sink_mass": row[_FIRST_KEY_PROB] / rows,
            }
            if row[_ENTROPY_ROWS] > 0:  # absent where no call collected it (AttentionStats.with_entropy)
                result[name]["entropy"] = row[_ENTROPY] / row[_ENTROPY_ROWS]
        if result:
            self.history.append(result)
            self.recent.append((int(step), result, {k: v for k, v in heads.items() if k in result}))
        return result

    def most_changed(self, top: int = 2) -> list[tuple[str, float]]:
        """``("layer3/saturation", change)`` and ``("layer1/max_logit", change)`` pairs: for each of
        the two statistics, the ``top`` layers whose value changed most between the oldest and the
        newest monitored step in the window (saturation and max logit have different units, so each
        gets its own ranking)."""
        if len(self.history) < 2:
            return []
        first, last = self.history[0], self.history[-1]
        pairs: list[tuple[str, float]] = []
        for stat in ("saturation", "max_logit"):
            changes = [
                (f"{name}/{stat}", last[name][stat] - first[name][stat])
                for name in last
                if name in first and math.isfinite(last[name][stat] - first[name][stat])
            ]
            changes.sort(key=lambda p: -abs(p[1]))
            pairs.extend(p for p in changes[:top] if p[1] != 0.0)
        return pairs

    def state_dict(self) -> dict:
        return {"history": [dict(h) for h in self.history]}

    def load_state_dict(self, state: Mapping) -> None:
        self.recent.clear()
        self.history.clear()
        self.history.extend(state.get("history", []))
