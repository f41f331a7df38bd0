"""StableAttentionCallback with a real Lightning Trainer on the CPU, a tiny GPT-2 and real text.

Every run fine-tunes the same pre-trained weights on shuffled chunks of Python's documentation; a
"corrupted" batch is the same text garbled as if decoded with the wrong codec (callback_lm.py). With
the detectors' warm-up shortened to 20 steps (the defaults suit runs of thousands of steps), they are
calibrated by about step 30; the corrupted batch comes at step 50 of 60.
"""

from __future__ import annotations

import copy
import glob
import http.server
import json
import logging
import os
import re
import socket
import threading

import lightning as L
import pandas as pd
import pytest
import torch
from callback_lm import ByteLM, batches_loader, trainer
from lightning.pytorch import Callback

from stable_attn import AttentionStats
from stable_attn.callbacks import StableAttentionCallback
from stable_attn.monitor import Alert, SpikeDetector
from stable_attn.monitor.alerts.schema import REMOTE_CAPS, validate_alert

STEPS = 60
BAD = 50
ALERT_KEYS = {"step", "kind", "metric", "value", "baseline", "threshold", "score", "lr", "layers", "action",
              "message", "checkpoint", "time", "version", "data_position", "lrs", "world_size", "ranks", "loss_window",
              "attention", "grad_norms", "outcome", "diagnosis"}


def make_callback(**kwargs) -> StableAttentionCallback:
    kwargs.setdefault("loss_detector", SpikeDetector.loss(warmup=20))
    kwargs.setdefault("grad_norm_detector", SpikeDetector.grad_norm(warmup=20))
    return StableAttentionCallback(**kwargs)


def fit(tmp_path, pretrained, callbacks, batch_ids=range(STEPS), corrupt=(BAD,), max_steps=None, dropout=0.0,
        ckpt_path=None, **trainer_kwargs):
    L.seed_everything(0, verbose=False)
    module = ByteLM(weights=pretrained, dropout=dropout)
    batch_ids = list(batch_ids)
    t = trainer(tmp_path, callbacks, max_steps or len(batch_ids), **trainer_kwargs)
    t.fit(module, batches_loader(batch_ids, corrupt_batches=corrupt), ckpt_path=ckpt_path)
    return t, module


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def optimizer_state(trainer) -> dict:
    return copy.deepcopy(trainer.optimizers[0].state_dict()["state"])


def params(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_states_equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


class Spy(Callback):
    """Records model and optimizer state around one step, and whether layer stats were filled."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.stats_calls: dict[int, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.before = (params(pl_module), optimizer_state(trainer))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        calls = sum(int(m.stable_attn_stats.calls) for m in pl_module.modules() if hasattr(m, "stable_attn_stats"))
        self.stats_calls[trainer.global_step] = calls

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step + 1:
            self.after = (params(pl_module), optimizer_state(trainer))
        if trainer.global_step == self.step + 2:
            self.next = params(pl_module)


class WebhookServer:
    """An HTTP server on 127.0.0.1 (ephemeral port) that stores the JSON bodies POSTed to it."""

    def __init__(self) -> None:
        received = self.received = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def dead_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (a port just released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/alerts"


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"on_spike='explode'.*'warn', 'skip', 'rollback', 'stop'"):
        StableAttentionCallback(on_spike="explode")
    with pytest.raises(ValueError, match=r"rollback_every=0"):
        StableAttentionCallback(rollback_every=0)
    with pytest.raises(ValueError, match=r"log_every_n_steps=-1.*int >= 1 or None"):
        StableAttentionCallback(log_every_n_steps=-1)
    with pytest.raises(ValueError, match=r"url must be an http"):
        StableAttentionCallback(webhook_url="ftp://example.org")
    with pytest.raises(TypeError, match=r"on_alert holds 3"):
        StableAttentionCallback(on_alert=[print, 3])
    with pytest.raises(TypeError, match=r"loss_detector="):
        StableAttentionCallback(loss_detector=lambda step, value: None)
    with pytest.raises(ValueError, match=r"alerts_file='logs/a.jsonl'"):
        StableAttentionCallback(alerts_file="logs/a.jsonl")
    with pytest.raises(ValueError, match=r"early_warning_warmup=-1.*int >= 0 or None"):
        StableAttentionCallback(early_warning_warmup=-1)


def test_monitor_metrics_alert_jsonl_and_webhook(tmp_path, pretrained, caplog):
    received: list[Alert] = []
    spy = Spy(BAD)
    with WebhookServer() as hook, caplog.at_level(logging.INFO, logger="stable_attn"):
        cb = make_callback(log_every_n_steps=5, on_alert=received.append, webhook_url=hook.url)
        t, module = fit(tmp_path, pretrained, [cb, spy], enable_progress_bar=True)
        assert cb.dispatcher is None  # closed at teardown, which waits for the webhook queue
        webhook = list(hook.received)

    # swap: the model runs on stable_attn and its two attention layers carry stats
    assert module.model.config._attn_implementation == "stable_attn"
    assert sorted(cb.layers.stats) == ["layer0", "layer1"]
    assert any("switched 1 transformers model(s) [GPT2LMHeadModel] to 'stable_attn': 2 attention layer(s)"
               in r.message
               for r in caplog.records)

    # stats are collected on monitored steps only ((step + 1) % 5 == 0), and then by every forward
    for step, calls in spy.stats_calls.items():
        assert (calls > 0) == ((step + 1) % 5 == 0), (step, calls)

    # metrics in the CSVLogger output, per layer, at the monitored steps
    (csv,) = glob.glob(str(tmp_path / "run" / "*" / "metrics.csv"))
    df = pd.read_csv(csv)
    layer_cols = [f"stable_attn/{s}/layer{i}" for s in ("saturation", "fixed_rate", "max_logit", "sink_mass")
                  for i in (0, 1)]
    for col in ["train/loss", "train/grad_norm", "train/lr", "stable_attn/alerts", *layer_cols]:
        assert col in df.columns, col
    rows = df.dropna(subset=["stable_attn/max_logit/layer0"])
    assert sorted(rows["step"]) == [s for s in range(STEPS) if (s + 1) % 5 == 0]
    assert ((rows["stable_attn/saturation/layer0"] >= 0) & (rows["stable_attn/saturation/layer0"] <= 1)).all()
    assert ((rows["stable_attn/sink_mass/layer1"] > 0) & (rows["stable_attn/sink_mass/layer1"] < 1)).all()
    # the callback's loss is the loss the module logs itself (Lightning's own "loss" column)
    own = df.dropna(subset=["loss"]).set_index("step")["loss"]
    ours = rows.set_index("step")["train/loss"]
    assert torch.allclose(torch.tensor(ours.values), torch.tensor(own.loc[ours.index].values), rtol=1e-6)

    # alerts: the corrupted batch, on both watched metrics, and nothing else
    assert [(a.step, a.metric, a.kind) for a in received] == [
        (BAD, "train/loss", "spike"), (BAD, "train/grad_norm", "spike")]
    loss_alert = received[0]
    assert loss_alert.value > 2 * loss_alert.baseline and loss_alert.value > loss_alert.threshold
    assert loss_alert.lr == pytest.approx(3e-3) and loss_alert.action == "warn"
    assert {name.split("/")[1] for name, _ in loss_alert.layers} <= {"saturation", "max_logit"}
    assert cb.alert_count == 2 and t.progress_bar_metrics["stable_attn/alerts"] == 2.0
    assert df["stable_attn/alerts"].max() == 2.0

    lines = read_jsonl(os.path.join(t.log_dir, "stable_attn_alerts.jsonl"))
    assert [(d["step"], d["metric"]) for d in lines] == [(BAD, "train/loss"), (BAD, "train/grad_norm")]
    assert all(set(d) == ALERT_KEYS for d in lines)
    assert [(d["step"], d["metric"]) for d in webhook] == [(BAD, "train/loss"), (BAD, "train/grad_norm")]
    # the evidence (docs/ALERTS.md), in the file and in the webhook bodies alike: the schema, the step, the
    # loss window, the learning rate, the layers of the latest monitored step, what the action did
    assert all(validate_alert(d) == 2 for d in lines + webhook)
    for d in (lines[0], webhook[0]):
        assert [s for s, _ in d["loss_window"]] == list(range(BAD - 31, BAD + 1))
        assert d["loss_window"][-1][1] == pytest.approx(d["value"])
        assert d["lrs"] == [pytest.approx(3e-3)] and d["world_size"] == 1
        assert d["attention"]["step"] == BAD - 1 and [s["layer"] for s in d["attention"]["layers"]] == [
            "layer0", "layer1"]
        assert all(s["max_logit"] > 0 and 0 <= s["saturation"] <= 1 for s in d["attention"]["layers"])
        assert d["attention"]["moved"]["layer"] in ("layer0", "layer1")
        assert d["outcome"] == {"taken": "warn", "update_applied": True, "rolled_back_to": None,
                                "skipping_batches": None, "stopped": False, "checkpoint": None}
        assert all(name.startswith("model.") for name, _ in d["grad_norms"]["top"])
    assert len(webhook[0]["ranks"]) <= REMOTE_CAPS["ranks"] and str(tmp_path) not in json.dumps(webhook)
    assert any(r.levelno == logging.WARNING and "spike at step 50: train/loss" in r.message for r in caplog.records)
    # what the user sees: WARNING lines for the swap, for detection becoming active, and a summary at the end
    shown = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert any("switched 1 transformers model(s)" in m for m in shown)
    gross = {}
    for m in shown:
        found = re.match(r"StableAttentionCallback: spike detection active from step (\d+) on ([^:]+): a value", m)
        if found:
            gross.update(dict.fromkeys(found.group(2).split(", "), int(found.group(1))))
    assert gross.keys() == {"train/loss", "train/grad_norm"} and max(gross.values()) < 10, gross
    calibrated = {}
    for m in shown:
        found = re.match(r"StableAttentionCallback: calibrated spike detection active from step (\d+) on (.+)$", m)
        if found:
            calibrated.update(dict.fromkeys(found.group(2).split(", "), int(found.group(1))))
    assert calibrated.keys() == {"train/loss", "train/grad_norm"} and max(calibrated.values()) < BAD
    assert shown[-1].startswith("StableAttentionCallback: 2 alert(s) (spike 2, nonfinite 0, early_warning 0")


def test_skip_leaves_weights_and_optimizer_state_unchanged(tmp_path, pretrained, caplog):
    spy = Spy(BAD)
    cb = make_callback(on_spike="skip", webhook_url=dead_url(), webhook_timeout=0.5)
    with caplog.at_level(logging.WARNING, logger="stable_attn"):
        t, _ = fit(tmp_path, pretrained, [cb, spy])
    assert t.global_step == STEPS  # an unreachable webhook does not disturb training
    assert any("webhook" in r.message and "failed" in r.message for r in caplog.records)
    assert cb.skipped_steps == [BAD]
    before_params, before_opt = spy.before
    after_params, after_opt = spy.after
    assert_states_equal(before_params, after_params)
    assert_states_equal(before_opt, after_opt)  # AdamW moments and per-parameter step counts
    assert not all(torch.equal(after_params[k], spy.next[k]) for k in after_params)  # the next step trains
    lines = read_jsonl(os.path.join(t.log_dir, "stable_attn_alerts.jsonl"))
    assert {(d["step"], d["action"]) for d in lines} == {(BAD, "skip")}


def test_rollback_matches_a_run_that_never_saw_the_dropped_batches(tmp_path, pretrained):
    # Snapshots after every 4th step: the spike at step 50 restores the state after 48 steps, so the
    # batches of steps 48, 49 and 50 are dropped. Dropout is on, to check that the random number
    # generators are rolled back too.
    cb = make_callback(on_spike="rollback", spike_confirm_steps=1, rollback_every=4)
    t, rolled = fit(tmp_path / "a", pretrained, [cb], dropout=0.1)
    assert cb.rollbacks == [(BAD, 48)]
    kept = [b for b in range(STEPS) if b not in (48, 49, 50)]
    ref_cb = make_callback()
    t_ref, ref = fit(tmp_path / "b", pretrained, [ref_cb], batch_ids=kept, corrupt=(), dropout=0.1)
    assert ref_cb.alert_count == 0
    assert t_ref.global_step == len(kept) == STEPS - 3
    assert_states_equal(params(rolled), params(ref))
    assert_states_equal(optimizer_state(t), optimizer_state(t_ref))
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == t_ref.lr_scheduler_configs[0].scheduler.last_epoch


def test_stop_saves_a_checkpoint_and_stops(tmp_path, pretrained):
    spy = Spy(BAD)
    # loss and grad norm alone still act (on the spike's first step: spike_confirm_steps=1)
    cb = make_callback(on_spike="stop", spike_confirm_steps=1, attention_stats=False)
    t, module = fit(tmp_path, pretrained, [cb, spy])
    assert len(cb.layers) == 0 and not cb.surge_detectors
    assert not any(hasattr(m, "stable_attn_stats") for m in module.modules())
    assert t.global_step == BAD + 1 and t.should_stop
    path = os.path.join(t.log_dir, f"stable_attn-stop-step={BAD}.ckpt")
    assert cb.stop_checkpoint == path and os.path.isfile(path)
    ckpt = torch.load(path, weights_only=False)
    # the checkpoint holds the weights from before the spiking batch: its update was dropped
    assert_states_equal(spy.before[0], ckpt["state_dict"])
    assert ckpt["callbacks"]  # the detector state travels with it


def test_resume_keeps_detector_and_alert_state(tmp_path, pretrained):
    cb = make_callback()
    t, _ = fit(tmp_path / "a", pretrained, [cb], batch_ids=range(40), corrupt=(35,))
    assert cb.alert_count == 2 and cb.loss_detector.ready
    ckpt = str(tmp_path / "a.ckpt")
    t.save_checkpoint(ckpt)
    saved = cb.state_dict()

    class AtStart(Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = copy.deepcopy(resumed.state_dict())

    resumed, probe = make_callback(), AtStart()
    assert not resumed.loss_detector.ready
    t2, _ = fit(tmp_path / "b", pretrained, [resumed, probe], batch_ids=range(45), corrupt=(), ckpt_path=ckpt)
    assert t2.global_step == 45
    assert probe.state == saved  # detectors (loss, grad norm, every layer's surge detectors), alert count
    assert resumed.loss_detector.ready and resumed.alert_count == 2


def test_layer_stats_are_reduced_over_heads_and_calls():
    # A direct check of what the callback logs, against AttentionStats filled by the real op.
    from stable_attn.monitor.layer_stats import LayerStats

    torch.manual_seed(0)
    import stable_attn

    s0, s1 = AttentionStats(), AttentionStats()
    layers = LayerStats({"layer0": s0, "layer1": s1})
    assert not s0.enabled  # collection is off until a monitored step switches it on
    layers.enable(True)
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    for _ in range(2):
        stable_attn.attention(q, k, v, causal=True, stats=s0)
    stable_attn.attention(q * 4, k, v, stats=s1)
    expect0 = s0.summary()
    expect1 = s1.summary()
    out = layers.collect(step=0, all_gather=None, device=torch.device("cpu"))
    for name, expect in (("layer0", expect0), ("layer1", expect1)):
        for stat in ("saturation", "fixed_rate", "max_logit", "sink_mass"):
            assert out[name][stat] == pytest.approx(expect[stat], rel=1e-6), (name, stat)
    assert s0.empty and s1.empty  # reset after collection
    assert out["layer1"]["max_logit"] > out["layer0"]["max_logit"]


class SdpaLM(L.LightningModule):
    """A nanoGPT-style module that calls F.scaled_dot_product_attention itself (no transformers model)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 32)
        self.qkv = torch.nn.Linear(32, 96)
        self.head = torch.nn.Linear(32, 256)

    def training_step(self, batch, batch_idx):
        x = self.emb(batch)
        q, k, v = (t.view(*batch.shape, 2, 16).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = self.head(y.transpose(1, 2).reshape(*batch.shape, 32))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), batch[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_patch_sdpa_routes_plain_modules_for_the_run_only(tmp_path, caplog):
    original = torch.nn.functional.scaled_dot_product_attention
    seen = []

    class Probe(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            fn, patch = torch.nn.functional.scaled_dot_product_attention, cb.engine.sdpa_patch
            seen.append(fn is not original and fn is patch.wrapper and patch.active)

    cb = StableAttentionCallback(patch_sdpa=True)
    L.seed_everything(0, verbose=False)
    with caplog.at_level(logging.INFO, logger="stable_attn"):
        t = trainer(tmp_path, [cb, Probe()], 3)
        t.fit(SdpaLM(), batches_loader(range(3), corrupt_batches=()))
    assert seen == [True, True, True]
    assert torch.nn.functional.scaled_dot_product_attention is original  # restored at teardown
    assert any("scaled_dot_product_attention now runs stable_attn" in r.message for r in caplog.records)
    assert not any("no transformers PreTrainedModel" in r.message for r in caplog.records)
    (csv,) = glob.glob(str(tmp_path / "run" / "*" / "metrics.csv"))
    assert "train/loss" in pd.read_csv(csv).columns


def test_gradient_accumulation_one_record_per_optimizer_step(tmp_path, pretrained):
    micro: list[float] = []

    class Losses(Callback):
        """Each micro-batch's loss as the model computed it (a forward hook: no Lightning involved)."""

        def on_train_start(self, trainer, pl_module):
            pl_module.model.register_forward_hook(lambda mod, args, out: micro.append(out.loss.item()))

    cb = make_callback()
    spy = Spy(step=-1)
    t, _ = fit(tmp_path, pretrained, [cb, spy, Losses()], batch_ids=range(12), corrupt=(), max_steps=6,
               accumulate_grad_batches=2)
    assert t.global_step == 6 and len(micro) == 12
    (csv,) = glob.glob(str(tmp_path / "run" / "*" / "metrics.csv"))
    rows = pd.read_csv(csv).dropna(subset=["train/loss"]).set_index("step")
    assert sorted(rows.index) == list(range(6))
    for step in range(6):
        expected = (micro[2 * step] + micro[2 * step + 1]) / 2  # the mean over the step's micro-batches
        assert rows.loc[step, "train/loss"] == pytest.approx(expected, rel=1e-5)
    # layer statistics span both micro-batches of a step: 2 forwards x 2 layers
    assert set(spy.stats_calls.values()) == {4}


def test_given_to_transformers_trainer_it_names_the_trainer_callback():
    cb = StableAttentionCallback()
    for hook in (cb.on_init_end, cb.on_train_begin):  # the Trainer's first hooks; Lightning calls neither
        with pytest.raises(TypeError, match=r"Lightning callback.*callbacks.StableAttentionTrainerCallback"):
            hook(None, None, None)
