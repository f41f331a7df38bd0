"""Training-loop integrations: one engine, three adapters.

    from stable_attn.callbacks import StableAttentionCallback            # lightning.Trainer
    trainer = lightning.Trainer(callbacks=[StableAttentionCallback(on_spike="skip")])

    from stable_attn.callbacks import StableAttentionTrainerCallback     # transformers.Trainer
    trainer = transformers.Trainer(..., callbacks=[StableAttentionTrainerCallback(on_spike="skip")])

    from stable_attn.callbacks import StableAttentionGuard               # a hand-written loop (FSDP2, DDP)
    guard = StableAttentionGuard(on_spike="skip")                        # docs/DISTRIBUTED.md shows the loop

All three are thin adapters over :class:`stable_attn.monitor.engine.MonitorEngine`, which imports no training
loop. Each adapter is imported on first use (Lightning, or transformers' Trainer and accelerate), so the
engine and its helpers in :mod:`stable_attn.monitor` (``grad_norm``, ``rollback``, ``layer_stats``) can be
used from any training loop without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .lightning import StableAttentionCallback
    from .plain import StableAttentionGuard
    from .trainer import StableAttentionTrainerCallback

__all__ = ["StableAttentionCallback", "StableAttentionGuard", "StableAttentionTrainerCallback"]


def __getattr__(name: str) -> Any:
    if name == "StableAttentionCallback":
        from .lightning import StableAttentionCallback

        return StableAttentionCallback
    if name == "StableAttentionTrainerCallback":  # transformers.Trainer's; imports transformers' trainer
        from .trainer import StableAttentionTrainerCallback

        return StableAttentionTrainerCallback
    if name == "StableAttentionGuard":  # no training framework: torch only
        from .plain import StableAttentionGuard

        return StableAttentionGuard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
