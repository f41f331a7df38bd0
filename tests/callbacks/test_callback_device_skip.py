"""device_skip=True under Lightning: the same weights, optimizer state, skipped steps and alerts as the host's
decision, on real runs of the pre-trained tiny GPT-2 (callback_lm.py) with garbled batches, a NaN loss and a NaN
gradient; and a checkpoint saved mid-run holds the same callback state."""

from __future__ import annotations

import json
from dataclasses import asdict

import lightning as L
import torch
from callback_lm import ByteLM, batches_loader, trainer

from stable_attn.callbacks import StableAttentionCallback

STEPS = 60
GARBLED = (24, 25, 44)
NAN_LOSS, NAN_GRAD = 32, 50


class Faulty(ByteLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step == NAN_LOSS else loss

    def on_after_backward(self):
        if self.trainer.global_step == NAN_GRAD:
            self.model.lm_head.weight.grad[3, 5] = float("nan")


def fit(tmp_path, pretrained, device_skip: bool):
    alerts: list = []
    cb = StableAttentionCallback(on_spike="skip", device_skip=device_skip, on_alert=alerts.append,
                                 log_every_n_steps=10)
    L.seed_everything(0, verbose=False)
    module = Faulty(weights=pretrained)
    t = trainer(tmp_path, [cb], STEPS, log_every_n_steps=10)
    t.fit(module, batches_loader(range(STEPS), corrupt_batches=GARBLED))
    return t, cb, module, alerts


def rows(alerts):
    return [json.dumps({k: v for k, v in asdict(a).items() if k not in ("grad_norms", "time")}, sort_keys=True,
                       default=str) for a in alerts]


def test_lightning_device_skip_equals_the_host_path(tmp_path, pretrained):
    t_host, host, m_host, a_host = fit(tmp_path / "host", pretrained, False)
    t_dev, dev, m_dev, a_dev = fit(tmp_path / "device", pretrained, True)
    assert {24, NAN_LOSS, NAN_GRAD} <= set(host.skipped_steps)
    assert dev.skipped_steps == host.skipped_steps
    for (name, a), b in zip(m_host.state_dict().items(), m_dev.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    s_host, s_dev = t_host.optimizers[0].state_dict()["state"], t_dev.optimizers[0].state_dict()["state"]
    assert s_host.keys() == s_dev.keys()
    for key in s_host:
        for name, value in s_host[key].items():
            assert torch.equal(value, s_dev[key][name]), (key, name)
    assert rows(a_dev) == rows(a_host)
    assert dev.engine._device.mismatches == 0
    keep = lambda s: {k: v for k, v in s.items() if k != "alert_delivery"}  # noqa: E731 (paths differ)
    assert json.dumps(keep(dev.state_dict()), sort_keys=True) == json.dumps(keep(host.state_dict()), sort_keys=True)
