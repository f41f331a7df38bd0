"""examples/train_gpt2.py: the main job, shortened (``--preset tiny``), checked by what it leaves behind.

Two real training runs of a 2-layer GPT-2 on the offline Python-docs corpus (160 steps each, ~15 s of CPU
time each): a clean one, which must raise no alert at all, and one with a corrupted batch at step 130
(after the loss detector's ~120-step warm-up), which must raise the spike alert at that step and skip
that update. The corpus and tokenizer come from the example's own cache (``$STABLE_ATTN_CACHE`` or
``~/.cache/stable_attn``), keyed by a hash of the corpus, so a second run reuses them.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import struct
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from stable_attn.monitor.names import ALERTS_FILE

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt2.py"
STEPS = 160
SPIKE_AT = 130
LAYERS = 2  # the tiny preset's
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _load_example():
    module = sys.modules.get("train_gpt2")
    if module is not None and Path(module.__file__).resolve() == EXAMPLE:
        return module
    spec = importlib.util.spec_from_file_location("train_gpt2", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt2"] = module
    spec.loader.exec_module(module)
    return module


tg = _load_example()


def _run(run_dir: Path, capsys: pytest.CaptureFixture, *extra: str) -> tuple[Path, str]:
    # One thread: the tiny model gains nothing from two, and on a loaded machine idle OpenMP threads spin.
    threads = torch.get_num_threads()
    try:
        out = tg.main(["--preset", "tiny", "--max-steps", str(STEPS), "--run-dir", str(run_dir), "--threads", "1",
                       "--no-progress-bar", *extra])
    finally:
        torch.set_num_threads(threads)
    return out, capsys.readouterr().out


def _metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.csv as {column: {step: value}} (empty cells skipped)."""
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    table: dict[str, dict[int, float]] = {}
    for row in rows:
        step = int(row["step"])
        for key, text in row.items():
            if key not in ("step", "epoch") and text:
                table.setdefault(key, {})[step] = float(text)
    return table


def _alerts(run_dir: Path) -> list[dict]:
    import json

    text = (run_dir / ALERTS_FILE).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    assert 400 <= width <= 2000 and 200 <= height <= 2000, (path.name, width, height)
    assert 10_000 < len(data) < 1_000_000, (path.name, len(data))


def test_clean_run_trains_logs_and_reports_without_alerts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir, printed = _run(tmp_path / "run", capsys)
    assert run_dir == tmp_path / "run"

    m = _metrics(run_dir)
    loss = m["train/loss"]
    assert sorted(loss) == list(range(STEPS)), "train/loss must be logged for every step (log_every=1)"
    assert all(math.isfinite(v) for v in loss.values())
    # It learns: from about ln(4096) = 8.3 nats at initialisation to well below it.
    assert abs(loss[0] - math.log(4096)) < 0.3
    first, last = sum(loss[s] for s in range(10)) / 10, sum(loss[s] for s in range(STEPS - 10, STEPS)) / 10
    assert last < first - 1.0, (first, last)
    val = m["val/loss"]
    assert len(val) == STEPS // 40 and max(val) >= STEPS - 1, f"validation every 40 steps and at the end: {val}"
    assert all(math.isfinite(v) and v < loss[0] for v in val.values())
    lr = m["train/lr"]
    assert max(lr.values()) == pytest.approx(3e-3) and lr[STEPS - 1] < 1e-3  # warm-up, then cosine decay
    assert all(0 < v for v in m["train/grad_norm"].values())

    for i in range(LAYERS):
        sat = m[f"stable_attn/saturation/layer{i}"]
        assert sorted(sat) == list(range(STEPS))
        assert all(0.0 <= v <= 1.0 for v in sat.values())
        assert all(0.0 <= v <= 1.0 for v in m[f"stable_attn/sink_mass/layer{i}"].values())
        assert all(0.0 <= v for v in m[f"stable_attn/fixed_rate/layer{i}"].values())
        assert all(math.isfinite(v) for v in m[f"stable_attn/max_logit/layer{i}"].values())
    assert f"stable_attn/saturation/layer{LAYERS}" not in m
    # The attention runs in bf16 (cast on the CPU): ties at the row max do occur, and the fix acts on them.
    assert max(max(m[f"stable_attn/saturation/layer{i}"].values()) for i in range(LAYERS)) > 0.01
    assert max(max(m[f"stable_attn/fixed_rate/layer{i}"].values()) for i in range(LAYERS)) > 0.0
    assert set(m["stable_attn/alerts"].values()) == {0.0}

    assert _alerts(run_dir) == [], "a clean run must raise no alert"

    report = (run_dir / "report.md").read_text()
    assert "No alerts were raised." in report
    for i in range(LAYERS):
        assert f"| layer{i} |" in report
    for png in ("loss.png", "saturation_heatmap.png", "max_logit.png"):
        assert f"]({png})" in report
        _check_png(run_dir / png)

    assert f"final train loss: {loss[STEPS - 1]:.6g} (step {STEPS - 1})" in printed
    assert "alerts:           spike 0, nonfinite 0, early_warning 0" in printed
    assert "saturation:       L0=" in printed and " L1=" in printed
    assert "attn_implementation='stable_attn_in_bf16'" in printed


def test_injected_spike_raises_one_alert_at_that_step_and_skips_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run_dir, printed = _run(tmp_path / "run", capsys, "--inject-spike-at", str(SPIKE_AT), "--on-spike", "skip")

    alerts = _alerts(run_dir)
    assert alerts, "the corrupted batch raised no alert"
    assert {a["step"] for a in alerts} == {SPIKE_AT}
    assert {a["kind"] for a in alerts} == {"spike"}
    by_metric = {a["metric"]: a for a in alerts}
    assert len(by_metric) == len(alerts), "one alert per metric"
    # The loss alert is required; random tokens also make the gradient norm jump, which may alert too.
    assert "train/loss" in by_metric and set(by_metric) <= {"train/loss", "train/grad_norm"}
    loss_alert = by_metric["train/loss"]
    assert loss_alert["value"] > loss_alert["threshold"] > loss_alert["baseline"]
    assert loss_alert["action"] == "skip" and "skipped" in loss_alert["message"]
    assert {name.split("/")[0] for name, _ in loss_alert["layers"]} <= {f"layer{i}" for i in range(LAYERS)}

    m = _metrics(run_dir)
    loss = m["train/loss"]
    before = [loss[s] for s in range(SPIKE_AT - 20, SPIKE_AT)]
    # Uniform random targets cost at least ln(4096) = 8.3 nats; the trained model scores far below that.
    assert loss[SPIKE_AT] > math.log(4096) and loss[SPIKE_AT] > max(before) + 1.5
    assert loss_alert["value"] == pytest.approx(loss[SPIKE_AT], rel=1e-6)
    # The skipped update left the model where it was: the next steps are back at the trained level.
    after = [loss[s] for s in range(SPIKE_AT + 1, SPIKE_AT + 6)]
    assert sum(after) / len(after) < sum(before) / len(before) + 0.25, (before, after)
    assert m["stable_attn/alerts"][STEPS - 1] == float(len(alerts))

    report = (run_dir / "report.md").read_text()
    assert "No alerts were raised." not in report
    assert f"| {SPIKE_AT} | spike | train/loss |" in report
    assert "layer0/" in report and "| layer1 |" in report
    _check_png(run_dir / "loss.png")
    assert f"alerts:           spike {len(alerts)}, nonfinite 0, early_warning 0" in printed
    assert f"skipped updates:  steps [{SPIKE_AT}]" in printed


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    f = [tg.lr_factor(s, 10, 100, 0.1) for s in range(120)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(f[:10], f[1:10]))
    assert all(a >= b for a, b in zip(f[10:100], f[11:100]))
    assert f[55] == pytest.approx(0.55) and f[100] == f[119] == pytest.approx(0.1)


def test_paper_preset_matches_the_published_setting() -> None:
    p = tg.PRESETS["gpt2-124m"]
    assert (p.n_layer, p.n_head, p.n_embd, p.seq_len) == (12, 12, 768, 1024)
    assert (p.lr, p.beta1, p.beta2, p.weight_decay, p.warmup_steps, p.grad_clip) == (1e-3, 0.9, 0.95, 0.0, 2000, 1.0)
    assert p.precision == "bf16-mixed" and not p.bias
    assert p.batch_size * p.accumulate * p.seq_len == 327_680


def test_models_for_each_attention_and_bias_free_option() -> None:
    from stable_attn.integrations.transformers import attention_modules

    cfg = replace(tg.PRESETS["gpt2-124m"], n_layer=2, n_head=2, n_embd=32, seq_len=16)
    expected = {"stable_attn": True, "stable_attn_paper": "paper", "stable_attn_off": False}
    for attention, stabilize in expected.items():
        model = tg.build_model(cfg, 64, 0, attention, 4.0)
        assert model.config._attn_implementation == "stable_attn"
        for _, module in attention_modules(model):
            assert module.stable_attn_options["stabilize"] == stabilize
            assert module.stable_attn_options["beta"] == 4.0
    sdpa = tg.build_model(cfg, 64, 0, "sdpa", 2.0, torch.bfloat16)
    assert sdpa.config._attn_implementation == "sdpa_in_bf16"

    model = tg.build_model(cfg, 64, 0, "stable_attn", 2.0)
    biases = [(n, p) for n, p in model.named_parameters() if n.endswith(".bias")]
    assert biases and all(not p.requires_grad and not p.any() for _, p in biases)
    x = torch.randint(0, 64, (2, 17))
    loss = tg.GPT2LightningModule(model, cfg)._loss(x)
    loss.backward()
    assert all(p.grad is None for _, p in biases) and model.transformer.wte.weight.grad is not None


def test_bf16_cast_matches_the_attention_on_bf16_inputs() -> None:
    from stable_attn.integrations.transformers import attach_stats

    torch.manual_seed(0)
    cfg = replace(tg.PRESETS["tiny"], n_layer=1, n_head=2, n_embd=32, seq_len=32)
    model = tg.build_model(cfg, 64, 0, "stable_attn", 2.0, torch.bfloat16)
    stats = attach_stats(model)["layer0"]
    x = torch.randint(0, 64, (2, 32))
    out = model(input_ids=x).logits
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert int(stats.rows.sum()) == 2 * 32 * 2  # the stats were filled through the cast
    model.set_attn_implementation("eager")
    ref = model(input_ids=x).logits
    # Same model, attention in fp32: close, but not equal (bf16 rounding of q, k, v and of P-bar).
    assert torch.allclose(out, ref, atol=0.05) and not torch.equal(out, ref)


def test_missing_matplotlib_leaves_the_run_and_says_how_to_build_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def no_matplotlib(run_dir):
        raise ImportError("stable_attn.report needs matplotlib")

    monkeypatch.setattr(tg, "build_report", no_matplotlib)
    assert tg.write_report(tmp_path) is None
    assert f"stable-attn report {tmp_path}" in capsys.readouterr().out


def test_bad_arguments_are_refused_with_their_value() -> None:
    with pytest.raises(ValueError, match="--inject-spike-at 200 must be below --max-steps 100"):
        tg.main(["--preset", "tiny", "--max-steps", "100", "--inject-spike-at", "200"])
    with pytest.raises(ValueError, match="n_embd=100 must be a multiple of n_head=3"):
        tg.main(["--preset", "tiny", "--n-embd", "100", "--n-head", "3"])
    with pytest.raises(SystemExit):
        tg.main(["--attention", "flash"])


@pytest.mark.slow
def test_default_run_learns_quietly_within_its_budget(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The README's first command as it is (cpu preset, 300 steps), on one thread: the budget is 5 minutes
    on 2 cores; measured about 170 s of CPU time on the dev box."""
    import resource

    threads = torch.get_num_threads()
    before = resource.getrusage(resource.RUSAGE_SELF)
    try:
        run_dir = tg.main(["--run-dir", str(tmp_path / "run"), "--threads", "1", "--no-progress-bar"])
    finally:
        torch.set_num_threads(threads)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    capsys.readouterr()
    assert cpu < 300, f"the default run took {cpu:.0f} s of CPU time"
    m = _metrics(run_dir)
    assert sorted(m["train/loss"]) == list(range(300))
    assert max(m["val/loss"]) == 299 and m["val/loss"][299] < 6.0  # ln(4096) = 8.3 at initialisation
    assert _alerts(run_dir) == []
    for i in range(4):
        assert max(m[f"stable_attn/saturation/layer{i}"].values()) > 0.01
