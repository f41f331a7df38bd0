"""GPU check of StableAttentionCallback under Lightning's FSDP strategy, bf16-mixed, Triton backend.

Not a pytest test (CI has no GPU): run on a CUDA machine as ``python tests/callbacks/gpu_check.py OUT_DIR``.
It fine-tunes the tiny byte-level GPT-2 of the CPU tests with ``strategy=FSDPStrategy()`` on one GPU,
feeds a garbled batch at step 90, and checks, with the callback's default detectors, that: the model
runs on stable_attn with the CUDA (Triton) backend, per-layer statistics reach the CSV, the gradient
norm goes through FSDP's own reduction and equals the norm of the unsharded gradients, the spike is
alerted at step 90 and nowhere else, and ``on_spike="skip"`` leaves the weights unchanged on that
step; then the same without FSDP and with ``on_spike="warn"``, where step 90 trains and a NaN put
into one gradient at step 95 is still skipped (no NaN update, whatever ``on_spike`` says). Prints one
line per check and exits non-zero if any failed.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from callback_lm import ByteLM, batches_loader, pretrain  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy  # noqa: E402

from stable_attn.callbacks import StableAttentionCallback  # noqa: E402

STEPS, BAD, NAN_STEP = 100, 90, 95


class NanGradLM(ByteLM):
    """ByteLM with one NaN in one gradient at ``nan_step`` (user code or faulty hardware)."""

    def __init__(self, weights: str, nan_step: int | None) -> None:
        super().__init__(weights=weights)
        self.nan_step = nan_step

    def on_after_backward(self):
        if self.trainer.global_step == self.nan_step:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.view(-1)[0] = float("nan")
                    break


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


class Probe(Callback):
    def __init__(self, cb: StableAttentionCallback) -> None:
        self.cb = cb
        self.norm_pairs: list[tuple[float, float]] = []
        self.ready: list[tuple[int, bool, bool]] = []
        self.series: list[tuple[int, float, float]] = []
        self.at: dict[int, str] = {}  # digest of the weights at the start of a step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in (BAD, BAD + 1, NAN_STEP, NAN_STEP + 1):
            self.at[trainer.global_step] = digest(pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # runs after the callback: compare its norm with the unsharded gradients (one device: all local)
        self.ready.append((trainer.global_step, self.cb.loss_detector.ready, self.cb.grad_norm_detector.ready))
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        last = self.cb.engine.last
        self.series.append((trainer.global_step, round(last["train/loss"], 3), round(last["train/grad_norm"], 3)))
        if grads:
            local = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))
            self.norm_pairs.append((self.cb.engine.last["train/grad_norm"], float(local)))



FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def fit(out: str, weights: str, on_spike: str, fsdp: bool):
    L.seed_everything(0, verbose=False)
    alerts = []
    cb = StableAttentionCallback(
        on_spike=on_spike, log_every_n_steps=5, on_alert=alerts.append,
    )
    probe = Probe(cb)
    # STABLE_ATTN_GPU_CHECK_ON_CPU=1 runs the same script on the CPU without FSDP, to check the script itself
    dry = os.environ.get("STABLE_ATTN_GPU_CHECK_ON_CPU") == "1"
    if dry:
        torch.set_num_threads(1)
    setup = dict(accelerator="cpu", strategy="auto", precision="32-true") if dry else \
        dict(accelerator="cuda", strategy=FSDPStrategy() if fsdp else "auto", precision="bf16-mixed")
    trainer = L.Trainer(
        devices=1, max_steps=STEPS, **setup, logger=CSVLogger(out, name=f"{on_spike}-{'fsdp' if fsdp else 'single'}"),
        callbacks=[cb, probe], log_every_n_steps=5, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = NanGradLM(weights, nan_step=None if fsdp else NAN_STEP)
    trainer.fit(module, batches_loader(range(STEPS), corrupt_batches=[BAD]))
    return cb, probe, trainer, module, alerts, dry


def main(out: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    weights = os.path.join(out, "tiny_gpt2.pt")
    pretrain(weights)

    # 1. FSDP, on_spike="skip": the decision is taken before the update, synchronously
    cb, probe, trainer, module, alerts, dry = fit(out, weights, "skip", fsdp=True)
    check("strategy", dry or type(trainer.strategy).__name__ == "FSDPStrategy", type(trainer.strategy).__name__)
    check("swap", module.model.config._attn_implementation == "stable_attn")
    check("steps", trainer.global_step == STEPS, str(trainer.global_step))
    (csv_path,) = glob.glob(os.path.join(out, "skip-fsdp", "*", "metrics.csv"))
    with open(csv_path, newline="") as f:
        table = list(csv.DictReader(f))
    cols = [c for c in table[0] if c.startswith("stable_attn/")]
    rows = [r for r in table if r.get("stable_attn/max_logit/layer0")]
    check("layer stats logged", len(rows) == STEPS // 5 and len(cols) >= 9, f"{len(rows)} rows, columns {cols}")
    shown = ["step", "train/loss", "train/grad_norm", "stable_attn/saturation/layer0", "stable_attn/saturation/layer1",
             "stable_attn/fixed_rate/layer1", "stable_attn/max_logit/layer1", "stable_attn/sink_mass/layer0"]
    print(" | ".join(shown))
    for r in rows:
        print(" | ".join(f"{float(r[c]):.4g}" for c in shown))
    armed = [next((st for st, *r in probe.ready if r[i]), None) for i in (0, 1)]
    print(f"detectors ready from step: loss {armed[0]}, grad norm {armed[1]}")
    print("(step, loss, grad norm):", probe.series)
    diffs = [abs(a - b) / max(b, 1e-12) for a, b in probe.norm_pairs]
    # skipped steps have no gradients left when the probe runs
    check("grad norm through FSDP", len(diffs) == STEPS - len(cb.skipped_steps) and max(diffs) < 1e-4,
          f"{len(diffs)} steps with gradients, max rel diff {max(diffs):.2e}")
    check("alerts at step 90 only", sorted({a.step for a in alerts}) == [BAD], str([a.format() for a in alerts]))
    unchanged = probe.at[BAD] == probe.at[BAD + 1]
    check("skip", cb.skipped_steps == [BAD] and unchanged, f"skipped {cb.skipped_steps}, weights unchanged {unchanged}")

    # 2. one GPU, on_spike="warn": the spike only alerts, the NaN gradient is skipped all the same
    cb, probe, trainer, module, alerts, dry = fit(out, weights, "warn", fsdp=False)
    check("warn: alerts at steps 90 and 95 only", sorted({a.step for a in alerts}) == [BAD, NAN_STEP],
          str([a.format() for a in alerts]))
    check("warn: step 90 trained", probe.at[BAD] != probe.at[BAD + 1])
    check("warn: NaN step skipped", cb.skipped_steps == [NAN_STEP] and probe.at[NAN_STEP] == probe.at[NAN_STEP + 1],
          f"skipped {cb.skipped_steps}")
    finite = all(bool(torch.isfinite(p).all()) for p in module.parameters())
    check("warn: weights finite", finite)
    if FAILED:
        sys.exit(f"failed: {FAILED}")


if __name__ == "__main__":
    main(sys.argv[1])
