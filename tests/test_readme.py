"""README runs as written and says what the code does: every ```python block, pasted alone into a fresh
interpreter namespace in a temporary folder, runs, prints what its `# prints:` comments say, and does what its
other comments claim; the quoted start-up lines, the main job's summary and the speed sentence are held to the
code and the committed benchmark output; its commands stay the ones CI runs.

No block is skipped: README has no marker for blocks that cannot run on a CPU, and every block runs here (the
long main job is a ```bash block; its own test is tests/examples/test_train_gpt2.py).
"""

from __future__ import annotations

import re

import pytest
from doc_blocks import ROOT, blocks, quoted_lines, run, text_blocks

README = ROOT / "README.md"
FIRST_SCREEN_LINES = 45
MAX_LINES = 250
BLOCKS = blocks(README)


def test_readme_is_short_and_has_the_blocks_this_file_checks():
    assert len(README.read_text().splitlines()) <= MAX_LINES
    # the regex sees every fence that opens a python block (a changed fence would make a block invisible)
    assert len(BLOCKS) == README.read_text().count("```python\n") == 5


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_every_python_block_runs_as_pasted_and_prints_what_it_says(block, tmp_path, monkeypatch, caplog, capsys):
    calls = []
    if 'attn_implementation="stable_attn")  # from_pretrained' in block.code:  # count the op's calls per layer
        from stable_attn.integrations.transformers import attention_function

        real = attention_function.attention
        monkeypatch.setattr(attention_function, "attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    ran = run(block, tmp_path, monkeypatch, caplog, capsys)
    scope = ran.scope
    if calls:  # "every attention layer ran stable_attn's op": 2 layers, one forward
        assert len(calls) == scope["cfg"].num_hidden_layers
        assert all(p.grad is not None for p in scope["model"].parameters())
    if "callbacks=[StableAttentionCallback(" in block.code:  # the Lightning block: README's quoted start-up lines
        from stable_attn.monitor.config import ACTION_WORDS, MonitorConfig

        trainer = scope["trainer"]
        assert trainer.global_step == 8
        assert trainer.lightning_module.model.config._attn_implementation == "stable_attn"
        default = MonitorConfig.default("on_spike")
        assert any(m.startswith(f"StableAttentionCallback: on a spike: {ACTION_WORDS[default]} "
                                f"(on_spike={default!r}, the default;") for m in ran.logs)
        startup = text_blocks(README, "## What you will see")[0]
        for quoted in quoted_lines(startup):
            assert any(m.startswith(quoted) for m in ran.logs), (quoted, ran.logs)
        (callback,) = (c for c in trainer.callbacks if type(c).__name__ == "StableAttentionCallback")
        assert callback.engine._qk is not None and callback.engine._qk.tau == 100.0  # qk_clip=100.0
        assert (tmp_path / "lightning_logs").is_dir()  # the block wrote into the temporary folder
    if "StableAttentionTrainerCallback(" in block.code:  # the Trainer block's comments
        assert scope["trainer"].state.global_step == 8
        assert scope["model"].config._attn_implementation == "stable_attn"  # switched at train begin
        assert (tmp_path / "out" / "trainer_state.json").is_file()
    if "stable_attn.attention(q, k, v" in block.code:  # the op: GQA and per-head statistics
        stats = scope["stats"]
        heads = scope["q"].shape[1]
        assert scope["k"].shape[1] == 2 and heads == 8
        for name in ("saturation", "max_logit", "sink_mass"):
            assert getattr(stats, name).shape[-1] == heads, name
    if "flash_attn_varlen_func(" in block.code:  # shapes as the comments say (tests/integrations/test_flash_compat.py
        assert scope["out"].shape == scope["q"].shape == (2, 128, 4, 64)  # checks the values)
        assert scope["out1"].shape == (256, 4, 64)


def test_first_screen_states_the_default_spike_action_and_the_start_up_line():
    from stable_attn.monitor.config import ACTION_WORDS, MonitorConfig

    default = MonitorConfig.default("on_spike")
    first = " ".join("\n".join(README.read_text().splitlines()[:FIRST_SCREEN_LINES]).split())
    assert f"**On a spike, by default: {ACTION_WORDS[default].split(',')[0]}** (`on_spike=\"{default}\"`)" in first
    assert f"`StableAttentionCallback: on a spike: {ACTION_WORDS[default]} (on_spike='{default}', the default;" in first
    assert "**Speed.** GPU: not measured yet (docs/BENCHMARKS.md" in first


def test_speed_sentence_is_the_committed_benchmark_output():
    """README's generate() ratios are the range of the wall ratios benchmarks/generate_speed.py wrote."""
    text = " ".join(README.read_text().split())
    m = re.search(r"`generate\(\)` is ([\d.]+)x to ([\d.]+)x slower than `sdpa` \(`benchmarks/generate_speed.py`\)",
                  text)
    assert m, "README's generate() sentence changed; hold it to benchmarks/results/generate_speed_cpu.txt"
    output = (ROOT / "benchmarks" / "results" / "generate_speed_cpu.txt").read_text()
    ratios = [float(r) for r in re.findall(r"^\w+\s+[\d.]+\s+[\d.]+\s+\d+\s+\d+\s+([\d.]+)x", output, flags=re.M)]
    assert len(ratios) == 2 and (float(m.group(1)), float(m.group(2))) == (min(ratios), max(ratios))


def test_main_job_duration_is_the_benchmarks_row():
    """README's main-job minutes are docs/BENCHMARKS.md's measured one-thread run, rounded."""
    text = " ".join(README.read_text().split())
    m = re.search(r"the main job takes about (\d+) minutes on one thread", text)
    assert m, "README's main-job sentence changed; hold it to docs/BENCHMARKS.md, 'Main job and import time'"
    benchmarks = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    row = re.search(r"^\| main job, one thread \| .*? \| (\d+) min (\d+) s \|", benchmarks, flags=re.M)
    assert row and int(m.group(1)) == round(int(row.group(1)) + int(row.group(2)) / 60)


def test_main_job_summary_is_what_the_example_prints():
    """The quoted end of the main job has the lines, labels and alert kinds `format_summary` prints today."""
    from stable_attn.monitor.names import ALERT_KINDS
    from stable_attn.report.summary import LayerSummary, RunSummary, format_summary

    (quoted,) = re.findall(r"```\n(final train loss:.*?)```", README.read_text(), flags=re.S)
    lines = quoted.strip().splitlines()
    loss = re.match(r"final train loss: ([\d.]+) \(step (\d+)\)", lines[0])
    val = re.match(r"final val loss: +([\d.]+) \(step (\d+)\)", lines[1])
    saturation = re.findall(r"L(\d+)=([\d.]+)", lines[3])
    summary = RunSummary(
        final_train_loss=(int(loss.group(2)), float(loss.group(1))), last_finite_train_loss=None,
        final_val_loss=(int(val.group(2)), float(val.group(1))), alert_counts=dict.fromkeys(ALERT_KINDS, 0),
        layers=[LayerSummary(f"layer{i}", float(s), None, None, None, None, None) for i, s in saturation])
    assert format_summary(summary).splitlines() == lines


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
    first = blocks(README, "bash")[0].code.strip().splitlines()
    assert first[0].startswith("# run the main job") and "examples/train_gpt2.py" in first[1]
    assert '".[examples,trainer]"' in first[1]  # the Trainer block needs accelerate
    assert first[2] == "# run the tests" and "pytest" in first[3]
    assert "run the tests" in (ROOT / ".ci" / "run").read_text()

