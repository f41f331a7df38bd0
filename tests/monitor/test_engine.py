"""MonitorEngine in a hand-written PyTorch loop: no Lightning, no Trainer, no torch.distributed.

The model is a tiny GPT-2 (built with ``sdpa``: the engine switches it) trained with AdamW at a small
learning rate on uniformly random bytes, so its loss sits near ln(256) and its gradient norm is
steady. A spike is injected by scaling one step's loss (and so its gradients) by 20: the detectors'
gross-jump rule (active from the 4th value) must catch it on that step.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from stable_attn.monitor import Alert, names
from stable_attn.monitor.engine import MonitorEngine, Trainables, World

STEPS = 16
BAD = 12
EVERY = 4
# What the 0.1 Lightning callback wrote in its checkpoints (single process, on_spike="rollback" adds the snapshot).
CHECKPOINT_KEYS = {
    "loss_detector", "other_rank_loss_detectors", "grad_norm_detector", "other_rank_grad_norm_detectors",
    "alert_kinds", "not_training_streak", "surge", "alert_count", "skipped_steps", "rollbacks", "stop_checkpoint",
    "layers", "alert_delivery", "spike_actions", "unconfirmed_grad_norm_jumps",
}
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


def clone(state: dict) -> dict:
    return {k: clone(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


class Loop:
    """A plain training loop driving the engine the way an adapter does."""

    def __init__(self, engine: MonitorEngine, log_dir: str, world: World | None = None, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.engine = engine
        self.model = tiny_gpt2()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0)
        self.data = torch.Generator().manual_seed(1000 + seed)
        self.decisions, self.ends, self.states = [], [], {}
        engine.setup(self.model, world or World())
        engine.start(log_dir, EVERY)
        engine.train_start(self.trainables(0))

    def trainables(self, step: int) -> Trainables:
        return Trainables(step=step, model=self.model, optimizers=[self.opt], schedulers=[self.sched])

    def run(self, steps: int = STEPS, scale: dict[int, float] | None = None) -> None:
        scale = scale or {}
        for step in range(steps):
            self.states[step] = (clone(self.model.state_dict()), clone(self.opt.state_dict()))
            self.engine.begin_step(step)
            for _ in range(2):  # two micro-batches: gradient accumulation
                batch = torch.randint(0, 256, (4, 32), generator=self.data)
                loss = self.model(input_ids=batch, labels=batch).loss / 2 * scale.get(step, 1.0)
                self.engine.add_loss(loss)
                loss.backward()
                self.ends.append(self.engine.end_step(self.trainables(step)))  # between micro-batches: nothing
            self.decisions.append(self.engine.before_optimizer_step(self.opt, self.model.parameters()))
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self.ends.append(self.engine.end_step(self.trainables(step + 1)))
        self.states[steps] = (clone(self.model.state_dict()), clone(self.opt.state_dict()))
        self.engine.end_run("at the end of the test loop")


def test_the_engine_imports_no_training_loop():
    # (transformers' modeling code imports accelerate itself, so accelerate is not a sign of the Trainer)
    code = ("import sys, torch, stable_attn.monitor.engine as e\n"
            "e.MonitorEngine().setup(torch.nn.Linear(2, 2), e.World())\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'lightning_fabric', "
            "'pytorch_lightning') or m.startswith(('transformers.trainer', 'stable_attn.callbacks.lightning', "
            "'stable_attn.callbacks.trainer')))\n"
            "import torch.distributed as d\n"
            "print(bad, d.is_available() and d.is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[] False"


def test_skip_in_a_plain_loop_leaves_the_spiking_step_unapplied(tmp_path):
    alerts: list[Alert] = []
    engine = MonitorEngine(on_spike="skip", on_alert=alerts.append)
    loop = Loop(engine, str(tmp_path))
    loop.run(scale={BAD: 20.0})

    assert any(getattr(m, "config", None) is not None and m.config._attn_implementation == "stable_attn"
               for m in loop.model.modules())
    assert [d.step for d in loop.decisions if d.drop] == [BAD] and engine.skipped_steps == [BAD]
    assert loop.decisions[BAD].action == "skip" and not loop.decisions[BAD].rollback
    assert {(a.step, a.kind, a.metric) for a in alerts} == {(BAD, "spike", names.LOSS), (BAD, "spike", names.GRAD_NORM)}
    assert all(a.action == "skip" for a in alerts)
    # The dropped step changed nothing: weights and AdamW moments and step counts, bit for bit.
    assert_equal(loop.states[BAD][0], loop.states[BAD + 1][0])
    assert_equal(loop.states[BAD][1], loop.states[BAD + 1][1])
    assert not torch.equal(loop.states[BAD - 1][0]["lm_head.weight"], loop.states[BAD][0]["lm_head.weight"])

    monitored = [e for e in loop.ends if e.metrics is not None]
    assert [e.step for e in monitored] == [s for s in range(STEPS) if (s + 1) % EVERY == 0]
    for end in monitored:
        for layer in ("layer0", "layer1"):
            for stat in names.LAYER_STATS:
                assert math.isfinite(end.metrics[names.layer_metric(stat, layer)])
            assert 0.0 <= end.metrics[names.layer_metric("saturation", layer)] <= 1.0
        assert end.metrics[names.LOSS] == pytest.approx(math.log(256), rel=0.05)
    assert [e.step for e in loop.ends if e.alert_count_changed] == [BAD]
    assert engine.summary().startswith("2 alert(s) (spike 2, nonfinite 0") and engine.dispatcher is None
    assert (tmp_path / names.ALERTS_FILE).read_text().count("\n") == 2


def test_rollback_restores_the_last_snapshot(tmp_path):
    engine = MonitorEngine(on_spike="rollback", spike_confirm_steps=1, rollback_every=4)
    loop = Loop(engine, str(tmp_path))
    loop.run(scale={BAD - 2: 20.0})  # step 10: the snapshot is the state after 8 steps

    assert engine.rollbacks == [(BAD - 2, 8)] and loop.decisions[BAD - 2].rollback
    assert [e.rolled_back for e in loop.ends].count(True) == 1
    assert_equal(loop.states[BAD - 1][0], loop.states[8][0])  # after step 10 the state is the one after step 8
    assert_equal(loop.states[BAD - 1][1], loop.states[8][1])
    assert "rollback_snapshot" in engine.state_dict()  # one process: the snapshot goes with the checkpoint


def test_a_rollback_puts_the_detectors_back_with_the_weights(tmp_path):
    """The detectors judged the first losses after a rollback against the level the run had reached since
    the snapshot: on a falling loss those looked like a spike again, and rollbacks followed one another."""
    engine = MonitorEngine(on_spike="rollback", spike_confirm_steps=1, rollback_every=4)
    loop = Loop(engine, str(tmp_path))
    at_snapshot = {}
    original = engine.action.take

    def remember(state):
        original(state)
        at_snapshot[state.step] = engine._judge.detector_states()

    engine.action.take = remember
    loop.run(steps=BAD - 1, scale={BAD - 2: 20.0})  # the rollback's end_step is the last one
    assert engine.rollbacks == [(BAD - 2, 8)]
    assert engine._judge.detector_states() == at_snapshot[8]
    saved = engine.state_dict()
    assert saved["rollback_detectors"] == at_snapshot[8]  # a resumed run rolls back the detectors too
    resumed = MonitorEngine(on_spike="rollback", spike_confirm_steps=1, rollback_every=4)
    resumed.load_state_dict(saved)
    resumed.train_start(loop.trainables(BAD - 1))
    assert resumed.action.detectors == at_snapshot[8]


def test_stop_names_the_checkpoint_and_a_nan_is_never_applied(tmp_path):
    engine = MonitorEngine(on_spike="stop", spike_confirm_steps=1)
    loop = Loop(engine, str(tmp_path))
    loop.run(steps=BAD + 1, scale={BAD: 20.0})
    (stop,) = [e for e in loop.ends if e.stop_checkpoint is not None]
    assert stop.step == BAD and stop.stop_checkpoint == str(tmp_path / f"stable_attn-stop-step={BAD}.ckpt")
    assert engine.stop_checkpoint == stop.stop_checkpoint and loop.decisions[BAD].stop

    alerts: list[Alert] = []
    warn = MonitorEngine(on_spike="warn", on_alert=alerts.append)
    loop = Loop(warn, str(tmp_path / "warn"))
    loop.run(steps=8, scale={5: math.nan})
    assert [(d.step, d.action) for d in loop.decisions if d.drop] == [(5, "skip")]
    assert_equal(loop.states[5][0], loop.states[6][0])
    assert alerts[0].kind == "nonfinite" and "never applied" in alerts[0].message


class ThreadGather:
    """all_gather between threads standing in for ranks (each thread drives one rank's engine)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.slots: list[torch.Tensor | None] = [None] * size

    def for_rank(self, rank: int):
        def all_gather(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            out = torch.stack(self.slots)
            self.barrier.wait()  # nobody overwrites a slot before everyone has read it
            return out
        return all_gather


def test_ranks_agree_on_a_spike_only_one_of_them_saw(tmp_path):
    gather, alerts = ThreadGather(2), {0: [], 1: []}
    engines = {r: MonitorEngine(on_spike="skip", on_alert=alerts[r].append) for r in (0, 1)}
    loops, errors = {}, []

    def rank(r: int) -> None:
        try:
            loops[r] = Loop(engines[r], str(tmp_path), World(rank=r, size=2, all_gather=gather.for_rank(r)), seed=r)
            loops[r].run(scale={BAD: 20.0} if r == 1 else {})
        except BaseException as exc:  # surfaced below; a failing rank must not hang the other
            errors.append(exc)
            gather.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and set(loops) == {0, 1}
    assert loops[0].decisions == loops[1].decisions
    assert [d.step for d in loops[0].decisions if d.drop] == [BAD]
    assert_equal(loops[0].states[BAD][0], loops[0].states[BAD + 1][0])  # rank 0 saw nothing, and skipped too
    assert not alerts[1] and {a.metric for a in alerts[0]} == {names.LOSS, names.GRAD_NORM}
    assert all("on rank 1 of 2" in a.message for a in alerts[0])
    assert engines[0].alert_count == engines[1].alert_count == 2  # counted on every rank, delivered on rank 0
    metrics = [[e.metrics for e in loops[r].ends if e.metrics is not None] for r in (0, 1)]
    assert metrics[0] == metrics[1]  # layer statistics reduced over both ranks
    assert len(engines[0].state_dict()["other_rank_loss_detectors"]) == 1


def test_state_dict_keeps_the_checkpoint_keys_and_round_trips(tmp_path):
    engine = MonitorEngine(on_spike="skip")
    Loop(engine, str(tmp_path)).run(scale={BAD: 20.0})
    state = engine.state_dict()
    assert set(state) == CHECKPOINT_KEYS
    resumed = MonitorEngine(on_spike="skip")
    resumed.load_state_dict(json.loads(json.dumps(state)))  # plain Python: a Trainer keeps it in trainer_state.json
    resumed.setup(tiny_gpt2(), World())  # layer and surge detector state apply once the model is found
    assert_equal(resumed.state_dict(), state)
    assert resumed.loss_detector.ready == engine.loss_detector.ready and resumed.skipped_steps == [BAD]


def test_bad_world_and_arguments_are_refused():
    with pytest.raises(ValueError, match=r"World\(size=2\) needs all_gather"):
        World(size=2)
    with pytest.raises(ValueError, match=r"World\(rank=2\) is not supported with size=2; use an int in \[0, 2\)"):
        World(rank=2, size=2, all_gather=lambda t: t)
    with pytest.raises(RuntimeError, match=r"before_optimizer_step was called before begin_step"):
        MonitorEngine().before_optimizer_step(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), [])
    with pytest.raises(ValueError, match=r"on_spike='explode'"):
        MonitorEngine(on_spike="explode")
    with pytest.raises(ValueError, match=r"not_training_stop_after=5 .*int >= 10 or None"):
        MonitorEngine(not_training_stop_after=5)


def test_the_adapter_may_say_which_steps_are_monitored(tmp_path):
    engine = MonitorEngine()
    engine.start(str(tmp_path), 4)
    assert [engine.begin_step(s) for s in range(1, 9)] == [False, False, True, False, False, False, True, False]
    # a loop numbering steps by the count after them (transformers.Trainer) decides itself
    assert engine.begin_step(9, monitor=True) and engine.begin_step(9) and not engine.begin_step(10, monitor=False)
    engine.end_run("at the end of the test")
