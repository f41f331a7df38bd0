"""MonitorConfig: every argument of the monitoring engine and of the two callbacks, in one place.

Each argument is one field of :class:`MonitorConfig`, with its name, order, annotation and default, its
line of documentation, and whether the transformers ``Trainer`` callback saves it in ``trainer_state.json``
(plain values only: detector objects, callables, and the webhook's URL and headers, which often carry a
token, are never written there). :meth:`MonitorConfig.__post_init__` checks them all, naming the argument,
its value and what is accepted.

:class:`~stable_attn.monitor.engine.MonitorEngine`, :class:`~stable_attn.callbacks.StableAttentionCallback`
and :class:`~stable_attn.callbacks.StableAttentionTrainerCallback` take these arguments as keywords; their
``inspect.signature`` (what ``help()`` and IDEs that introspect show) and the ``Args:`` section of their
docstrings are made from here, so an argument added here appears in all three. It imports no torch itself.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypedDict

from . import names
from .alerts import channels as alerting
from .alerts.alert import Alert
from .detectors.spikes import SpikeDetector

__all__ = ["ACTIONS", "ACTION_WORDS", "CONFIRMED_ACTIONS", "DEVICE_ACTIONS", "MonitorConfig", "MonitorOptions",
           "SpikeAction", "check_coverage"]

SpikeAction = Literal["warn", "skip", "rollback", "stop", "recover"]
#: What ``on_spike`` accepts, in the order the docs give them.
ACTIONS = ("warn", "skip", "rollback", "stop", "recover")
#: The actions that lose progress: taken only on a spike that lasts ``spike_confirm_steps`` steps in a row
#: (its earlier steps are skipped; monitor/verdict.py).
CONFIRMED_ACTIONS = ("rollback", "stop", "recover")
#: The actions ``device_skip=True`` serves: decided on the device without the host (monitor/actions/device_skip.py).
DEVICE_ACTIONS = ("warn", "skip")
#: What each ``on_spike`` does to the update of a step whose loss or gradient norm spikes, in the words of the
#: callbacks' start-up line (:meth:`MonitorConfig.spike_line`) and README.
ACTION_WORDS = {
    "warn": "warn only, the update is applied",
    "skip": "skip the update",
    "rollback": "roll back to the last snapshot",
    "stop": "stop with a checkpoint",
    "recover": "roll back rollback_steps, skip skip_batches batches, stop after max_recoveries",
}


def _arg(default: Any, doc: str, *, saved: bool = True) -> Any:
    """A constructor argument: its default, its docs line (``{log_every}`` and ``{log_dir}`` are filled in
    by each adapter, see :meth:`MonitorConfig.args_doc`), and whether ``trainer_state.json`` keeps it."""
    return field(default=default, metadata={"doc": doc, "saved": saved})


def _check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        accepted = f"an int >= {minimum}" + (" or None" if allow_none else "")
        raise ValueError(f"{name}={value!r} is not supported; use {accepted}")


# The arguments only on_spike="recover" reads (monitor/actions/recovery.py)
RECOVER_ONLY = ("rollback_steps", "snapshot_memory_limit", "skip_batches", "lr_factor", "lr_steps", "max_recoveries",
                "cooldown_steps")
_WHAT_IT_DOES = {
    "skip": " (it drops the spiking step's update and skips no batches)",
    "rollback": " (it restores the last snapshot and skips no batches)",
}


def check_qk_clip(tau: Any, alpha: Any, attention_stats: bool = True) -> None:
    """QK-Clip's arguments: ``tau`` None or a finite number > 0, ``alpha`` in [0, 1]; it reads the statistics."""
    import math

    if tau is not None and (isinstance(tau, bool) or not isinstance(tau, int | float) or not math.isfinite(tau)
                            or tau <= 0):
        raise ValueError(f"qk_clip={tau!r} is not supported; use None (off) or a finite number > 0 (the bound on "
                         "each head's max logit, e.g. 100.0 as in Kimi K2)")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"qk_clip_alpha={alpha!r} is not supported; use a number in [0, 1] (the queries' share "
                         "of the scale; 0.5 splits it evenly)")
    if tau is not None and not attention_stats:
        raise ValueError(f"qk_clip={tau!r} with attention_stats=False is not supported: QK-Clip reads each head's "
                         "max logit from the attention statistics; use attention_stats=True or qk_clip=None")


@dataclass(frozen=True)
class MonitorConfig:
    """The arguments of the monitoring engine and of both callbacks, checked at construction.

    The fields keep the values as given (``trainer_state.json`` saves them so); :meth:`checked` gives
    them as the engine keeps them (``on_alert`` as a list, ``webhook_timeout`` as a float,
    ``webhook_headers`` as a dict).
    """

    on_spike: SpikeAction = _arg("warn", """``"warn"``, ``"skip"``, ``"rollback"``, ``"stop"`` or ``"recover"``
        (docs/RECOVERY.md).""")
    log_every_n_steps: int | None = _arg(None, """optimizer steps between monitored steps; None follows
        {log_every}.""")
    swap: bool = _arg(True, """switch transformers models to ``"stable_attn"`` at setup.""")
    patch_sdpa: bool = _arg(False, """also route ``torch.nn.functional.scaled_dot_product_attention`` to the
        stabilized kernel (for attention modules that are not transformers models); undone at
        teardown.""")
    loss_detector: SpikeDetector | None = _arg(None, """detector for the training loss; default
        ``SpikeDetector.loss()``.""", saved=False)
    grad_norm_detector: SpikeDetector | None = _arg(None, """detector for the gradient norm; default
        ``SpikeDetector.grad_norm()`` (a wider gross-jump ratio: a healthy run's early gradient norm swings by
        several times from step to step); None with ``monitor_grad_norm=False`` skips it.""", saved=False)
    monitor_grad_norm: bool = _arg(True, """compute the gradient norm every step (one pass over the
        gradients).""")
    attention_stats: bool = _arg(True, """collect per-layer attention statistics on monitored steps (the
        kernel computes them as side outputs of the forward; on the CPU path they cost a few percent of a
        monitored step).""")
    early_warnings: bool = _arg(True, """run surge detectors on each layer's saturation and max logit, and
        :class:`~stable_attn.monitor.EntropyCollapseDetector` on its entropy where collected.""")
    early_warning_warmup: int | None = _arg(None, """monitored steps each surge detector watches before it
        can fire; None keeps :class:`~stable_attn.monitor.SurgeDetector`'s default (10). The callback also
        gives each surge detector the step's training loss: an early warning needs the loss to have stopped
        improving (a max logit that grows while the loss falls is learning), so a surge detector stays silent
        until it has seen 50 monitored steps' losses. Its time constants count monitored steps: with
        ``log_every_n_steps=50`` that is 2,500 optimizer steps.""")
    rollback_every: int = _arg(100, """optimizer steps between snapshots for ``on_spike="rollback"``; with
        ``"recover"`` the snapshots are ``min(rollback_every, rollback_steps)`` steps apart.""")
    # on_spike="recover": monitor/actions/recovery.py, docs/RECOVERY.md
    rollback_steps: int = _arg(100, """with ``on_spike="recover"``: roll back to the newest snapshot taken at
        least this many optimizer steps before the spike (a ring of ``ceil(rollback_steps / spacing) + 1``
        snapshots in host memory).""")
    snapshot_memory_limit: int | None = _arg(8 * 2**30, """with ``on_spike="recover"``: bytes of host memory
        the snapshot ring may take (8 GiB); a ring that would need more (its length x one snapshot's weights,
        optimizer and scheduler state, measured at the first snapshot) keeps its snapshots as files in a
        folder ``recovery`` in {log_dir} instead, one per snapshot and rank, deleted as the ring moves on and at
        the end of the run. 0: always on disk; None: always in memory.""")
    skip_batches: int = _arg(200, """with ``on_spike="recover"``: batches of the epoch skipped after the
        rollback (0: none).""")
    lr_factor: float = _arg(1.0, """with ``on_spike="recover"``: the learning rate is multiplied by this,
        in (0, 1], for ``lr_steps`` optimizer steps after each recovery (1.0: unchanged).""")
    lr_steps: int = _arg(100, """with ``on_spike="recover"``: optimizer steps that run at ``lr x lr_factor``
        after a recovery.""")
    max_recoveries: int = _arg(3, """with ``on_spike="recover"``: recoveries per run; a spike after the last
        one stops the run with a checkpoint.""")
    cooldown_steps: int = _arg(50, """with ``on_spike="recover"``: optimizer steps between recoveries; a spike
        within them has its update skipped.""")
    on_alert: Callable[[Alert], Any] | Iterable[Callable[[Alert], Any]] | None = _arg(None, """a callable or
        callables, each called with every :class:`~stable_attn.monitor.Alert` on the training thread (keep
        them fast: see **Delivery** in :class:`~stable_attn.callbacks.StableAttentionCallback`).""",
                                                                                   saved=False)
    webhook_url: str | None = _arg(None, """``http(s)://`` URL that receives each alert as a JSON POST (ASCII,
        no spaces, control characters or ``user:password@``; redirects are not followed).""", saved=False)
    webhook_timeout: float = _arg(2.0, """seconds for each webhook connect and read, in (0, 60]; also the most
        the end of the run waits for undelivered webhook alerts.""")
    webhook_headers: Mapping[str, str] | None = _arg(None, """HTTP headers sent with each webhook request, to
        ``webhook_url``'s host only (e.g. ``{{"Authorization": "Bearer <token>"}}``); never logged.""",
                                                     saved=False)
    alerts_file: str | None = _arg(names.ALERTS_FILE, """file name of the alerts JSONL inside {log_dir}, or
        None for none; the default is what ``stable-attn report`` reads.""")
    layer_window: int = _arg(10, """monitored steps over which layer changes are reported in alerts.""")
    not_training_after: int = _arg(10, """optimizer steps in a row without an applied update (or with a
        non-finite loss) that raise the ``not_training`` alert.""")
    not_training_stop_after: int | None = _arg(100, """steps in a row after which the run is stopped with a
        checkpoint; None never stops.""")
    spike_action_cap: int | None = _arg(10, """with ``on_spike`` ``"skip"``, ``"rollback"`` or ``"stop"``: at
        most this many updates are dropped for spikes in one streak (spikes with fewer than
        ``spike_action_cooldown`` spike-free steps between them); at the cap one alert says the detector may
        be miscalibrated, and the streak's later spikes are alerted only (a NaN or inf update is still never
        applied). None: no cap.""")
    spike_action_cooldown: int = _arg(20, """optimizer steps in a row without a spike that end a streak of
        spike actions (acting resumes).""")
    spike_confirm_steps: int = _arg(3, """with ``on_spike`` ``"rollback"``, ``"stop"`` or ``"recover"``: the
        optimizer steps in a row a loss or gradient-norm spike must last before that action is taken; the
        spike's earlier updates are dropped as under ``"skip"`` (so the weights a later rollback or stop keeps
        are the same). A drift (a sustained rise by construction) and a NaN or inf act at once. 1: act on the
        spike's first step.""")
    diagnose_spikes: bool = _arg(False, """on a loss or gradient-norm spike, re-run the step's forward and backward
        on its batches and pre-step weights with the fix off, with our fix and with ``P-bar V`` in fp32
        (:mod:`stable_attn.monitor.actions.replay`; one extra forward and backward per variant, on spike steps only, not
        under DDP); the spike alert's ``diagnosis`` holds each variant's loss and gradient norm and the verdict
        (numerical or data), and the first three spikes are kept under ``{log_dir}/replay/step-N`` for
        ``stable-attn replay`` (one copy of the model on disk each).""")
    # QK-Clip: monitor/actions/qk_clip.py
    qk_clip: float | None = _arg(None, """QK-Clip's ``tau``: after each applied optimizer step, every attention
        head (key-value group) whose max scaled logit over the step's training forwards (all micro-batches and
        ranks) exceeds ``tau`` has its query and key weights scaled so that it is ``tau`` (Kimi K2: 100.0);
        statistics are then collected every step (without the entropy off monitored steps). None: off.
        Layouts: :mod:`stable_attn.monitor.actions.qk_clip`; one it cannot edit raises at setup.""")
    qk_clip_alpha: float = _arg(0.5, """the queries' share of QK-Clip's scale ``eta = tau / S_h``: queries by
        ``eta ** alpha``, keys by ``eta ** (1 - alpha)``; in [0, 1].""")
    device_skip: bool = _arg(False, """decide the skip on the device: each step's update is gated by a 0/1 factor
        computed there from its loss and gradient norm against bounds the host took from the detectors after the
        step before, so the host reads no value of a step before its update; it reads them one step later (alerts,
        ``skipped_steps``, the not-training streak, one step late). The weights and optimizer state are those of
        the host's decision, bit for bit (:mod:`stable_attn.monitor.actions.device_skip`; costs one copy of the
        parameters and optimizer state in device memory). With ``on_spike`` ``"warn"`` or ``"skip"`` only, without
        ``diagnose_spikes`` and ``qk_clip``; a ``not_training_stop_after`` stop comes one step later, that step's
        update dropped too.""")

    # The arguments as the engine keeps them (see checked()); not an argument itself.
    _checked: dict[str, Any] = field(init=False, repr=False, compare=False, default_factory=dict)
    # The names of the arguments given (from_options); not an argument itself.
    given: frozenset[str] = field(init=False, repr=False, compare=False, default=frozenset())

    def __post_init__(self) -> None:
        if self.on_spike not in ACTIONS:
            raise ValueError(f"on_spike={self.on_spike!r} is not supported; use one of {ACTIONS}")
        _check_int("log_every_n_steps", self.log_every_n_steps, 1, allow_none=True)
        _check_int("rollback_every", self.rollback_every, 1)
        _check_int("rollback_steps", self.rollback_steps, 1)
        _check_int("snapshot_memory_limit", self.snapshot_memory_limit, 0, allow_none=True)
        _check_int("skip_batches", self.skip_batches, 0)
        _check_int("lr_steps", self.lr_steps, 0)
        _check_int("max_recoveries", self.max_recoveries, 1)
        _check_int("cooldown_steps", self.cooldown_steps, 1)
        factor = self.lr_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0.0 < factor <= 1.0:
            raise ValueError(f"lr_factor={factor!r} is not supported; use a number in (0, 1] (the learning "
                             "rate's factor after a recovery; 1.0 leaves it unchanged)")
        _check_int("spike_action_cap", self.spike_action_cap, 1, allow_none=True)
        _check_int("spike_action_cooldown", self.spike_action_cooldown, 1)
        _check_int("spike_confirm_steps", self.spike_confirm_steps, 1)
        _check_int("layer_window", self.layer_window, 2)
        _check_int("early_warning_warmup", self.early_warning_warmup, 0, allow_none=True)
        _check_int("not_training_after", self.not_training_after, 1)
        _check_int("not_training_stop_after", self.not_training_stop_after, self.not_training_after,
                   allow_none=True)
        for arg in ("swap", "patch_sdpa", "monitor_grad_norm", "attention_stats", "early_warnings", "diagnose_spikes"):
            flag = getattr(self, arg)
            if not isinstance(flag, bool):
                raise TypeError(f"{arg}={flag!r} is not supported; use True or False")
        for arg in ("loss_detector", "grad_norm_detector"):
            det = getattr(self, arg)
            if det is not None and not isinstance(det, SpikeDetector):
                raise TypeError(f"{arg}={det!r} is not supported; use a stable_attn.monitor.SpikeDetector or None")
        check_qk_clip(self.qk_clip, self.qk_clip_alpha, self.attention_stats)
        self._check_device_skip()
        callbacks = alerting.check_on_alert(self.on_alert)
        timeout, headers = alerting.check_webhook(self.webhook_url, self.webhook_timeout, self.webhook_headers)
        alerting.check_alerts_file(self.alerts_file)
        self._checked.update(on_alert=callbacks, webhook_timeout=timeout, webhook_headers=headers)

    def _check_device_skip(self) -> None:
        """``device_skip=True`` covers the decisions the device can take alone: a skip, and a warning."""
        if not isinstance(self.device_skip, bool):
            raise TypeError(f"device_skip={self.device_skip!r} is not supported; use True or False")
        if not self.device_skip:
            return
        if self.on_spike not in DEVICE_ACTIONS:
            raise ValueError(f"device_skip=True with on_spike={self.on_spike!r} is not supported: a rollback, stop or "
                             "recovery is decided on the host before the step ends; use on_spike='skip' or 'warn' "
                             "with device_skip=True, or device_skip=False")
        for name, value, off in (("diagnose_spikes", self.diagnose_spikes, False), ("qk_clip", self.qk_clip, None)):
            if value != off:
                raise ValueError(f"device_skip=True with {name}={value!r} is not supported: it needs the step's "
                                 f"verdict on the host before the step ends; use {name}={off!r} or device_skip=False")

    # ------------------------------------------------------------ building one
    @classmethod
    def from_options(cls, options: Mapping[str, Any], owner: str) -> MonitorConfig:
        """``MonitorConfig(**options)``; a name it does not take is refused as ``owner``'s own constructor
        would refuse it (``TypeError: <owner>.__init__() got an unexpected keyword argument ...``)."""
        known = set(cls.names())
        for key in options:
            if key not in known:
                raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {key!r}")
        config = cls(**options)
        object.__setattr__(config, "given", frozenset(options))  # a named feature must cover something (coverage.py)
        config._check_recover_only(options)
        return config

    def _check_recover_only(self, options: Mapping[str, Any]) -> None:
        """An argument only ``on_spike="recover"`` reads, given another value than its default under another action,
        would be ignored: refused instead. (Its default is let through: a Trainer callback rebuilt from
        ``trainer_state.json`` passes every saved argument.)"""
        if self.on_spike == "recover":
            return
        for name in RECOVER_ONLY:
            if name in options and options[name] != self.default(name):
                raise ValueError(f"{name}={options[name]!r} takes effect only with on_spike='recover', and this run "
                                 f"has on_spike={self.on_spike!r}{_WHAT_IT_DOES.get(self.on_spike, '')}: use "
                                 f"on_spike='recover', or leave {name} out")

    # ------------------------------------------------------------ reading one
    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every argument's name, in signature order."""
        return tuple(f.name for f in fields(cls) if f.init)

    @classmethod
    def saved_names(cls) -> tuple[str, ...]:
        """The arguments ``trainer_state.json`` can hold (plain values, no secrets), in signature order."""
        return tuple(f.name for f in fields(cls) if f.init and f.metadata["saved"])

    @classmethod
    def unsaved_names(cls) -> tuple[str, ...]:
        """The arguments never written to ``trainer_state.json`` (objects, callables, the webhook's URL and
        headers), in signature order."""
        return tuple(f.name for f in fields(cls) if f.init and not f.metadata["saved"])

    def saved(self) -> dict[str, Any]:
        """The saved arguments, as given."""
        return {name: getattr(self, name) for name in self.saved_names()}

    def unsaved_given(self) -> list[str]:
        """The unsaved arguments that were given (not None): a rebuild from ``trainer_state.json`` lacks them."""
        return [name for name in self.unsaved_names() if getattr(self, name) is not None]

    def checked(self) -> dict[str, Any]:
        """Every argument as the engine keeps it: as given, but ``on_alert`` a list of callables,
        ``webhook_timeout`` a float and ``webhook_headers`` a dict."""
        return {name: self._checked.get(name, getattr(self, name)) for name in self.names()}

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of the argument ``name`` (the one place it is written is its field above)."""
        for f in fields(cls):
            if f.init and f.name == name:
                return f.default
        raise ValueError(f"name={name!r} is not an argument of MonitorConfig; use one of {cls.names()}")

    def spike_line(self) -> str:
        """What a spike does in this run, for the callbacks' start-up line: ``on a spike: skip the update
        (on_spike='skip')``, with ``the default`` when it is one, and that NaN/inf updates are never applied."""
        default = ", the default" if self.on_spike == self.default("on_spike") else ""
        lasting = (f", once the spike has lasted {self.spike_confirm_steps} steps in a row (its earlier steps: skip "
                   "the update; spike_confirm_steps)"
                   if self.on_spike in CONFIRMED_ACTIONS and self.spike_confirm_steps > 1 else "")
        return (f"on a spike: {ACTION_WORDS[self.on_spike]}{lasting} (on_spike={self.on_spike!r}{default}; "
                f"choose from {', '.join(map(repr, ACTIONS))}); a NaN or inf loss or gradient is never applied")

    @property
    def rolls_back(self) -> bool:
        """``on_spike="rollback"``: the engine keeps rollback snapshots (a single-process checkpoint saves the last)."""
        return self.on_spike == "rollback"

    @property
    def recovers(self) -> bool:
        """``on_spike="recover"``: a ring of snapshots and skip windows (monitor/actions/recovery.py)."""
        return self.on_spike == "recover"

    # ------------------------------------------------------ signatures and docs
    @classmethod
    def signature(cls, *leading: inspect.Parameter) -> inspect.Signature:
        """``(self, *, <leading>, <every argument>)``: what ``inspect.signature`` and ``help()`` show for a
        constructor that takes the arguments as ``**options``."""
        params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *leading]
        params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
                   for f in fields(cls) if f.init]
        return inspect.Signature(params, return_annotation="None")

    @classmethod
    def args_doc(cls, *, log_every: str, log_dir: str, indent: str = "    ") -> str:
        """The ``Args:`` section of a docstring, one entry per argument; ``log_every`` says what
        ``log_every_n_steps=None`` follows, ``log_dir`` where ``alerts_file`` is written."""
        lines = [f"{indent}Args:"]
        for f in fields(cls):
            if not f.init:
                continue
            text = " ".join(f.metadata["doc"].split()).format(log_every=log_every, log_dir=log_dir)
            wrapped = textwrap.wrap(f"{f.name}: {text}", width=110 - len(indent), break_on_hyphens=False,
                                    break_long_words=False)
            lines.append(f"{indent}    {wrapped[0]}")
            lines.extend(f"{indent}        {line}" for line in wrapped[1:])
        return "\n".join(lines) + "\n"

    @classmethod
    def document(cls, target: Any, *, log_every: str, log_dir: str) -> None:
        """Append the ``Args:`` section to ``target``'s docstring (a class, or a function); nothing under
        ``python -OO``, which strips docstrings."""
        if target.__doc__:
            target.__doc__ = target.__doc__.rstrip() + "\n\n" + cls.args_doc(log_every=log_every, log_dir=log_dir)


MonitorConfig.document(MonitorConfig, log_every="the training loop's own logging interval",
                       log_dir="the run's log directory")


# The arguments as a TypedDict, for static type checkers and IDEs: the engine and both callbacks take them as
# ``**options: Unpack[MonitorOptions]`` (PEP 692), because pyright, mypy and PyCharm read annotations, not the
# ``__signature__`` that ``help()`` shows. Defaults and checks stay in MonitorConfig alone;
# tests/monitor/test_config.py holds these names and annotations to its fields.
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
    device_skip: bool


# A requested feature that would cover no attention layer is refused rather than run a whole training without
# it: QK-Clip edits the q/k weights of transformers models' attention layers; statistics, the early warnings and the
# swap need those layers too. patch_sdpa reroutes F.scaled_dot_product_attention calls, which carry no layer. A
# feature is requested when its argument was given (swap=True), or, for qk_clip, is not None; a default that covers
# nothing is only logged by the engine (a plain model still gets loss and gradient-norm monitoring).
def check_coverage(config: MonitorConfig, root: str, *, models: int, layers: int, qk_layers: int) -> None:
    """Raise ValueError naming the first requested feature of ``config`` (a MonitorConfig) that covers nothing:
    ``models`` transformers models and ``layers`` attention layers with statistics were found under ``root``
    (the module's class name), ``qk_layers`` of them editable by QK-Clip."""
    given = getattr(config, "given", frozenset())
    if models == 0:
        where = f"{root} holds no transformers PreTrainedModel"
    else:
        where = f"the {models} transformers model(s) in {root} have no attention layer stable_attn can watch"
    if config.patch_sdpa:
        where += " (patch_sdpa=True reroutes scaled_dot_product_attention calls, which carry no layer)"
    requested = [("qk_clip", config.qk_clip is not None, qk_layers, "would clip the query and key weights of 0 "
                  "attention layers"),
                 ("swap", "swap" in given and config.swap, models, "would switch 0 transformers models"),
                 ("attention_stats", "attention_stats" in given and config.attention_stats, layers,
                  "would collect statistics of 0 attention layers"),
                 ("early_warnings", "early_warnings" in given and config.early_warnings and config.attention_stats,
                  layers, "would watch the saturation, max logit and entropy of 0 attention layers")]
    for name, wanted, covered, what in requested:
        if wanted and covered == 0:
            raise ValueError(f"{name}={getattr(config, name)!r} {what}: {where}; give the callback a module that "
                             f"holds a transformers model (attn_implementation 'stable_attn' or one it can swap), "
                             f"or leave {name} out")
