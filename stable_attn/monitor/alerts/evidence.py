"""The evidence an alert carries: what the engine saw at the step, gathered on rank zero from what it has.

:class:`Evidence` is the engine's notebook. Every optimizer step :meth:`Evidence.record` keeps the step's
gathered per-rank rows (loss, gradient norm: the table the verdict was judged from, no other collective),
the detectors' readings, every param group's learning rate and a reference to the parameters; and it
appends the step's loss to the loss window. :meth:`Evidence.fill` turns that into the evidence fields of
an alert of the step (docs/ALERTS.md has each field, its unit and when it is null):

- ``data_position``: the step's data position (the adapters give it through ``MonitorEngine.add_batch``), copied;
- ``lrs``: every param group's learning rate (``lr`` keeps the first's);
- ``world_size`` and ``ranks``: each rank's loss and gradient norm with its detector's forecast before
  the value, and the score, threshold and rule where that rank's detector flagged it (the ranks flagged on the
  alert's metric first, then those flagged on the other, then by rank);
- ``loss_window``: ``[step, loss]`` of the last :data:`~stable_attn.monitor.alerts.schema.CAPS` ``loss_window``
  (32) optimizer steps up to the alert's, the mean over ranks as ``train/loss`` logs it (since the process
  started: a resume starts the window afresh);
- ``attention``: the per-layer statistics of the latest monitored step (the alert's step for an early
  warning, and for a spike on a monitored step: the engine writes that alert once the step's statistics are
  reduced, after the optimizer step; for a spike on another step, the monitored step before it) and the layer
  and head that moved (:func:`moved`);
- ``grad_norms``: the 5 parameters with the largest gradient norm, one ``torch._foreach_norm`` over the
  gradients on alert steps only (the every-step norm is one fused total; asking it for per-tensor norms would
  cost every step), once per step however many alerts it raises;
- ``outcome``: what the step's action did once it resolved (update applied or dropped, rolled back to which
  step, skipping which batches, stopped, the checkpoint's file name): the engine holds a step's alerts until its
  action has run after the optimizer step (a recovery that fell back to an older snapshot, or found none and
  stopped, is told as it happened, not as it was decided).

"Moved" (:func:`moved`): over the window of monitored steps the engine keeps (``layer_window``), for each
layer and each of max logit, saturation, sink mass and entropy, the relative change between the oldest and the
newest step, ``|after - before| / max(|before|, floor)`` (floors :data:`RELATIVE_FLOORS`: 1 logit, 1% of rows,
1% of probability, 0.1 nats, so a statistic near zero does not rank first on noise); the largest one names the
layer and statistic, and within that layer the head whose own value of that statistic changed most, by the
same measure, names the head (rank zero's per-head statistics: heads are not gathered across ranks).

What the engine knows at the moment an alert is delivered comes as a :class:`StepFacts`, a frozen record it builds
(the data position, the world size, the watched layers, the rollback target and whether the run stops).

Nothing here raises into training: a failure to gather one piece of evidence leaves that field None and is
logged once (DEBUG after the first).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from .. import names
from ..grad_norm import is_dtensor, local
from ..layer_stats import LayerStats
from ..verdict import RankReading
from .alert import Alert, checkpoint_name, json_safe
from .schema import CAPS

__all__ = ["RELATIVE_FLOORS", "TOP_GRAD_NORMS", "Evidence", "StepFacts", "moved", "top_grad_norms"]

log = logging.getLogger("stable_attn")

#: The floor under ``|before|`` in each statistic's relative change (see the module): in its own units.
RELATIVE_FLOORS = {"max_logit": 1.0, "saturation": 0.01, "sink_mass": 0.01, "entropy": 0.1}
#: Parameters listed in ``grad_norms.top``.
TOP_GRAD_NORMS = CAPS["grad_norms.top"]
_LAYER_FIELDS = ("max_logit", "saturation", "sink_mass", "entropy", "fixed_rate")


@dataclass(frozen=True)
class StepFacts:
    """What the engine knows of the step when an alert of it is delivered (built by the engine, read here)."""

    data_position: dict[str, Any] | None = None  # {"epoch", "batch_index", "fingerprint"} of the step's last batch
    world_size: int = 1
    layers: LayerStats | None = None  # the watched attention layers and their recent statistics
    restores_to: int | None = None  # the step a rollback decided at this step goes back to
    stopping: bool = False  # the run stops at the end of this step
    #: What the step's action did once it resolved (after the optimizer step): ``taken``, ``rolled_back_to``,
    #: ``skipping_batches``, ``stopped``, ``checkpoint`` (a local path). None before: the alerts of a step wait for it.
    resolved: dict[str, Any] | None = None


def _relative(before: float, after: float, stat: str) -> float:
    return abs(after - before) / max(abs(before), RELATIVE_FLOORS[stat])


def _finite(*values: Any) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def moved(recent: Iterable[tuple[int, Mapping[str, Mapping[str, float]], Mapping[str, Mapping[str, list[float]]]]]
          ) -> dict[str, Any] | None:
    """The layer, statistic and head that moved most over ``recent`` (:attr:`LayerStats.recent`), as the
    ``attention.moved`` object; None with fewer than two monitored steps or no finite change."""
    window = list(recent)
    if len(window) < 2:
        return None
    (first_step, first, first_heads), (last_step, last, last_heads) = window[0], window[-1]
    best: tuple[float, str, str] | None = None
    for layer, values in last.items():
        for stat in RELATIVE_FLOORS:
            before, after = first.get(layer, {}).get(stat), values.get(stat)
            if not _finite(before, after):
                continue
            change = _relative(before, after, stat)
            if change > 0 and (best is None or change > best[0]):
                best = (change, layer, stat)
    if best is None:
        return None
    change, layer, stat = best
    out: dict[str, Any] = {"layer": layer, "stat": stat, "from_step": first_step, "to_step": last_step,
                           "before": first[layer][stat], "after": last[layer][stat], "relative_change": change,
                           "head": None, "head_before": None, "head_after": None, "head_relative_change": None}
    heads_before = first_heads.get(layer, {}).get(stat) or []
    heads_after = last_heads.get(layer, {}).get(stat) or []
    if len(heads_before) == len(heads_after):
        ranked = [(_relative(b, a, stat), h) for h, (b, a) in enumerate(zip(heads_before, heads_after))
                  if _finite(b, a)]
        if ranked:
            head_change, head = max(ranked, key=lambda p: (p[0], -p[1]))  # ties: the lowest head
            out.update(head=head, head_before=heads_before[head], head_after=heads_after[head],
                       head_relative_change=head_change)
    return out


def top_grad_norms(named: Iterable[tuple[str, torch.Tensor]], top: int = TOP_GRAD_NORMS) -> dict[str, Any] | None:
    """``{"scope", "parameters", "top"}``: the ``top`` largest gradient 2-norms among ``(name, gradient)`` pairs
    (non-finite first: they are the culprits), one fused norm per device and dtype and one host copy. Sharded
    (DTensor) gradients are measured on this rank's shard (``scope`` ``"local"``). None without gradients."""
    pairs = [(name, g) for name, g in named if g is not None and g.numel()]
    if not pairs:
        return None
    sharded = any(is_dtensor(g) for _, g in pairs)
    grads = [local(g).detach() for _, g in pairs]
    norms = torch._foreach_norm(grads, 2.0)
    device = norms[0].device
    values = torch.stack([n.float().to(device) for n in norms]).cpu().tolist()
    ranked = sorted(zip(values, (name for name, _ in pairs)),
                    key=lambda p: (math.isfinite(p[0]), -p[0] if math.isfinite(p[0]) else 0.0))
    return {"scope": "local" if sharded else "global", "parameters": len(pairs),
            "top": [[name, value] for value, name in ranked[:top]]}


class Evidence:
    """What :meth:`fill` puts into the alerts of a :class:`~stable_attn.monitor.engine.MonitorEngine` (see the
    module). The engine calls :meth:`watch` at setup, :meth:`record` once per optimizer step and :meth:`fill`
    on every alert it delivers."""

    def __init__(self) -> None:
        self.losses: deque[tuple[int, float]] = deque(maxlen=CAPS["loss_window"])
        self._root: weakref.ref[torch.nn.Module] | None = None
        self._names: dict[int, str] = {}
        self._step: int | None = None
        self._rows: list[RankReading] = []
        self._judged: Any = None
        self._lrs: list[Any] | None = None
        self._params: list[torch.nn.Parameter] = []
        self._grad_norms: tuple[int, dict[str, Any] | None] | None = None  # (step, what top_grad_norms gave)
        self._failed: set[str] = set()

    def watch(self, root: torch.nn.Module) -> None:
        """The module whose parameters the gradient norms are named after (held weakly)."""
        self._root = weakref.ref(root)
        self._names = {}

    def record(self, step: int, rows: list[RankReading], judged: Any, optimizer: Any,
               parameters: list[torch.nn.Parameter]) -> None:
        """The step's gathered readings (one :class:`~stable_attn.monitor.verdict.RankReading` per rank), its
        :class:`~stable_attn.monitor.verdict.Judgement`, every param group's learning rate and the parameters
        (their gradients are read only if the step alerts)."""
        self._step, self._rows, self._judged, self._params = step, rows, judged, parameters
        self._grad_norms = None
        # the groups' values as they are (a tensor lr is read at an alert only: no device sync every step)
        groups = getattr(optimizer, "param_groups", None) or []
        self._lrs = [g.get("lr") for g in groups[: CAPS["lrs"]] if isinstance(g, Mapping)]
        loss = judged.last.get(names.LOSS, math.nan)
        if self.losses and self.losses[-1][0] == step:
            self.losses.pop()
        self.losses.append((step, float(loss)))

    # ------------------------------------------------------------------ fill
    def fill(self, alert: Alert, facts: StepFacts, leave: tuple[str, ...] = ()) -> Alert:
        """``alert`` with its evidence fields filled from the step's record and ``facts`` (fields already set, and
        those named in ``leave``, are kept)."""
        fields: dict[str, Any] = {}
        for name, build in (("data_position", self._data_position), ("lrs", self._lrs_of),
                            ("world_size", self._world_size), ("ranks", self._ranks),
                            ("loss_window", self._loss_window), ("attention", self._attention),
                            ("grad_norms", self._grad_norms_of), ("outcome", self._outcome)):
            if getattr(alert, name) is not None or name in leave:
                continue
            try:
                fields[name] = json_safe(build(alert, facts))
            except Exception as exc:  # evidence is a courtesy: it never costs the alert or the run
                level = logging.DEBUG if name in self._failed else logging.WARNING
                self._failed.add(name)
                log.log(level, "stable_attn: the alert at step %s carries no %s: %s: %s", alert.step, name,
                        type(exc).__name__, exc)
        resolved = facts.resolved
        if (alert.checkpoint is None and "outcome" in fields and resolved is not None and self._this_step(alert)
                and resolved.get("checkpoint") is not None):
            fields["checkpoint"] = resolved["checkpoint"]  # the step stopped after all (a recovery found nothing)
        return replace(alert, **fields)

    def _this_step(self, alert: Alert) -> bool:
        return self._step is not None and alert.step == self._step

    def _data_position(self, alert: Alert, facts: StepFacts) -> dict[str, Any] | None:
        position = facts.data_position
        if not position:
            return None
        return {"epoch": _int_or_none(position.get("epoch")), "batch_index": _int_or_none(position.get("batch_index")),
                "fingerprint": None if position.get("fingerprint") is None else str(position["fingerprint"])}

    def _lrs_of(self, alert: Alert, facts: StepFacts) -> list[float] | None:
        if not self._this_step(alert) or not self._lrs:
            return None
        return [None if lr is None else float(lr) for lr in self._lrs]

    def _world_size(self, alert: Alert, facts: StepFacts) -> int:
        return int(facts.world_size)

    def _ranks(self, alert: Alert, facts: StepFacts) -> list[dict[str, Any]] | None:
        if not self._this_step(alert) or not self._rows:
            return None
        judged = self._judged
        events, baselines = judged.events, judged.baselines

        def reading(metric: str, rank: int, value: float) -> dict[str, Any] | None:
            if metric not in baselines:
                return None
            event = events.get(metric, {}).get(rank)
            return {"value": value, "baseline": baselines[metric].get(rank),
                    "score": event.score if event is not None else None,
                    "threshold": event.threshold if event is not None else None,
                    "rule": event.rule if event is not None else None}

        out = []
        for rank, row in enumerate(self._rows):
            out.append({"rank": rank, "loss": reading(names.LOSS, rank, row.loss) if row.has_loss else None,
                        "grad_norm": reading(names.GRAD_NORM, rank, row.grad_norm)})
        # the ranks whose detector of the alert's metric flagged first, then those flagged on the other metric
        own = events.get(alert.metric, {})
        flagged = {r for metric in events.values() for r in metric}
        out.sort(key=lambda r: (r["rank"] not in own, r["rank"] not in flagged, r["rank"]))
        return out[: CAPS["ranks"]]

    def _loss_window(self, alert: Alert, facts: StepFacts) -> list[list[Any]] | None:
        window = [[step, loss] for step, loss in self.losses if step <= alert.step]
        return window or None

    def _attention(self, alert: Alert, facts: StepFacts) -> dict[str, Any] | None:
        layers = facts.layers
        if layers is None or not layers.recent:
            return None
        step, values, _ = layers.recent[-1]
        shown = [{"layer": name, **{k: v.get(k) for k in _LAYER_FIELDS}} for name, v in values.items()]
        return {"step": step, "window": len(layers.recent), "layers": shown[: CAPS["attention.layers"]],
                "layers_total": len(shown), "moved": moved(layers.recent)}

    def _grad_norms_of(self, alert: Alert, facts: StepFacts) -> dict[str, Any] | None:
        if not self._this_step(alert):
            return None
        if self._grad_norms is None or self._grad_norms[0] != alert.step:
            self._grad_norms = (alert.step, top_grad_norms(self._named_grads()))
        return self._grad_norms[1]

    def _named_grads(self) -> list[tuple[str, torch.Tensor]]:
        root = self._root() if self._root is not None else None
        if root is not None and any(id(p) not in self._names for p in self._params):
            self._names = {id(p): name for name, p in root.named_parameters()}
        return [(self._names.get(id(p), f"parameter{i}"), p.grad) for i, p in enumerate(self._params)]

    def _outcome(self, alert: Alert, facts: StepFacts) -> dict[str, Any]:
        verdict = self._judged.verdict if self._this_step(alert) and self._judged is not None else None
        dropped = verdict.drop if verdict is not None else None
        resolved = facts.resolved
        if verdict is not None and resolved is not None:  # the step's outcome, whatever its alert first said
            checkpoint = resolved.get("checkpoint")
            return {"taken": resolved["taken"], "update_applied": not dropped,
                    "rolled_back_to": resolved.get("rolled_back_to"),
                    "skipping_batches": resolved.get("skipping_batches"),
                    "stopped": bool(resolved.get("stopped")),
                    "checkpoint": checkpoint_name(checkpoint) if checkpoint is not None else None}
        rolled_back_to = None
        if verdict is not None and verdict.rollback and facts.restores_to is not None:
            rolled_back_to = int(facts.restores_to)
        stopped = bool((verdict is not None and verdict.stop) or facts.stopping or alert.checkpoint is not None)
        checkpoint = checkpoint_name(alert.checkpoint) if alert.checkpoint is not None else None
        # the batches a recovery skips: its own alert says (it sets the outcome itself)
        return {"taken": alert.action, "update_applied": None if dropped is None else not dropped,
                "rolled_back_to": rolled_back_to, "skipping_batches": None, "stopped": stopped,
                "checkpoint": checkpoint or None}


def _int_or_none(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    return int(value)

