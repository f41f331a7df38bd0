"""README runs as written: every ```python block, pasted alone into a fresh interpreter namespace, runs; its
first screen states the default spike action that MonitorConfig holds; its commands stay the ones CI runs.

No block is skipped: README has no marker for blocks that cannot run on a CPU, and every block runs here (the
long main job is a ```bash block; its own test is tests/examples/test_train_gpt2.py).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
FIRST_SCREEN_LINES = 45


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def _python_blocks() -> list[tuple[int, str]]:
    """Every python block with the README line its code starts on."""
    text = README.read_text()
    return [(text[:m.start(1)].count("\n") + 1, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


PYTHON_BLOCKS = _python_blocks()


def test_readme_has_the_python_blocks_this_file_runs():
    # the regex sees every fence that opens a python block (a changed fence would make a block invisible)
    assert len(PYTHON_BLOCKS) == README.read_text().count("```python\n") >= 8


@pytest.mark.parametrize("line, code", PYTHON_BLOCKS, ids=[f"line{line}" for line, _ in PYTHON_BLOCKS])
def test_every_python_block_runs_as_pasted(line, code, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)  # blocks write "out", "tiny-llama", lightning_logs
    threads = torch.get_num_threads()
    scope: dict = {"__name__": "__readme__"}
    try:
        with caplog.at_level(logging.WARNING, logger="stable_attn"):
            exec(compile(code, f"README.md:{line}", "exec"), scope)
    finally:
        torch.set_num_threads(threads)
    if "callbacks=[StableAttentionCallback(" in code:  # the three-step block: defaults as on the first screen
        from stable_attn.monitor.config import ACTION_WORDS, MonitorConfig

        assert scope["trainer"].global_step == 8
        assert scope["model"].config._attn_implementation == "stable_attn"
        default = MonitorConfig.default("on_spike")
        assert any(r.getMessage().startswith(f"StableAttentionCallback: on a spike: {ACTION_WORDS[default]} "
                                             f"(on_spike={default!r}, the default;") for r in caplog.records)
        (callback,) = (c for c in scope["trainer"].callbacks if type(c).__name__ == "StableAttentionCallback")
        assert callback.engine._qk is not None and callback.engine._qk.tau == 100.0  # the one qk_clip line
    if "set_attn_implementation" in code:  # the switch README gives for generating with sdpa works both ways
        assert scope["model"].config._attn_implementation == "stable_attn"
        scope["model"].set_attn_implementation("sdpa")
        assert scope["model"].config._attn_implementation == "sdpa"
    if "patch_sdpa()" in code:  # served inside the block, put back after it
        assert not hasattr(torch.nn.functional.scaled_dot_product_attention, "stable_attn_patch")
        assert scope["y"].shape == scope["x"].shape


def test_first_screen_states_the_default_spike_action_and_the_start_up_line():
    from stable_attn.monitor.config import ACTION_WORDS, MonitorConfig

    default = MonitorConfig.default("on_spike")
    first = " ".join("\n".join(README.read_text().splitlines()[:FIRST_SCREEN_LINES]).split())
    assert f"**On a spike, by default: {ACTION_WORDS[default].split(',')[0]}** (`on_spike=\"{default}\"`)" in first
    assert f"`StableAttentionCallback: on a spike: {ACTION_WORDS[default]} (on_spike='{default}', the default;" in first
    assert "**Speed.** GPU: not measured yet (docs/BENCHMARKS.md" in first


def test_readme_quotes_the_report_levels_the_plots_draw():
    from stable_attn.report.plots import LEVELS

    (sat,), (floor, alarm) = ([v for v, _ in LEVELS[stat]] for stat in ("saturation", "max_logit"))
    text = " ".join(README.read_text().split())
    assert f"early-warning detectors' levels drawn (saturation {sat:g}; max logit {floor:g} and {alarm:g})" in text


def test_readme_troubleshooting_names_the_misspelling_transformers_does_not_hint_at():
    # transformers' own error lists only its implementations: README's line is the user's hint
    from transformers import AutoModelForCausalLM, LlamaConfig

    import stable_attn  # noqa: F401

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match='attn_implementation="stable_atn"` is not supported') as err:
        AutoModelForCausalLM.from_config(cfg, attn_implementation="stable_atn")
    assert "stable_attn" not in str(err.value).replace("stable_atn", "")
    text = " ".join(README.read_text().split())
    assert ('`ValueError: Specified attn_implementation="stable_atn" is not supported. The only possible arguments '
            'are ...`: transformers lists only its own implementations') in text
    assert 'Check the spelling, `"stable_attn"`, and that `import stable_attn` ran before the model was built' in text


def test_readme_starts_with_the_two_commands():
    first = _blocks("bash")[0].strip().splitlines()
    assert first[0].startswith("# run the main job") and "examples/train_gpt2.py" in first[1]
    assert '".[examples,trainer]"' in first[1]  # the Trainer block needs accelerate
    assert first[2] == "# run the tests" and "pytest" in first[3]
    assert "run the tests" in (README.parent / ".ci" / "run").read_text()
