"""A monitor state read back from a checkpoint is checked at resume: the rollback snapshot (fields, shapes,
finiteness) and the detectors' states (field types, finiteness), each refusal naming the field."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from stable_attn.callbacks import StableAttentionCallback
from stable_attn.monitor.actions.snapshots import (
    Trainables,
    check_snapshot,
    snapshot_from_state,
    snapshot_state,
    take_snapshot,
)


def _trainables(width: int = 3) -> Trainables:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    return Trainables(step=5, model=model, optimizers=[opt])


def _saved(state: Trainables) -> dict:
    """What torch.load gives back for a snapshot: fresh tensors (the checkpoint's), not the live ones."""
    return {k: (v if k != "model" else {n: t.clone() for n, t in v.items()})
            for k, v in snapshot_state(take_snapshot(state)).items()}


def test_a_sound_snapshot_passes() -> None:
    state = _trainables()
    check_snapshot(snapshot_from_state(_saved(state)), state)


def test_nan_weights_in_a_resumed_snapshot_are_refused_naming_the_entry() -> None:
    state = _trainables()
    saved = _saved(state)
    saved["model"]["weight"][0, 0] = math.nan
    with pytest.raises(ValueError, match=r"rollback snapshot is damaged: model\['weight'\] is a tensor with NaN"):
        check_snapshot(snapshot_from_state(saved), state)


def test_nan_optimizer_state_in_a_resumed_snapshot_is_refused_naming_the_entry() -> None:
    saved = _saved(_trainables())
    saved["optimizers"][0]["state"][0]["exp_avg_sq"].fill_(math.inf)
    with pytest.raises(ValueError, match=r"optimizers\[0\]\['state'\]\[0\]\['exp_avg_sq'\] is a tensor with NaN"):
        snapshot_from_state(saved)


def test_a_wrong_shaped_snapshot_is_refused_at_resume_not_at_the_first_spike() -> None:
    other = _saved(_trainables(width=4))  # a snapshot of another model
    with pytest.raises(ValueError, match=r"model\['weight'\] is torch.float32 \(2, 4\), the model's is "
                                         r"torch.float32 \(2, 3\)"):
        check_snapshot(snapshot_from_state(other), _trainables(width=3))
    state = _trainables()
    saved = _saved(state)
    saved["optimizers"][0]["state"][0]["exp_avg"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"optimizers\[0\]\['state'\]\[0\]\['exp_avg'\] is \(7,\), its parameter "
                                         r"is \(2, 3\)"):
        check_snapshot(snapshot_from_state(saved), state)


@pytest.mark.parametrize("field, value, message", [
    ("step", "12", r"step is '12', expected an int >= 0"),
    ("step", 3.5, r"step is 3.5, expected an int >= 0"),
    ("cpu_rng", [1, 2], r"cpu_rng is a list, expected a 1-d uint8 tensor"),
    ("optimizers", {}, r"optimizers is a dict, expected a list"),
])
def test_snapshot_fields_of_the_wrong_type_are_named(field, value, message) -> None:
    saved = _saved(_trainables())
    saved[field] = value
    with pytest.raises(ValueError, match=message):
        snapshot_from_state(saved)


def _callback_state(**changes) -> tuple[StableAttentionCallback, dict]:
    cb = StableAttentionCallback(on_spike="rollback")
    state = cb.state_dict()
    for path, value in changes.items():
        *outer, last = path.split("__")
        target = state
        for key in outer:
            target = target[key]
        target[last] = value
    return StableAttentionCallback(on_spike="rollback"), state


@pytest.mark.parametrize("path, value, message", [
    ("loss_detector__var", math.inf, r"\['loss_detector'\]\['var'\] is inf, expected None or a finite number >= 0"),
    ("loss_detector__var", -1.0, r"\['loss_detector'\]\['var'\] is -1.0, expected None or a finite number >= 0"),
    ("loss_detector__level", math.nan, r"\['loss_detector'\]\['level'\] is nan"),
    ("loss_detector__n", "40", r"\['loss_detector'\]\['n'\] is '40', expected an int >= 0"),
    ("grad_norm_detector__armed", "yes", r"\['grad_norm_detector'\]\['armed'\] is 'yes', expected True or False"),
    ("loss_detector__window", [1.0, math.inf], r"\['loss_detector'\]\['window'\] is \[1.0, inf\]"),
    ("alert_count", "x", r"\['alert_count'\] is 'x', expected an int >= 0"),
    ("not_training_streak", 2.5, r"\['not_training_streak'\] is 2.5"),
    ("skipped_steps", [3, "4"], r"\['skipped_steps'\] is \[3, '4'\]"),
])
def test_tampered_detector_state_is_refused_at_resume_naming_the_field(path, value, message) -> None:
    cb, state = _callback_state(**{path: value})
    with pytest.raises(ValueError, match=r"the checkpoint's StableAttentionCallback state" + message):
        cb.load_state_dict(state)


def test_a_resumed_snapshot_is_checked_against_the_model_before_training_starts() -> None:
    cb, state = _callback_state()
    saved = _saved(_trainables(width=4))
    state["rollback_snapshot"] = saved
    cb.load_state_dict(state)
    live = _trainables(width=3)
    trainer = SimpleNamespace(global_step=5, optimizers=live.optimizers, lr_scheduler_configs=[],
                              precision_plugin=None)
    with pytest.raises(ValueError, match=r"model\['weight'\] is torch.float32 \(2, 4\)"):
        cb.on_train_start(trainer, live.model)
    sound, state = _callback_state()
    state["rollback_snapshot"] = _saved(live)
    sound.load_state_dict(state)
    sound.on_train_start(trainer, live.model)
    assert sound.engine.action.snapshot is not None and sound.engine.action.snapshot.step == 5


def test_ctrl_c_during_a_rollback_restore_leaves_the_whole_snapshot_restored(monkeypatch) -> None:
    """SIGINT between loading the weights and the optimizer state used to leave the weights of the snapshot
    with the optimizer state of the current step (what an exit checkpoint then keeps)."""
    import os
    import signal

    from stable_attn.monitor.actions.snapshots import restore_snapshot

    state = _trainables()
    snapshot = take_snapshot(state)
    opt = state.optimizers[0]
    for _ in range(3):  # three more steps: weights and moments move on
        state.model(torch.randn(4, 3)).sum().backward()
        opt.step()
    load = opt.load_state_dict

    def interrupted_load(saved):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C right after the weights were loaded
        return load(saved)

    monkeypatch.setattr(opt, "load_state_dict", interrupted_load)
    # Python's own Ctrl-C handler, whatever an earlier test's trainer left installed: the held signal goes
    # to the handler that was there before the restore, and only Python's raises KeyboardInterrupt.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            restore_snapshot(state, snapshot)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    for name, t in state.model.state_dict().items():
        assert torch.equal(t, snapshot.model[name]), name
    restored = opt.state_dict()
    assert restored["state"][0]["step"] == snapshot.optimizers[0]["state"][0]["step"]
    for pid, entry in snapshot.optimizers[0]["state"].items():
        for key, t in entry.items():
            assert torch.equal(restored["state"][pid][key], t), (pid, key)
