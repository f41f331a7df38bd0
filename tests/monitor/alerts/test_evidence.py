"""The evidence alerts carry (schema version 2, docs/ALERTS.md): gathered by the engine in a plain loop,
checked against the schema, bounded in the webhook body, read back by ``stable-attn report``.

The loop is tests/monitor/test_engine.py's (a tiny GPT-2 on random bytes, a spike injected by scaling one
step's loss by 20); the engine is driven directly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_engine import EVERY, Loop

from stable_attn.cli import main
from stable_attn.monitor import Alert, names
from stable_attn.monitor.alerts.evidence import RELATIVE_FLOORS, moved, top_grad_norms
from stable_attn.monitor.alerts.schema import (
    ALERT_SCHEMA,
    CAPS,
    EVIDENCE,
    REMOTE_CAPS,
    VERSION,
    AlertSchemaError,
    validate_alert,
)
from stable_attn.monitor.engine import MonitorEngine
from stable_attn.report import load_run

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

V1_FIELDS = ("step", "kind", "metric", "value", "baseline", "threshold", "score", "lr", "layers", "action", "message",
             "checkpoint", "time")


def jsonl(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / names.ALERTS_FILE).read_text().splitlines()]


def run_engine(tmp_path: Path, steps: int, bad: int, **options) -> tuple[MonitorEngine, Loop, list[Alert], list[dict]]:
    received: list[Alert] = []
    engine = MonitorEngine(on_alert=received.append, **options)
    loop = Loop(engine, str(tmp_path))
    engine.data_position = {"epoch": 0, "batch_index": bad, "fingerprint": "0123abcd"}  # the recover helper's job
    loop.run(steps, scale={bad: 20.0})
    return engine, loop, received, jsonl(tmp_path)


def test_a_spike_alert_carries_the_evidence_of_its_step(tmp_path):
    steps, bad = 40, 36
    engine, loop, received, lines = run_engine(tmp_path, steps, bad, on_spike="skip")
    assert [(d["step"], d["metric"]) for d in lines] == [(bad, names.LOSS), (bad, names.GRAD_NORM)]
    for line in lines:
        assert validate_alert(line) == VERSION == line["version"]
    loss = lines[0]
    assert loss["data_position"] == {"epoch": 0, "batch_index": bad, "fingerprint": "0123abcd"}
    assert loss["lrs"] == [pytest.approx(1e-4)] and loss["lr"] == pytest.approx(1e-4)
    assert loss["world_size"] == 1
    # the loss window: the last 32 optimizer steps up to the alert's, the spike last
    window = loss["loss_window"]
    assert len(window) == CAPS["loss_window"] == 32
    assert [s for s, _ in window] == list(range(bad - 31, bad + 1))
    assert window[-1][1] == pytest.approx(loss["value"])
    assert all(l == pytest.approx(math.log(256), rel=0.05) for _, l in window[:-1])
    # the detector's reading, on rank 0: its forecast before the value, and the event's threshold and score
    (rank,) = loss["ranks"]
    assert rank["rank"] == 0 and rank["loss"]["value"] == pytest.approx(loss["value"])
    assert rank["loss"]["threshold"] == pytest.approx(loss["threshold"]) and rank["loss"]["score"] == loss["score"]
    assert rank["loss"]["baseline"] == pytest.approx(math.log(256), rel=0.05) and rank["loss"]["rule"]
    assert rank["grad_norm"]["value"] == pytest.approx(lines[1]["value"])
    # attention: the latest monitored step before the spike (spikes are judged before the step's statistics are
    # reduced), both layers, and the layer and head that moved most over the window
    attention = loss["attention"]
    monitored = [s for s in range(bad) if (s + 1) % EVERY == 0]
    assert attention["step"] == monitored[-1] and attention["window"] == 9  # layer_window 10 of 9 monitored steps
    assert [s["layer"] for s in attention["layers"]] == ["layer0", "layer1"] and attention["layers_total"] == 2
    for stats in attention["layers"]:
        assert stats["max_logit"] > 0 and 0 <= stats["saturation"] <= 1 and 0 < stats["sink_mass"] < 1
        assert 0 < stats["entropy"] <= math.log(32)
    moved_most = attention["moved"]
    assert moved_most["layer"] in ("layer0", "layer1") and moved_most["head"] in (0, 1)
    assert (moved_most["from_step"], moved_most["to_step"]) == (monitored[0], monitored[-1])
    stat = moved_most["stat"]
    expected = abs(moved_most["after"] - moved_most["before"]) / max(abs(moved_most["before"]), RELATIVE_FLOORS[stat])
    assert moved_most["relative_change"] == pytest.approx(expected)
    # gradient norms: the 5 largest, real parameter names, largest first, none above the total norm
    grads = loss["grad_norms"]
    named = dict(loop.model.named_parameters())
    assert grads["scope"] == "global" and grads["parameters"] == len(named)
    top = [norm for _, norm in grads["top"]]
    assert len(top) == 5 and top == sorted(top, reverse=True) and {n for n, _ in grads["top"]} <= named.keys()
    assert math.sqrt(sum(n * n for n in top)) <= lines[1]["value"] * (1 + 1e-5)
    assert loss["outcome"] == {"taken": "skip", "update_applied": False, "rolled_back_to": None,
                               "skipping_batches": None, "stopped": False, "checkpoint": None}
    # the callables get the same alert; the log line says it in short
    assert received[0].to_dict() == loss
    line = received[0].format()
    for part in ("update dropped", f"data epoch 0 batch index {bad} fingerprint 0123abcd", "moved most: layer",
                 "top grad "):
        assert part in line, (part, line)


def test_a_spike_on_a_monitored_step_carries_that_steps_attention(tmp_path):
    """The alert waits for the step's statistics (reduced after the optimizer step) and keeps the gradient norms
    taken before the dropped update cleared the gradients."""
    steps, bad = 40, 35
    assert (bad + 1) % EVERY == 0  # a monitored step
    engine, loop, received, lines = run_engine(tmp_path, steps, bad, on_spike="skip")
    assert [(d["step"], d["metric"]) for d in lines] == [(bad, names.LOSS), (bad, names.GRAD_NORM)]
    for line in lines:
        validate_alert(line)
        assert line["attention"]["step"] == bad and line["attention"]["moved"]["to_step"] == bad
        assert len(line["grad_norms"]["top"]) == 5 and line["outcome"]["update_applied"] is False
    assert [a.to_dict() for a in received] == lines  # the callables get the same, once each


def test_the_outcome_of_a_rollback_and_of_a_stop(tmp_path):
    _, _, _, lines = run_engine(tmp_path / "rollback", 16, 10, on_spike="rollback", spike_confirm_steps=1,
                                rollback_every=4)
    assert {d["outcome"]["rolled_back_to"] for d in lines} == {8}
    assert all(d["outcome"]["taken"] == "rollback" and d["outcome"]["update_applied"] is False for d in lines)
    engine, _, received, lines = run_engine(tmp_path / "stop", 16, 10, on_spike="stop", spike_confirm_steps=1)
    assert all(validate_alert(d) == 2 for d in lines)
    outcome = lines[0]["outcome"]
    assert outcome["stopped"] and outcome["checkpoint"] == names.stop_checkpoint(10)
    assert lines[0]["checkpoint"] == engine.stop_checkpoint  # the local path, in the local file only
    assert "stopped" in received[0].format()


def test_warn_applies_the_update_and_a_nan_is_never_applied(tmp_path):
    _, _, _, lines = run_engine(tmp_path / "warn", 16, 10, on_spike="warn")
    assert lines and all(d["outcome"]["update_applied"] is True and d["outcome"]["taken"] == "warn" for d in lines)
    received: list[Alert] = []
    engine = MonitorEngine(on_spike="warn", on_alert=received.append)
    loop = Loop(engine, str(tmp_path / "nan"))
    loop.run(12, scale={10: math.nan})
    lines = jsonl(tmp_path / "nan")
    assert lines and all(validate_alert(d) == 2 for d in lines) and {d["kind"] for d in lines} == {"nonfinite"}
    loss = next(d for d in lines if d["metric"] == names.LOSS)
    assert loss["value"] == "nan" and loss["ranks"][0]["loss"] == {
        "value": "nan", "baseline": pytest.approx(math.log(256), rel=0.05), "score": "inf",
        "threshold": loss["ranks"][0]["loss"]["threshold"], "rule": "nonfinite"}
    assert loss["loss_window"][-1] == [10, "nan"] and loss["data_position"] is None
    assert loss["grad_norms"]["top"][0][1] == "nan"  # the non-finite gradients come first
    assert loss["outcome"]["taken"] == "skip" and loss["outcome"]["update_applied"] is False


# ----------------------------------------------------------------------------- the schema


def v2_line() -> dict:
    return json.loads(Alert(step=5, kind="spike", metric=names.LOSS, value=math.inf, lr=1e-3,
                            layers=[("layer0/max_logit", 0.5)], action="skip", loss_window=[[4, 2.0], [5, math.inf]],
                            ranks=[{"rank": 0, "loss": {"value": math.inf, "baseline": 2.0, "score": math.inf,
                                                        "threshold": 2.5, "rule": "nonfinite"}, "grad_norm": None}],
                            outcome={"taken": "skip", "update_applied": False, "rolled_back_to": None,
                                     "skipping_batches": [10, 209], "stopped": False, "checkpoint": None}).to_json())


def test_validate_alert_names_the_field_that_does_not_match() -> None:
    line = v2_line()
    assert validate_alert(line) == 2 and line["loss_window"][1] == [5, "inf"]
    for path, bad, said in (
        (("step",), -1, "'step': is -1; use a value >= 0"),
        (("kind",), "oops", "'kind': is 'oops'; use one of"),
        (("ranks", 0, "loss", "baseline"), "x", "'ranks[0].loss.baseline': is 'x'"),
        (("outcome", "skipping_batches"), [10], "'outcome.skipping_batches': holds 1 entries; at least 2"),
        (("outcome", "stopped"), None, "'outcome.stopped': is None; use boolean"),
        (("loss_window",), [[i, 1.0] for i in range(33)], "'loss_window': holds 33 entries; at most 32"),
        (("data_position",), {"epoch": 0, "batch": 3}, "'data_position.batch_index': is missing"),
        (("version",), "2", "'version': is '2'; use an integer >= 1"),
    ):
        broken = json.loads(json.dumps(line))
        target = broken
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = bad
        with pytest.raises(AlertSchemaError, match=None) as err:
            validate_alert(broken)
        assert said in str(err.value), (said, str(err.value))
    missing = dict(line)
    del missing["outcome"]
    with pytest.raises(AlertSchemaError, match="'outcome': is missing"):
        validate_alert(missing)


def test_an_old_line_is_version_1_and_still_reads() -> None:
    old = {k: v for k, v in v2_line().items() if k in V1_FIELDS}
    assert validate_alert(old) == 1
    back = Alert.from_dict(old)
    assert back.version == 1 and back.ranks is None and back.value == math.inf
    newer = Alert.from_dict({**v2_line(), "version": 3, "diagnosis": {"verdict": "data"}})  # a newer writer's field
    assert newer.version == 3 and newer.outcome["skipping_batches"] == [10, 209]
    assert json.loads(json.dumps(ALERT_SCHEMA)) == ALERT_SCHEMA  # the schema is plain JSON
    assert set(ALERT_SCHEMA["properties"]) == set(V1_FIELDS) | set(EVIDENCE) == set(Alert.FIELDS)


def test_the_webhook_body_names_no_path_and_is_bounded(tmp_path) -> None:
    checkpoint = str(tmp_path / "deep" / "run" / names.stop_checkpoint(7))
    big = Alert(step=7, kind="spike", metric=names.LOSS, value=9.0, action="stop", checkpoint=checkpoint,
                lrs=[1e-3] * CAPS["lrs"], world_size=64,
                ranks=[{"rank": r, "loss": None, "grad_norm": None} for r in range(CAPS["ranks"])],
                loss_window=[[s, 2.0] for s in range(32)],
                data_position={"epoch": 3, "batch_index": 123456, "fingerprint": "f" * 16},
                attention={"step": 4, "window": 10, "layers_total": 64,
                           "moved": {"layer": "model.layer63", "stat": "max_logit", "from_step": 0, "to_step": 4,
                                     "before": 3.0, "after": 9.0, "relative_change": 2.0, "head": 11,
                                     "head_before": 2.5, "head_after": 9.0, "head_relative_change": 2.6},
                           "layers": [{"layer": f"model.layer{i}", "max_logit": 3.0, "saturation": 0.1,
                                       "sink_mass": 0.2, "entropy": None, "fixed_rate": 0.0}
                                      for i in range(CAPS["attention.layers"])]},
                grad_norms={"scope": "global", "parameters": 200,
                            "top": [[f"model.transformer.h.{i}.attn.c_attn.weight", 1.0] for i in range(5)]},
                outcome={"taken": "stop", "update_applied": False, "rolled_back_to": None, "skipping_batches": None,
                         "stopped": True, "checkpoint": names.stop_checkpoint(7)})
    assert validate_alert(big.to_dict()) == 2
    body = json.dumps(big.for_remote().to_dict(), allow_nan=False)
    remote = json.loads(body)
    assert validate_alert(remote) == 2
    assert str(tmp_path) not in body and remote["checkpoint"] == names.stop_checkpoint(7)
    assert len(remote["ranks"]) == REMOTE_CAPS["ranks"] and len(remote["lrs"]) == REMOTE_CAPS["lrs"]
    assert len(remote["attention"]["layers"]) == REMOTE_CAPS["attention.layers"]
    assert remote["attention"]["layers_total"] == 64 and remote["world_size"] == 64  # what was left out shows
    assert len(body) < 8000, len(body)
    assert len(json.dumps(big.to_dict())) > 2 * len(body)  # the local file keeps more


def test_moved_and_top_grad_norms_by_hand() -> None:
    recent = [(3, {"layer0": {"max_logit": 2.0, "saturation": 0.0}, "layer1": {"max_logit": 4.0, "saturation": 0.0}},
               {"layer1": {"max_logit": [4.0, 3.0]}}),
              (7, {"layer0": {"max_logit": 2.2, "saturation": 0.004}, "layer1": {"max_logit": 9.0, "saturation": 0.0}},
               {"layer1": {"max_logit": [4.5, 9.0]}})]
    got = moved(recent)
    # layer1's max logit rose 125%; layer0's saturation 0 -> 0.004 is 0.4 of its 1% floor, its max logit 10%
    assert (got["layer"], got["stat"], got["head"]) == ("layer1", "max_logit", 1)
    assert got["relative_change"] == pytest.approx(1.25) and got["head_relative_change"] == pytest.approx(2.0)
    assert moved(recent[:1]) is None
    grads = [("a", torch.tensor([3.0, 4.0])), ("b", torch.tensor([1.0])), ("c", torch.tensor([math.nan])),
             ("d", None)]
    assert top_grad_norms(grads, top=2) == {"scope": "global", "parameters": 3,
                                            "top": [["c", pytest.approx(math.nan, nan_ok=True)], ["a", 5.0]]}


# ----------------------------------------------------------------------------- the report


def test_the_report_shows_the_evidence_and_reads_old_lines(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    _, _, _, lines = run_engine(run, 16, 10, on_spike="rollback", spike_confirm_steps=1, rollback_every=4)
    old = {k: v for k, v in lines[0].items() if k in V1_FIELDS} | {"step": 3, "message": "an old line"}
    bad = dict(lines[1], step=12, ranks=[{"rank": "zero", "loss": None, "grad_norm": None}])
    with open(run / names.ALERTS_FILE, "a") as f:
        f.write(json.dumps(old) + "\n" + json.dumps(bad) + "\n")
    data = load_run(run)
    assert [a["step"] for a in data.alerts] == [3, 10, 10, 12]
    assert data.alerts[3]["ranks"] is None and data.alerts[3]["outcome"] is not None  # only the bad field is dropped
    assert len(data.evidence_problems) == 1 and "ranks[0].rank" in data.evidence_problems[0]
    assert main(["report", str(run)]) == 0
    md = (run / "report.md").read_text()
    section = md.split("## Alert evidence", 1)[1].split("\n## ", 1)[0]
    assert "### step 3" not in section  # the old line has no evidence
    for part in ("### step 10: spike on train/loss", "- action: `rollback`; the update was dropped", "rolled back to "
                 "step 8", "- data position: epoch 0, batch 10, fingerprint `0123abcd`", "- moved most: layer",
                 " head ", "- detector: value", "threshold", "- per rank: rank 0: loss", "- learning rate: 0.0001",
                 "- largest gradient norms (global, of 28 parameters): `", "- loss over steps 0-10: ",
                 "- attention at step 7: layer0 max logit"):
        assert part in section, part
    assert "evidence field(s) of stable_attn_alerts.jsonl did not match" in md
    # the alerts table keeps its version-1 columns
    columns = "step | kind | metric | value | baseline | threshold | score | layers | action | message | checkpoint"
    assert f"| {columns} |" in md
    capsys.readouterr()


def test_top_grad_norms_of_sharded_gradients_say_their_scope(tmp_path) -> None:
    """DTensor gradients (FSDP2, tensor parallel) are measured on this rank's shard, and the evidence says so."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        grads = [("a", distribute_tensor(torch.full((4,), 3.0), mesh, [Shard(0)])), ("b", torch.ones(2))]
        got = top_grad_norms(grads)
        assert got["scope"] == "local" and got["parameters"] == 2
        assert got["top"][0] == ["a", 6.0]
        assert top_grad_norms([("b", torch.ones(2))])["scope"] == "global"
    finally:
        dist.destroy_process_group()
