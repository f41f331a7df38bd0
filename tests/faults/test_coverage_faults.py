"""A requested feature that would cover no attention layer is refused at setup, naming the option and why; a
default that covers nothing is not (a plain model keeps its loss and gradient-norm monitoring)."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from callback_lm import tiny_gpt2

from stable_attn.callbacks import StableAttentionCallback
from stable_attn.integrations.sdpa import is_sdpa_patched
from stable_attn.monitor.engine import MonitorEngine, World
from tests.faults.conftest import outcome


class PlainAttention(torch.nn.Module):
    """One attention layer through F.scaled_dot_product_attention: no transformers model."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


#: (option, what the error says about it)
REQUESTED = [
    (dict(qk_clip=10.0), r"qk_clip=10\.0 would clip the query and key weights of 0 attention layers"),
    (dict(swap=True), r"swap=True would switch 0 transformers models"),
    (dict(attention_stats=True), r"attention_stats=True would collect statistics of 0 attention layers"),
    (dict(early_warnings=True), r"early_warnings=True would watch the saturation, max logit and entropy of 0"),
]


@pytest.mark.parametrize("patch_sdpa", [False, True], ids=["plain", "patch_sdpa"])
@pytest.mark.parametrize("option,says", REQUESTED, ids=[next(iter(o)) for o, _ in REQUESTED])
def test_a_requested_feature_on_no_layer_is_refused(tmp_path, option, says, patch_sdpa, row):
    engine = MonitorEngine(patch_sdpa=patch_sdpa, **option)
    engine.setup(PlainAttention(), World())
    got = outcome(engine.start, str(tmp_path), 1)
    row(f"ValueError at start naming {next(iter(option))}", got)
    assert re.match("ValueError: " + says + r".*PlainAttention holds no transformers PreTrainedModel", got), got
    assert ("patch_sdpa=True reroutes" in got) == patch_sdpa
    engine.end_run("after the refusal")
    assert not is_sdpa_patched()


def test_defaults_on_no_layer_and_requests_on_a_model_are_taken(tmp_path, row):
    got = []
    for engine, model in [(MonitorEngine(patch_sdpa=True), PlainAttention()),
                          (MonitorEngine(qk_clip=10.0, swap=True, attention_stats=True, early_warnings=True),
                           tiny_gpt2())]:
        engine.setup(model, World())
        got.append(outcome(engine.start, str(tmp_path), 1))
        engine.end_run("at the end")
    row("accepted, accepted", ", ".join(got))
    assert got == ["accepted", "accepted"]


class PlainLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.attn = PlainAttention()

    def training_step(self, batch, batch_idx):
        return self.attn(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_qk_clip_with_patch_sdpa_and_no_model_stops_fit_before_the_first_step(tmp_path, row):
    from callback_lm import trainer

    original = F.scaled_dot_product_attention
    cb = StableAttentionCallback(qk_clip=100.0, patch_sdpa=True)
    module = PlainLM()
    before = [p.detach().clone() for p in module.parameters()]
    t = trainer(tmp_path, [cb], 3)
    got = outcome(t.fit, module, torch.utils.data.DataLoader(torch.randn(6, 5, 16), batch_size=2))
    row("fit refused before step 1 (ValueError naming qk_clip), SDPA restored",
        f"{got}; step {t.global_step}; sdpa patched {is_sdpa_patched()}")
    assert got.startswith("ValueError: qk_clip=100.0 would clip the query and key weights of 0 attention layers: "
                          "PlainLM holds no")
    assert t.global_step == 0 and all(torch.equal(a, b) for a, b in zip(before, module.parameters()))
    assert F.scaled_dot_product_attention is original and not is_sdpa_patched()
