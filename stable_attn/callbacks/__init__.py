"""Training-loop integrations. ``StableAttentionCallback`` is the Lightning one:

    from stable_attn.callbacks import StableAttentionCallback
    trainer = lightning.Trainer(callbacks=[StableAttentionCallback(on_spike="skip")])

Lightning is imported on first use of the callback, so the helpers here (``grad_norm``, ``rollback``,
``layer_stats``) can be used from any training loop without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .lightning import StableAttentionCallback

__all__ = ["StableAttentionCallback"]


def __getattr__(name: str) -> Any:
    if name == "StableAttentionCallback":
        from .lightning import StableAttentionCallback

        return StableAttentionCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
