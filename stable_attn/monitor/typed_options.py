"""The monitoring arguments as a ``TypedDict``, for static type checkers and IDEs.

The engine and both callbacks take :class:`~stable_attn.monitor.config.MonitorConfig`'s fields as
``**options``; ``inspect.signature`` and ``help()`` show them from the config, but pyright, mypy and
PyCharm read annotations, not ``__signature__``. ``**options: Unpack[MonitorOptions]`` (PEP 692) gives
them each argument's name and type. Defaults and checks stay in ``MonitorConfig`` alone;
tests/monitor/test_config.py holds the names and annotations here to its fields.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from .alerts import Alert
    from .config import SpikeAction
    from .spikes import SpikeDetector

__all__ = ["MonitorOptions"]


class MonitorOptions(TypedDict, total=False):
    """Every keyword of ``StableAttentionCallback``, ``StableAttentionTrainerCallback`` and ``MonitorEngine``."""

    on_spike: SpikeAction
    log_every_n_steps: int | None
    swap: bool
    patch_sdpa: bool
    loss_detector: SpikeDetector | None
    grad_norm_detector: SpikeDetector | None
    monitor_grad_norm: bool
    attention_stats: bool
    early_warnings: bool
    early_warning_warmup: int | None
    rollback_every: int
    rollback_steps: int
    snapshot_memory_limit: int | None
    skip_batches: int
    lr_factor: float
    lr_steps: int
    max_recoveries: int
    cooldown_steps: int
    on_alert: Callable[[Alert], Any] | Iterable[Callable[[Alert], Any]] | None
    webhook_url: str | None
    webhook_timeout: float
    webhook_headers: Mapping[str, str] | None
    alerts_file: str | None
    layer_window: int
    not_training_after: int
    not_training_stop_after: int | None
    spike_action_cap: int | None
    spike_action_cooldown: int
    spike_confirm_steps: int
    diagnose_spikes: bool
    qk_clip: float | None
    qk_clip_alpha: float
