"""README's transformers.Trainer block runs as written, and `stable-attn report` reads what it leaves."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from stable_attn.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"


def test_trainer_usage_block_runs_and_reports(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    usage = next(b for b in blocks if "StableAttentionTrainerCallback(" in b)
    scope: dict = {}
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        exec(compile(usage, "README.md", "exec"), scope)
    trainer = scope["trainer"]
    # the start-up line says what a spike does in this run (the block passes on_spike="skip")
    assert any(r.getMessage().startswith("StableAttentionTrainerCallback: on a spike: skip the update "
                                         "(on_spike='skip'; ") for r in caplog.records)
    assert trainer.state.global_step == 8
    assert scope["model"].config._attn_implementation == "stable_attn"
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in logged] == [4, 8] and all("stable_attn/saturation/layer0" in e for e in logged)
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert state["log_history"][0]["stable_attn/max_logit/layer1"] == logged[0]["stable_attn/max_logit/layer1"]

    assert main(["report", "out"]) == 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "trainer_state.json" in report and "| layer0 |" in report
