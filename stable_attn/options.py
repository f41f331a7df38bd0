"""The options of an attention call: one object, checked in one place, shared by every entry point.

:class:`Options` is what the backends receive (``kernels/reference.py``, ``kernels/reference_varlen.py``,
``kernels/triton_attention.py``): every field in the kernels' own terms (``mode`` an integer
``rules.MODE_*``, ``scale`` resolved, ``block_n`` 0 for the default partition), plus the scalars the
kernels derive from them (``qk_scale2``, ``cap_scale``, ...), computed here once so both backends use the
same fp64 expressions. :meth:`Options.create` is the only way from the public arguments to an
``Options``; it checks every value and names the argument, the value and what is accepted.

Vocabulary of the mode: the public spelling is ``stabilize=True`` (our rule), ``"paper"`` (the published
rule) or ``False`` (plain FlashAttention-2). The integers ``rules.MODE_*`` are the kernels' compile-time
constants, and :data:`MODE_NAMES` names them where a mode is printed (kernel variant names,
benchmark tables); :data:`FIX_NAMES` names the ``stabilize`` values in the numerics lab's and the probe's
reports (``"ours"`` there is ``stabilize=True``). :func:`mode_of` and :func:`stabilize_of` are the only
translations between the integers and the public values.

Defaults are written once, in :data:`DEFAULTS`: ``attention()``, ``attention_varlen()``, ``patch_sdpa()``,
``configure()`` and ``config.stable_attn`` all read them from there. :data:`MODEL_OPTIONS` are the options
a whole model (or an sdpa patch) sets; :func:`model_options` checks such a set.

The torch.library ops take the fields as named scalar arguments; :func:`op_schema` writes that part of
their schema from the dataclass, :meth:`Options.op_args` / :meth:`Options.from_op_args` convert, so no
caller slices arguments by position.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from . import rules

Stabilize = bool | Literal["paper"]

STABILIZE_VALUES: tuple[Stabilize, ...] = (True, "paper", False)
MODE_NAMES: Mapping[int, str] = MappingProxyType(
    {rules.MODE_EXACT: "exact", rules.MODE_PAPER: "paper", rules.MODE_OFF: "off"})
# What the numerics lab and the probe print for each setting (their reports and stored results use these).
FIX_NAMES: Mapping[str, Stabilize] = MappingProxyType({"off": False, "ours": True, "paper": "paper"})
BACKENDS = ("auto", "torch", "triton")

# Default key-block size: the partition the per-block rule sees, the same in both backends and every mode
# (why 128, and why not the published code's 512: docs/ALGORITHM.md, "The key partition").
BLOCK_N = 128

DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "causal": False,
    "scale": None,  # 1 / sqrt(head dim)
    "window": None,
    "softcap": None,
    "dropout_p": 0.0,
    "stabilize": True,
    "beta": 2.0,
    "backend": "auto",
    "block_n": None,  # BLOCK_N
    "pv_fp32": False,  # P-bar V in the input dtype, as FlashAttention-2
})
MODEL_OPTIONS = ("stabilize", "beta", "backend", "block_n", "pv_fp32")


def mode_of(stabilize: object) -> int:
    """``rules.MODE_*`` for a ``stabilize`` value; ValueError naming the accepted values otherwise."""
    # identity tests: 1 == True and 0 == False, but stabilize=1 is not a spelling we accept
    if stabilize is True:
        return rules.MODE_EXACT
    if stabilize is False:
        return rules.MODE_OFF
    if isinstance(stabilize, str) and stabilize == "paper":
        return rules.MODE_PAPER
    raise ValueError(f"stabilize={stabilize!r} is not supported; use True (our rule), 'paper' (the published "
                     "rule) or False (plain FlashAttention-2)")


def stabilize_of(mode: int) -> Stabilize:
    """The public ``stabilize`` value of a ``rules.MODE_*``."""
    for value in STABILIZE_VALUES:
        if mode_of(value) == mode:
            return value
    raise ValueError(f"mode={mode!r} is not one of rules.MODE_* {sorted(MODE_NAMES)}")


def is_number(x: object) -> bool:
    """An int or a float, not a bool (``True`` is an int to Python, never a value we accept)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_int(x: object) -> bool:
    """An int, not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def _check_causal(x: object) -> None:
    if not (isinstance(x, bool) or (is_int(x) and x in (0, 1))):
        raise TypeError(f"causal={x!r} must be True or False")


def scale_problem(x: object) -> str | None:
    """Why ``scale=x`` is refused, or None; the one scale rule (``attention()`` raises on it, the sdpa
    patch leaves such calls to the original function)."""
    # the forward takes block maxima on the unscaled q.k and scales them after, which gives the maxima
    # of the scaled scores only for a positive finite fp32 score scale (kernels/triton_forward.fwd_block)
    if x is not None and not (is_number(x) and math.isfinite(x) and x > 0
                              and rules.FP32_MIN_NORMAL <= x * rules.LOG2E <= rules.FP32_MAX):
        return (f"scale={x!r} must be a finite positive number or None (1/sqrt(D)), with scale * log2(e) "
                f"in fp32's normal range [{rules.FP32_MIN_NORMAL:.3g}, {rules.FP32_MAX:.3g}]")
    return None


def _check_scale(x: object) -> None:
    problem = scale_problem(x)
    if problem is not None:
        raise ValueError(problem)


def _check_window(x: object) -> None:
    if x is not None and not (is_int(x) and x >= 1):
        raise ValueError(f"window={x!r} must be a positive int (keys j > p - window) or None")


def _check_softcap(x: object) -> None:
    if x is not None and not (is_number(x) and math.isfinite(x) and x > 0):
        raise ValueError(f"softcap={x!r} must be a finite positive number or None")


def _check_dropout_p(x: object) -> None:
    if not (is_number(x) and 0.0 <= x < 1.0):
        raise ValueError(f"dropout_p={x!r} must be a number in [0, 1)")


def _check_beta(x: object) -> None:
    if not (is_number(x) and math.isfinite(x) and x > 1.0):
        raise ValueError(f"beta={x!r} must be a finite number > 1")


def _check_backend(x: object) -> None:
    if not (isinstance(x, str) and x in BACKENDS):
        raise ValueError(f"backend={x!r} is not supported; use one of {BACKENDS}")


def _check_block_n(x: object) -> None:
    if x is not None and not (is_int(x) and x >= 16 and x & (x - 1) == 0):
        raise ValueError(f"block_n={x!r} must be a power of two >= 16 or None ({BLOCK_N})")


def _check_pv_fp32(x: object) -> None:
    if not isinstance(x, bool):
        raise TypeError(f"pv_fp32={x!r} must be True (P-bar V in fp32, served by the PyTorch path) or False")


_CHECKS = {
    "causal": _check_causal, "scale": _check_scale, "window": _check_window, "softcap": _check_softcap,
    "dropout_p": _check_dropout_p, "stabilize": mode_of, "beta": _check_beta, "backend": _check_backend,
    "block_n": _check_block_n, "pv_fp32": _check_pv_fp32,
}


# DEFAULTS' values in a plain dict, read by _completed: torch.compile breaks the graph when traced code reads a
# mapping proxy after any dict was mutated in the same trace (a static cache's decoding step does)
_DEFAULTS_READ: dict[str, Any] = dict(DEFAULTS)


def _completed(values: Mapping[str, Any], accepted: tuple[str, ...], where: str) -> dict[str, Any]:
    """``values`` with the missing ``accepted`` names from :data:`DEFAULTS`; unknown names raise."""
    unknown = sorted(set(values) - set(accepted))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; accepted keys are {sorted(accepted)}")
    return {name: values.get(name, _DEFAULTS_READ[name]) for name in accepted}


def _check_values(values: Mapping[str, Any]) -> None:
    for name, value in values.items():
        _CHECKS[name](value)


def model_options(values: Mapping[str, Any] | None = None, where: str = "options") -> dict[str, Any]:
    """The per-model options (:data:`MODEL_OPTIONS`), checked and completed with :data:`DEFAULTS`.

    What ``configure()``, ``config.stable_attn`` and ``patch_sdpa()`` store; ``where`` starts the error
    messages (e.g. ``"LlamaAttention: config.stable_attn"``).
    """
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise TypeError(f"{where} must be a dict with keys among {list(MODEL_OPTIONS)}, got {type(values).__name__}")
    full = _completed(values, MODEL_OPTIONS, where)
    try:
        _check_values(full)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return full


@dataclass(frozen=True)
class Options:
    """Everything that selects the computation, in the kernels' terms; shared by forward and backward.

    Build it with :meth:`create` from the public arguments (checked there). Constructing it directly
    (tests, benchmarks) takes the fields as they are.
    """

    causal: bool = DEFAULTS["causal"]
    scale: float = 1.0
    window: int | None = DEFAULTS["window"]  # left sliding window: query at position p sees keys j > p - W
    softcap: float | None = DEFAULTS["softcap"]
    dropout_p: float = DEFAULTS["dropout_p"]
    seed: int = 0  # Philox seed of the dropout mask; drawn per call (the ops take it as a tensor)
    mode: int = rules.MODE_EXACT  # mode_of(DEFAULTS["stabilize"])
    beta: float = DEFAULTS["beta"]
    block_n: int = 0  # key-block size; 0 = BLOCK_N
    backend: str = DEFAULTS["backend"]  # as asked; the ops receive the resolved "torch" or "triton"
    # no backward will be asked for (attention() sets it): the forward may take the decode path
    # (kernels/decode_plan.takes_decode), whose key splits are decisions the training kernels do not make
    forward_only: bool = False
    # P-bar kept in fp32 for the P-bar V product (Qiu & Yao: fp32 for that product alone stabilises training);
    # the PyTorch path only (_ops.resolve_backend), the numerics lab's and stable-attn replay's comparison
    pv_fp32: bool = DEFAULTS["pv_fp32"]

    @classmethod
    def create(cls, *, head_dim: int | None = None, seed: int = 0, **values: Any) -> Options:
        """Check the public arguments (names as in ``attention()``; missing ones from :data:`DEFAULTS`).

        ``scale=None`` needs ``head_dim`` (the default scale is ``1/sqrt(head_dim)``).
        """
        v = _completed(values, tuple(DEFAULTS), "the options")
        _check_values(v)
        scale = v["scale"]
        if scale is None:
            if head_dim is None:
                raise ValueError("scale=None needs the head dim (the default scale is 1/sqrt(D))")
            scale = 1.0 / math.sqrt(head_dim)
        return cls(
            causal=bool(v["causal"]), scale=float(scale), window=v["window"],
            softcap=None if v["softcap"] is None else float(v["softcap"]), dropout_p=float(v["dropout_p"]),
            seed=seed, mode=mode_of(v["stabilize"]), beta=float(v["beta"]), block_n=v["block_n"] or 0,
            backend=v["backend"], pv_fp32=v["pv_fp32"],
        )

    @property
    def stabilize(self) -> Stabilize:
        return stabilize_of(self.mode)

    # block_n = 0 (the default partition) is read only here: everything else asks key_block / key_block_given
    @property
    def key_block(self) -> int:
        """The key-block size: the partition the per-block rule sees (``block_n``, or :data:`BLOCK_N`)."""
        return self.block_n or BLOCK_N

    @property
    def key_block_given(self) -> bool:
        """Whether the caller chose ``block_n`` (only then is the partition fixed where no rule sees it)."""
        return self.block_n != 0

    # Kernel scalars: one Python expression each, so the PyTorch path and the Triton launcher round
    # the same fp64 value to the same fp32 kernel argument.
    @property
    def qk_scale2(self) -> float:
        """Score scale in base-2 units (``s2 = q.k * qk_scale2``) when there is no softcap."""
        return self.scale * rules.LOG2E

    @property
    def cap_scale(self) -> float:
        """``scale / softcap``: the argument of tanh is ``q.k * cap_scale`` (1.0 without softcap)."""
        return self.scale / self.softcap if self.softcap is not None else 1.0

    @property
    def cap_log2e(self) -> float:
        """``softcap * log2(e)``: the capped base-2 score is ``tanh(.) * cap_log2e`` (1.0 without softcap)."""
        return self.softcap * rules.LOG2E if self.softcap is not None else 1.0

    @property
    def keep_scale(self) -> float:
        """``1 / (1 - dropout_p)``, the scale of the kept weights (1.0 without dropout)."""
        return 1.0 / (1.0 - self.dropout_p) if self.dropout_p > 0 else 1.0

    def model_options(self) -> dict[str, Any]:
        """The :data:`MODEL_OPTIONS` of these options, in the public vocabulary."""
        return {"stabilize": self.stabilize, "beta": self.beta, "backend": self.backend,
                "block_n": self.block_n if self.key_block_given else None, "pv_fp32": self.pv_fp32}

    def op_args(self) -> tuple:
        """The fields the ops take as scalar arguments, in :func:`op_schema` order."""
        return tuple(getattr(self, name) for name in _OP_FIELDS)

    @classmethod
    def from_op_args(cls, args: tuple, seed: int = 0) -> Options:
        """The inverse of :meth:`op_args` (the seed travels separately, as a tensor)."""
        return cls(seed=seed, **dict(zip(_OP_FIELDS, args, strict=True)))

    def replace(self, **changes: Any) -> Options:
        return dataclasses.replace(self, **changes)


_SCHEMA_TYPES = {"bool": "bool", "float": "float", "int": "int", "str": "str", "int | None": "int?",
                 "float | None": "float?"}
_OP_FIELDS = tuple(f.name for f in dataclasses.fields(Options) if f.name != "seed")


def op_schema() -> str:
    """The ops' scalar arguments, ``"bool causal, float scale, int? window, ..."``, from :class:`Options`."""
    types = {f.name: f.type for f in dataclasses.fields(Options)}
    return ", ".join(f"{_SCHEMA_TYPES[types[name]]} {name}" for name in _OP_FIELDS)
