"""The detectors: :class:`~.spikes.SpikeDetector` (loss and gradient norm), :class:`~.surge.SurgeDetector` and
:class:`~.collapse.EntropyCollapseDetector` (per-layer early warnings), the :class:`~.events.SpikeEvent` they
return and the robust statistics they share (:mod:`.robust`). Pure Python, no torch."""
