"""device_skip=True: the skip decided on the device equals the host path's, bit for bit, and reads no value of a
step on the host before its update.

A hand-written loop (StableAttentionGuard) trains a small model twice from the same seed, once with the host's
decision and once with the device's, over injected loss spikes, gradient-norm spikes, a NaN loss and NaN gradients:
the weights, the optimizer state, ``skipped_steps`` and the alerts must be the same."""

from __future__ import annotations

import json
import math
import threading
from dataclasses import asdict

import pytest
import torch

from stable_attn.callbacks import StableAttentionGuard
from stable_attn.monitor.actions.device_skip import (
    UpdateGate,
    _edge,
    _float,
    _key,
    detector_bounds,
    keep_factor,
    share_bound,
)
from stable_attn.monitor.config import MonitorConfig
from stable_attn.monitor.detectors.spikes import SpikeDetector
from stable_attn.monitor.loop import World

# What a late read cannot know: the per-parameter gradient norms (the step's gradients are gone) and the time.
LATE_UNKNOWN = ("grad_norms", "time")
STEPS = 150
# step -> (input scale, what else): a loss spike, a cluster, a NaN loss, NaN gradients, a gradient-norm-only jump
EVENTS = {12: 30.0, 40: 8.0, 41: 8.0, 70: "nan_loss", 90: "nan_grad", 110: "norm", 130: 5.0, 131: 5.0, 132: 5.0}


def run(tmp_path, device_skip: bool, on_spike: str = "skip", optimizer: str = "adamw", steps: int = STEPS,
        reads: list | None = None, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = (torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1) if optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    alerts: list = []
    guard = StableAttentionGuard(on_spike=on_spike, swap=False, device_skip=device_skip, on_alert=alerts.append,
                                 **options)
    guard.setup(model, opt, [sched], log_dir=str(tmp_path), log_every_n_steps=25)
    gen = torch.Generator().manual_seed(1)
    target = torch.nn.Linear(6, 1)
    data = [torch.randn(16, 6, generator=gen) for _ in range(steps)]
    for step, x in enumerate(guard.batches(data), start=guard.start_step):
        event = EVENTS.get(step)
        guard.begin_step(step)
        if isinstance(event, float):
            x = x * event
        y = target(x).detach()
        loss = (model(x) - y).pow(2).mean()
        if event == "nan_loss":
            loss = loss * math.nan
        guard.add_loss(loss)
        loss.backward()
        if event == "nan_grad":
            model[0].weight.grad[0, 0] = math.nan
        if event == "norm":
            for p in model.parameters():
                p.grad.mul_(50.0)
        if reads is not None:
            reads.append(("step", step))
        decision = guard.before_optimizer_step()
        if decision.apply:
            opt.step()
        if reads is not None:
            reads.append(("end", step))
        opt.zero_grad()
        sched.step()
        guard.end_step()
    guard.close()
    return model, opt, guard, alerts


def same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for key in sa["state"]:
        for name, value in sa["state"][key].items():
            other = sb["state"][key][name]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other) or (value.isnan() == other.isnan()).all(), (key, name)
                assert value.view(-1).numpy().tobytes() == other.view(-1).numpy().tobytes(), (key, name)
            else:
                assert value == other, (key, name)


def alert_rows(alerts: list) -> list[str]:
    """Each alert as JSON (NaN equals NaN there), without what a late read cannot know."""
    return [json.dumps({k: v for k, v in asdict(a).items() if k not in LATE_UNKNOWN}, sort_keys=True, default=str)
            for a in alerts]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_device_decision_leaves_the_host_paths_bits(tmp_path, optimizer):
    host_model, host_opt, host, host_alerts = run(tmp_path / "host", False, optimizer=optimizer)
    dev_model, dev_opt, dev, dev_alerts = run(tmp_path / "device", True, optimizer=optimizer)
    assert host.skipped_steps, "the injected events must drop some updates"
    assert {12, 70, 90} <= set(host.skipped_steps)
    assert dev.skipped_steps == host.skipped_steps
    for a, b in zip(host_model.parameters(), dev_model.parameters(), strict=True):
        assert a.detach().numpy().tobytes() == b.detach().numpy().tobytes()
    same_state(host_opt, dev_opt)
    assert alert_rows(dev_alerts) == alert_rows(host_alerts)
    assert dev.engine._device.mismatches == 0
    saved = [{k: v for k, v in g.engine.state_dict().items() if k != "alert_delivery"} for g in (host, dev)]
    assert json.dumps(saved[0], sort_keys=True) == json.dumps(saved[1], sort_keys=True)  # detectors, streak, counts


def test_warn_drops_only_non_finite_updates_as_the_host_does(tmp_path):
    host_model, host_opt, host, host_alerts = run(tmp_path / "host", False, on_spike="warn", steps=100)
    dev_model, dev_opt, dev, dev_alerts = run(tmp_path / "device", True, on_spike="warn", steps=100)
    assert dev.skipped_steps == host.skipped_steps == [70, 90]
    for a, b in zip(host_model.parameters(), dev_model.parameters(), strict=True):
        assert a.detach().numpy().tobytes() == b.detach().numpy().tobytes()
    same_state(host_opt, dev_opt)
    assert alert_rows(dev_alerts) == alert_rows(host_alerts)


def spy_reads(monkeypatch) -> tuple[list, dict]:
    """Record every host read of a tensor (item, tolist, bool, float, int, numpy) made inside the guard's
    before_optimizer_step and end_step, with the call and its step; and each step's host copy (device_skip)."""
    reads: list = []
    copies: dict[int, tuple[int, torch.Tensor]] = {}  # id -> (step, the copy, kept alive so ids stay unique)
    phase: dict = {"now": None}
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy"):
        original = getattr(torch.Tensor, name)

        def read(self, *args, __original=original, __name=name, **kwargs):
            if phase["now"] is not None:
                reads.append((*phase["now"], __name, id(self)))
            return __original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)
    for call in ("before_optimizer_step", "end_step"):
        original = getattr(StableAttentionGuard, call)

        def wrapped(self, *args, __original=original, __call=call, **kwargs):
            phase["now"] = (__call, self._step)
            try:
                return __original(self, *args, **kwargs)
            finally:
                phase["now"] = None
        monkeypatch.setattr(StableAttentionGuard, call, wrapped)
    from stable_attn.monitor.actions import device_skip as module

    gate = module.DeviceSkip.gate

    def recording_gate(self, step, *args, **kwargs):
        out = gate(self, step, *args, **kwargs)
        if self.pending is not None and self.pending.step == step:
            copies[id(self.pending.table)] = (step, self.pending.table)
        return out

    monkeypatch.setattr(module.DeviceSkip, "gate", recording_gate)
    return reads, copies


def test_no_value_of_a_step_is_read_on_the_host_before_its_update(tmp_path, monkeypatch):
    """With device_skip the only tensors read on the host inside the engine's calls are the copies of earlier
    steps' values (before_optimizer_step of step t reads step t - 1's; end_step of a monitored step reads its own,
    after the update); the host path, for comparison, reads the step's own values before its update."""
    reads, copies = spy_reads(monkeypatch)
    _model, _opt, guard, _ = run(tmp_path / "device", True, steps=60)
    assert guard.skipped_steps == [12, 40, 41]
    assert reads, "the spy must see the late reads"
    for call, step, name, ident in reads:
        assert ident in copies, (call, step, name)
        copied_at = copies[ident][0]
        assert copied_at < step if call == "before_optimizer_step" else copied_at <= step, (call, step, copied_at)
    reads.clear()
    run(tmp_path / "host", False, steps=20)
    assert any(call == "before_optimizer_step" for call, *_ in reads)  # the spy sees the host path's reads


def test_the_gate_puts_back_host_state_and_fresh_state_at_the_read():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), math.nan)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    gate = UpdateGate()
    gate.arm(opt, [p], torch.tensor(False))
    opt.step()
    assert torch.isnan(p).all() and p in opt.state
    gate.select()
    assert torch.equal(p.detach(), torch.ones(3))
    gate.settle(dropped=True)
    assert p not in opt.state  # the host path's skipped first step creates no momentum buffer
    # a Python number in the state (not on the device): put back when the step is read
    opt.state[p] = {"count": 4, "buf": torch.zeros(3)}
    gate.arm(opt, [p], torch.tensor(False))
    opt.state[p]["count"] = 5
    gate.select()
    assert opt.state[p]["count"] == 5
    gate.settle(dropped=True)
    assert opt.state[p]["count"] == 4


def test_a_read_before_the_step_ends_waits_for_the_gate():
    """The step read (a state_dict, a summary) between the gate and the step's end: the dropped update, NaN
    included, still goes, device bits first, then the host's; read before the optimizer step, the same."""
    for read_before_step in (False, True):
        p = torch.nn.Parameter(torch.ones(3))
        p.grad = torch.full((3,), math.nan)
        opt = torch.optim.AdamW([p], lr=0.1)
        gate = UpdateGate()
        gate.arm(opt, [p], torch.tensor(False))
        if read_before_step:
            gate.settle(dropped=True)
        opt.step()
        if not read_before_step:
            gate.settle(dropped=True)
        assert torch.isnan(p).all() and p in opt.state  # nothing undone before the step ends
        gate.select()
        assert torch.equal(p.detach(), torch.ones(3)) and p not in opt.state, read_before_step


def test_a_second_optimizer_step_in_one_gated_step_is_refused():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = torch.optim.SGD([p], lr=0.1)
    gate = UpdateGate()
    gate.arm(opt, [p], torch.tensor(True))
    with pytest.raises(RuntimeError, match="one optimizer step per training step.*device_skip=False"):
        gate.arm(opt, [p], torch.tensor(True))
    gate.select()
    gate.arm(opt, [p], torch.tensor(True))  # the next step's gate


def test_a_run_closed_inside_a_dropped_step_keeps_the_old_weights(tmp_path):
    """A loop that saves (state_dict) after the optimizer step and breaks before end_step: the dropped update is
    not left in the model."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = StableAttentionGuard(on_spike="skip", swap=False, device_skip=True, on_alert=lambda a: None)
    guard.setup(model, opt, [], log_dir=str(tmp_path))
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        guard.begin_step(step)
        loss = model(torch.randn(8, 4, generator=gen)).pow(2).mean()
        guard.add_loss(loss * (math.nan if step == 2 else 1.0))
        loss.backward()
        if step == 2:
            before = [t.detach().clone() for t in model.parameters()]
            for t in model.parameters():
                t.grad.fill_(math.nan)
        assert guard.before_optimizer_step().apply
        opt.step()
        opt.zero_grad()
        if step == 2:
            guard.state_dict()  # read now: the NaN step is judged, its undo waits for the gate
            break
        guard.end_step()
    guard.close()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    assert guard.skipped_steps == [2]


def test_the_float_order_and_the_edge_search():
    values = [-math.inf, -1e300, -1.0, -5e-324, 0.0, 5e-324, 1.0, 2.0, 1e308]
    keys = [_key(v) for v in values]
    assert keys == sorted(keys) and all(_float(_key(v)) == v for v in values)
    edge = 2.5
    assert _edge(lambda v: v > edge, 0.0, 1e308) == edge
    assert _edge(lambda v: v > edge, 0.0, 1e308, hint=2.4999) == edge
    assert _edge(lambda v: v < -edge, 0.0, -1e308, hint=-3.0) == -edge


def test_the_bounds_are_the_detectors_own_decisions():
    """Just inside each bound the detector accepts, the next double beyond it flags (on a copy)."""
    import copy
    gen = torch.Generator().manual_seed(3)
    det = SpikeDetector.loss()
    noise = torch.randn(300, generator=gen).tolist()
    for step, n in enumerate(noise):
        lo, hi, _ = detector_bounds(det, step, 1e-3)
        if hi < 1.7e308:
            assert copy.deepcopy(det).update(step, hi, lr=1e-3) is None
            assert copy.deepcopy(det).update(step, math.nextafter(hi, math.inf), lr=1e-3) is not None
        det.update(step, 2.0 * math.exp(0.02 * n) - step * 1e-3, lr=1e-3)
    s = share_bound(det, 0.5)
    assert s == math.inf or (det.progress_share(s) >= 0.5 and not det.progress_share(math.nextafter(s, -1)) >= 0.5)


def test_the_factor_follows_the_judges_rules():
    # one rank: loss, norm, has_loss, bad; bounds: loss lo, hi, share, norm lo, hi, cond
    bounds = torch.tensor([[-math.inf, 2.0, 5.0, -math.inf, 10.0, 20.0]], dtype=torch.float64)

    def keep(loss, norm, act=True, scaler=False, has_norm=True):
        table = torch.tensor([[loss, norm, 1.0, float(not math.isfinite(norm))]], dtype=torch.float64)
        return bool(keep_factor(table, bounds, has_norm=has_norm, scaler=scaler, act=act))

    assert keep(1.0, 5.0) and not keep(3.0, 5.0) and not keep(math.nan, 5.0) and not keep(1.0, math.inf)
    assert not keep(1.0, 15.0)  # a drift-range norm confirms itself
    assert keep(1.0, 25.0)  # a jump of the norm the loss does not confirm
    assert not keep(6.0, 25.0, act=True) and not keep(2.5, 25.0)  # confirmed by the loss's share or its flag
    assert keep(3.0, 25.0, act=False) and not keep(math.nan, 1.0, act=False)
    assert keep(1.0, math.inf, scaler=True)  # the GradScaler's inf gradients are its business


@pytest.mark.parametrize("options, needle", [
    (dict(on_spike="rollback"), "on_spike='rollback'"), (dict(on_spike="recover"), "on_spike='recover'"),
    (dict(on_spike="stop"), "on_spike='stop'"), (dict(on_spike="skip", diagnose_spikes=True), "diagnose_spikes"),
    (dict(on_spike="skip", qk_clip=100.0), "qk_clip"),
])
def test_what_the_device_cannot_decide_is_refused_naming_the_flag(options, needle):
    with pytest.raises(ValueError, match="device_skip=True") as info:
        MonitorConfig(device_skip=True, **options)
    assert needle in str(info.value)
    with pytest.raises(TypeError, match="device_skip=1"):
        MonitorConfig(device_skip=1)
    assert MonitorConfig().device_skip is False


class ThreadGather:
    """all_gather between threads standing in for ranks."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.slots: list = [None] * size

    def for_rank(self, rank: int):
        def all_gather(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            out = torch.stack(self.slots)
            self.barrier.wait()
            return out
        return all_gather


def ranks_run(tmp_path, device_skip: bool, steps: int = 40) -> dict:
    """Two thread ranks, each its own data; rank 1 alone sees a garbled batch at step 12 and a NaN loss at 20."""
    gather, out, errors = ThreadGather(2), {}, []
    models = {}
    for r in (0, 1):  # built here: the threads would race for the global generator
        torch.manual_seed(0)
        models[r] = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def rank(r: int) -> None:
        try:
            model = models[r]
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            guard = StableAttentionGuard(on_spike="skip", swap=False, device_skip=device_skip, alerts_file=None)
            guard.setup(model, opt, log_dir=str(tmp_path / f"rank{r}"), log_every_n_steps=15,
                        world=World(rank=r, size=2, all_gather=gather.for_rank(r)))
            gen = torch.Generator().manual_seed(10 + r)
            for step in range(steps):
                x = torch.randn(16, 6, generator=gen) * (30.0 if (r, step) == (1, 12) else 1.0)
                guard.begin_step(step)
                loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean() * (math.nan if (r, step) == (1, 20) else 1.0)
                guard.add_loss(loss)
                loss.backward()
                if guard.before_optimizer_step().apply:
                    opt.step()
                opt.zero_grad()
                guard.end_step()
            guard.close()
            out[r] = (model, opt, guard)
        except BaseException as exc:  # a failing rank must not hang the other
            errors.append(exc)
            gather.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return out


def test_two_ranks_agree_on_the_device_as_on_the_host(tmp_path):
    host, dev = ranks_run(tmp_path / "host", False), ranks_run(tmp_path / "device", True)
    assert host[0][2].skipped_steps == host[1][2].skipped_steps and {12, 20} <= set(host[0][2].skipped_steps)
    for r in (0, 1):
        assert dev[r][2].skipped_steps == host[r][2].skipped_steps
        for a, b in zip(host[r][0].parameters(), dev[r][0].parameters(), strict=True):
            assert a.detach().numpy().tobytes() == b.detach().numpy().tobytes()
        same_state(host[r][1], dev[r][1])


def test_a_not_training_stop_comes_one_step_later_with_the_same_weights(tmp_path):
    """NaN losses from step 30 on: the host path stops at step 32 (not_training_stop_after=3), the device path,
    reading each step a step late, at step 33 with that update dropped on the host: the same weights and state."""
    results = {}
    for device in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        guard = StableAttentionGuard(on_spike="skip", swap=False, device_skip=device, alerts_file=None,
                                     not_training_after=2, not_training_stop_after=3)
        guard.setup(model, opt, log_dir=str(tmp_path / str(device)), log_every_n_steps=100)
        gen = torch.Generator().manual_seed(1)
        stopped = None
        for step in range(60):
            guard.begin_step(step)
            loss = model(torch.randn(8, 4, generator=gen)).pow(2).mean() * (math.nan if step >= 30 else 1.0)
            guard.add_loss(loss)
            loss.backward()
            if guard.before_optimizer_step().apply:
                opt.step()
            opt.zero_grad()
            if guard.end_step().stop_checkpoint is not None:
                stopped = step
                break
        guard.close()
        results[device] = (model, opt, guard, stopped)
    assert results[False][3] == 32 and results[True][3] == 33
    assert results[True][2].skipped_steps == results[False][2].skipped_steps == [30, 31, 32]
    for a, b in zip(results[False][0].parameters(), results[True][0].parameters(), strict=True):
        assert a.detach().numpy().tobytes() == b.detach().numpy().tobytes()
    same_state(results[False][1], results[True][1])


def test_without_the_gradient_norm_the_max_abs_check_is_gated_alike(tmp_path):
    """monitor_grad_norm=False: NaN gradients are seen by the max-abs check, on the device as on the host."""
    host_model, host_opt, host, host_alerts = run(tmp_path / "host", False, steps=100, monitor_grad_norm=False)
    dev_model, dev_opt, dev, dev_alerts = run(tmp_path / "device", True, steps=100, monitor_grad_norm=False)
    assert {12, 70, 90} <= set(host.skipped_steps) and dev.skipped_steps == host.skipped_steps
    for a, b in zip(host_model.parameters(), dev_model.parameters(), strict=True):
        assert a.detach().numpy().tobytes() == b.detach().numpy().tobytes()
    same_state(host_opt, dev_opt)
    assert alert_rows(dev_alerts) == alert_rows(host_alerts)


def test_the_spike_action_cap_is_read_before_each_step_as_on_the_host(tmp_path):
    """spike_action_cap=1: the cluster at steps 40-41 drops 40 and, the cap reached, applies 41 (alerted only)."""
    host_model, host_opt, host, host_alerts = run(tmp_path / "host", False, steps=60, spike_action_cap=1)
    dev_model, dev_opt, dev, dev_alerts = run(tmp_path / "device", True, steps=60, spike_action_cap=1)
    assert 40 in host.skipped_steps and 41 not in host.skipped_steps and dev.skipped_steps == host.skipped_steps
    for a, b in zip(host_model.parameters(), dev_model.parameters(), strict=True):
        assert a.detach().numpy().tobytes() == b.detach().numpy().tobytes()
    same_state(host_opt, dev_opt)
    assert alert_rows(dev_alerts) == alert_rows(host_alerts)
