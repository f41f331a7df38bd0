"""The "Alert evidence" section of report.md: per alert of schema version 2, what it carries (docs/ALERTS.md).

One block per alert that holds any evidence (up to :data:`MAX_EVIDENCE_ALERTS`): the action and what it did,
the data position, the detector's baseline, threshold and score with each rank's reading, the learning
rates, the layer and head that moved most and the step's per-layer statistics, the largest gradient norms,
and the loss window. Alerts of version 1 (no evidence) add nothing, so an old file's report is unchanged.
"""

from __future__ import annotations

import math
from typing import Any

from ..monitor.alerts.alert import Alert
from .summary import fmt

__all__ = ["MAX_EVIDENCE_ALERTS", "evidence_section"]

#: Alerts whose evidence report.md shows (the rest are in the JSONL file).
MAX_EVIDENCE_ALERTS = 20


def _num(x: Any) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _f(x: Any) -> str:
    value = _num(x)
    return fmt(value) if value is not None and math.isfinite(value) else ("n/a" if value is None else str(value))


def _text(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _has_evidence(alert: dict) -> bool:
    return any(alert.get(name) is not None for name in Alert.EVIDENCE_FIELDS)


def _outcome(outcome: dict) -> str:
    parts = [f"`{_text(outcome.get('taken'))}`"]
    applied = outcome.get("update_applied")
    if applied is not None:
        parts.append("the update was applied" if applied else "the update was dropped (never reached the weights)")
    if outcome.get("rolled_back_to") is not None:
        parts.append(f"rolled back to step {outcome['rolled_back_to']}")
    if outcome.get("skipping_batches") is not None:
        first, last = outcome["skipping_batches"]
        parts.append(f"skipping batches {first}-{last}")
    if outcome.get("stopped"):
        checkpoint = outcome.get("checkpoint")
        parts.append("stopped" + (f", checkpoint `{_text(checkpoint)}`" if checkpoint else ""))
    return "; ".join(parts)


def _reading(name: str, reading: dict | None) -> str:
    if not reading:
        return ""
    text = f"{name} {_f(reading.get('value'))} (baseline {_f(reading.get('baseline'))}"
    if reading.get("threshold") is not None:
        text += f", threshold {_f(reading.get('threshold'))}, {_f(reading.get('score'))} sigma, rule " \
                f"{_text(reading.get('rule'))}"
    return text + ")"


def _block(alert: dict) -> list[str]:
    lines = [f"### step {alert['step']}: {_text(alert.get('kind', '?'))} on {_text(alert.get('metric', '?'))}", ""]
    outcome = alert.get("outcome")
    if outcome:
        lines.append(f"- action: {_outcome(outcome)}")
    position = alert.get("data_position")
    if position:
        lines.append(f"- data position: epoch {_text(position.get('epoch'))}, batch "
                     f"{_text(position.get('batch_index'))}, fingerprint `{_text(position.get('fingerprint'))}`")
    lines.append(f"- detector: value {_f(alert.get('value'))}, baseline {_f(alert.get('baseline'))}, threshold "
                 f"{_f(alert.get('threshold'))}, score {_f(alert.get('score'))} sigma")
    ranks = alert.get("ranks") or []
    if ranks:
        shown = []
        for r in ranks:
            parts = [p for p in (_reading("loss", r.get("loss")), _reading("grad norm", r.get("grad_norm"))) if p]
            shown.append(f"rank {r.get('rank')}: " + ", ".join(parts) if parts else f"rank {r.get('rank')}: n/a")
        more = (alert.get("world_size") or len(ranks)) - len(ranks)
        lines.append("- per rank: " + "; ".join(shown) + (f"; {more} more rank(s) not listed" if more > 0 else ""))
    lrs = alert.get("lrs")
    if lrs:
        groups = " (per param group)" if len(lrs) > 1 else ""
        lines.append("- learning rate: " + ", ".join(_f(x) for x in lrs) + groups)
    attention = alert.get("attention")
    if attention:
        moved = attention.get("moved")
        if moved:
            head = f" head {moved['head']}" if moved.get("head") is not None else ""
            text = (f"- moved most: {_text(moved.get('layer'))}{head} {_text(moved.get('stat'))} "
                    f"{_f(moved.get('before'))} -> {_f(moved.get('after'))} (relative change "
                    f"{_f(moved.get('relative_change'))}, steps {moved.get('from_step')}-{moved.get('to_step')})")
            if moved.get("head") is not None:
                text += (f"; the head: {_f(moved.get('head_before'))} -> {_f(moved.get('head_after'))} (relative "
                         f"change {_f(moved.get('head_relative_change'))})")
            lines.append(text)
        layers = attention.get("layers") or []
        if layers:
            lines.append(f"- attention at step {attention.get('step')}: " + "; ".join(
                f"{_text(s.get('layer'))} max logit {_f(s.get('max_logit'))}, saturation {_f(s.get('saturation'))}, "
                f"sink mass {_f(s.get('sink_mass'))}, entropy {_f(s.get('entropy'))}" for s in layers))
    grads = alert.get("grad_norms")
    if grads and grads.get("top"):
        lines.append(f"- largest gradient norms ({_text(grads.get('scope'))}, of {grads.get('parameters')} "
                     "parameters): " + ", ".join(f"`{_text(name)}` {_f(norm)}" for name, norm in grads["top"]))
    window = alert.get("loss_window")
    if window:
        lines.append(f"- loss over steps {window[0][0]}-{window[-1][0]}: " + " ".join(_f(loss) for _, loss in window))
    return lines + [""]


def evidence_section(alerts: list[dict]) -> list[str]:
    """The report.md lines of the "Alert evidence" section; none when no alert carries evidence."""
    with_evidence = [a for a in alerts if _has_evidence(a)]
    if not with_evidence:
        return []
    md = ["", "## Alert evidence", "",
          "What each alert carried (schema version 2, docs/ALERTS.md): the action and what it did, where the batch "
          "was in the data, the detector's reading on every rank, the learning rate, the attention layer and head "
          "that moved most over the layer window, the largest gradient norms and the recent losses.", ""]
    for alert in with_evidence[:MAX_EVIDENCE_ALERTS]:
        md += _block(alert)
    if len(with_evidence) > MAX_EVIDENCE_ALERTS:
        md.append(f"{len(with_evidence) - MAX_EVIDENCE_ALERTS} more alerts with evidence are in the JSONL file.")
    return md
