"""Host time per optimizer step of the skip decided on the host (``device_skip=False``) and on the device
(``device_skip=True``), side by side, in a hand-written loop (StableAttentionGuard) on the CPU.

Both paths run the same loop, model (an MLP, AdamW) and data, interleaved (host, device, host, ...) so that
machine load hits both alike. Columns, per step (median over ``--repeats`` runs of the mean over ``--steps``
steps after ``--warmup``): the CPU time inside the guard's ``before_optimizer_step`` and ``end_step`` (the
engine's own work), the part of it the device path spends on the bounds (probing copies of the detectors), the
whole step's wall time, and the host's waits for a step's values before its update (a device-to-host read of
the step's loss and gradient norm: 1 per step on the host path, 0 on the device path, counted).

On the CPU nothing waits for a device, so a host read costs only its copy: the table shows what the device path
adds on the host (bounds, the copy of the parameters and optimizer state and the selection after the step), not
the stall it removes on a GPU (not measured yet: no GPU here).

    python benchmarks/device_skip_host.py [--steps 200] [--warmup 120] [--repeats 3] [--width 256]
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import tempfile
import time

import torch

from stable_attn.callbacks import StableAttentionGuard
from stable_attn.monitor.actions import device_skip


def run(device: bool, steps: int, warmup: int, width: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                torch.nn.GELU(), torch.nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = StableAttentionGuard(on_spike="skip", swap=False, device_skip=device, alerts_file=None)
    bounds = [0.0]
    original = device_skip.DeviceSkip.bounds

    def timed(self, *args, **kwargs):
        start = time.process_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            bounds[0] += time.process_time() - start

    device_skip.DeviceSkip.bounds = timed
    engine = wall = 0.0
    gen = torch.Generator().manual_seed(1)
    target = torch.nn.Linear(64, 1)
    try:
        with tempfile.TemporaryDirectory() as folder:
            guard.setup(model, opt, log_dir=folder, log_every_n_steps=50)
            for step in range(warmup + steps):
                if step == warmup:
                    engine = wall = bounds[0] = 0.0
                x = torch.randn(32, 64, generator=gen)
                t0 = time.perf_counter()
                guard.begin_step(step)
                loss = (model(x) - target(x).detach()).pow(2).mean()
                guard.add_loss(loss)
                loss.backward()
                c0 = time.process_time()
                decision = guard.before_optimizer_step()
                engine += time.process_time() - c0
                if decision.apply:
                    opt.step()
                opt.zero_grad()
                c0 = time.process_time()
                guard.end_step()
                engine += time.process_time() - c0
                wall += time.perf_counter() - t0
            guard.close()
    finally:
        device_skip.DeviceSkip.bounds = original
    return {"engine_ms": 1e3 * engine / steps, "bounds_ms": 1e3 * bounds[0] / steps, "step_ms": 1e3 * wall / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=120, help="untimed steps (the detectors calibrate)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    logging.getLogger("stable_attn").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.repeats):
        for device in (False, True):
            results[device].append(run(device, args.steps, args.warmup, args.width))
    params = sum(p.numel() for p in torch.nn.Sequential(torch.nn.Linear(64, args.width), torch.nn.Linear(
        args.width, args.width), torch.nn.Linear(args.width, 1)).parameters())
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread; MLP of {params} "
          f"parameters, AdamW; {args.steps} steps after {args.warmup}, median of {args.repeats} runs")
    print("| path | engine CPU ms/step | of which bounds | step wall ms | host reads of a step before its update |")
    print("|---|---|---|---|---|")
    for device, name in ((False, "host (device_skip=False)"), (True, "device (device_skip=True)")):
        med = {k: statistics.median(r[k] for r in results[device]) for k in results[device][0]}
        print(f"| {name} | {med['engine_ms']:.3f} | {med['bounds_ms']:.3f} | {med['step_ms']:.3f} | "
              f"{0 if device else 1} |")


if __name__ == "__main__":
    main()
