"""A tiny byte-level GPT-2 on real English text, for the callback tests and benchmark.

The text is Python's own documentation (``pydoc_data.topics``, shipped with CPython), read as bytes:
real, offline, deterministic. A "corrupted" chunk is the same text with every byte's high bit
flipped, the kind of garbage a shard decoded with the wrong codec or a binary file mixed into the
corpus produces: byte values the model has never seen, so the loss of such a batch jumps far above
the trained level (measured: about 3x).
"""

from __future__ import annotations

from collections.abc import Iterable
from pydoc_data.topics import topics

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

SEQ = 32
BATCH = 8
TEXT = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def tiny_gpt2(dropout: float = 0.0, attn_implementation: str = "sdpa") -> GPT2LMHeadModel:
    """Built with ``sdpa`` by default: the callback under test is what switches it to ``stable_attn``."""
    if attn_implementation == "stable_attn":
        from stable_attn.integrations.transformers import register

        register()
    config = GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=dropout,
        embd_pdrop=dropout, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation=attn_implementation,
    )
    return GPT2LMHeadModel(config)


class TemperatureGPT(torch.nn.Module):
    """GPT-2 from ``weights`` with one trained parameter of a single row (a logit temperature): with two ranks,
    FSDP2 leaves rank 1 an empty shard of it (tests/callbacks/plain_run.py, sharded_run.py)."""

    def __init__(self, weights: str) -> None:
        super().__init__()
        self.gpt = tiny_gpt2()
        self.gpt.load_state_dict(torch.load(weights, weights_only=True))
        self.temperature = torch.nn.Parameter(torch.ones(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # no KV cache in training: a recomputed block (activation checkpointing) would append to it again
        logits = self.gpt(input_ids=ids, use_cache=False).logits[:, :-1] * self.temperature
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class ByteChunks(Dataset):
    """Chunk ``i`` is bytes ``[i * SEQ, (i + 1) * SEQ)`` of the text, in the order of ``indices``.

    ``corrupt``: chunk indices whose bytes are garbled (high bit flipped).
    """

    def __init__(self, indices: Iterable[int], corrupt: Iterable[int] = ()) -> None:
        self.indices = list(indices)
        self.corrupt = set(corrupt)
        if (max(self.indices) + 1) * SEQ > len(TEXT):
            raise ValueError("not enough text for these chunks")

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> torch.Tensor:
        chunk = self.indices[i]
        data = torch.frombuffer(bytearray(TEXT[chunk * SEQ:(chunk + 1) * SEQ]), dtype=torch.uint8).long()
        if chunk in self.corrupt:
            data = data ^ 0x80
        return data


def _chunk_order() -> list[int]:
    """A fixed shuffle of all chunks: each batch mixes prose, code and tables from across the text,
    as a shuffled data pipeline would (consecutive chunks make the batch loss swing with the topic)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randperm(len(TEXT) // SEQ, generator=g).tolist()


CHUNK_ORDER = _chunk_order()


def batches_loader(batch_ids: Iterable[int], corrupt_batches: Iterable[int] = (), offset: int = 0) -> DataLoader:
    """A loader that yields the given batches, in the given order, BATCH chunks each (batch ``b`` holds
    chunks ``CHUNK_ORDER[offset + b*BATCH : offset + (b+1)*BATCH]``); ``corrupt_batches`` are garbled."""
    batch_ids = list(batch_ids)
    picks = lambda b: CHUNK_ORDER[offset + b * BATCH: offset + (b + 1) * BATCH]  # noqa: E731
    indices = [c for b in batch_ids for c in picks(b)]
    corrupt = [c for b in corrupt_batches for c in picks(b)]
    return DataLoader(ByteChunks(indices, corrupt), batch_size=BATCH, shuffle=False)


class ByteLM(L.LightningModule):
    """GPT-2 LM with AdamW and a linear warm-up, logging its own loss like a user's module would."""

    def __init__(self, lr: float = 3e-3, warmup: int = 5, dropout: float = 0.0, weights=None) -> None:
        super().__init__()
        self.model = tiny_gpt2(dropout)
        if weights is not None:
            self.model.load_state_dict(torch.load(weights, weights_only=True))
        self.lr = lr
        self.warmup = warmup

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / self.warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(tmp_path, callbacks, max_steps: int, **kwargs) -> L.Trainer:
    """A CPU Trainer with a CSVLogger under ``tmp_path`` and nothing else switched on."""
    from lightning.pytorch.loggers import CSVLogger

    kwargs.setdefault("log_every_n_steps", 1)
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("enable_progress_bar", False)
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=CSVLogger(str(tmp_path), name="run"),
        callbacks=callbacks, enable_model_summary=False, num_sanity_val_steps=0, **kwargs,
    )


PRETRAIN_OFFSET = 8000  # chunks (of CHUNK_ORDER) used for pre-training lie far from the ones the tests train on


def pretrain(path, steps: int = 150, seed: int = 0) -> None:
    """Train the tiny GPT-2 past its steep first descent and save its weights to ``path``.

    Tests start from these weights (as a fine-tuning run would) so that the loss is near its plateau and
    the spike detectors are calibrated after a short warm-up, instead of every test paying for the
    first ~130 steps of the curve.
    """
    torch.manual_seed(seed)
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    loader = batches_loader(range(steps), offset=PRETRAIN_OFFSET)
    for batch in loader:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.save(model.state_dict(), path)


class PeriodicBytes(Dataset):
    """Memorising a period-7 byte pattern (random phase per sample), with 0.3% of the bytes replaced by
    random ones: the loss falls to 0.005-0.2 nats, and from step ~60 the batch noise (how many random
    bytes a batch holds) is 25% to several times the loss. ``corrupt``: batches garbled (high bit set)."""

    def __init__(self, batches: int, seed: int, corrupt=(), period: int = 7, flip: float = 0.003) -> None:
        g = torch.Generator().manual_seed(seed)
        self.pattern = torch.randint(1, 128, (period,), generator=g)
        self.phase = torch.randint(0, period, (batches * BATCH,), generator=g)
        self.flips = torch.rand(batches * BATCH, SEQ, generator=g) < flip
        self.noise = torch.randint(1, 128, (batches * BATCH, SEQ), generator=g)
        self.corrupt, self.period = set(corrupt), period

    def __len__(self) -> int:
        return len(self.phase)

    def __getitem__(self, i: int) -> torch.Tensor:
        x = self.pattern[(self.phase[i] + torch.arange(SEQ)) % self.period]
        x = torch.where(self.flips[i], self.noise[i], x)
        return x ^ 0x80 if i // BATCH in self.corrupt else x
