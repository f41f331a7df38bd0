"""Deprecated: moved to :mod:`stable_attn.monitor.grad_norm` (issue 29); import it from there. The
Lightning-strategy case of ``total_grad_norm(parameters, strategy)`` (FSDP1) is the Lightning adapter's
now, :func:`stable_attn.callbacks.lightning.strategy_grad_norm`; this module keeps the old signature."""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch

from ..monitor import grad_norm as _moved
from ..monitor.grad_norm import nonfinite_grads

__all__ = ["nonfinite_grads", "total_grad_norm"]

warnings.warn("stable_attn.callbacks.grad_norm moved to stable_attn.monitor.grad_norm; import it from there",
              DeprecationWarning, stacklevel=2)


def total_grad_norm(parameters: Iterable[torch.nn.Parameter], strategy: object | None = None) -> torch.Tensor | None:
    """:func:`stable_attn.monitor.grad_norm.total_grad_norm`, or with a Lightning ``strategy``
    :func:`stable_attn.callbacks.lightning.strategy_grad_norm` (as before the move)."""
    if strategy is None:
        return _moved.total_grad_norm(parameters)
    from .lightning import strategy_grad_norm

    return strategy_grad_norm(parameters, strategy=strategy)
