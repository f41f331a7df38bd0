"""What a training loop and the engine exchange, apart from the models: where the engine runs (:class:`World`,
given by the adapter), what a step decided (:class:`Decision`) and what ``end_step`` leaves to the adapter
(:class:`StepEnd`); and where a micro-batch sits in the training data (:func:`data_position`): its epoch, its
index in the epoch, and a fingerprint of its token ids, so that an alert says which batch spiked and a skip
window can be checked batch by batch.

The fingerprint is a short hex digest (BLAKE2b, 8 bytes) of the batch's token ids: ``input_ids`` when the batch
is a mapping (a dict or a transformers ``BatchEncoding``) holding them, else the first integer tensor found in it
(a tuple ``(tokens, targets)``, a bare tensor); None when there is none. It reads the ids on the host (one copy of
the ids of the micro-batch: a few kB for a language-model batch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Decision", "StepEnd", "World", "batch_fingerprint", "data_position", "token_ids"]


@dataclass(frozen=True)
class World:
    """Where the engine runs: this process's rank, the number of ranks, the device of the model, and
    the collective it may use.

    Attributes:
        all_gather: required when ``size > 1``; called on every rank with a tensor of the same shape,
            returns every rank's tensor stacked (``[size, *shape]``) or concatenated along dim 0, in
            rank order (Lightning's ``strategy.all_gather`` and accelerate's ``gather`` both do).
        grad_norm: the global 2-norm of the gradients of the parameters it is given (a 0-d tensor, or
            None without gradients); None uses :func:`~stable_attn.monitor.grad_norm.total_grad_norm`,
            right for one process and DDP.
    """

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    grad_norm: Callable[[Iterable[torch.nn.Parameter]], torch.Tensor | None] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"World(size={self.size!r}) is not supported; use an int >= 1")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"World(rank={self.rank!r}) is not supported with size={self.size}; use an int in "
                             f"[0, {self.size})")
        if self.size > 1 and self.all_gather is None:
            raise ValueError(f"World(size={self.size}) needs all_gather: every rank must see every rank's values")

    @property
    def is_zero(self) -> bool:
        return self.rank == 0

    @property
    def backend(self) -> str:
        return "triton (CUDA)" if self.device.type == "cuda" else "torch (CPU)"

    def gather_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (on the host), through :attr:`all_gather` on the world's device."""
        if self.all_gather is None:
            raise RuntimeError(f"World(size={self.size}) has no all_gather")
        return self.all_gather(tensor.to(self.device)).cpu()


@dataclass(frozen=True)
class Decision:
    """What :meth:`MonitorEngine.before_optimizer_step` decided for the step (the same on every rank)."""

    step: int
    drop: bool  # the update is dropped: the engine has already set the gradients to None
    action: str  # what the step's alerts say is done: "warn", "skip", "rollback" or "stop"
    rollback: bool  # end_step restores the last snapshot
    stop: bool  # end_step returns the checkpoint path to save before stopping
    # device_skip=True: the update is kept or undone on the device (drop is False here: the optimizer steps, and
    # end_step puts back a dropped step's bits); the host reads the step's values one step later
    gated: bool = False


@dataclass(frozen=True)
class StepEnd:
    """What :meth:`MonitorEngine.end_step` leaves to the adapter."""

    step: int
    metrics: dict[str, float] | None = None  # on monitored steps: what to log at ``step``
    stop_checkpoint: str | None = None  # save a checkpoint there (every rank), then stop training
    rolled_back: bool = False
    alert_count_changed: bool = False  # an alert was raised during this step (since its begin_step)


def token_ids(batch: Any) -> torch.Tensor | None:
    """The batch's token ids: ``input_ids`` of a mapping, else its first integer tensor (depth first), else None."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids
        values: Any = list(batch.values())
    elif isinstance(batch, torch.Tensor):
        return batch if not batch.is_floating_point() and not batch.is_complex() and batch.dtype != torch.bool \
            else None
    elif isinstance(batch, (list, tuple)):
        values = batch
    else:
        return None
    for value in values:
        found = token_ids(value)
        if found is not None:
            return found
    return None


def batch_fingerprint(batch: Any) -> str | None:
    """A 16-hex-digit digest of the batch's token ids (their values and shape), or None without token ids."""
    ids = token_ids(batch)
    if ids is None:
        return None
    host = ids.detach().to("cpu", torch.int64).contiguous()
    digest = hashlib.blake2b(digest_size=8)
    digest.update(str(tuple(host.shape)).encode())
    digest.update(host.numpy().tobytes())
    return digest.hexdigest()


def data_position(batch: Any, epoch: int | None, batch_index: int | None) -> dict[str, Any]:
    """``{"epoch", "batch_index", "fingerprint"}`` of one micro-batch."""
    return {"epoch": epoch, "batch_index": batch_index, "fingerprint": batch_fingerprint(batch)}
