"""What an alert's evidence costs on the step that alerts (docs/lab/callback-overhead.md, "Alert evidence").

The evidence (stable_attn/monitor/alerts/evidence.py) is gathered only when an alert is delivered, except the loss
window and the learning rates, kept every step (a deque append and a list of floats), and the per-head
statistics, one more host copy on monitored steps (both inside benchmarks/callback_overhead.py's hook time).
This times the rest, on one alert step: :meth:`Evidence.fill` for a loss-spike alert, which is dominated by
the per-parameter gradient norms (one ``torch._foreach_norm`` over every gradient, one host copy), on GPT-2
models of two sizes after one real forward and backward: the median of ``--repeats`` fills (each measuring the
gradient norms again), a second alert of the same step (which reuses them), the step's own first forward and
backward, for scale, and what :meth:`Evidence.record` costs every step (the mean of 1000 calls).
``--alert-lines`` also prints each size's filled alert as its JSONL line (the evidence's content, to diff).

    python benchmarks/alert_evidence.py [--repeats 5] [--threads 1] [--sizes tiny,124m] [--alert-lines]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from stable_attn.monitor import Alert, names
from stable_attn.monitor.alerts.evidence import StepFacts
from stable_attn.monitor.engine import MonitorEngine, Trainables, World

SIZES = {  # name: (layers, width, heads, vocab, seq, batch)
    "tiny": (4, 128, 4, 256, 128, 8),  # benchmarks/callback_overhead.py's model
    "124m": (12, 768, 12, 50257, 128, 2),  # GPT-2 small's parameter count (124M)
}


def measure(size: str, repeats: int) -> dict[str, float]:
    layers, width, heads, vocab, seq, batch = SIZES[size]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=heads,
                                       attn_implementation="sdpa"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = MonitorEngine(on_spike="skip", alerts_file=None)
    engine.setup(model, World())
    with tempfile.TemporaryDirectory() as log_dir:
        engine.start(log_dir, 1)
        engine.train_start(Trainables(step=0, model=model, optimizers=[opt], schedulers=[]))
        engine.begin_step(0)
        data = torch.randint(0, vocab, (batch, seq))
        engine.add_batch({"input_ids": data}, epoch=0, batch_index=0)  # the alert's data position
        start = time.perf_counter()
        loss = model(input_ids=data, labels=data).loss
        loss.backward()
        step_s = time.perf_counter() - start
        engine.add_loss(loss)
        # the engine's step, as an adapter calls it (the verdict, the evidence's record), without dropping the update
        engine.before_optimizer_step(opt, model.parameters())
        alert = Alert(step=0, kind="spike", metric=names.LOSS, value=loss.item(), action="skip")
        evidence = engine.desk.evidence
        facts = StepFacts(data_position=engine.data_position, world_size=1, layers=engine.layers)
        fills = []
        for _ in range(repeats):
            evidence._grad_norms = None  # a new alert step: the gradient norms are measured again
            start = time.perf_counter()
            filled = evidence.fill(alert, facts)
            fills.append(time.perf_counter() - start)
        start = time.perf_counter()
        evidence.fill(alert, facts)  # a second alert of the same step
        again_s = time.perf_counter() - start
        # what every step pays: the record of the step (loss window, the groups' learning rates, references)
        step, rows, judged, params = evidence._step, evidence._rows, evidence._judged, evidence._params
        start = time.perf_counter()
        for i in range(1000):
            evidence.record(step + i, rows, judged, opt, params)
        record_us = (time.perf_counter() - start) * 1e3
        engine.end_run("at the end of the benchmark")
    assert filled.grad_norms is not None and len(filled.grad_norms["top"]) == 5
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "tensors": filled.grad_norms["parameters"], "fill_ms": 1e3 * statistics.median(fills),
            "again_ms": 1e3 * again_s, "step_ms": 1e3 * step_s, "record_us": record_us,
            "alert_line": json.dumps(filled.to_dict(), sort_keys=True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sizes", default="tiny,124m")
    p.add_argument("--alert-lines", action="store_true", help="print each size's filled alert line after the table")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {platform.machine()}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}; "
          f"median of {args.repeats} fills")
    print("| model | parameters | tensors | evidence of one alert step, ms | another alert of the same step, ms "
          "| the first forward + backward, ms | every step's record, us |")
    print("|---|---|---|---|---|---|---|")
    lines = []
    for size in args.sizes.split(","):
        r = measure(size, args.repeats)
        print(f"| GPT-2 {size} | {r['params'] / 1e6:.1f}M | {r['tensors']} | {r['fill_ms']:.2f} | {r['again_ms']:.2f} "
              f"| {r['step_ms']:.0f} | {r['record_us']:.1f} |")
        lines.append(r["alert_line"])
    if args.alert_lines:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
