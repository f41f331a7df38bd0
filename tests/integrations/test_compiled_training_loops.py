"""The two training loops' own ``torch.compile`` switches, with stable_attn's callbacks, reach the fused op.

- Lightning: ``trainer.fit(torch.compile(module))``, Lightning's documented usage (it compiles the module's
  ``forward``), with :class:`StableAttentionCallback`;
- transformers: ``TrainingArguments(torch_compile=True)`` (the Trainer compiles the model), with
  :class:`StableAttentionTrainerCallback`.

A tiny Llama built with ``"sdpa"`` (the callback switches it to ``"stable_attn"``) trains a few steps on packed
documents and on a padded batch; the backend records the graphs dynamo captured and runs ``aot_eager``. Each
run asserts from those graphs that every attention layer calls the fused op with no 4D mask, that the graph did
not break, and that the weights after training equal an uncompiled run's.
"""

from __future__ import annotations

import lightning as L
import pytest
import tiny_models
import torch
from test_compile_matrix import Recorder, assert_every_layer_fused
from torch._dynamo.backends import registry
from torch.utils.data import DataLoader, Dataset
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

import stable_attn.integrations.transformers as st
from stable_attn.callbacks import StableAttentionCallback, StableAttentionTrainerCallback

VOCAB = 128
STEPS = 3
LAYERS = 2

RECORDER = Recorder()


def batches() -> list[dict]:
    """``STEPS`` batches: packed documents (the varlen op) and a right-padded pair (the dense op, key padding)."""
    g = torch.Generator().manual_seed(0)
    collate = DataCollatorWithFlattening(return_tensors="pt")
    out = []
    for step in range(STEPS):
        if step % 2 == 0:
            docs = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (5, 7, 4)]
            out.append(dict(collate([{"input_ids": d, "labels": d} for d in docs])))
        else:
            ids = torch.randint(1, VOCAB, (2, 8), generator=g)
            mask = torch.ones_like(ids)
            mask[1, 6:] = 0
            out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def assert_fused_graphs(what: str) -> None:
    graphs = RECORDER.graphs
    # packed and padded batches have different shapes and inputs: one graph each, no break in either
    assert len(graphs) == 2, f"{what}: {len(graphs)} graphs"
    for gm in graphs:
        assert_every_layer_fused(RECORDER.attention_calls([gm]), LAYERS, what)


def assert_same_weights(got: torch.nn.Module, want: torch.nn.Module, what: str) -> None:
    want_state = want.state_dict()
    for name, tensor in got.state_dict().items():
        torch.testing.assert_close(tensor, want_state[name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{what} {n}: {m}")


class TinyLlamaLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_models.build("llama", "sdpa", VOCAB)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.model(**batch, use_cache=False).loss

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self(batch)  # through forward: what Lightning compiles

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def lightning_fit(tmp_path, compiled: bool) -> TinyLlamaLM:
    module = TinyLlamaLM()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=str(tmp_path), callbacks=[StableAttentionCallback()])
    loader = DataLoader(batches(), batch_size=None)
    trainer.fit(torch.compile(module, fullgraph=True, backend=RECORDER) if compiled else module, loader)
    assert trainer.global_step == STEPS
    assert module.model.config._attn_implementation == st.NAME  # the callback switched it
    return module


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's notes on a CPU run (no workers, no GPU)
def test_lightning_fit_of_a_compiled_module_reaches_the_fused_op(tmp_path):
    torch._dynamo.reset()
    RECORDER.graphs.clear()
    compiled = lightning_fit(tmp_path / "compiled", compiled=True)
    assert_fused_graphs("Lightning torch.compile")
    assert_same_weights(compiled, lightning_fit(tmp_path / "eager", compiled=False), "Lightning compiled vs eager")


class Listed(Dataset):
    """The batches as single rows, in order (the Trainer then collates batch ``b`` back unchanged)."""

    def __init__(self, items: list[dict]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def trainer_train(tmp_path, compiled: bool) -> torch.nn.Module:
    model = tiny_models.build("llama", "sdpa", VOCAB)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=1,
                             learning_rate=1e-2, lr_scheduler_type="constant", save_strategy="no", report_to="none",
                             use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0,
                             train_sampling_strategy="sequential", logging_steps=1, torch_compile=compiled,
                             torch_compile_backend="aot_eager" if compiled else None)
    # one item per step, already a batch: the collator only unwraps it
    trainer = Trainer(model=model, args=args, train_dataset=Listed(batches()),
                      data_collator=lambda items: {k: v for k, v in items[0].items()},
                      callbacks=[StableAttentionTrainerCallback()])
    trainer.train()
    assert trainer.state.global_step == STEPS
    assert model.config._attn_implementation == st.NAME  # the callback switched it
    return model


def test_trainer_torch_compile_reaches_the_fused_op(tmp_path, monkeypatch):
    torch._dynamo.reset()
    RECORDER.graphs.clear()
    # accelerate takes only the backends it names (aot_eager among them): the recorder stands in for that name
    registry.lookup_backend("aot_eager")  # loaded before it is replaced
    monkeypatch.setitem(registry._COMPILER_FNS, "aot_eager", RECORDER)
    compiled = trainer_train(tmp_path / "compiled", compiled=True)
    assert_fused_graphs("TrainingArguments(torch_compile=True)")
    assert_same_weights(compiled, trainer_train(tmp_path / "eager", compiled=False), "Trainer compiled vs eager")
