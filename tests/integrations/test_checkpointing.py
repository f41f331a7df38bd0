"""Gradient checkpointing under ``torch.compile(fullgraph=True)``: what the callbacks prepare, and put back.

transformers' own code stops such a graph twice, with any attention: the use_cache warning (config default
``use_cache=True``) and, from 5.25 on, its kernels package's context variable. The cells here compile a
checkpointed model called as a training loop calls it (no ``use_cache`` argument, the config's default), once
prepared by :func:`prepare_checkpointed_training` and once not.
"""

from __future__ import annotations

import logging

import lightning as L
import pytest
import tiny_models
import torch
from test_compile_matrix import Recorder, assert_every_layer_fused, make_batch

import stable_attn.integrations.transformers as st
from stable_attn.callbacks import StableAttentionCallback
from stable_attn.integrations.transformers.checkpointing import DYNAMO_FLAG, prepare_checkpointed_training

VOCAB = 128


def checkpointed(name: str = "llama") -> torch.nn.Module:
    model = tiny_models.build(name, "stable_attn", VOCAB)
    model.train()
    model.gradient_checkpointing_enable()
    assert model.config.use_cache is True  # transformers' default, as users leave it
    return model


def compile_and_train(model, batch) -> Recorder:
    torch._dynamo.reset()
    recorder = Recorder()
    compiled = torch.compile(model, fullgraph=True, backend=recorder)
    compiled(**batch).loss.backward()  # no use_cache argument: the config's default decides
    return recorder


def test_a_prepared_checkpointed_model_compiles_onto_the_fused_op_and_is_put_back(caplog):
    model = checkpointed()
    flag_before = getattr(torch._dynamo.config, DYNAMO_FLAG)
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        undo = prepare_checkpointed_training([model])
    try:
        assert model.config.use_cache is False
        assert getattr(torch._dynamo.config, DYNAMO_FLAG) is True
        said = [r.getMessage() for r in caplog.records]
        assert any("config.use_cache set to False" in m and "LlamaForCausalLM" in m for m in said), said
        if not flag_before:
            assert any(DYNAMO_FLAG in m for m in said), said
        recorder = compile_and_train(model, make_batch("dense"))
        assert len(recorder.graphs) == 1
        assert recorder.checkpoints() == 2
        assert_every_layer_fused(recorder.attention_calls(), 2, "prepared llama")
    finally:
        undo.restore()
    assert model.config.use_cache is True
    assert getattr(torch._dynamo.config, DYNAMO_FLAG) is flag_before
    undo.restore()  # idempotent
    assert model.config.use_cache is True


def test_unprepared_it_meets_transformers_own_warning():
    """The failure the preparation removes is transformers': the same model, not prepared, does not compile
    with ``fullgraph=True`` (with ``"sdpa"`` too)."""
    for impl in ("stable_attn", "sdpa"):
        model = tiny_models.build("llama", impl, VOCAB)
        model.train()
        model.gradient_checkpointing_enable()
        with pytest.raises(Exception, match="Logger|Unsafe side effect"):
            compile_and_train(model, make_batch("dense"))


def test_models_without_checkpointing_are_left_alone(caplog):
    model = tiny_models.build("llama", "stable_attn", VOCAB)
    flag_before = getattr(torch._dynamo.config, DYNAMO_FLAG)
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        undo = prepare_checkpointed_training([model])
    assert model.config.use_cache is True and getattr(torch._dynamo.config, DYNAMO_FLAG) is flag_before
    assert not caplog.records and undo.use_cache == [] and undo.dynamo_flag is None


class _Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = checkpointed()
        self.seen_use_cache = None

    def training_step(self, batch, batch_idx):
        self.seen_use_cache = self.model.config.use_cache
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("fails", [False, True], ids=["fit", "fit-raises"])
def test_the_lightning_callback_prepares_and_puts_back(tmp_path, fails):
    module = _Module()
    batches = torch.utils.data.DataLoader([make_batch("dense")] * 2, batch_size=None)
    if fails:
        def boom(*args, **kwargs):
            raise RuntimeError("boom")
        module.on_train_batch_end = boom
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[StableAttentionCallback(swap=False)])
    flag_before = getattr(torch._dynamo.config, DYNAMO_FLAG)
    if fails:
        with pytest.raises(RuntimeError, match="boom"):
            trainer.fit(module, train_dataloaders=batches)
    else:
        trainer.fit(module, train_dataloaders=batches)
    assert module.seen_use_cache is False  # during the run
    assert module.model.config.use_cache is True  # after it, whatever happened
    assert getattr(torch._dynamo.config, DYNAMO_FLAG) is flag_before
    assert st.attention_modules(module.model)
