"""StableAttentionGuard in one process: the calls of a hand-written loop, what a dropped step leaves alone, the
refusals, and an import that pulls in no training framework."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from stable_attn.callbacks import StableAttentionGuard


def loop(guard: StableAttentionGuard, steps: int, nan_at: int | None, tmp_path) -> tuple[torch.nn.Module, list]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    guard.setup(model, opt, [sched], log_dir=str(tmp_path), log_every_n_steps=1)
    data = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(steps)]
    changed = []
    for step, x in enumerate(guard.batches(data), start=guard.start_step):
        guard.begin_step(step)
        before = [p.detach().clone() for p in model.parameters()]
        loss = model(x).pow(2).mean()
        if step == nan_at:
            loss = loss * float("nan")
        guard.add_loss(loss)
        loss.backward()
        decision = guard.before_optimizer_step()
        assert decision.apply == (step != nan_at) and decision.drop == (step == nan_at)
        if decision.apply:
            opt.step()
        opt.zero_grad()
        sched.step()
        guard.end_step()
        changed.append(any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)))
    guard.close()
    return model, changed


def test_a_nan_step_is_dropped_and_the_state_resumes(tmp_path):
    guard = StableAttentionGuard(on_spike="skip", swap=False)
    _, changed = loop(guard, 6, nan_at=3, tmp_path=tmp_path)
    assert changed == [True, True, True, False, True, True]
    assert guard.skipped_steps == [3] and guard.alert_count >= 1
    state = guard.state_dict()
    assert state["next_step"] == 6
    again = StableAttentionGuard(on_spike="skip", swap=False)
    again.load_state_dict(state)
    assert again.start_step == 6 and again.skipped_steps == [3]


def test_recover_refuses_a_loop_that_does_not_draw_through_batches(tmp_path):
    guard = StableAttentionGuard(on_spike="recover", swap=False)
    model = torch.nn.Linear(4, 1)
    guard.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), log_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"guard\.batches"):
        guard.begin_step(0)
    guard.close()


def test_calls_before_setup_are_refused():
    guard = StableAttentionGuard()
    with pytest.raises(RuntimeError, match="setup"):
        guard.begin_step(0)
    with pytest.raises(ValueError, match="state_dict"):
        guard.load_state_dict({"nope": 1})


def test_importing_the_guard_imports_no_training_framework():
    code = ("import sys; from stable_attn.callbacks import StableAttentionGuard; "
            "print(sorted(m for m in ('lightning', 'transformers.trainer') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_gradient_accumulation_sums_the_micro_batch_losses(tmp_path):
    """Two micro-batches per optimizer step, drawn through guard.batches: the judged loss is the sum of the
    divided losses, each micro-batch's data index is recorded, and a NaN in the second micro-batch drops the step."""
    guard = StableAttentionGuard(on_spike="skip", swap=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard.setup(model, opt, log_dir=str(tmp_path), log_every_n_steps=1)
    data = guard.batches([torch.full((2, 4), float(i)) for i in range(8)])
    losses, positions = [], []
    for step in range(4):
        guard.begin_step(step)
        total = 0.0
        for micro in range(2):
            x = next(data)
            loss = model(x).pow(2).mean() / 2
            if step == 2 and micro == 1:
                loss = loss * float("nan")
            guard.add_loss(loss)
            loss.backward()
            total += float(loss.detach())
            positions.append(guard.engine.data_position["batch_index"])
        decision = guard.before_optimizer_step()
        assert decision.apply == (step != 2)
        if decision.apply:
            opt.step()
        opt.zero_grad()
        guard.end_step()
        losses.append((guard.engine.last["train/loss"], total))
    guard.close()
    assert positions == list(range(8))
    for judged, summed in losses:
        assert judged == pytest.approx(summed, rel=1e-6, nan_ok=True)
    assert guard.skipped_steps == [2]
