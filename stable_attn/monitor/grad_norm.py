"""The total gradient norm of a model, correct for replicated and sharded parameters.

Under DDP every rank holds the full, already all-reduced gradients, so the local norm is the global
one (reducing it again would count every gradient ``world_size`` times). Under FSDP each rank holds
a shard, so the squared norms of the shards must be summed across ranks; which reduction is right
depends on how the model was sharded (full shard, hybrid shard, tensor parallel), and only the
sharding itself knows:

- FSDP2 / tensor parallel (gradients are ``DTensor``): the norm of DTensors is itself a DTensor whose
  ``full_tensor()`` performs the one reduction the placements require, one per device mesh (a model
  sharded on two meshes, or tensor parallelism applied to some modules only, holds DTensors of different
  meshes beside plain replicated gradients, which one norm call refuses to mix);
- everything else: the norm of the local gradients.

FSDP1 (a ``FullyShardedDataParallel`` root, whose gradients are plain local shards) needs the wrapper's own
``clip_grad_norm_``: the Lightning adapter asks its ``FSDPStrategy`` for it
(:mod:`stable_attn.callbacks.lightning`), since only the training loop knows the root.

:func:`nonfinite_grads` is the cheap check for a run that does not monitor the norm: whether any local
gradient holds a NaN or inf (the max-abs of each gradient, which reads every element once, squares
nothing that could overflow, and propagates NaN). It is local on purpose: the callback shares each
rank's flag, so a rank whose gradients went bad after the all-reduce is seen too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["nonfinite_grads", "total_grad_norm"]


def _local_total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:  # torch >= 2.6: foreach kernels, one launch per device and dtype
        return get_total_norm(grads, norm_type=2.0)
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), 2.0).float() for g in grads])
    return torch.linalg.vector_norm(norms, 2.0)


def is_dtensor(t: torch.Tensor) -> bool:
    """A sharded tensor (FSDP2, tensor parallel), told by its type's name: torch.distributed need not import."""
    return type(t).__name__ == "DTensor"


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, in place; a plain tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def total_grad_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
    """The 2-norm of all gradients of ``parameters`` over every rank (a 0-d tensor), or None when
    no parameter has a gradient.

    Call it on every rank at the same point of the step: with DTensor gradients it is a collective.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    if not any(is_dtensor(g) for g in grads):
        return _local_total_norm(grads).detach()
    groups: dict[object, list[torch.Tensor]] = {}  # by device mesh; None: plain (replicated) gradients
    for g in grads:
        groups.setdefault(g.device_mesh if is_dtensor(g) else None, []).append(g)
    norms = []
    for g in groups.values():
        norm = _local_total_norm(g)
        norms.append((norm.full_tensor() if is_dtensor(norm) else norm).detach())
    if len(norms) == 1:
        return norms[0]
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.float().to(device) for n in norms]), 2.0)


def nonfinite_grads(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
    """A 0-d float32 tensor on the gradients' device, 1.0 when any local gradient element of
    ``parameters`` is NaN or inf, else 0.0; None when no parameter has a gradient.

    Local to this rank (sharded gradients are checked shard by shard; no collective), and without a
    host read: the caller decides when to look.
    """
    grads = [local(g) for g in (p.grad for p in parameters if p.grad is not None)]
    grads = [g.detach() for g in grads if g.numel()]  # max-abs has no identity on an empty tensor
    if not grads:
        return None
    device = grads[0].device
    peaks = torch._foreach_norm(grads, math.inf)  # one launch per device and dtype
    return (~torch.isfinite(torch.stack([p.float().to(device) for p in peaks]))).any().float()
