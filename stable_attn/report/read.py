"""Reading a run directory: find its metrics (Lightning ``metrics.csv`` or a Trainer's
``trainer_state.json``) and its alerts JSONL, and read them into a :class:`RunData`.

Which file is chosen when there are several is described in :mod:`stable_attn.report`. Alert lines
are decoded with :meth:`~stable_attn.monitor.Alert.decode_fields`, the inverse of the encoding the
callback's JSONL channel writes.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..monitor.alerts.alert import Alert
from ..monitor.alerts.schema import AlertSchemaError, alert_version, check_field
from ..monitor.names import (
    ALERTS_FILE,
    GRAD_NORM,
    LEGACY_ALERTS_FILES,
    LOSS,
    LR,
    METRICS_FILE,
    VAL_LOSS,
    parse_layer_metric,
)

__all__ = [
    "TRAINER_STATE_FILE",
    "RunData",
    "Series",
    "display_path",
    "find_alerts_jsonl",
    "find_metrics_csv",
    "find_trainer_state",
    "load_run",
    "read_alerts",
    "read_metrics",
    "read_trainer_state",
]


@dataclass
class Series:
    """One metric over training: ``steps`` (int64, increasing) and ``values`` (float64, may hold NaN)."""

    steps: np.ndarray
    values: np.ndarray


@dataclass
class RunData:
    """What :func:`load_run` read from a run directory, with notes on whatever was missing."""

    run_dir: Path
    metrics_path: Path | None
    alerts_path: Path | None
    metrics: dict[str, Series]
    alerts: list[dict]
    notes: list[str] = field(default_factory=list)
    #: one line per alert line that was skipped (``stable_attn_alerts.jsonl line 7: ...; skipped``)
    skipped_alert_lines: list[str] = field(default_factory=list)
    #: one line per evidence field that did not match the schema and was left out (the alert itself is read)
    evidence_problems: list[str] = field(default_factory=list)

    def series(self, name: str) -> Series | None:
        """``name``, else ``name_step``, else ``name_epoch`` (Lightning's suffixes), else None."""
        for candidate in (name, f"{name}_step", f"{name}_epoch"):
            if candidate in self.metrics:
                return self.metrics[candidate]
        return None

    def layers(self) -> list[str]:
        """Layer names with any per-layer stable_attn metric (``layer0``, ``model.layer1``, ...), in
        natural order (``layer2`` before ``layer10``)."""
        found = {parsed[1] for parsed in map(parse_layer_metric, self.metrics) if parsed}
        return sorted(found, key=_natural_key)


def _natural_key(name: str) -> list[tuple[int, int | str]]:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part]


def _newest(run_dir: Path, name: str) -> Path | None:
    direct = run_dir / name
    if direct.is_file():
        return direct
    found = [p for p in run_dir.rglob(name) if p.is_file()]
    if not found:
        return None
    return max(found, key=lambda p: (p.stat().st_mtime, len(str(p)), str(p)))


def find_metrics_csv(run_dir: str | os.PathLike) -> Path | None:
    """The metrics CSV :func:`build_report` would use (see the module docstring), or None."""
    return _newest(Path(run_dir), METRICS_FILE)


def find_alerts_jsonl(run_dir: str | os.PathLike, metrics_csv: str | os.PathLike | None = None) -> Path | None:
    """The alerts JSONL :func:`build_report` would use (see the module docstring), or None.

    ``metrics_csv``: the metrics file in use (default: :func:`find_metrics_csv`); an alerts file in its
    directory is the same run's."""
    root = Path(run_dir)
    metrics = Path(metrics_csv) if metrics_csv is not None else find_metrics_csv(root)
    names = (ALERTS_FILE, *LEGACY_ALERTS_FILES)
    for directory in ([metrics.parent] if metrics is not None else []) + [root]:
        for name in names:
            if (directory / name).is_file():
                return directory / name
    found = [p for name in names for p in root.rglob(name) if p.is_file()]
    if not found:
        return None
    return max(found, key=lambda p: (p.stat().st_mtime, len(str(p)), str(p)))


def _to_float(text: str) -> float | None:
    text = text.strip()
    if not text:
        return None
    try:
        return float(text)  # accepts "nan", "inf", "-inf" as Lightning writes them
    except ValueError:
        return None


def read_metrics(path: str | os.PathLike) -> dict[str, Series]:
    """Read a Lightning ``metrics.csv`` into one :class:`Series` per metric column.

    Empty cells are skipped; when a step has several values for a metric (a re-logged value), the
    last row wins. Rows without a parsable ``step`` are skipped. Non-numeric columns are dropped.
    """
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "step" not in reader.fieldnames:
            raise ValueError(
                f"metrics file {str(path)!r} has no 'step' column (columns: {reader.fieldnames}); "
                "expected a Lightning CSVLogger metrics.csv"
            )
        per_metric: dict[str, dict[int, float]] = {}
        for row in reader:
            step = _to_float(row.get("step") or "")
            if step is None or not math.isfinite(step):
                continue
            for key, text in row.items():
                if key in ("step", "epoch") or key is None or text is None:
                    continue
                value = _to_float(text)
                if value is not None:
                    per_metric.setdefault(key, {})[int(step)] = value
    out = {}
    for key, by_step in per_metric.items():
        steps = np.array(sorted(by_step), dtype=np.int64)
        out[key] = Series(steps, np.array([by_step[s] for s in steps.tolist()], dtype=np.float64))
    return out


def _step(value: Any) -> int:
    """An alert's ``step`` as an int: an int, or a float or str holding a whole number (not NaN or inf)."""
    if isinstance(value, bool):
        raise TypeError(f"'step' is {value!r}, not an integer")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"'step' is {value!r}, not an integer") from None
    if not math.isfinite(number) or number != int(number) or number < 0:
        raise ValueError(f"'step' is {value!r}, not an integer >= 0")
    return int(value) if isinstance(value, int) else int(number)


def _check_evidence(alert: dict, number: int, evidence_problems: list[str] | None) -> None:
    """A version-2 line's evidence fields checked against the schema; a field that does not match is set to
    None (and said in ``evidence_problems``): the alert's other fields still read."""
    if alert_version(alert) < 2:
        return
    for name in Alert.EVIDENCE_FIELDS:
        if alert.get(name) is None:
            continue
        try:
            check_field(name, alert[name])
        except AlertSchemaError as err:
            alert[name] = None
            if evidence_problems is not None:
                evidence_problems.append(f"line {number}: {str(err)[:200]}")


def read_alerts(path: str | os.PathLike, problems: list[str] | None = None,
                evidence_problems: list[str] | None = None) -> tuple[list[dict], int]:
    """Alerts from a JSONL file (one object per line) and the number of lines that were not alerts.

    Blank lines are ignored; a line that is not a JSON object with a whole-number ``step`` (``"step":
    Infinity`` included) counts as bad and is skipped; ``problems``, when given, gets one line per bad
    line (``line 7: 'step' is inf, not an integer >= 0``).
    :meth:`~stable_attn.monitor.Alert.to_json` writes non-finite floats as the strings ``"nan"``, ``"inf"``
    and ``"-inf"`` (strict JSON); :meth:`~stable_attn.monitor.Alert.decode_fields`
    reads them back as floats, as it does the ``NaN``/``Infinity`` literals Python's ``json`` writes
    by default, so the :attr:`~stable_attn.monitor.Alert.FLOAT_FIELDS` are floats (or None) in what
    this returns. Other keys are kept as the line holds them, and a line may lack any key but ``step``.
    A version-2 line's evidence fields (docs/ALERTS.md) are checked against the schema
    (:mod:`stable_attn.monitor.alerts.schema`): one that does not match is set to None and, when
    ``evidence_problems`` is given, said there (``line 7: alert field 'ranks[0].rank': ...``).
    """
    alerts = []
    bad = 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                alert = json.loads(line)
                if not isinstance(alert, dict):
                    raise TypeError("not a JSON object")
                if "step" not in alert:
                    raise KeyError("no 'step'")
                alert = Alert.decode_fields(alert)
                alert["step"] = _step(alert["step"])
                _check_evidence(alert, number, evidence_problems)
            except (ValueError, TypeError, KeyError, OverflowError) as err:
                bad += 1
                if problems is not None:
                    reason = err.args[0] if isinstance(err, KeyError) and err.args else err
                    text = str(reason).splitlines()[0] if str(reason) else type(err).__name__
                    problems.append(f"line {number}: {text[:200]}")
                continue
            alerts.append(alert)
    alerts.sort(key=lambda a: a["step"])
    return alerts, bad


#: The file a transformers ``Trainer`` writes its state and ``log_history`` to.
TRAINER_STATE_FILE = "trainer_state.json"
# The Trainer's log names that mean what the callback's names mean.
_TRAINER_NAMES = {"loss": LOSS, "eval_loss": VAL_LOSS, "grad_norm": GRAD_NORM, "learning_rate": LR}
# Keys of a log_history entry that are not metrics over steps: the position, and the end-of-run summary.
_TRAINER_SKIP = ("step", "epoch", "total_flos")


def _global_step(path: Path) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            step = json.load(f).get("global_step", -1)
    except (OSError, ValueError, AttributeError):
        return -1
    return step if isinstance(step, int) else -1


def find_trainer_state(run_dir: str | os.PathLike) -> Path | None:
    """The ``trainer_state.json`` below ``run_dir`` with the highest ``global_step`` (then the newest), or None."""
    found = [p for p in Path(run_dir).rglob(TRAINER_STATE_FILE) if p.is_file()]
    if not found:
        return None
    return max(found, key=lambda p: (_global_step(p), p.stat().st_mtime, str(p)))


def read_trainer_state(path: str | os.PathLike) -> dict[str, Series]:
    """The ``log_history`` of a transformers ``trainer_state.json`` as one :class:`Series` per metric.

    Entries without an integer ``step`` and non-numeric values are skipped; the end-of-run summary
    (``train_runtime``, ``train_loss``, ...) is left out; when a step logs a metric twice, the last wins.
    ValueError when the file is not a Trainer state.
    """
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)  # Python's json reads the NaN and Infinity the Trainer writes
    except ValueError as err:
        raise ValueError(f"{str(path)!r} is not JSON: {err}") from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise ValueError(f"{str(path)!r} has no 'log_history' list; expected a transformers trainer_state.json")
    per_metric: dict[str, dict[int, float]] = {}
    for entry in history:
        step = entry.get("step") if isinstance(entry, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        for key, value in entry.items():
            if key in _TRAINER_SKIP or key.startswith("train_") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                per_metric.setdefault(_TRAINER_NAMES.get(key, key), {})[step] = float(value)
    out = {}
    for key, by_step in per_metric.items():
        steps = np.array(sorted(by_step), dtype=np.int64)
        out[key] = Series(steps, np.array([by_step[s] for s in steps.tolist()], dtype=np.float64))
    return out


def load_run(run_dir: str | os.PathLike) -> RunData:
    """Find and read the metrics CSV and the alerts JSONL of ``run_dir``; a missing file is a note, but a
    directory with neither metrics nor alerts raises FileNotFoundError naming the files looked for."""
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"run_dir={str(run_dir)!r} is not a directory; expected the directory a training run "
            f"wrote (with a {METRICS_FILE} below it and usually a {ALERTS_FILE})"
        )
    notes: list[str] = []
    metrics_path = find_metrics_csv(root)
    metrics: dict[str, Series] = {}
    trainer_state = find_trainer_state(root) if metrics_path is None else None
    if trainer_state is not None:
        metrics_path = trainer_state
        try:
            metrics = read_trainer_state(trainer_state)
        except ValueError as err:
            notes.append(f"Could not read {trainer_state.name}: {err}")
    elif metrics_path is None:
        notes.append(f"No {METRICS_FILE} found below the run directory (nor a Trainer's {TRAINER_STATE_FILE}): "
                     "no loss or attention plots.")
    else:
        try:
            metrics = read_metrics(metrics_path)
        except ValueError as err:
            notes.append(f"Could not read {metrics_path.name}: {err}")
        others = [p for p in root.rglob(METRICS_FILE) if p.is_file() and p != metrics_path]
        if others:
            notes.append(
                f"Used the newest {METRICS_FILE}; {len(others)} older one(s) ignored: "
                + ", ".join(f"`{display_path(p, root)}`" for p in sorted(others))
            )
    alerts_path = find_alerts_jsonl(root, metrics_path)
    if metrics_path is None and alerts_path is None:
        looked_for = ", ".join((METRICS_FILE, TRAINER_STATE_FILE, ALERTS_FILE, *LEGACY_ALERTS_FILES))
        raise FileNotFoundError(f"no training run in {str(run_dir)!r}: looked for {looked_for} in it and below it "
                                "and found none")
    alerts: list[dict] = []
    skipped: list[str] = []
    evidence: list[str] = []
    if alerts_path is None:
        notes.append(f"No {ALERTS_FILE} found: no alerts are shown (the run may not have had the callback, "
                     "or its alerts_file was None or renamed).")
    else:
        problems: list[str] = []
        alerts, bad = read_alerts(alerts_path, problems, evidence)
        if bad:
            notes.append(f"{bad} line(s) of {alerts_path.name} were not valid alerts and were skipped.")
        if evidence:
            notes.append(f"{len(evidence)} evidence field(s) of {alerts_path.name} did not match the alert schema "
                         "(docs/ALERTS.md) and are not shown: " + "; ".join(evidence[:3]))
        skipped = [f"{alerts_path.name} {p}; skipped" for p in problems]
    return RunData(root, metrics_path, alerts_path, metrics, alerts, notes, skipped, evidence)


def display_path(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` (POSIX separators) where it lies below it, else as it is."""
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)
