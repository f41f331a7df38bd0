"""Preparing the transformers models inside a training module (a LightningModule) for a monitored run:
switched to ``"stable_attn"``, with per-layer statistics attached."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from stable_attn.integrations.transformers.models import attach_stats, attention_modules
from stable_attn.integrations.transformers.registry import NAMES, register
from stable_attn.stats import AttentionStats

log = logging.getLogger("stable_attn")

__all__ = ["PreparedModels", "SwitchWatch", "find_hf_models", "implementations_line", "layer_implementation",
           "prepare_models", "swap_attention"]

# what a user reads when a model left stable_attn after the swap (the start-up line, the run's WARNING, explain)
SHARED_CONFIG_HINT = ("transformers' from_config keeps the config object it is given, so building another model "
                      "(an 'sdpa' twin for an A/B) from this model's config, or set_attn_implementation on a model "
                      "sharing it, switches this one too; give the other model its own copy: "
                      "from_config(copy.deepcopy(config), attn_implementation='sdpa')")


def find_hf_models(root: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The outermost transformers ``PreTrainedModel`` instances under ``root`` (by module path;
    ``""`` when ``root`` is one). Inner ones (the ``GPT2Model`` in a ``GPT2LMHeadModel``) share the
    outer model's config and follow its attention implementation."""
    found: dict[str, torch.nn.Module] = {}
    for name, module in root.named_modules():
        if not isinstance(module, PreTrainedModel):
            continue
        if any(name == p or name.startswith(p + ".") for p in found if p != name) or "" in found:
            continue
        found[name] = module
    return found


def swap_attention(models: dict[str, torch.nn.Module]) -> None:
    """``set_attn_implementation("stable_attn")`` on each model (registering the implementation
    with transformers first)."""
    register()
    for model in models.values():
        if getattr(model.config, "_attn_implementation", None) not in NAMES:
            model.set_attn_implementation("stable_attn")


def layer_implementation(module: torch.nn.Module) -> str | None:
    """The attention implementation an attention module runs: the one its config names now (transformers reads
    ``config._attn_implementation`` at every forward), None without a config."""
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


def implementations_line(modules: Collection[torch.nn.Module]) -> str:
    """``"all 12 run 'stable_attn'"`` or ``"10 run 'stable_attn', 2 run 'sdpa'"``: what the layers run now."""
    counts = Counter(layer_implementation(m) for m in modules)
    if len(counts) == 1:
        (impl, n), = counts.items()
        return f"{'all ' if n > 1 else ''}{n} run {impl!r}"
    return ", ".join(f"{n} run {impl!r}" for impl, n in counts.most_common())


class SwitchWatch:
    """The attention layers that ran ``"stable_attn"`` when a run prepared them, to find those whose config was
    switched away since (:data:`SHARED_CONFIG_HINT`): :meth:`switched` names each model once."""

    def __init__(self) -> None:
        self._layers: dict[str, list[torch.nn.Module]] = {}
        self._reported: set[str] = set()

    def add(self, models: dict[str, torch.nn.Module]) -> None:
        for path, model in models.items():
            ours = [m for _, m in attention_modules(model) if layer_implementation(m) in NAMES]
            if ours:
                self._layers[f"{path or 'model'} ({type(model).__name__})"] = ours

    def switched(self) -> list[str]:
        """One line per model not reported before whose layers no longer all run ``"stable_attn"``."""
        lines = []
        for name, layers in self._layers.items():
            away = [m for m in layers if layer_implementation(m) not in NAMES]
            if away and name not in self._reported:
                self._reported.add(name)
                lines.append(f"{name}: {len(away)} of its {len(layers)} attention layer(s) switched away from "
                             f"'stable_attn' since the start ({implementations_line(layers)} now)")
        return lines

    def warn(self, who: str) -> None:
        """A WARNING for each model :meth:`switched` names, with the likely cause and its fix."""
        for line in self.switched():
            log.warning("%s: %s: the run does not use stable_attn there (no fix, no statistics from those layers). "
                        "The likely cause: %s", who, line, SHARED_CONFIG_HINT)


@dataclass(frozen=True)
class PreparedModels:
    """What :func:`prepare_models` did: the models it prepared (by module path), and with ``stats=True`` each
    attention layer's statistics and module under one layer name (``layer{i}``, prefixed with the model's path,
    or ``model``, when a run holds several models)."""

    models: dict[str, torch.nn.Module] = field(default_factory=dict)
    stats: dict[str, AttentionStats] = field(default_factory=dict)
    modules: dict[str, torch.nn.Module] = field(default_factory=dict)

    @property
    def attention_layers(self) -> int:
        """The attention modules of the prepared models."""
        return sum(len(attention_modules(m)) for m in self.models.values())

    def implementations(self) -> str:
        """What the prepared models' attention layers run now (:func:`implementations_line`)."""
        layers = [m for model in self.models.values() for _, m in attention_modules(model)]
        return implementations_line(layers) if layers else "none"


def prepare_models(root: torch.nn.Module, *, swap: bool, stats: bool,
                   prepared: Collection[torch.nn.Module] = ()) -> PreparedModels:
    """Prepare the outermost transformers models under ``root`` (:func:`find_hf_models`) that are not in
    ``prepared`` (the models of an earlier call of the same run): ``swap`` switches them to ``"stable_attn"``,
    ``stats`` attaches :class:`AttentionStats` to every attention layer (:func:`attach_stats`)."""
    known = {id(m) for m in prepared}
    models = {path: m for path, m in find_hf_models(root).items() if id(m) not in known}
    if swap and models:
        swap_attention(models)
    layer_stats: dict[str, AttentionStats] = {}
    modules: dict[str, torch.nn.Module] = {}
    several = len(models) + len(known) > 1
    for path, model in models.items():
        if not stats:
            continue
        # attach_stats names the layers in attention_modules' order
        attached = attach_stats(model)
        names = [f"{path or 'model'}.{layer}" if several else layer for layer in attached]
        layer_stats.update(zip(names, attached.values(), strict=True))
        modules.update(zip(names, (m for _, m in attention_modules(model)), strict=True))
    return PreparedModels(models, layer_stats, modules)
