"""SpikeDetector with the learning rate: a schedule restart is followed, not alerted; warm-up, ramps and a
missing learning rate change nothing."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from stable_attn.monitor import SpikeDetector
from stable_attn.monitor.detectors import spikes
from stable_attn.monitor.engine import MonitorEngine, Trainables, World
from stable_attn.monitor.verdict import RankReading, StepJudge

PERIOD = 400


def restarts(seed: int, steps: int = 1600, jump: float = 1.0, warm: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A falling loss with 1% noise under a cosine schedule restarted every PERIOD steps (through a linear warm-up
    of ``warm`` steps); at each restart the loss rises by ``jump`` over 5 steps past the warm-up and settles back
    over about 60 steps. Returns (losses, learning rates)."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    k = t % PERIOD
    lrs = (1e-6 + 0.5 * (1e-3 - 1e-6) * (1 + np.cos(np.pi * k / PERIOD))) * np.minimum(1.0, (k + 1) / warm)
    curve = 2.0 + 3.0 * (1 + t / 50.0) ** -0.5
    rise = np.minimum(1.0, (k + 1) / (warm + 5)) * np.exp(-np.maximum(k - warm - 5, 0) / 60)
    bump = np.where(t >= PERIOD, jump * rise, 0.0)
    return curve * (1 + bump) * np.exp(0.01 * rng.standard_normal(steps)), lrs


def flags(det: SpikeDetector, values: np.ndarray, lrs: np.ndarray | None) -> list[int]:
    lr_at = [None] * len(values) if lrs is None else lrs.tolist()
    return [i for i, (x, lr) in enumerate(zip(values.tolist(), lr_at)) if det.update(i, x, lr=lr) is not None]


@pytest.mark.parametrize("warm", [1, 30])
@pytest.mark.parametrize("seed", range(2))
def test_a_restart_that_doubles_the_loss_is_followed_with_the_learning_rate(seed: int, warm: int) -> None:
    values, lrs = restarts(seed, warm=warm)
    assert flags(SpikeDetector.loss(), values, None)  # without the learning rate: false alarms at the restarts
    det = SpikeDetector.loss()
    assert flags(det, values, lrs) == []
    assert det.restarts == 3 and det.phase == "calibrated"
    norm = SpikeDetector.grad_norm()
    assert flags(norm, values, lrs) == [] and norm.restarts == 3


@pytest.mark.parametrize("after", [30, 150])
def test_a_corrupted_batch_after_a_restart_is_still_caught(after: int) -> None:
    values, lrs = restarts(2)
    at = PERIOD + after
    values[at] *= 2.5
    assert flags(SpikeDetector.loss(), values, lrs) == [at]


def test_a_nonfinite_value_during_the_grace_is_flagged() -> None:
    values, lrs = restarts(3)
    values[PERIOD + 2] = math.nan
    assert flags(SpikeDetector.loss(), values, lrs) == [PERIOD + 2]


def test_a_garbled_gradient_norm_during_the_grace_is_flagged_by_the_start_rule() -> None:
    values, lrs = restarts(4, jump=0.5)
    values[PERIOD + 4] *= 20.0
    assert flags(SpikeDetector.grad_norm(), values, lrs) == [PERIOD + 4]


@pytest.mark.parametrize("seed", range(3))
def test_a_grace_judges_no_lower_than_the_detector_outside_it(seed: int) -> None:
    """A gradient norm whose healthy single-step values swing 10-100x between points (a ViT LoRA of the real-runs
    corpus), under a schedule restarted every 5 points: each restart's grace compared the big values with 3x the
    median of the small ones since the restart, below the norm's own 5x and blind to its noise. Judged at the gross
    rule's bar, only the rare value well above the run's swings is flagged; a garbled norm far beyond them (its
    4 sigmas of this noise are some 400x the median) still is, in a grace."""
    rng = np.random.default_rng(seed)
    steps = 150
    norm = np.exp(rng.uniform(np.log(0.05), np.log(0.5), steps))
    big = rng.random(steps) < 0.2
    norm[big] = np.exp(rng.uniform(np.log(3.0), np.log(6.0), int(big.sum())))
    k = np.arange(steps) % 5
    lrs = 1e-5 * (1e-3 + np.cos(0.5 * np.pi * k / 5))  # from the peak nearly to zero, then back, every 5 points
    det = SpikeDetector.grad_norm()
    flagged = flags(det, norm, lrs)
    assert det.restarts >= 25 and len(flagged) <= 2
    old = SpikeDetector.grad_norm()
    old._noise_margin = lambda: 0.0  # the grace's bar as it was: 3x the median, the start rule alone
    assert len(flags(old, norm, lrs)) >= 8
    garbled = norm.copy()
    at = 5 * 20 + 2  # in a grace
    garbled[at] = 1e4 * float(np.max(norm))
    assert at in flags(SpikeDetector.grad_norm(), garbled, lrs)


@pytest.mark.parametrize("kind", ["warmup_from_zero", "ramp", "constant", "step_decay", "nan", "none"])
def test_schedules_without_a_restart_change_nothing(kind: str) -> None:
    rng = np.random.default_rng(5)
    steps = 800
    t = np.arange(steps)
    values = (2.0 + 3.0 * (1 + t / 50.0) ** -0.5) * np.exp(0.01 * rng.standard_normal(steps))
    values[500] *= 1.5
    lrs = {"warmup_from_zero": np.minimum(1.0, t / 100.0) * 1e-3, "ramp": 1e-4 * 1.01 ** t,
           "constant": np.full(steps, 1e-3), "step_decay": 1e-3 * 0.1 ** (t // 300),
           "nan": np.full(steps, math.nan), "none": None}[kind]
    det = SpikeDetector.loss()
    assert flags(det, values, lrs) == flags(SpikeDetector.loss(), values, None) == [500]
    assert det.restarts == 0
    off = SpikeDetector.loss(lr_restart_ratio=None)
    restarted, lr_at = restarts(0)
    assert flags(off, restarted, lr_at) == flags(SpikeDetector.loss(), restarted, None)


def test_state_round_trip_in_the_grace_and_the_previous_version_loads() -> None:
    values, lrs = restarts(6)
    reference, restored = SpikeDetector.loss(), SpikeDetector.loss()
    for i in range(PERIOD + 3):
        reference.update(i, values[i], lr=lrs[i])
    restored.load_state_dict(json.loads(json.dumps(reference.state_dict())))
    rest = range(PERIOD + 3, len(values))
    assert [reference.update(i, values[i], lr=lrs[i]) for i in rest] == \
        [restored.update(i, values[i], lr=lrs[i]) for i in rest]
    state = reference.state_dict()
    schedule = ("lr_peak", "lr_low", "lr_last", "restarts", "grace", "grace_rising", "settle")
    previous = spikes._PREVIOUS_VERSION
    for version, dropped in ((previous, ("warm",)), (previous - 1, schedule + ("warm",))):
        old = SpikeDetector.loss()
        old.load_state_dict({**{k: v for k, v in state.items() if k not in dropped}, "version": version})
        assert old.state_dict()["warm"] == -1  # a resumed run is past its start: no warm-up end to come
        assert old.restarts == (0 if "restarts" in dropped else reference.restarts)


@pytest.mark.parametrize("bad", [1.0, 0.5, math.inf, math.nan])
def test_lr_restart_ratio_is_checked(bad: float) -> None:
    with pytest.raises(ValueError, match="lr_restart_ratio"):
        SpikeDetector.loss(lr_restart_ratio=bad)
    with pytest.raises(TypeError, match="lr"):
        SpikeDetector.loss().update(0, 1.0, lr="fast")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="warmup_drift"):
        SpikeDetector.loss(warmup_drift=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup_drift=False.*lr_restart_ratio=None"):
        SpikeDetector.loss(warmup_drift=False, lr_restart_ratio=None)  # it would hold nothing


def test_the_judge_passes_the_learning_rate_to_both_detectors() -> None:
    values, lrs = restarts(7)
    loss, norm = SpikeDetector.loss(), SpikeDetector.grad_norm()
    judge = StepJudge("skip", loss, norm)
    dropped = [step for step, (x, lr) in enumerate(zip(values.tolist(), lrs.tolist()))
               if judge.judge(step, [RankReading(x, x)], has_norm=True, scaler=False, lr=lr).verdict.drop]
    assert dropped == [] and loss.restarts == norm.restarts == 3


def test_the_engine_gives_the_detectors_the_optimizer_learning_rate(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=20, eta_min=1e-5)  # restarts at 20, 40
    engine = MonitorEngine()
    engine.setup(model, World())
    engine.start(str(tmp_path), 10)
    engine.train_start(Trainables(step=0, model=model, optimizers=[opt], schedulers=[sched]))
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    for step in range(50):
        engine.begin_step(step)
        loss = ((model(x) - y) ** 2).mean()
        engine.add_loss(loss)
        loss.backward()
        engine.before_optimizer_step(opt, model.parameters())
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        engine.end_step(Trainables(step=step + 1, model=model, optimizers=[opt], schedulers=[sched]))
    engine.end_run("at the end of the test loop")
    assert engine.loss_detector.restarts == engine.grad_norm_detector.restarts == 2


def warm_up(seed: int, steps: int, warm: int) -> tuple[np.ndarray, np.ndarray]:
    """A falling loss with 1% noise under a linear warm-up of ``warm`` steps, then a constant learning rate."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    values = (2.0 + 3.0 * (1 + t / 50.0) ** -0.5) * np.exp(0.01 * rng.standard_normal(steps))
    return values, 1e-3 * np.minimum(1.0, (t + 1) / warm)


def test_the_end_of_a_warm_up_re_seats_a_calibrated_detector_only() -> None:
    values, lrs = warm_up(8, 400, warm=250)
    det, plain = SpikeDetector.loss(), SpikeDetector.loss()
    for i in range(250):
        det.update(i, values[i], lr=lrs[i])
        plain.update(i, values[i])
    assert det.phase == "calibrated" and det.baseline == plain.baseline
    det.update(250, values[250], lr=lrs[250])  # the first update the learning rate does not rise: the peak
    plain.update(250, values[250])
    state = det.state_dict()
    assert state["warm"] == -1 and state["settle"] > 0 and plain.state_dict()["settle"] == 0
    assert det.baseline != plain.baseline  # re-seated
    assert flags(det, values[251:], lrs[251:]) == []
    # a warm-up that ends before calibration changes nothing: the same estimates as without the learning rate
    values, lrs = warm_up(9, 300, warm=30)
    det, plain = SpikeDetector.loss(), SpikeDetector.loss()
    assert flags(det, values, lrs) == flags(plain, values, None)
    lr_keys = ("lr_peak", "lr_low", "lr_last", "warm")
    assert {k: v for k, v in det.state_dict().items() if k not in lr_keys} == \
        {k: v for k, v in plain.state_dict().items() if k not in lr_keys}
