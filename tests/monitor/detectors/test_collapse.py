"""EntropyCollapseDetector: the loss-gated collapse, the ungated plunge, the state, the layer wiring."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from stable_attn import attention
from stable_attn.monitor.detectors.collapse import EntropyCollapseDetector
from stable_attn.monitor.layer_watch import LayerWatch
from stable_attn.stats import AttentionStats


def _feed(det, entropies, losses):
    return [(t, e) for t, (h, loss) in enumerate(zip(entropies, losses))
            if (e := det.update(t, h, loss=loss)) is not None]


def _sharpening(steps=120, start=3.0, end=0.03, seed=0):
    """An entropy that falls tenfold every 60 steps (to 0.38 of its value 25 steps back: well below half
    its running median, not below a tenth) with 1% noise."""
    rng = random.Random(seed)
    return [start * (end / start) ** (t / steps) * (1 + 0.01 * rng.gauss(0, 1)) for t in range(steps)]


def test_fires_on_a_collapse_while_the_loss_stalls():
    rng = random.Random(1)
    entropy = [2.0 + 0.02 * rng.gauss(0, 1) for _ in range(80)] + [0.8] * 20
    loss = [3.0 + 0.01 * rng.gauss(0, 1) for _ in range(100)]
    events = _feed(EntropyCollapseDetector("e"), entropy, loss)
    assert events and events[0][0] == 80
    first = events[0][1]
    assert (first.kind, first.rule, first.is_new) == ("early_warning", "collapse", True)
    assert first.baseline == pytest.approx(2.0, abs=0.02) and first.value < first.threshold <= 1.0
    assert all(not e.is_new for _, e in events[1:])  # one episode


def test_silent_on_a_sharpening_while_the_loss_falls_and_warns_on_the_same_sharpening_when_it_stalls():
    entropy = _sharpening()
    falling = [5.0 * (2.0 / 5.0) ** (t / 120) for t in range(120)]
    assert _feed(EntropyCollapseDetector("e"), entropy, falling) == []
    stalled = [3.0] * 120
    events = _feed(EntropyCollapseDetector("e"), entropy, stalled)
    # the same fall fires as soon as the loss gate opens (the 50th loss), so the loss is what keeps it silent
    assert events and events[0][0] == 49 and events[0][1].rule == "collapse"


def test_plunge_fires_whatever_the_loss_does():
    entropy = [3.0] * 30 + [0.2] * 5
    falling = [5.0 - 0.05 * t for t in range(35)]
    events = _feed(EntropyCollapseDetector("e"), entropy, falling)
    assert [(t, e.rule) for t, e in events if e.is_new] == [(30, "plunge")]
    # an entropy already near zero wandering by ratios is not a collapse: min_drop (nats)
    tiny = [0.01] * 60 + [0.0001] * 10
    assert _feed(EntropyCollapseDetector("e"), tiny, [3.0] * 70) == []


def test_rebaseline_accepts_a_lasting_level():
    entropy = [2.0] * 60 + [0.5] * 120
    events = _feed(EntropyCollapseDetector("e", rebaseline_after=10), entropy, [3.0] * 180)
    assert [t for t, _ in events] == list(range(60, 70))


def test_state_survives_json_and_resumes_identically():
    rng = random.Random(2)
    entropy = [2.0 + 0.05 * rng.gauss(0, 1) for _ in range(70)] + [0.7] * 30
    loss = [3.0 + 0.02 * rng.gauss(0, 1) for _ in range(100)]
    whole, first = EntropyCollapseDetector("e"), EntropyCollapseDetector("e")
    expected = _feed(whole, entropy, loss)
    for t in range(75):  # into the episode: run length and flagged values must be restored too
        first.update(t, entropy[t], loss=loss[t])
    resumed = EntropyCollapseDetector("e")
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert resumed.state_dict() == first.state_dict()
    rest = [(t, e) for t in range(75, 100) if (e := resumed.update(t, entropy[t], loss=loss[t])) is not None]
    tail = [(t, e.is_new, e.run_length) for t, e in expected if t >= 75]
    assert tail and [(t, e.is_new, e.run_length) for t, e in rest] == tail
    with pytest.raises((TypeError, ValueError)):
        resumed.load_state_dict({"version": 1, "type": "SurgeDetector"})


def test_rejects_bad_arguments_by_name():
    with pytest.raises(ValueError, match="fraction"):
        EntropyCollapseDetector("e", fraction=1.5)
    with pytest.raises(ValueError, match="alarm_fraction"):
        EntropyCollapseDetector("e", fraction=0.3, alarm_fraction=0.4)
    assert EntropyCollapseDetector("e").update(0, math.nan, loss=3.0) is None


def test_layer_watch_warns_on_a_real_entropy_collapse():
    """Real attention: the same keys, queries scaled up 40x at step 60 (one-hot rows), a flat loss."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    stats = AttentionStats()
    watch = LayerWatch(window=10, early_warnings=True, warmup=None)
    watch.add({"layer0": stats})
    assert isinstance(watch.surge_detectors["stable_attn/entropy/layer0"], EntropyCollapseDetector)
    warned, logged = [], []
    for step in range(70):
        watch.enable(True)
        attention(q * (40.0 if step >= 60 else 1.0), k, v, causal=True, stats=stats)
        watch.enable(False)
        metrics, events = watch.observe(step, None, torch.device("cpu"), loss=3.0)
        logged.append(metrics["stable_attn/entropy/layer0"])
        warned += [(step, e.metric, e.rule) for e in events]
    assert logged[59] > 1.0 and logged[60] < 0.1 * logged[59]
    assert (60, "stable_attn/entropy/layer0", "plunge") in warned
    assert all(step >= 60 for step, _, _ in warned)
    state = json.loads(json.dumps(watch.state_dict()))
    assert state["surge"]["stable_attn/entropy/layer0"]["type"] == "EntropyCollapseDetector"


def test_a_spiking_step_is_logged_but_not_judged_by_the_early_warnings():
    """A corrupted batch's attention is the batch's: its entropy collapsed at the main job's injected spike,
    which the loss already alerts. Unjudged, the step leaves the detectors as they were."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    stats = AttentionStats()
    watch = LayerWatch(window=10, early_warnings=True, warmup=None)
    watch.add({"layer0": stats})
    for step in range(61):
        watch.enable(True)
        attention(q * (40.0 if step == 60 else 1.0), k, v, causal=True, stats=stats)
        watch.enable(False)
        before = json.dumps(watch.state_dict()["surge"])
        metrics, events = watch.observe(step, None, torch.device("cpu"), loss=3.0, judge=step != 60)
    assert metrics["stable_attn/entropy/layer0"] < 0.1 and events == []
    assert json.dumps(watch.state_dict()["surge"]) == before


def test_the_engine_alerts_on_an_entropy_collapse(tmp_path):
    """The path both callbacks take: a tiny GPT-2 in MonitorEngine, monitored every step; at step 14 its
    queries are scaled 1000x (one-hot attention in the first layer): an early warning on its entropy then."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from stable_attn.monitor.engine import MonitorEngine, Trainables, World

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       attn_implementation="sdpa"))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights change only where the test scales them
    alerts = []
    engine = MonitorEngine(on_alert=[alerts.append])
    engine.setup(model, World())
    engine.start(str(tmp_path), 1)
    data = torch.Generator().manual_seed(1)
    for step in range(20):
        if step == 14:
            with torch.no_grad():
                for block in model.transformer.h:
                    block.attn.c_attn.weight[:, :32] *= 1000.0
        engine.begin_step(step)
        batch = torch.randint(0, 256, (4, 32), generator=data)
        loss = model(input_ids=batch, labels=batch).loss
        engine.add_loss(loss)
        loss.backward()
        engine.before_optimizer_step(opt, model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        engine.end_step(Trainables(step=step + 1, model=model, optimizers=[opt], schedulers=[]))
    engine.end_run("at the end of the test")
    warned = [a for a in alerts if a.kind == "early_warning" and "entropy" in a.metric]
    assert warned and (warned[0].step, warned[0].metric) == (14, "stable_attn/entropy/layer0"), alerts
    assert "entropy/layer0=0.219 < 0.2549 (baseline 2.549)" in warned[0].format()
    assert "plunge rule" in warned[0].format()
