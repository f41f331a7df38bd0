"""Where a micro-batch sits in the training data: its epoch, its index in the epoch, and a fingerprint of its
token ids, so that an alert says which batch spiked and a skip window can be checked batch by batch.

The fingerprint is a short hex digest (BLAKE2b, 8 bytes) of the batch's token ids: ``input_ids`` when the batch
is a mapping (a dict or a transformers ``BatchEncoding``) holding them, else the first integer tensor found in it
(a tuple ``(tokens, targets)``, a bare tensor); None when there is none. It reads the ids on the host (one copy of
the ids of the micro-batch: a few kB for a language-model batch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["batch_fingerprint", "data_position", "token_ids"]


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
