"""Training-loop integrations. ``StableAttentionCallback`` is the Lightning one:

    from stable_attn.callbacks import StableAttentionCallback
    trainer = lightning.Trainer(callbacks=[StableAttentionCallback(on_spike="skip")])
"""

from .lightning import StableAttentionCallback

__all__ = ["StableAttentionCallback"]
