"""Tiny transformers models for the QK-Clip tests of both callbacks (Lightning and transformers.Trainer).

The models are built with ``attn_implementation="stable_attn"`` and their attention weights scaled up at
init (as tests/monitor/actions/test_qk_clip.py does) so that the heads' max logits are a few units apart: a tau
between them clips some heads and leaves others. :class:`EditCheck` checks every optimizer step's edit
exactly, from the weights just before and just after the callback's ``end_step`` and the step's per-head
max logits as the kernel's statistics hold them when the optimizer step starts.
"""

from __future__ import annotations

import copy
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import stable_attn.integrations.transformers as st
from stable_attn.monitor import names
from stable_attn.monitor.actions.qk_clip import head_layout

VOCAB, SEQ, BATCH = 64, 16, 4


def tiny_model(family: str) -> torch.nn.Module:
    """GPT-2 (fused ``c_attn``, 4 heads) or Llama (4 query heads, 2 key-value heads), 2 layers, seeded."""
    st.register()
    torch.manual_seed(7)
    if family == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, attn_pdrop=0.0,
                         resid_pdrop=0.0, embd_pdrop=0.0)
        model = GPT2LMHeadModel._from_config(cfg, attn_implementation="stable_attn")
    else:
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = LlamaForCausalLM._from_config(cfg, attn_implementation="stable_attn")
    with torch.no_grad():  # sharper attention than the init gives: max logits of a few units, spread out
        for _, m in st.attention_modules(model):
            for p in m.parameters():
                p.mul_(4.0)
    return model


def batches(n: int, seed: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(n)]


def layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``layer<i>`` -> attention module, the callbacks' names (one model: no path prefix)."""
    return {f"layer{i}": m for i, (_, m) in enumerate(st.attention_modules(model))}


def head_max_logits(model: torch.nn.Module, micro_batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per layer, each query head's max logit over ``micro_batches`` (a copy of ``model``, no grad)."""
    twin = copy.deepcopy(model)
    stats = st.attach_stats(twin)
    for s in stats.values():
        s.reset()
        s.enabled = True
    with torch.no_grad():
        for b in micro_batches:
            twin(input_ids=b)
    return {name: s.max_logit.clone() for name, s in stats.items()}


def group_max_logits(model: torch.nn.Module, micro_batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per layer, each key-value group's max logit over ``micro_batches``."""
    heads = head_max_logits(model, micro_batches)
    out = {}
    for name, m in layers(model).items():
        lay = head_layout(m)
        out[name] = heads[name].view(lay.kv_heads, lay.group).amax(1)
    return out


def tau_between(group_max: dict[str, torch.Tensor]) -> float:
    """A tau with groups of layer 0 above and below it."""
    g = group_max["layer0"].sort().values
    assert g[0] > 0 and g[0] < g[-1]
    return float((g[0] + g[-1]) / 2)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def moments(optimizer: torch.optim.Optimizer) -> dict:
    return copy.deepcopy(optimizer.state_dict()["state"])


def assert_moments_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert a[k].keys() == b[k].keys()
        for key in a[k]:
            assert torch.equal(torch.as_tensor(a[k][key]), torch.as_tensor(b[k][key])), (k, key)


class EditCheck:
    """The exact QK-Clip edit of each optimizer step, computed here, not by the engine's QKClip.

    A training loop's probe calls :meth:`step_logits` when the step's gradients are complete (its forwards
    are done, statistics not yet reset), :meth:`before_clip` after the optimizer step and before the
    callback's ``end_step``, :meth:`after_clip` after it. Each applied step's edit must then be: the key rows
    of every key-value group whose max logit ``S`` passed tau scaled by ``(tau / S) ** 0.5`` in fp32 and
    rounded once to the weight's dtype, its query heads' rows likewise; every other parameter (and the
    optimizer state) bit for bit as the optimizer left it."""

    def __init__(self, model: torch.nn.Module, tau: float) -> None:
        self.model, self.tau = model, tau
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.S: dict[str, torch.Tensor] = {}
        self.clipped: dict[int, dict[str, list[int]]] = {}  # step -> layer -> clipped key-value groups
        self.history: dict[int, dict[str, float]] = {}  # step -> layer -> its largest max logit
        self.history_S: dict[int, dict[str, torch.Tensor]] = {}  # step -> layer -> per-head max logits
        self.checked: list[int] = []

    def step_logits(self) -> None:
        self.S = {name: m.stable_attn_stats.max_logit.clone() for name, m in layers(self.model).items()}

    def before_clip(self, optimizer: torch.optim.Optimizer) -> None:
        self._before, self._moments = params(self.model), moments(optimizer)

    def after_clip(self, step: int, optimizer: torch.optim.Optimizer, applied: bool = True) -> None:
        now = params(self.model)
        assert_moments_equal(self._moments, moments(optimizer))  # the clip leaves the optimizer state alone
        expected = dict(self._before)
        self.clipped[step] = {}
        self.history[step] = {name: s.max().item() for name, s in self.S.items()}
        self.history_S[step] = dict(self.S)
        for name, m in layers(self.model).items():
            lay = head_layout(m)
            group_max = self.S[name].double().view(lay.kv_heads, lay.group).amax(1)
            over = (group_max > self.tau).nonzero().flatten().tolist() if applied else []
            if over:
                self.clipped[step][name] = over
            for g in over:
                f = (self.tau / group_max[g].item()) ** 0.5
                self._scale(expected, lay.key, g, lay.head_dim, f)
                for h in range(g * lay.group, (g + 1) * lay.group):
                    self._scale(expected, lay.query, h, lay.head_dim, f)
        for n, p in now.items():
            assert p.dtype == expected[n].dtype and torch.isfinite(p).all(), n
            assert torch.equal(p, expected[n]), (step, n, (p - expected[n]).abs().max())
        self.checked.append(step)

    def _scale(self, expected: dict, block, head: int, head_dim: int, f: float) -> None:
        for param, dim in ((block.weight, block.dim), (block.bias, 0)):
            if param is None:
                continue
            n = self.names[id(param)]
            t = expected[n] = expected[n].clone()
            rows = t.narrow(dim, block.offset + head * head_dim, head_dim)
            rows.copy_((rows.float() * f).to(rows.dtype))


def read_alerts(log_dir) -> list[dict]:
    """The alert lines our callbacks wrote under ``log_dir`` (none: an empty list)."""
    path = os.path.join(log_dir, names.ALERTS_FILE)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]
