"""What a spike does: the :class:`~stable_attn.monitor.actions.base.Action` of each ``on_spike`` (each owns its
state), the snapshots they restore, QK-Clip and the spike replay."""
