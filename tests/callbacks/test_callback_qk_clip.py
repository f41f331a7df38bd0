"""StableAttentionCallback(qk_clip=tau) end to end in a Lightning Trainer on the CPU.

Tiny GPT-2 (fused ``c_attn``) and Llama (GQA) built with ``attn_implementation="stable_attn"``, their attention
weights scaled up so tau sits between the heads' max logits (qk_clip_lm.py). Every optimizer step's edit is
checked exactly against the step's statistics (qk_clip_lm.EditCheck); one step is compared with a plain run.
"""

from __future__ import annotations

import math
import os

import lightning as L
import pytest
import torch
from lightning.pytorch import Callback
from qk_clip_lm import (
    EditCheck,
    assert_moments_equal,
    batches,
    group_max_logits,
    head_max_logits,
    moments,
    params,
    read_alerts,
    tau_between,
    tiny_model,
)
from torch.utils.data import DataLoader

from stable_attn.callbacks import StableAttentionCallback
from stable_attn.monitor import names
from stable_attn.monitor.alerts.schema import validate_alert


class LM(L.LightningModule):
    """The tiny model with AdamW; ``nan_step``: the loss of that optimizer step is NaN (a bad batch)."""

    def __init__(self, family: str, nan_step: int | None = None) -> None:
        super().__init__()
        self.model = tiny_model(family)
        self.nan_step = nan_step

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        if self.trainer.global_step == self.nan_step:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Before(Callback):
    """Listed before the StableAttentionCallback: its hooks see the step before the clip."""

    def __init__(self, check: EditCheck, accumulate: int) -> None:
        self.check, self.accumulate = check, accumulate

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.check.step_logits()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.accumulate == 0:  # the optimizer stepped: the callback clips next
            self.check.before_clip(trainer.optimizers[0])


class After(Callback):
    def __init__(self, check: EditCheck, accumulate: int, skipped: tuple[int, ...] = ()) -> None:
        self.check, self.accumulate, self.skipped = check, accumulate, skipped
        self.metrics: dict[int, dict[str, float]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.accumulate == 0:
            step = trainer.global_step - 1
            self.check.after_clip(step, trainer.optimizers[0], applied=step not in self.skipped)


class Metrics(L.pytorch.loggers.Logger):
    """Keeps what the callback logs."""

    def __init__(self, root: str) -> None:
        super().__init__()
        self.root, self.logged = root, {}

    name, version = "metrics", 0

    @property
    def save_dir(self):  # trainer.log_dir: where the alerts file goes
        return self.root

    def log_metrics(self, metrics, step=None):
        self.logged.setdefault(step, {}).update(metrics)

    def log_hyperparams(self, *args, **kwargs):
        pass


def fit(tmp_path, family, qk_clip, *, steps, accumulate=1, precision="32-true", nan_step=None, on_spike="warn",
        ckpt_path=None, data=None, probe=True, **cb_kwargs):
    L.seed_everything(0, verbose=False)
    module = LM(family, nan_step)
    data = data if data is not None else batches(steps * accumulate)
    cb = StableAttentionCallback(qk_clip=qk_clip, on_spike=on_spike, **cb_kwargs)
    check = EditCheck(module.model, qk_clip or math.inf)
    logger = Metrics(str(tmp_path))
    skipped = (nan_step,) if nan_step is not None else ()
    probes = [Before(check, accumulate), cb, After(check, accumulate, skipped)] if probe else [cb]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, precision=precision, logger=logger,
                        callbacks=probes, accumulate_grad_batches=accumulate, log_every_n_steps=2,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(data, batch_size=None), ckpt_path=ckpt_path)
    return trainer, module, cb, check, logger


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_every_step_clips_exactly_from_the_max_over_micro_batches(tmp_path, family):
    """fp32, two micro-batches per step, 3 steps: each step's edit is exactly the one its statistics call
    for (EditCheck), the statistics are the MAX over both micro-batches, the metrics are logged on the steps
    that clip and the first clip writes one schema-valid qk_clip alert."""
    data = batches(6)
    tau = tau_between(group_max_logits(tiny_model(family), data[:2]))
    trainer, module, cb, check, logger = fit(tmp_path, family, tau, steps=3, accumulate=2, data=data)

    assert trainer.global_step == 3 and check.checked == [0, 1, 2]
    # step 0's statistics are the max over its two micro-batches (not the last one's): recomputed on a twin
    model = tiny_model(family)
    first, second = head_max_logits(model, data[:1]), head_max_logits(model, data[1:2])
    step0 = check.history_S[0]
    for n in first:
        torch.testing.assert_close(step0[n], torch.maximum(first[n], second[n]), rtol=1e-6, atol=0)
    assert any((first[n] > second[n]).any() and (second[n] > first[n]).any() for n in first)  # both count
    groups = group_max_logits(model, data[:2])["layer0"]
    assert check.clipped[0]["layer0"] == (groups > tau).nonzero().flatten().tolist()
    assert 0 < len(check.clipped[0]["layer0"]) < len(groups)  # some groups clipped, some not
    clip_steps = [s for s in check.checked if check.clipped[s]]
    assert cb.engine._qk.clip_steps == len(clip_steps) and clip_steps[0] == 0
    for step in check.checked:
        logged = logger.logged.get(step, {})
        if check.clipped[step]:
            group = 2 if family == "llama" else 1  # query heads per clipped key-value group
            assert logged[names.QK_CLIP_HEADS] == group * sum(len(g) for g in check.clipped[step].values())
            for layer in check.clipped[step]:
                assert logged[names.qk_clip_metric(layer)] == check.history[step][layer]
        else:
            assert names.QK_CLIP_HEADS not in logged
    alerts = [a for a in read_alerts(cb.log_dir) if a["kind"] == "qk_clip"]
    assert len(alerts) == 1 and alerts[0]["step"] == 0 and validate_alert(alerts[0]) == 2
    assert alerts[0]["threshold"] == pytest.approx(tau) and alerts[0]["value"] > tau
    assert "QK-Clip #1" in alerts[0]["message"] and cb.alert_kinds["qk_clip"] == 1


def test_bf16_mixed_one_step_against_a_plain_run(tmp_path):
    """bf16-mixed: the parameters stay fp32 and the edit lands in them; against the same step without
    qk_clip, the unclipped groups' rows, every other parameter and the AdamW moments are the same bits and the
    clipped rows are the plain run's times (tau / S) ** 0.5, S the step's max logit under autocast."""
    family, data = "llama", batches(1)
    # monitored steps (log_every_n_steps=1): the plain run collects the statistics too
    _, plain, _, plain_check, _ = fit(tmp_path / "plain", family, None, steps=1, precision="bf16-mixed", data=data,
                                      log_every_n_steps=1)
    assert plain_check.checked == [0] and plain_check.clipped[0] == {}  # qk_clip=None edits nothing
    plain_trainer_moments = moments(plain.trainer.optimizers[0])
    s_plain = plain_check.S
    tau = float(s_plain["layer0"].view(2, 2).amax(1).mean())  # between layer 0's two groups
    trainer, module, cb, check, _ = fit(tmp_path / "clip", family, tau, steps=1, precision="bf16-mixed", data=data,
                                        log_every_n_steps=1)

    assert check.checked == [0] and check.clipped[0].get("layer0") and len(check.clipped[0]["layer0"]) == 1
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in module.parameters())
    assert trainer.precision == "bf16-mixed"
    fp32 = head_max_logits(tiny_model(family), data)  # the same forward without autocast
    for n in s_plain:  # the same forward under autocast: the same statistics, not those of fp32
        assert torch.equal(check.S[n], s_plain[n]) and not torch.equal(check.S[n], fp32[n])
        torch.testing.assert_close(check.S[n], fp32[n], rtol=0.05, atol=0)
    # the clipped run's weights are the plain run's with the edit applied (EditCheck's arithmetic, here
    # from the plain run's weights and optimizer state)
    replay = EditCheck(module.model, tau)
    replay.S = check.S
    replay._before, replay._moments = params(plain.model), plain_trainer_moments
    replay.after_clip(0, trainer.optimizers[0])
    assert_moments_equal(plain_trainer_moments, moments(trainer.optimizers[0]))
    changed = {n for n, p in module.model.named_parameters() if not torch.equal(p, plain.model.get_parameter(n))}
    assert changed and all("q_proj" in n or "k_proj" in n for n in changed), changed


def test_a_skipped_step_is_not_clipped(tmp_path):
    """on_spike="skip": the NaN-loss step's update is dropped and so is its clip (weights bit for bit as before
    the step); the steps around it clip as usual."""
    data = batches(4)
    tau = tau_between(group_max_logits(tiny_model("gpt2"), data[:1]))
    trainer, module, cb, check, logger = fit(tmp_path, "gpt2", tau, steps=4, nan_step=2, on_spike="skip",
                                             data=data)
    assert cb.skipped_steps == [2] and check.checked == [0, 1, 2, 3]
    assert check.clipped[2] == {} and check.clipped[1] and check.clipped[3]
    assert names.QK_CLIP_HEADS not in logger.logged.get(2, {})
    assert cb.engine._qk.clip_steps == 3
    kinds = [a["kind"] for a in read_alerts(cb.log_dir)]
    assert kinds.count("qk_clip") == 1 and "nonfinite" in kinds


def test_resume_keeps_the_qk_clip_count(tmp_path):
    """Lightning ckpt_path resume: the clip count comes back, so the resumed run's next clip (the 3rd) raises
    no second "first clip" alert; a run resumed without the state would."""
    data = batches(4)
    tau = tau_between(group_max_logits(tiny_model("gpt2"), data[:1]))
    trainer, _, cb, _, _ = fit(tmp_path / "a", "gpt2", tau, steps=2, data=data, probe=False)
    assert cb.engine._qk.clip_steps == 2
    ckpt = str(tmp_path / "a.ckpt")
    trainer.save_checkpoint(ckpt)
    trainer2, _, cb2, _, _ = fit(tmp_path / "b", "gpt2", tau, steps=4, data=data, ckpt_path=ckpt, probe=False)
    assert trainer2.global_step == 4
    assert cb2.engine._qk.clip_steps == 4 and cb2.alert_kinds["qk_clip"] == 1
    assert [a for a in read_alerts(cb2.log_dir) if a["kind"] == "qk_clip"] == []


@pytest.mark.slow
def test_ddp_ranks_clip_identically(tmp_path):
    """2 CPU processes (gloo), each on its own batches: both clip from the MAX of both ranks' max logits
    (not their own) and end with the same query/key weights bit for bit (ddp_qk_clip_run.py)."""
    from distributed_helpers import rank_results, run_launcher

    here = os.path.dirname(os.path.abspath(__file__))
    run_launcher([os.path.join(here, "ddp_qk_clip_run.py"), str(tmp_path)], tmp_path, 300, here)
    r0, r1 = rank_results(tmp_path)
    assert r0["global_step"] == r1["global_step"] == 3 and len(r0["steps"]) == len(r1["steps"]) == 3
    assert r0["qk"] == r1["qk"] and r0["clip_steps"] == r1["clip_steps"] > 0
    for s0, s1 in zip(r0["steps"], r1["steps"], strict=True):
        assert s0["reduced"] == s1["reduced"] == [max(a, b) for a, b in zip(s0["local"], s1["local"], strict=True)]
        assert s0["heads"] == s1["heads"]
    assert r0["steps"][0]["local"] != r1["steps"][0]["local"]  # the ranks' own logits differ
