"""Training a transformers model with gradient checkpointing under ``torch.compile(fullgraph=True)``.

Two things in transformers' own code stop such a graph, with any attention implementation (``"sdpa"``
as well as ``"stable_attn"``):

- ``config.use_cache`` left at its default ``True``: each forward then warns through
  ``logger.warning_once`` that the cache is incompatible with checkpointing, and dynamo refuses that
  call (``Unsupported: logging.Logger method not supported for non-export cases``). In eager mode
  transformers turns the cache off itself; here :func:`prepare_checkpointed_training` sets
  ``config.use_cache = False`` so no forward warns. A call that passes ``use_cache=True`` explicitly still
  meets transformers' warning: that one is the caller's to drop.
- From transformers 5.25 on, its ``kernels`` dependency (0.19) sets a ``ContextVar`` around every attention
  forward; inside a checkpointed layer dynamo refuses that side effect ("HOP: Unsafe side effect ...
  Attempted to mutate CompileableContextVar"). The narrow switch for it is
  ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True``: the backward's recompute of
  a checkpointed layer does not replay the forward's side effects (a set-and-reset of a context variable
  has none to replay).

Both changes are made only for models whose gradient checkpointing is on, each said once in the log, and
undone by :meth:`Undo.restore` at the end of the run (the callbacks call it when training ends or fails).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

log = logging.getLogger("stable_attn")

__all__ = ["DYNAMO_FLAG", "Undo", "checkpointing_on", "prepare_checkpointed_training"]

DYNAMO_FLAG = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def checkpointing_on(model: torch.nn.Module) -> bool:
    """Whether transformers' gradient checkpointing is enabled on ``model``."""
    return bool(getattr(model, "is_gradient_checkpointing", False))


@dataclass
class Undo:
    """What :func:`prepare_checkpointed_training` changed, to put back."""

    use_cache: list[tuple[object, object]] = field(default_factory=list)  # (config, its old use_cache)
    dynamo_flag: bool | None = None  # the flag's old value, when we set it

    def restore(self) -> None:
        """Put back every change (idempotent)."""
        for config, old in self.use_cache:
            config.use_cache = old
        self.use_cache = []
        if self.dynamo_flag is not None:
            setattr(torch._dynamo.config, DYNAMO_FLAG, self.dynamo_flag)
            self.dynamo_flag = None


def prepare_checkpointed_training(models: Iterable[torch.nn.Module], name: str = "stable_attn",
                                  announce: bool = True) -> Undo:
    """For the models of ``models`` whose gradient checkpointing is on: ``config.use_cache = False`` and
    the dynamo switch above, each said in one WARNING line (when ``announce``: rank zero) naming what changed
    and why. Returns the :class:`Undo`."""
    undo = Undo()
    checkpointed = [m for m in models if checkpointing_on(m)]
    if not checkpointed:
        return undo
    for model in checkpointed:
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            undo.use_cache.append((config, config.use_cache))
            config.use_cache = False
            if announce:
                log.warning("%s: %s trains with gradient checkpointing: config.use_cache set to False for the run "
                            "(transformers turns the cache off anyway, through a warning that "
                            "torch.compile(fullgraph=True) cannot trace)", name, type(model).__name__)
    dynamo_config = torch._dynamo.config
    if hasattr(dynamo_config, DYNAMO_FLAG) and not getattr(dynamo_config, DYNAMO_FLAG):
        undo.dynamo_flag = False
        setattr(dynamo_config, DYNAMO_FLAG, True)
        if announce:
            log.warning("%s: gradient checkpointing is on: torch._dynamo.config.%s = True for the run, so that "
                        "torch.compile can trace the checkpointed layers of transformers >= 5.25 (its kernels package "
                        "sets a context variable in every attention forward; docs/ARCHITECTURE.md, 'Compile with "
                        "gradient checkpointing')", name, DYNAMO_FLAG)
    return undo
