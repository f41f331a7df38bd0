"""README's three-step usage block must run as written, and its commands must stay the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_three_step_usage_block_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    usage = next(b for b in _blocks("python") if "StableAttentionCallback(" in b)
    scope: dict = {}
    exec(compile(usage, "README.md", "exec"), scope)
    trainer, model = scope["trainer"], scope["model"]
    assert trainer.global_step == 8
    assert model.config._attn_implementation == "stable_attn"
    (callback,) = (c for c in trainer.callbacks if type(c).__name__ == "StableAttentionCallback")
    assert callback.engine._qk is not None and callback.engine._qk.tau == 100.0  # the one qk_clip line


def test_readme_starts_with_the_two_commands():
    first = _blocks("bash")[0].strip().splitlines()
    assert first[0].startswith("# run the main job") and "examples/train_gpt2.py" in first[1]
    assert first[2] == "# run the tests" and "pytest" in first[3]
    assert "run the tests" in (README.parent / ".ci" / "run").read_text()
