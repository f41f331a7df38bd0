"""stable_attn.monitor.actions.replay and pv_fp32: replay a spiking step three ways and say
whether the spike is the attention numerics or the data; the fp32-P-bar-V variant of the PyTorch path;
diagnose_spikes."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import stable_attn
from stable_attn import cli
from stable_attn.integrations.transformers.models import model_options_of
from stable_attn.kernels import naive
from stable_attn.monitor.actions import replay
from stable_attn.monitor.alerts.schema import validate_alert
from stable_attn.monitor.engine import MonitorEngine, Trainables
from tests.integrations import tiny_models

VOCAB = 24


def _model() -> torch.nn.Module:
    model = tiny_models.build("llama", "stable_attn", VOCAB)
    model.train()
    return model


def _periodic(batch: int = 4, n: int = 24, offset: int = 0) -> torch.Tensor:
    return (torch.arange(n)[None, :] + torch.arange(batch)[:, None] * 3 + offset) % 8


# ------------------------------------------------------------------ the fp32 P-bar V variant of the PyTorch path
def _tied_inputs(seed: int):
    """Rows whose max is tied at two keys (P-bar = 1.0 exactly at both) among random scores."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, 33, 16, generator=g).bfloat16()
    k = torch.randn(2, 2, 150, 16, generator=g).bfloat16()
    k[:, :, 40] = k[:, :, 7]
    k[:, :, 7] *= 3
    k[:, :, 40] = k[:, :, 7]
    v = torch.randn(2, 2, 150, 16, generator=g).bfloat16()
    return q, k, v


@pytest.mark.parametrize("seed", [0, 1])
def test_pv_fp32_is_at_least_as_close_to_the_oracle(seed):
    q, k, v = _tied_inputs(seed)
    exact = naive.attention(q.double(), k.double(), v.double())
    err = {}
    for name, kwargs in {"bf16": {}, "fp32": {"pv_fp32": True}}.items():
        out = stable_attn.attention(q, k, v, stabilize=False, backend="torch", **kwargs)
        err[name] = (out.double() - exact).abs().mean().item()
    assert err["fp32"] <= err["bf16"], err
    # the two really differ (P-bar V in fp32 is not the bf16 product under another name)
    a = stable_attn.attention(q, k, v, stabilize=False, backend="torch")
    b = stable_attn.attention(q, k, v, stabilize=False, backend="torch", pv_fp32=True)
    assert not torch.equal(a, b)


def test_pv_fp32_arguments():
    q, k, v = _tied_inputs(0)
    with pytest.raises(TypeError, match=r"pv_fp32=1 must be True"):
        stable_attn.attention(q, k, v, pv_fp32=1)
    with pytest.raises(ValueError, match=r"pv_fp32=True with backend='triton' is not supported"):
        stable_attn.attention(q, k, v, pv_fp32=True, backend="triton")


# ------------------------------------------------------------------ replay_step leaves the model as it was
def test_replay_restores_grads_rng_mode_options_and_statistics():
    model = _model()
    stats = stable_attn.integrations.transformers.attach_stats(model)
    ids = _periodic()
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = [int(s.calls) for s in stats.values()]  # the training forward above counted once per layer
    assert calls and all(c > 0 for c in calls)
    rng = torch.random.get_rng_state()
    result = replay.replay_step(model, [ids, ids])
    assert set(result.results) == {"off", "ours", "fp32_pv"}
    for r in result.results.values():
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert model.training
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]) and torch.equal(p.detach(), weights[n])
    modules = [m for _, m in stable_attn.integrations.transformers.attention_modules(model)]
    assert all("stable_attn_options" not in m.__dict__ for m in modules)
    assert all(s.enabled for s in stats.values())
    assert [int(s.calls) for s in stats.values()] == calls  # replay's forwards do not count


def test_replay_restores_the_model_when_the_loss_raises():
    model = _model()
    ids = _periodic()

    def broken(m, batch):
        if model_options_of(next(iter(stable_attn.integrations.transformers.attention_modules(m)))[1])["pv_fp32"]:
            raise RuntimeError("boom")
        return replay.default_loss(m, batch)

    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="boom"):
        replay.replay_step(model, [ids], loss_fn=broken)
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())
    modules = [m for _, m in stable_attn.integrations.transformers.attention_modules(model)]
    assert all("stable_attn_options" not in m.__dict__ for m in modules)


def test_replay_refuses_what_it_cannot_replay():
    model = tiny_models.build("llama", "eager", VOCAB)
    with pytest.raises(ValueError, match=r"attn_implementation='eager'"):
        replay.replay_step(model, [_periodic()])
    with pytest.raises(ValueError, match=r"batches=\[\]"):
        replay.replay_step(_model(), [])
    with pytest.raises(ValueError, match=r"use names from"):
        replay.replay_step(_model(), [_periodic()], variants=("fast",))
    with pytest.raises(ValueError, match=r"metric='lr'"):
        replay.verdict(replay.Replay(), "lr", 1.0)


# ------------------------------------------------------------------ the verdicts
def _trained_model(steps: int = 40) -> torch.nn.Module:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        ids = _periodic(offset=step)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return model


def test_a_corrupted_batch_is_data():
    model = _trained_model()
    clean = replay.replay_step(model, [_periodic(offset=3)])
    threshold = 2.0 * clean.results["ours"]["loss"] + 0.1  # the detector's level: well above the clean loss
    assert replay.verdict(clean, "loss", threshold) == "unclear"  # a clean batch does not spike again
    corrupted = torch.randint(8, VOCAB, (4, 24), generator=torch.Generator().manual_seed(1))  # unseen tokens
    result = replay.replay_step(model, [corrupted])
    assert all(r["loss"] > threshold for r in result.results.values()), (result.results, threshold)
    assert replay.verdict(result, "loss", threshold) == "data"


def _normalisation_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """A unit-level construction where the fix-off arithmetic alone makes the loss spike.

    Every row has two keys tied at the max score 0 (P-bar = 1.0 at both) and 126 keys whose P-bar,
    exp(-0.68935) = 0.501910, lies just below the bf16 midpoint 0.501953 and rounds down to 0.5: a relative
    error of -0.38% on 97% of the row's mass, all in one direction. V is all ones, so the exact output is 1. Fix
    off, FlashAttention-2 divides the bf16 weights (sum 65) by the fp32 row sum of the unrounded ones (65.24):
    O = 0.99632, which rounds to the bf16 0.99609. Our rule's row sum is the sum of the rounded weights and
    fp32 P-bar V does not round them: both give exactly 1. The loss measures the output's distance from 1 in
    bf16 ulps squared; it reaches the model's parameters through a zero-weighted term so that the backward
    runs as in a step. The attention options are the model's own (what replay switches).
    """
    opts = model_options_of(next(iter(stable_attn.integrations.transformers.attention_modules(model)))[1])
    out = stable_attn.attention(batch["q"], batch["k"], batch["v"], scale=batch["scale"], backend="torch",
                                stabilize=opts["stabilize"], pv_fp32=opts["pv_fp32"])
    zero = sum(p.sum() for p in model.parameters()) * 0.0
    return ((out.float() - 1.0) / 2.0**-8).pow(2).mean() + zero


def _tie_batch() -> dict:
    D, n = 16, 128
    q = torch.zeros(1, 1, 4, D, dtype=torch.bfloat16)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, n, D, dtype=torch.bfloat16)
    k[:, :, 2:, 0] = -0.6875  # bf16-exact; the score scale makes the score -0.68935
    v = torch.ones(1, 1, n, D, dtype=torch.bfloat16)
    return {"q": q, "k": k, "v": v, "scale": 0.68935 / 0.6875}


def test_a_spike_the_fix_off_arithmetic_makes_is_numerical():
    model = _model()
    result = replay.replay_step(model, [_tie_batch()], loss_fn=_normalisation_loss, run_variant="off")
    losses = {name: r["loss"] for name, r in result.results.items()}
    assert losses["off"] == 1.0, losses  # every output is 1 - 2^-8: one bf16 ulp below 1, squared
    assert losses["ours"] == 0.0 and losses["fp32_pv"] == 0.0, losses
    assert replay.verdict(result, "loss", threshold=0.5) == "numerical"
    # the same step trained with our rule does not spike: nothing to explain
    ours = replay.replay_step(model, [_tie_batch()], loss_fn=_normalisation_loss, run_variant="ours")
    assert replay.verdict(ours, "loss", threshold=0.5) == "unclear"


# ------------------------------------------------------------------ bundles and the CLI
def test_bundle_and_cli(tmp_path, capsys):
    model = _trained_model(10)
    ids = _periodic()
    path = replay.write_replay_bundle(str(tmp_path / "b"), model, [ids], step=7, metric="loss", threshold=0.01)
    assert sorted(os.listdir(path)) == sorted([replay.BUNDLE_MODEL, replay.BUNDLE_BATCHES, replay.BUNDLE_META])
    assert cli.main(["replay", path]) == 0
    out = capsys.readouterr().out
    assert "replay of step 7" in out and "verdict: data" in out  # every variant's loss is above 0.01
    for name in ("off", "ours", "fp32_pv"):
        assert f"\n{name} " in out
    assert cli.main(["replay", path, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "data" and set(data["variants"]) == {"off", "ours", "fp32_pv"}
    direct = replay.replay_step(model, [ids])
    assert data["variants"]["ours"]["loss"] == pytest.approx(direct.results["ours"]["loss"], rel=1e-5)
    assert cli.main(["replay", str(tmp_path)]) == 1
    assert "is no replay bundle" in capsys.readouterr().err


# ------------------------------------------------------------------ diagnose_spikes in the engine
class _World:
    def __init__(self):
        self.size, self.rank, self.device, self.is_zero, self.grad_norm = 1, 0, torch.device("cpu"), True, None


def test_diagnose_spikes_puts_the_verdict_in_the_alert(tmp_path):
    model = _trained_model(10)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: every step sees the same model
    engine = MonitorEngine(diagnose_spikes=True, attention_stats=False, early_warnings=False)
    from stable_attn.monitor.engine import World

    engine.setup(model, World())
    engine.start(str(tmp_path), 1)
    engine.train_start(Trainables(0, model, [opt]))
    corrupted = torch.randint(8, VOCAB, (4, 24), generator=torch.Generator().manual_seed(1))
    for step in range(40):
        engine.begin_step(step)
        ids = corrupted if step == 35 else _periodic(offset=step)
        engine.step_batches.append(ids)  # what MonitorEngine.add_batch records for the adapters
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        engine.add_loss(loss)
        engine.before_optimizer_step(opt, model.parameters())
        opt.step()
        opt.zero_grad()
        engine.end_step(Trainables(step + 1, model, [opt]))
    engine.end_run("at the end")
    lines = [json.loads(line) for line in open(tmp_path / "stable_attn_alerts.jsonl")]
    spikes = [a for a in lines if a["kind"] == "spike" and a["step"] == 35]
    assert spikes, lines
    diagnosis = spikes[0]["diagnosis"]
    assert diagnosis["verdict"] == "data", diagnosis
    assert set(diagnosis["variants"]) == {"off", "ours", "fp32_pv"} and diagnosis["run_variant"] == "ours"
    assert diagnosis["bundle"] == "step-35"
    assert os.path.isfile(tmp_path / replay.BUNDLES_DIR / "step-35" / replay.BUNDLE_META)
    for a in lines:
        validate_alert(a)
