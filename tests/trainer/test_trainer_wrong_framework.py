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


def test_two_callbacks_on_one_transformers_trainer_are_refused_before_anything_is_patched(tmp_path):
    """Two of them would each wrap the Trainer, write every alert twice, leave SDPA patched after train()
    and load the same checkpoint entry on resume: the first to start refuses, naming the class."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    trainer = make_trainer(str(tmp_path), [StableAttentionTrainerCallback(patch_sdpa=True)], steps=2)
    trainer.add_callback(StableAttentionTrainerCallback(patch_sdpa=True))
    with pytest.raises(ValueError, match=r"has 2 StableAttentionTrainerCallbacks; use one per Trainer"):
        trainer.train()
    assert torch.nn.functional.scaled_dot_product_attention is sdpa
    assert not {"training_step", "log"} & set(vars(trainer)) and "clip_grad_norm_" not in vars(trainer.accelerator)
    assert trainer.state.global_step == 0


def test_two_callbacks_on_one_lightning_trainer_are_refused_at_setup(tmp_path):
    """Lightning refuses two in the constructor's list (equal state_key); one appended later is refused at setup."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    trainer = L.Trainer(callbacks=[StableAttentionCallback(patch_sdpa=True)], accelerator="cpu", max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.callbacks.append(StableAttentionCallback(patch_sdpa=True))
    with pytest.raises(ValueError, match=r"has 2 StableAttentionCallbacks; use one per Trainer"):
        trainer.fit(_Tiny(), torch.utils.data.DataLoader(torch.randn(4, 2)))
    assert torch.nn.functional.scaled_dot_product_attention is sdpa and trainer.global_step == 0
