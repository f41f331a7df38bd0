"""Each callback given to the other framework's Trainer fails at once, naming the right class."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from trainer_lm import make_trainer

from stable_attn.callbacks import StableAttentionCallback, StableAttentionTrainerCallback


def test_lightning_callback_in_transformers_trainer(tmp_path):
    with pytest.raises(TypeError, match="StableAttentionTrainerCallback"):
        make_trainer(str(tmp_path), [StableAttentionCallback()], steps=1)  # Trainer.__init__ calls on_init_end


def test_lightning_callback_added_to_transformers_trainer_later(tmp_path):
    trainer = make_trainer(str(tmp_path), [], steps=1)
    trainer.add_callback(StableAttentionCallback())
    with pytest.raises(TypeError, match="StableAttentionTrainerCallback"):
        trainer.train()


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_callback_in_lightning_trainer(tmp_path):
    trainer = L.Trainer(callbacks=[StableAttentionTrainerCallback()], accelerator="cpu", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    with pytest.raises(TypeError, match=r"transformers\.Trainer callback; for lightning\.Trainer use "
                                        r"stable_attn\.callbacks\.StableAttentionCallback"):
        trainer.fit(_Tiny(), torch.utils.data.DataLoader(torch.randn(4, 2)))
