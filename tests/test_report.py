"""stable_attn.report and the ``stable-attn report`` command on synthetic run directories.

The metrics CSV is written by Lightning's own CSVLogger (the file a real run leaves), with sparse
rows: training rows (epoch, train/loss), separate rows for the per-layer attention metrics, and
validation rows that repeat a step. Expected numbers are read back from the CSV with the csv module,
independently of stable_attn.report's parser.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from lightning.pytorch.loggers import CSVLogger
from matplotlib.image import imread

from stable_attn.cli import main
from stable_attn.monitor import Alert, JsonlChannel
from stable_attn.monitor.names import ALERTS_FILE
from stable_attn.report import build_report, find_alerts_jsonl, find_metrics_csv, fmt, load_run, read_alerts

LAYERS = 4
STEPS = 60
SPIKE_STEP = 37
WARNING_STEP = 50
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, *, seed: int, nan_at: int | None = None, alerts: list[dict] | None = None) -> Path:
    """A run directory as the example leaves it; returns the metrics.csv path."""
    rng = np.random.default_rng(seed)
    logger = CSVLogger(save_dir=str(run_dir), name="csv")
    for step in range(STEPS):
        loss = 6.0 * math.exp(-step / 25) + 2.0 + 0.1 * rng.standard_normal()
        if step == SPIKE_STEP:
            loss += 5.0
        if step == nan_at:
            loss = float("nan")
        logger.log_metrics({"epoch": 0, "train/loss": loss, "train/lr": 1e-3}, step=step)
        if step % 5 == 0:
            layer_metrics = {}
            for i in range(LAYERS):
                layer_metrics[f"stable_attn/saturation/layer{i}"] = float(rng.uniform(0, 0.1 * (i + 1)))
                layer_metrics[f"stable_attn/fixed_rate/layer{i}"] = float(rng.uniform(0, 0.05))
                layer_metrics[f"stable_attn/max_logit/layer{i}"] = float(5 + i + step / 10 + rng.uniform())
                layer_metrics[f"stable_attn/sink_mass/layer{i}"] = float(rng.uniform(0.2, 0.6))
            logger.log_metrics(layer_metrics, step=step)
        if step % 20 == 19:
            logger.log_metrics({"epoch": 0, "val/loss": loss + 0.2 + 0.05 * rng.standard_normal()}, step=step)
    logger.save()
    if alerts is not None:
        with open(run_dir / "alerts.jsonl", "w") as f:
            for alert in alerts:
                f.write(json.dumps(alert) + "\n")
    return Path(logger.log_dir) / "metrics.csv"


def alert(step: int, kind: str, value: float) -> dict:
    return {
        "step": step,
        "kind": kind,
        "metric": "train/loss",
        "value": value,
        "baseline": 2.3,
        "threshold": 3.1,
        "score": 9.0,
        "lr": 1e-3,
        "layers": ["layer1"],
        "action": "warn",
        "message": f"{kind} at step {step}",
        "time": 1700000000.0,
    }


def csv_column(path: Path, name: str) -> list[tuple[int, float]]:
    with open(path, newline="") as f:
        return [(int(r["step"]), float(r[name])) for r in csv.DictReader(f) if r[name] != ""]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def table_row(md: str, first_cell: str) -> list[str]:
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no table row starting with {first_cell!r} in report.md")


def red_pixels(path: Path) -> int:
    # tab:red is (214, 39, 40); nothing else in the loss plot is that red.
    rgb = imread(path)[..., :3]
    return int(((rgb[..., 0] > 0.7) & (rgb[..., 1] < 0.3) & (rgb[..., 2] < 0.3)).sum())


def test_report_matches_the_csv(tmp_path: Path) -> None:
    metrics = write_run(
        tmp_path, seed=1, alerts=[alert(SPIKE_STEP, "spike", 9.7), alert(WARNING_STEP, "early_warning", 2.5)]
    )
    assert find_metrics_csv(tmp_path) == metrics
    report = build_report(tmp_path)
    assert report == tmp_path / "report.md"
    md = report.read_text()

    for name, (width, height) in {
        "loss.png": (800, 450),
        "max_logit.png": (800, 450),
        "saturation_heatmap.png": (800, 300),
    }.items():
        assert png_size(tmp_path / name) == (width, height), name
        assert (tmp_path / name).stat().st_size > 10_000, f"{name} looks empty"
        assert f"]({name})" in md

    train = csv_column(metrics, "train/loss")
    val = csv_column(metrics, "val/loss")
    assert table_row(md, "final train loss")[1] == f"{fmt(train[-1][1])} (step {train[-1][0]})"
    assert table_row(md, "final validation loss")[1] == f"{fmt(val[-1][1])} (step {val[-1][0]})"
    assert table_row(md, "alerts: spike")[1] == "1"
    assert table_row(md, "alerts: early_warning")[1] == "1"
    assert table_row(md, "alerts: nonfinite")[1] == "0"

    spike_row = table_row(md, str(SPIKE_STEP))
    assert spike_row[1:3] == ["spike", "train/loss"] and float(spike_row[3]) == 9.7
    assert table_row(md, str(WARNING_STEP))[1] == "early_warning"
    assert "## Alert evidence" not in md  # version-1 lines carry none: the report of an old file is as it was

    assert [m.group(1) for m in re.finditer(r"^\| layer(\d+) \|", md, re.M)] == [str(i) for i in range(LAYERS)]
    for i in range(LAYERS):
        row = table_row(md, f"layer{i}")
        sat = [v for _, v in csv_column(metrics, f"stable_attn/saturation/layer{i}")]
        logit = [v for _, v in csv_column(metrics, f"stable_attn/max_logit/layer{i}")]
        sink = [v for _, v in csv_column(metrics, f"stable_attn/sink_mass/layer{i}")]
        fixed = [v for _, v in csv_column(metrics, f"stable_attn/fixed_rate/layer{i}")]
        assert len(sat) == STEPS // 5
        expected = [np.mean(sat), np.max(sat), np.mean(fixed), np.max(logit), logit[-1], np.mean(sink)]
        assert [float(c) for c in row[1:7]] == pytest.approx(expected, rel=1e-5)

    # The spike and the early warning are drawn as coloured lines; without alerts there is no red.
    assert red_pixels(tmp_path / "loss.png") > 300
    heat = imread(tmp_path / "saturation_heatmap.png")[..., :3]
    assert heat.std() > 0.1, "the heatmap is flat"

    quiet = tmp_path / "quiet"
    write_run(quiet, seed=1, alerts=[])
    build_report(quiet)
    assert red_pixels(quiet / "loss.png") == 0
    assert "No alerts were raised." in (quiet / "report.md").read_text()


def test_cli_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    write_run(run, seed=2, alerts=[alert(SPIKE_STEP, "spike", 8.0)])
    out = tmp_path / "out"
    assert main(["report", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out / "report.md") in printed
    assert "spike 1" in printed
    assert {p.name for p in out.iterdir()} == {"report.md", "loss.png", "max_logit.png", "saturation_heatmap.png"}
    assert "| 37 | spike |" in (out / "report.md").read_text()

    missing = tmp_path / "nope"
    assert main(["report", str(missing)]) == 1
    assert str(missing) in capsys.readouterr().err
    assert main([]) == 2


def test_missing_columns_nan_loss_and_no_alerts(tmp_path: Path) -> None:
    # Only a train loss, with a NaN at the end, and an empty alerts file.
    logger = CSVLogger(save_dir=str(tmp_path), name="csv")
    for step in range(10):
        logger.log_metrics({"train/loss": 3.0 - 0.1 * step if step < 9 else float("nan")}, step=step)
    logger.save()
    (tmp_path / "alerts.jsonl").write_text("")
    md = build_report(tmp_path).read_text()
    assert (tmp_path / "loss.png").is_file()
    assert not (tmp_path / "saturation_heatmap.png").exists()
    assert not (tmp_path / "max_logit.png").exists()
    assert table_row(md, "final train loss")[1] == "nan (step 9)"
    assert "last finite value: 2.2 (step 8)" in md
    assert "no `val/loss` column" in md
    assert "No `stable_attn/saturation/layer{i}` values" in md
    assert "No alerts were raised." in md
    assert "No per-layer stable_attn metrics were logged." in md


def test_a_folder_without_a_run_is_refused_with_one_line_naming_what_was_looked_for(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("not a run")
    with pytest.raises(FileNotFoundError, match="no training run in"):
        build_report(tmp_path)
    assert main(["report", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"stable-attn report: error: no training run in {str(tmp_path)!r}: looked for metrics.csv, "
                            f"trainer_state.json, {ALERTS_FILE}, alerts.jsonl in it and below it and found none\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # no report.md, no plots


def test_a_run_with_only_an_alerts_file_gets_a_report_with_notes(tmp_path: Path) -> None:
    JsonlChannel(tmp_path / ALERTS_FILE).send(Alert(step=3, kind="spike", metric="train/loss", value=9.0))
    md = build_report(tmp_path).read_text()
    assert "No metrics.csv found" in md
    assert table_row(md, "alerts: spike")[1] == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ALERTS_FILE, "report.md"])


def test_newest_metrics_file_wins_and_bad_alert_lines_are_counted(tmp_path: Path) -> None:
    old = write_run(tmp_path, seed=3)
    new = write_run(tmp_path, seed=4)
    assert old.parent.name == "version_0" and new.parent.name == "version_1"
    os.utime(old, (1_000_000_000, 1_000_000_000))
    assert find_metrics_csv(tmp_path) == new
    (tmp_path / "alerts.jsonl").write_text(
        json.dumps(alert(5, "nonfinite", float("nan"))) + "\nnot json\n\n" + json.dumps({"kind": "spike"}) + "\n"
    )
    alerts, bad = read_alerts(tmp_path / "alerts.jsonl")
    assert [a["step"] for a in alerts] == [5] and math.isnan(alerts[0]["value"]) and bad == 2
    run = load_run(tmp_path)
    assert any("2 line(s)" in n for n in run.notes)
    assert any("version_0/metrics.csv" in n for n in run.notes)
    md = build_report(tmp_path).read_text()
    assert table_row(md, "alerts: nonfinite")[1] == "1"
    assert f"| final train loss | {fmt(csv_column(new, 'train/loss')[-1][1])}" in md


def test_bad_run_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="run_dir="):
        build_report(tmp_path / "missing")
    (tmp_path / "metrics.csv").write_text("a,b\n1,2\n")
    md = build_report(tmp_path).read_text()
    assert "has no 'step' column" in md


def test_alerts_of_the_callbacks_layout_are_found_next_to_their_metrics(tmp_path: Path) -> None:
    # The callback writes ALERTS_FILE in trainer.log_dir, i.e. next to the CSVLogger's metrics.csv:
    # RUN_DIR/csv/version_N/. A rerun adds version_1; its own alerts are the ones shown, not version_0's.
    old = write_run(tmp_path, seed=5)
    new = write_run(tmp_path, seed=6)
    os.utime(old, (1_000_000_000, 1_000_000_000))
    for metrics, step in ((old, 11), (new, SPIKE_STEP)):
        JsonlChannel(metrics.parent / ALERTS_FILE).send(Alert(step=step, kind="spike", metric="train/loss", value=9.0))
    os.utime(new.parent / ALERTS_FILE, (1_000_000_000, 1_000_000_000))  # older than version_0's: still the one
    assert find_alerts_jsonl(tmp_path) == new.parent / ALERTS_FILE
    md = build_report(tmp_path).read_text()
    assert table_row(md, "alerts: spike")[1] == "1"
    assert table_row(md, str(SPIKE_STEP))[1:3] == ["spike", "train/loss"]
    assert "| 11 |" not in md

    # Without a CSV (a TensorBoard logger, or none), the newest alerts file anywhere below is used.
    bare = tmp_path / "bare"
    JsonlChannel(bare / "tb" / "version_0" / ALERTS_FILE).send(Alert(step=3, kind="nonfinite", metric="train/loss",
                                                                   value=float("nan")))
    assert find_alerts_jsonl(bare) == bare / "tb" / "version_0" / ALERTS_FILE
    assert table_row(build_report(bare).read_text(), "alerts: nonfinite")[1] == "1"


def test_non_finite_alert_values_read_back_as_floats(tmp_path: Path) -> None:
    # Alert.to_json writes strict JSON ("nan", "inf" strings); older files may hold NaN literals.
    path = tmp_path / ALERTS_FILE
    JsonlChannel(path).send(Alert(step=4, kind="nonfinite", metric="train/grad_norm", value=float("inf"), lr=1e-3))
    with open(path, "a") as f:
        f.write(json.dumps(alert(5, "nonfinite", float("nan"))) + "\n")
    assert '"value":"inf"' in path.read_text() and '"value": NaN' in path.read_text()
    alerts, bad = read_alerts(path)
    assert bad == 0
    assert alerts[0]["value"] == math.inf and isinstance(alerts[0]["value"], float)
    assert math.isnan(alerts[0]["baseline"]) and alerts[0]["lr"] == 1e-3
    assert math.isnan(alerts[1]["value"]) and alerts[1]["score"] == 9.0
    assert Alert.from_dict(alerts[0]).value == math.inf


def test_layer_names_of_several_models(tmp_path: Path) -> None:
    # With several models in one LightningModule the callback names layers "<model path>.layer<i>".
    logger = CSVLogger(save_dir=str(tmp_path), name="csv")
    names = ["model.layer0", "model.layer2", "model.layer10", "encoder.layer1"]
    for step in range(3):
        logger.log_metrics({"train/loss": 3.0 - 0.1 * step}, step=step)
        logger.log_metrics({f"stable_attn/saturation/{n}": 0.01 * (k + 1) for k, n in enumerate(names)}
                           | {f"stable_attn/max_logit/{n}": 5.0 + k for k, n in enumerate(names)}, step=step)
    logger.save()
    run = load_run(tmp_path)
    assert run.layers() == ["encoder.layer1", "model.layer0", "model.layer2", "model.layer10"]
    md = build_report(tmp_path).read_text()
    assert float(table_row(md, "model.layer10")[1]) == pytest.approx(0.03)
    assert float(table_row(md, "encoder.layer1")[4]) == pytest.approx(8.0)
    assert (tmp_path / "saturation_heatmap.png").is_file() and (tmp_path / "max_logit.png").is_file()


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_cli_report_to_an_unwritable_folder_is_one_error_line(tmp_path: Path, capsys, monkeypatch, fault) -> None:
    """A read-only output folder (report.md refused) or a full one (a PNG cut short) used to print a traceback."""
    import errno

    from matplotlib.figure import Figure

    run = tmp_path / "run"
    write_run(run, seed=5)
    out = tmp_path / "out"
    if fault == "read-only":
        def refuse(self, *args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        monkeypatch.setattr(Path, "write_text", refuse)
    else:
        def full(self, *args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(Figure, "savefig", full)
    assert main(["report", str(run), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    why = "Permission denied" if fault == "read-only" else "No space left on device"
    assert err == [f"stable-attn report: error: cannot write the report to {out}: {why}"], err


def test_cli_report_skips_a_bad_alert_line_with_one_line_saying_so(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    write_run(run, seed=6)
    lines = [json.dumps(alert(SPIKE_STEP, "spike", 8.0)), '{"step": Infinity, "kind": "spike", "value": 1.0}',
             '{"step": 2.5, "kind": "spike"}', json.dumps(alert(WARNING_STEP, "early_warning", 0.4))]
    (run / "alerts.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["report", str(run)]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "stable-attn report: warning: alerts.jsonl line 2: 'step' is inf, not an integer >= 0; skipped",
        "stable-attn report: warning: alerts.jsonl line 3: 'step' is 2.5, not an integer >= 0; skipped",
    ]
    alerts, bad = read_alerts(run / "alerts.jsonl")
    assert [a["step"] for a in alerts] == [SPIKE_STEP, WARNING_STEP] and bad == 2
    assert "| 37 | spike |" in (run / "report.md").read_text()


def _pixels(path: Path, rgb: tuple[int, int, int], tol: float = 0.06) -> int:
    image = imread(path)[..., :3]
    return int((np.abs(image - np.array(rgb) / 255).max(axis=-1) < tol).sum())


def test_plots_draw_the_detectors_levels_and_titles_say_what_happened(tmp_path: Path, monkeypatch) -> None:
    from matplotlib.axes import Axes

    from stable_attn.monitor import SurgeDetector
    from stable_attn.report import plots

    # the levels are the detectors' own defaults
    assert [v for v, _ in plots.LEVELS["saturation"]] == [SurgeDetector.saturation().min_level]
    assert [v for v, _ in plots.LEVELS["max_logit"]] == [SurgeDetector.max_logit().min_level,
                                                         SurgeDetector.max_logit().alarm_level]
    titles: list[str] = []
    original = Axes.set_title
    monkeypatch.setattr(Axes, "set_title", lambda ax, text, *a, **k: (titles.append(text), original(ax, text, *a, **k)))

    quiet = tmp_path / "quiet"
    write_run(quiet, seed=1, alerts=[])
    md = build_report(quiet).read_text()
    assert titles[0] == "Loss: no alerts"
    assert titles[1].startswith("Attention saturation") and titles[1].endswith("no alerts on it")
    assert titles[2].startswith("Max attention logit per layer: peak ") and titles[2].endswith("no alerts on it")
    # olive: the max-logit floor (50), pink: its alarm level (1000), cyan: the saturation floor on the colour bar
    assert _pixels(quiet / "max_logit.png", (188, 189, 34)) > 100
    assert _pixels(quiet / "max_logit.png", (227, 119, 194)) > 100
    assert _pixels(quiet / "saturation_heatmap.png", (23, 190, 207)) > 30
    how = md.split("## How to read this", 1)[1].split("\n## ", 1)[0]
    assert "early-warning floor 0.1" in how and "early-warning floor 50" in how and "alarm 1000" in how

    titles.clear()
    noisy = tmp_path / "noisy"
    warning = dict(alert(WARNING_STEP, "early_warning", 0.4), metric="stable_attn/saturation/layer3")
    write_run(noisy, seed=1, alerts=[alert(SPIKE_STEP, "spike", 9.7), alert(40, "spike", 9.0), warning])
    build_report(noisy)
    assert titles[0] == f"Loss: 3 alerts (spike 2, early_warning 1) at steps {SPIKE_STEP}, 40, {WARNING_STEP}"
    assert titles[1].endswith(f"; 1 alert (early_warning 1) at step {WARNING_STEP} on it")
    assert titles[2].endswith("no alerts on it")


def test_report_plots_the_heads_qk_clip_clipped_per_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    logger = CSVLogger(save_dir=str(run), name="csv")
    for step in range(30):
        logger.log_metrics({"train/loss": 3.0 - step / 100}, step=step)
        if step >= 5 and step % 3 == 0:  # logged on the steps that clip
            logger.log_metrics({"qk_clip/clipped_heads": float(step % 4 + 1), "qk_clip/max_logit/layer0": 120.0},
                               step=step)
    logger.save()
    out = tmp_path / "out"
    report = build_report(run, out)
    assert (out / "qk_clip.png").is_file() and "![QK-Clip: clipped heads per step](qk_clip.png)" in report.read_text()
    plain = tmp_path / "plain"
    write_run(plain, seed=3)
    build_report(plain, tmp_path / "plain_out")
    assert not (tmp_path / "plain_out" / "qk_clip.png").exists()  # no qk_clip metric: no plot
