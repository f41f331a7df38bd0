"""TRL's ``SFTTrainer`` end to end on a tiny Llama with ``attn_implementation="stable_attn"`` and
``StableAttentionTrainerCallback``: padding-free batches (TRL's own collator, whatever keyword arguments it
passes: ``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx``, ``position_ids``) and packing (``bfd``).

For each: every attention call is served by the varlen op (recorded by the integration's dispatch, not
assumed); no document attends to another (changing one document's tokens leaves the others' logits
unchanged); the training loss TRL computes equals the same documents run one by one; neither TRL nor
transformers warns about the attention. TRL is part of the ``test`` extra (and the ``trl`` extra), so this
runs in CI.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import stable_attn.integrations.transformers as st
from stable_attn.callbacks import StableAttentionTrainerCallback
from stable_attn.integrations.transformers import dispatch

sys.path.insert(0, os.path.dirname(__file__))

from tiny_models import build  # noqa: E402

VOCAB = 64
LENGTHS = (7, 12, 5, 9, 11, 6)  # the documents, odd lengths; 50 tokens in all


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built in memory (no download): ``<pad>``, ``<eos>`` and ``w2`` .. ``w63``."""
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def documents() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def one_by_one_loss(model: torch.nn.Module, docs: list[list[int]]) -> torch.Tensor:
    """The mean next-token loss of the documents, each run alone (within-document targets only)."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for doc in docs:
            ids = torch.tensor([doc])
            logits = model(input_ids=ids).logits[0, :-1].double()
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
            count += len(doc) - 1
    return total / count


class LossSpy:
    """Keeps every training loss ``SFTTrainer.compute_loss`` returns."""

    def __init__(self, trainer: SFTTrainer) -> None:
        self.losses: list[float] = []
        real = trainer.compute_loss

        def spy(*args, **kwargs):
            loss = real(*args, **kwargs)
            if trainer.model.training:
                self.losses.append(float(loss.detach()))
            return loss

        trainer.compute_loss = spy


CASES = {
    "padding_free": dict(padding_free=True, max_length=None),
    "packing": dict(packing=True, packing_strategy="bfd", max_length=32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sft_trainer_padding_free_and_packing(case, tmp_path, caplog):
    torch.manual_seed(0)
    model = build("llama", "stable_attn", VOCAB)
    docs = documents()
    want = one_by_one_loss(model, docs)  # the same weights, before the one update
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=len(docs), max_steps=1, learning_rate=1e-3,
                     logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
                     dataloader_num_workers=0, seed=0, bf16=False, **CASES[case])
    # bf16=False: TRL's default bf16 autocast would make the loss comparison one of bf16 rounding; its other
    # default, gradient checkpointing, stays on (each layer's forward runs again in the backward)
    assert args.gradient_checkpointing
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer(),
                             train_dataset=Dataset.from_dict({"input_ids": docs}),
                             callbacks=[StableAttentionTrainerCallback()])
        spy = LossSpy(trainer)
        with dispatch.recording() as served:
            trainer.train()
    # TRL's and transformers' own (stable_attn's start-up lines say what the callback switched)
    said = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records
                                                if r.name.startswith(("transformers", "trl"))]
    about_attention = [m for m in said if any(w in m.lower() for w in ("attn", "attention", "flash", "padding"))]
    assert about_attention == []

    # every attention call of the step on the varlen op, and every layer among them
    layers = {id(m) for _, m in st.attention_modules(trainer.model)}
    assert len(layers) == 2 and {id(r["module"]) for r in served} == layers and len(served) == 4
    assert all(r["varlen"] and r["path"] == dispatch.TRITON_VARLEN for r in served), served
    assert len(spy.losses) == 1
    torch.testing.assert_close(torch.tensor(spy.losses[0], dtype=torch.float64), want, rtol=1e-5, atol=1e-6)

    # no cross-document attention: the collated batch TRL trains on, one document's tokens changed
    batch = next(iter(trainer.get_train_dataloader()))
    assert {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids"} <= set(batch)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    model = trainer.model.eval()
    with torch.no_grad():
        logits = model(**inputs).logits
        cu = batch["cu_seq_lens_q"].tolist()
        changed = batch["input_ids"].clone()
        changed[0, cu[1]:cu[2]] = (changed[0, cu[1]:cu[2]] + 1 - 2) % (VOCAB - 2) + 2
        moved = model(**{**inputs, "input_ids": changed}).logits
    outside = torch.ones(logits.shape[1], dtype=torch.bool)
    outside[cu[1]:cu[2]] = False
    assert torch.equal(moved[0, outside], logits[0, outside])
    assert (moved[0, cu[1]:cu[2]] - logits[0, cu[1]:cu[2]]).abs().max() > 1e-3
