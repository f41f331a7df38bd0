"""Refuse a requested feature that would cover no attention layer, instead of running a whole training without it.

QK-Clip edits the query and key weights of the attention layers of transformers models; statistics, the early
warnings (saturation, max-logit surges, entropy collapse) and the swap need those layers too. ``patch_sdpa``
reroutes ``F.scaled_dot_product_attention`` calls, which carry no layer: it gives none of these a layer. A feature
is requested when its argument was given (``swap=True``), or, for ``qk_clip``, is not None; a default that covers
nothing is only logged by the engine (a plain model still gets loss and gradient-norm monitoring).
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_coverage"]


def check_coverage(config: Any, root: str, *, models: int, layers: int, qk_layers: int) -> None:
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
