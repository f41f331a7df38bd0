"""What one snapshot of the ``on_spike="recover"`` ring costs, in host memory and on disk.

Run:  python benchmarks/ring_cost.py                       (50M parameters, AdamW; about 10 s)
      python benchmarks/ring_cost.py --params 200 --repeats 3

Not CI. A stack of ``Linear(2048, 2048)`` layers with ``--params`` million parameters and AdamW (after one step,
so its two moments exist) is snapshotted into a :class:`~stable_attn.monitor.actions.recovery.SnapshotRing` kept in
memory (``snapshot_memory_limit=None``) and one kept on disk (``0``), in a temporary folder; the table gives a
snapshot's bytes, the time to take it (the training thread waits for it, once every ``spacing`` steps) and to
read it back at a rollback (the best of ``--repeats``): into a staging copy, verified (the file's manifest and
CRC-32 checksums, then shapes, dtypes and finiteness against the model) as a recovery does before it restores.
On a GPU the take also copies the state to the host.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_model  # noqa: E402

from stable_attn.monitor.actions.recovery import SnapshotRing  # noqa: E402
from stable_attn.monitor.actions.snapshots import Trainables  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=50, help="millions of parameters (default 50)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    layers = max(1, round(args.params * 1e6 / (2048 * 2049)))
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    state = Trainables(step=0, model=model, optimizers=[opt])
    n = sum(p.numel() for p in model.parameters())
    print(f"# machine: {cpu_model()}, 1 torch thread; model: {layers} x Linear(2048, 2048) = {n / 1e6:.1f}M "
          f"parameters, AdamW")
    print("| ring | one snapshot | take (s) | read back (s) |")
    print("|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        for where, limit in (("host memory", None), ("disk", 0)):
            takes, loads = [], []
            for _ in range(args.repeats):
                ring = SnapshotRing(100, 2, memory_limit=limit, directory=folder)
                t = time.perf_counter()
                ring.take(state)
                takes.append(time.perf_counter() - t)
                t = time.perf_counter()
                ring.entries[0].load(state)
                loads.append(time.perf_counter() - t)
                size = ring.snapshot_bytes or 0
                ring.clear()
            print(f"| {where} | {size / 1e6:.0f} MB | {min(takes):.2f} | {min(loads):.2f} |")


if __name__ == "__main__":
    main()
