"""QK-Clip: keep every attention head's max logit at or below ``tau`` by rescaling its query and key weights.

Kimi K2's control (MuonClip; Su Jianlin, "QK-Clip", 2025-07-12; Kimi K2 technical report, ``tau = 100``):
after an optimizer step, a head whose max scaled logit ``S_h`` over that step's forwards exceeds ``tau``
gets ``eta = tau / S_h``; its query rows of ``W_q`` (and q bias) are scaled by ``eta ** alpha`` and its
key rows of ``W_k`` (and k bias) by ``eta ** (1 - alpha)``. The head's logits ``q . k * scale`` are then
exactly ``eta`` times what they were on the same inputs (both projections are linear in their weights and
biases, RoPE is a per-position rotation that commutes with a per-head scale), so its max on those inputs is
``tau``. With grouped-query attention a key head serves ``G`` query heads: one ``eta`` per key-value group,
from the max over its query heads, applied to the group's query heads and its key head.

``S_h`` is the kernel's ``max_logit`` statistic (:class:`stable_attn.AttentionStats`, per query head,
after the scale): the caller reduces it over the step's micro-batches and ranks (MAX) and passes the
result to :meth:`QKClip.apply`, which is deterministic, so every rank edits its replica identically.

Which layouts it edits (:func:`head_layout`; anything else raises at setup, naming the module class):

- a fused ``c_attn`` (GPT-2's ``Conv1D``, weight ``[E, 3E]``: query columns ``[0, E)``, key ``[E, 2E)``),
  with its bias;
- separate ``q_proj`` / ``k_proj`` ``nn.Linear`` (Llama, Mistral, Qwen2 with biases, Gemma 2 without
  softcap), GQA included.

Refused, with the reason in the error: QK-norm layers (``q_norm`` / ``k_norm``: Qwen3, Gemma 3, OLMo 2):
the norm divides out any scale of ``W_q``, and its gain is one vector over the head dimension shared by
every head, so no per-head scale exists that leaves the other heads untouched; attention softcapping (the
kernel's ``max_logit`` is then the capped logit, not the one QK-Clip bounds); cross-attention ``c_attn``.

The weights are edited in place, in their own dtype (fp32 master weights under autocast or
Lightning's mixed precision stay fp32; the product is formed in fp32 and rounded once); the optimizer's
state (moments) is not touched, as in the published method.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import names as metric_names
from ..alerts.alert import Alert
from ..config import check_qk_clip

__all__ = ["HeadLayout", "QKClip", "QKClipRecord", "head_layout"]


def _held(t: torch.Tensor, dim: int, lo: int, length: int) -> tuple[torch.Tensor, int] | None:
    """The part of ``t``'s elements ``[lo, lo + length)`` along ``dim`` that this rank holds, as a view of its
    own storage, and the global index of that part's first element; None where it holds none. A plain tensor
    holds the whole range. A DTensor (FSDP2, tensor parallelism) is read and edited through its local shard:
    ``DTensor.narrow`` along a sharded dim returns a gathered copy, whose edit never reaches the parameter."""
    if type(t).__name__ != "DTensor":
        return t.narrow(dim, lo, length), lo
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    start, stop = max(lo, offset[dim]), min(lo + length, offset[dim] + shape[dim])
    if stop <= start:
        return None
    return t.to_local().narrow(dim, start - offset[dim], stop - start), start


@dataclass(frozen=True)
class _Block:
    """One projection's heads inside a parameter: ``heads`` blocks of ``head_dim`` output features from
    ``offset``, along ``dim`` of ``weight`` (0 for ``nn.Linear``, 1 for GPT-2's ``Conv1D``)."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    offset: int
    dim: int

    def scale(self, head: int, head_dim: int, factor: float) -> None:
        """Scale global head ``head``'s rows (and bias), as far as this rank holds them."""
        lo = self.offset + head * head_dim
        for t, dim in ((self.weight.data, self.dim), (None if self.bias is None else self.bias.data, 0)):
            part = _held(t, dim, lo, head_dim) if t is not None else None
            if part is not None:
                part[0].copy_((part[0].float() * factor).to(part[0].dtype))

    def held_heads(self, heads: int, head_dim: int) -> tuple[int, int]:
        """``(first, count)``: the heads whose rows this rank's shard of the weight holds (all of them unless
        the weight is a DTensor sharded along the heads); under tensor parallelism the heads it computes."""
        part = _held(self.weight.data, self.dim, self.offset, heads * head_dim)
        if part is None:
            return 0, 0
        return (part[1] - self.offset) // head_dim, part[0].shape[self.dim] // head_dim


@dataclass(frozen=True)
class HeadLayout:
    """Where one attention layer's query and key heads live in its parameters."""

    module_class: str
    query: _Block
    key: _Block
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def _int(module: nn.Module, *names: str) -> int | None:
    config = getattr(module, "config", None)
    for name in names:
        for owner in (module, config):
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _refuse(module: nn.Module, why: str) -> ValueError:
    return ValueError(f"qk_clip cannot edit {type(module).__name__}: {why}")


def head_layout(module: nn.Module) -> HeadLayout:
    """The :class:`HeadLayout` of an attention module; ``ValueError`` naming its class where QK-Clip cannot
    edit it (the module docstring lists the layouts and the refusals)."""
    cls = type(module).__name__
    if getattr(module, "q_norm", None) is not None or getattr(module, "k_norm", None) is not None:
        raise _refuse(module, "it normalises q and k (q_norm / k_norm), which divides out any scale of W_q and "
                              "W_k, and the norm's gain is shared by every head, so one head cannot be clipped "
                              "alone; QK-norm already bounds the logits through that gain")
    config = getattr(module, "config", None)
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise _refuse(module, "attention softcapping is on (config.attn_logit_softcapping): the kernel's "
                              "max_logit is then the capped logit, not the one QK-Clip bounds")
    head_dim = _int(module, "head_dim")
    heads = _int(module, "num_heads", "num_attention_heads")
    c_attn = getattr(module, "c_attn", None)
    if c_attn is not None:
        if getattr(module, "is_cross_attention", False):
            raise _refuse(module, "cross-attention (its queries come from q_attn, its c_attn holds keys and values)")
        weight = getattr(c_attn, "weight", None)
        embed = _int(module, "embed_dim", "hidden_size")
        if (not isinstance(weight, nn.Parameter) or weight.dim() != 2 or heads is None or head_dim is None
                or embed != heads * head_dim or tuple(weight.shape) != (embed, 3 * embed)):
            raise _refuse(module, f"its c_attn is not GPT-2's fused Conv1D of weight [E, 3E] "
                                  f"(weight {None if weight is None else tuple(weight.shape)}, heads {heads}, "
                                  f"head_dim {head_dim})")
        bias = getattr(c_attn, "bias", None)
        return HeadLayout(cls, _Block(weight, bias, 0, 1), _Block(weight, bias, embed, 1), heads, heads, head_dim)
    q_proj, k_proj = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
    if isinstance(q_proj, nn.Linear) and isinstance(k_proj, nn.Linear):
        kv_heads = _int(module, "num_key_value_heads", "num_kv_heads")
        if heads is None and head_dim is not None:
            heads = q_proj.out_features // head_dim
        if kv_heads is None and head_dim is not None:
            kv_heads = k_proj.out_features // head_dim
        if (heads is None or kv_heads is None or head_dim is None or q_proj.out_features != heads * head_dim
                or k_proj.out_features != kv_heads * head_dim or heads % kv_heads):
            raise _refuse(module, f"q_proj / k_proj ({q_proj.out_features} / {k_proj.out_features} outputs) do not "
                                  f"split into heads={heads}, kv_heads={kv_heads} of head_dim={head_dim}")
        return HeadLayout(cls, _Block(q_proj.weight, q_proj.bias, 0, 0), _Block(k_proj.weight, k_proj.bias, 0, 0),
                          heads, kv_heads, head_dim)
    raise _refuse(module, "no known query/key layout (a fused GPT-2 c_attn, or q_proj and k_proj nn.Linear); "
                          "accepted: GPT-2, Llama, Mistral, Qwen2 and models laid out like them")


@dataclass
class QKClipRecord:
    """What one :meth:`QKClip.apply` did: per clipped layer, its largest pre-clip ``S_h``, the clipped
    query heads and each one's ``eta``."""

    max_logit: dict[str, float] = field(default_factory=dict)  # every layer's largest pre-clip S_h
    heads: dict[str, list[int]] = field(default_factory=dict)  # clipped layers only
    eta: dict[str, list[float]] = field(default_factory=dict)

    @property
    def clipped_heads(self) -> int:
        return sum(len(h) for h in self.heads.values())


class QKClip:
    """Clip per-head max logits to ``tau`` by editing the query and key weights (module docstring).

    Args:
        tau: the bound on each head's max scaled logit.
        alpha: the query's share of the scale: queries ``eta ** alpha``, keys ``eta ** (1 - alpha)``.
    """

    def __init__(self, tau: float, alpha: float = 0.5) -> None:
        check_qk_clip(tau, alpha)
        if tau is None:
            raise ValueError("qk_clip=None: QKClip needs a tau; None switches QK-Clip off in the callbacks")
        self.tau, self.alpha = float(tau), float(alpha)
        self.layouts: dict[str, HeadLayout] = {}
        self.clip_steps = 0  # steps on which a head was clipped (the alert cadence: first and every 100th)

    def setup(self, modules: Mapping[str, nn.Module]) -> None:
        """Read every attention module's layout (layer name -> module); raises on one it cannot edit."""
        self.layouts = {name: head_layout(m) for name, m in modules.items()}

    def reduce(self, stats: Mapping[str, object], all_gather: Callable[[torch.Tensor], torch.Tensor] | None,
               device: torch.device) -> dict[str, torch.Tensor]:
        """Every layer's per-head ``max_logit`` (its :class:`~stable_attn.AttentionStats`), MAX-reduced over
        ranks by one ``all_gather``, called on every rank whatever the local statistics hold: the gathered
        tensor's shape comes from the layouts (``[layers, max heads]``, ``-inf`` where a layer saw no row)."""
        names = list(self.layouts)
        width = max((lay.heads for lay in self.layouts.values()), default=0)
        local = torch.full((len(names), width), -math.inf, dtype=torch.float32, device=device)
        for i, name in enumerate(names):
            mx = getattr(stats.get(name), "max_logit", None)
            if mx is not None:
                first = self._first_head(name, mx.numel())
                local[i, first:first + mx.numel()] = mx.detach().to(device=device, dtype=torch.float32)
        if all_gather is not None:
            local = all_gather(local).reshape(-1, *local.shape).amax(dim=0)
        return {name: local[i, :self.layouts[name].heads] for i, name in enumerate(names)}

    def _first_head(self, name: str, seen: int) -> int:
        """The global index of the first of the ``seen`` heads whose statistics this rank's layer ``name``
        collected: 0 when it computed every head; under tensor parallelism (q_proj sharded along its heads,
        each rank computing its own), the first head of this rank's shard."""
        layout = self.layouts[name]
        if seen == layout.heads:
            return 0
        first, held = layout.query.held_heads(layout.heads, layout.head_dim)
        if held != seen:
            raise ValueError(
                f"qk_clip: layer {name!r} ({layout.module_class}) computed {seen} query heads on this rank, and "
                f"its query weight holds {layout.heads} heads, {held} of them in this rank's shard; QK-Clip needs "
                "each rank to compute either every head or the heads of its own shard (tensor parallelism with "
                "q_proj / k_proj column-wise): use qk_clip=None for this sharding")
        return first

    @torch.no_grad()
    def apply(self, max_logits: Mapping[str, torch.Tensor]) -> QKClipRecord:
        """Clip after an applied optimizer step: ``max_logits`` maps layer names to ``[heads]`` per-head max
        logits of the step's forwards, already reduced over micro-batches and ranks. Layers without a value
        are left alone; ``S_h <= 0``, ``-inf`` (no row seen) and NaN never clip (``S_h > tau`` is false)."""
        record = QKClipRecord()
        for name, layout in self.layouts.items():
            s = max_logits.get(name)
            if s is None:
                continue
            s = s.detach().double().cpu().reshape(layout.kv_heads, layout.group)
            finite = s[torch.isfinite(s)]
            if finite.numel():
                record.max_logit[name] = finite.max().item()
            group_max = torch.nan_to_num(s, nan=-math.inf).amax(dim=1)
            over = (group_max > self.tau).nonzero().flatten().tolist()
            if not over:
                continue
            heads, etas = [], []
            for g in over:
                eta = self.tau / group_max[g].item()  # S > tau > 0: 0 < eta < 1, finite
                layout.key.scale(g, layout.head_dim, eta ** (1.0 - self.alpha))
                for h in range(g * layout.group, (g + 1) * layout.group):
                    layout.query.scale(h, layout.head_dim, eta ** self.alpha)
                    heads.append(h)
                    etas.append(eta)
            record.heads[name], record.eta[name] = heads, etas
        if record.heads:
            self.clip_steps += 1
        return record

    def after_step(self, step: int, stats: Mapping[str, Any], world: Any, monitored: bool, acted: bool,
                   lr: float | None) -> tuple[dict[str, float], Alert | None]:
        """After the optimizer step, on every rank: the step's per-head max logits MAX-reduced over ranks (one
        collective, whatever the step did), then the edit, unless the update was dropped (a skipped, rolled-back
        or stopped step is not clipped). Returns the step's ``qk_clip/`` metrics (empty: no clip) and the alert
        due (the first clip and every 100th). ``world``: the engine's (rank, size, device, all_gather)."""
        gather = world.all_gather if world.size > 1 else None
        max_logits = self.reduce(stats, gather, world.device)
        if not monitored:  # a monitored step's statistics are collected, then reset, by the layer watch
            for s in stats.values():
                s.reset()
        if acted:
            return {}, None
        record = self.apply(max_logits)
        if not record.heads:
            return {}, None
        metrics = {metric_names.QK_CLIP_HEADS: float(record.clipped_heads)}
        metrics.update({metric_names.qk_clip_metric(layer): record.max_logit[layer] for layer in record.heads})
        if not self.alert_due():
            return metrics, None
        worst = max(record.heads, key=lambda layer: record.max_logit[layer])
        detail = "; ".join(f"{layer} heads {record.heads[layer]} S_h {record.max_logit[layer]:.4g} eta "
                           f"{min(record.eta[layer]):.4g}" for layer in record.heads)
        return metrics, Alert(step=step, kind="qk_clip", metric=metric_names.qk_clip_metric(worst),
                              value=record.max_logit[worst], threshold=self.tau, lr=lr,
                              message=f"QK-Clip #{self.clip_steps} clipped {record.clipped_heads} query head(s): "
                                      f"{detail}")

    def alert_due(self) -> bool:
        """Whether the clip just applied is one to raise an alert for: the first and every 100th after it."""
        return self.clip_steps > 0 and (self.clip_steps - 1) % 100 == 0

    def state_dict(self) -> dict:
        return {"tau": self.tau, "alpha": self.alpha, "clip_steps": self.clip_steps}

    def load_state_dict(self, state: Mapping) -> None:
        self.clip_steps = int(state.get("clip_steps", 0))
