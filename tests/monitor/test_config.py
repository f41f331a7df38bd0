"""MonitorConfig is the one home of the monitoring arguments: the engine's and both callbacks' signatures,
their docs and the Trainer callback's saved arguments all come from it."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc

import pytest

from stable_attn.callbacks import StableAttentionCallback, StableAttentionGuard, StableAttentionTrainerCallback
from stable_attn.monitor import names
from stable_attn.monitor.config import MonitorConfig
from stable_attn.monitor.engine import MonitorEngine

# Every argument's default, written out once here: MonitorConfig owns them, the constructors and their
# docstrings take them from it, and a changed default must fail this test.
DEFAULTS = {
    "on_spike": "warn", "log_every_n_steps": None, "swap": True, "patch_sdpa": False, "loss_detector": None,
    "grad_norm_detector": None, "monitor_grad_norm": True, "attention_stats": True, "early_warnings": True,
    "early_warning_warmup": None, "rollback_every": 100, "rollback_steps": 100,
    "snapshot_memory_limit": 8 * 2**30, "skip_batches": 200,
    "lr_factor": 1.0, "lr_steps": 100, "max_recoveries": 3, "cooldown_steps": 50, "on_alert": None, "webhook_url": None,
    "webhook_timeout": 2.0, "webhook_headers": None, "alerts_file": names.ALERTS_FILE, "layer_window": 10,
    "not_training_after": 10, "not_training_stop_after": 100,
    # the spike actions' cap, cool-down and confirmation
    "spike_action_cap": 10, "spike_action_cooldown": 20, "spike_confirm_steps": 3,
    "diagnose_spikes": False, "qk_clip": None,
    "qk_clip_alpha": 0.5, "device_skip": False,
}
UNSAVED = ("loss_detector", "grad_norm_detector", "on_alert", "webhook_url", "webhook_headers")


def test_fields_and_defaults_are_the_arguments():
    config = MonitorConfig()
    assert MonitorConfig.names() == tuple(DEFAULTS)
    assert {name: getattr(config, name) for name in MonitorConfig.names()} == DEFAULTS
    assert MonitorConfig.unsaved_names() == UNSAVED
    assert MonitorConfig.saved_names() == tuple(n for n in DEFAULTS if n not in UNSAVED)


@pytest.mark.parametrize("cls", [MonitorEngine, StableAttentionCallback, StableAttentionTrainerCallback,
                                 StableAttentionGuard])
def test_signatures_come_from_the_config(cls):
    params = [p for p in inspect.signature(cls).parameters.values() if p.name != "name"]
    assert [(p.name, p.kind, p.default) for p in params] == [
        (name, inspect.Parameter.KEYWORD_ONLY, default) for name, default in DEFAULTS.items()]
    assert [p.annotation for p in params] == [f.type for f in dataclasses.fields(MonitorConfig) if f.init]
    shown = pydoc.render_doc(cls, renderer=pydoc.plaintext)  # what help() prints
    assert "on_spike: 'SpikeAction' = 'warn'" in shown and "not_training_stop_after: 'int | None' = 100" in shown


@pytest.mark.parametrize("cls", [MonitorEngine, StableAttentionCallback, StableAttentionTrainerCallback,
                                 StableAttentionGuard])
def test_every_argument_is_documented_once(cls):
    args = cls.__doc__.split("\n    Args:\n", 1)[1]
    entries = [line.strip().split(":", 1)[0] for line in args.splitlines() if line.startswith(" " * 8)
               and not line.startswith(" " * 12)]
    assert entries == list(DEFAULTS)
    assert "{" not in args.replace('{"Authorization"', "")  # every placeholder filled


def test_the_adapters_say_where_their_words_differ():
    lightning, trainer = (" ".join(cls.__doc__.split()) for cls in (StableAttentionCallback,
                                                                      StableAttentionTrainerCallback))
    assert "None follows the Trainer's ``log_every_n_steps``" in lightning
    assert "inside the run's log directory (``trainer.log_dir``)" in lightning
    assert "None follows the Trainer's ``logging_steps``" in trainer
    assert "inside ``TrainingArguments.output_dir``" in trainer


def test_checked_values_and_given_values():
    config = MonitorConfig(webhook_timeout=5, on_alert=print, webhook_url="https://example.com/hook",
                           webhook_headers={"Authorization": "Bearer x"})
    assert config.webhook_timeout == 5 and isinstance(config.saved()["webhook_timeout"], int)  # saved as given
    checked = config.checked()
    assert checked["webhook_timeout"] == 5.0 and isinstance(checked["webhook_timeout"], float)
    assert checked["on_alert"] == [print] and checked["webhook_headers"] == {"Authorization": "Bearer x"}
    assert config.unsaved_given() == ["on_alert", "webhook_url", "webhook_headers"]
    engine = MonitorEngine.from_config(config, name="X")
    assert engine.name == "X" and engine.config is config and engine.config.checked()["on_alert"] == [print]


@pytest.mark.parametrize("owner", [MonitorEngine, StableAttentionCallback, StableAttentionTrainerCallback,
                                 StableAttentionGuard])
def test_unknown_arguments_are_refused_as_a_constructor_would(owner):
    with pytest.raises(TypeError, match=rf"^{owner.__name__}\.__init__\(\) got an unexpected keyword argument 'foo'$"):
        owner(foo=1)
    with pytest.raises(ValueError, match="on_spike='x' is not supported"):
        owner(on_spike="x")


def test_typed_options_match_the_config():
    """The TypedDict that static checkers read (``**options: Unpack[MonitorOptions]``) names every argument
    of MonitorConfig, in order, with the same annotation."""
    from dataclasses import fields

    from stable_attn.monitor.config import MonitorConfig, MonitorOptions

    want = [(f.name, str(f.type)) for f in fields(MonitorConfig) if f.init]
    got = [(name, getattr(a, "__forward_arg__", a)) for name, a in MonitorOptions.__annotations__.items()]
    assert got == want


def test_the_start_up_line_says_what_a_spike_does_and_follows_the_one_default():
    from stable_attn.monitor.config import ACTION_WORDS, ACTIONS, CONFIRMED_ACTIONS

    assert tuple(ACTION_WORDS) == ACTIONS
    default = MonitorConfig.default("on_spike")
    assert default == inspect.signature(StableAttentionCallback).parameters["on_spike"].default
    line = MonitorConfig().spike_line()
    assert line.startswith(f"on a spike: {ACTION_WORDS[default]} (on_spike={default!r}, the default;")
    for action in ACTIONS:
        line = MonitorConfig(on_spike=action).spike_line()
        lasting = (", once the spike has lasted 3 steps in a row (its earlier steps: skip the update; "
                   "spike_confirm_steps)" if action in CONFIRMED_ACTIONS else "")
        assert line.startswith(f"on a spike: {ACTION_WORDS[action]}{lasting} (on_spike={action!r}")
        at_once = MonitorConfig(on_spike=action, spike_confirm_steps=1).spike_line()
        assert at_once.startswith(f"on a spike: {ACTION_WORDS[action]} (on_spike={action!r}")
        assert ("the default" in line) == (action == default)
        assert line.endswith("a NaN or inf loss or gradient is never applied")
    assert MonitorConfig(on_spike="skip").spike_line().startswith("on a spike: skip the update")
    with pytest.raises(ValueError, match="name='on_spikes' is not an argument of MonitorConfig"):
        MonitorConfig.default("on_spikes")


def test_an_argument_only_recover_reads_is_refused_under_another_action_never_ignored():
    from stable_attn.callbacks import StableAttentionCallback
    from stable_attn.monitor.config import RECOVER_ONLY, MonitorConfig

    with pytest.raises(ValueError, match=r"skip_batches=10 takes effect only with on_spike='recover', and this run "
                                         r"has on_spike='skip' \(it drops the spiking step's update and skips no "
                                         r"batches\)"):
        StableAttentionCallback(on_spike="skip", skip_batches=10)
    for name in RECOVER_ONLY:
        value = 1 if name != "lr_factor" else 0.5
        with pytest.raises(ValueError, match=f"{name}={value!r} takes effect only with on_spike='recover'"):
            MonitorConfig.from_options({"on_spike": "rollback", name: value}, owner="test")
        assert MonitorConfig.from_options({"on_spike": "recover", name: value}, owner="test").on_spike == "recover"
    # the defaults pass: a Trainer callback rebuilt from trainer_state.json passes every saved argument
    saved = MonitorConfig(on_spike="skip").saved()
    assert MonitorConfig.from_options(saved, owner="test").skip_batches == MonitorConfig.default("skip_batches")
