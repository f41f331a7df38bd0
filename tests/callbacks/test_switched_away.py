"""A model switched away from ``"stable_attn"`` after the callback swapped it: transformers' ``from_config`` keeps the
config object it is given, so an ``"sdpa"`` twin built from the model's config switches the model too. The start-up
line says what each layer runs; the first monitored step after the switch says so once, with the cause."""

from __future__ import annotations

import logging

from callback_lm import ByteLM, batches_loader, trainer
from transformers import GPT2LMHeadModel

from stable_attn.callbacks import StableAttentionCallback


class BuildsAnSdpaTwin(ByteLM):
    """Builds an "sdpa" twin from its own model's config when training starts (after the callback's swap)."""

    def on_train_start(self) -> None:
        self.twin = GPT2LMHeadModel._from_config(self.model.config, attn_implementation="sdpa")


def _fit(tmp_path, module, caplog) -> list[str]:
    cb = StableAttentionCallback(log_every_n_steps=2)
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        trainer(tmp_path, [cb], max_steps=6).fit(module, batches_loader(range(6)))
    return [r.getMessage() for r in caplog.records]


def test_a_twin_built_from_the_config_is_reported_once(tmp_path, caplog):
    messages = _fit(tmp_path, BuildsAnSdpaTwin(), caplog)
    assert any("to 'stable_attn': 2 attention layer(s) (all 2 run 'stable_attn')" in m for m in messages), messages
    switched = [m for m in messages if "switched away from 'stable_attn'" in m]
    assert len(switched) == 1, switched  # three monitored steps, one WARNING
    assert "model (GPT2LMHeadModel): 2 of its 2 attention layer(s)" in switched[0]
    assert "all 2 run 'sdpa' now" in switched[0] and "copy.deepcopy(config)" in switched[0]


def test_a_model_left_on_stable_attn_is_not_reported(tmp_path, caplog):
    messages = _fit(tmp_path, ByteLM(), caplog)
    assert not any("switched away" in m for m in messages), messages
