"""What the two-process tests share (2 CPU processes, gloo), on both sides of the launch.

The test side: :func:`run_ranks` starts a script's two ranks itself (``RANK``, ``LOCAL_RANK``, ``NODE_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set, so ``init_process_group("gloo")`` and Lightning launch
nothing), :func:`run_launcher` runs a script that starts its ranks itself (Lightning's ``strategy="ddp"``,
``torchrun``, ``mp.spawn``); both are bounded in time (every process killed on timeout) and fail the test with
the output's tail; :func:`rank_results` reads each rank's ``rank{r}.json``. Then the comparisons:
:func:`assert_same_on_ranks` and :func:`assert_like_ddp` (a sharded run acted as the replicated one and ended with
its weights bit for bit).

The rank side: the fault schedule of the sharded-against-DDP runs (:data:`STEPS`, :data:`BAD`, :data:`NAN_LOSS`,
:data:`NAN_GRAD`, :data:`ACTION_OPTIONS`), the full weights of a model whose parameters may be DTensors
(:func:`full_state`, a collective under FSDP2: every rank), their :func:`digest`, :func:`write_results` and
:func:`shutdown`.

The scripts find this module through ``PYTHONPATH`` (:func:`launch_env`), which the processes they start inherit.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
RANKS = (0, 1)

# The faults only rank 1 sees, in the sharded-against-DDP runs (tests/callbacks/plain_run.py, sharded_run.py,
# tests/trainer/sharded_trainer_run.py): a corrupted batch at BAD (a loss spike), a NaN loss at NAN_LOSS, NaN
# gradients at NAN_GRAD.
STEPS = 14
BAD = 5
NAN_LOSS = 8
NAN_GRAD = 11
RANK_OFFSET = 100  # rank r reads batches 100*r .. 100*r + STEPS - 1: different data on each rank
# the monitoring options of each on_spike action in those runs (a script adds its own variants)
ACTION_OPTIONS = {
    "warn": {},
    "skip": {},
    "rollback": {"spike_confirm_steps": 1, "rollback_every": 2},
    "stop": {},
    "recover": {"spike_confirm_steps": 1, "rollback_steps": 4, "rollback_every": 2, "skip_batches": 2,
                "cooldown_steps": 2},
}


# --- the test side -----------------------------------------------------------------------------------------


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def launch_env(here: str) -> dict[str, str]:
    """The environment of a launched script: one torch thread, the project, tests/ and the script's folder
    ``here`` importable."""
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([ROOT, TESTS, here, os.environ.get("PYTHONPATH", "")]))


def rank_results(folder: str | Path) -> list[dict]:
    """Each rank's ``rank{r}.json`` in ``folder``."""
    return [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in RANKS]


def run_ranks(script: str, args: Sequence[str], cwd: str | Path, timeout: float) -> list[dict]:
    """Both ranks of ``script`` (a path), started here; each rank's results (:func:`rank_results` of ``cwd``)."""
    env = dict(launch_env(os.path.dirname(script)), MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(),
               WORLD_SIZE=str(len(RANKS)), NODE_RANK="0")
    procs = [subprocess.Popen([sys.executable, script, *args], cwd=str(cwd),
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in RANKS]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return rank_results(cwd)


def torchrun(script: str) -> list[str]:
    """The command line prefix that runs ``script`` in two processes with torchrun."""
    return ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(len(RANKS)), script]


def run_launcher(command: Sequence[str], cwd: str | Path, timeout: float, here: str) -> None:
    """``python COMMAND`` (a script that starts its two ranks itself, or :func:`torchrun`'s prefix) in a session of
    its own, so that on timeout the launcher and every rank are killed together; ``here``: the script's folder."""
    proc = subprocess.Popen([sys.executable, *command], cwd=str(cwd), env=launch_env(here), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-4000:]


def read_alerts(path: str) -> list[dict]:
    """The alerts of a JSONL file, or of ``stable_attn_alerts.jsonl`` in a folder (none where it does not exist)."""
    if os.path.isdir(path):
        path = os.path.join(path, "stable_attn_alerts.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def saved_weights(folder: str | Path, case: str) -> dict[str, torch.Tensor]:
    """The full weights rank 0 saved for ``case`` (:func:`case_file`)."""
    return torch.load(Path(folder) / case_file(case), weights_only=True)


def assert_same_on_ranks(r0: dict, r1: dict, keys: Sequence[str], where: str = "") -> None:
    for key in keys:
        assert r0[key] == r1[key], (where, key) if where else key


def assert_like_ddp(folder: str | Path, fsdp: dict, ddp: dict, fsdp_case: str, ddp_case: str,
                    keys: Sequence[str]) -> None:
    """The sharded run acted exactly as the replicated one (``keys``), ended with the same full weights bit for bit,
    and logged the unsharded model's gradient norm (within fp32 rounding), not the local shard's."""
    import pytest

    for key in keys:
        assert fsdp[key] == ddp[key], key
    got, want = saved_weights(folder, fsdp_case), saved_weights(folder, ddp_case)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    assert fsdp["grad_norm"].keys() == ddp["grad_norm"].keys()
    for step, norm in ddp["grad_norm"].items():
        assert fsdp["grad_norm"][step] == pytest.approx(norm, rel=1e-5, nan_ok=True), step


# --- the rank side -----------------------------------------------------------------------------------------


def case_file(case: str) -> str:
    """Where rank 0 saves a case's full weights (``fsdp:skip`` -> ``fsdp-skip.pt``)."""
    return case.replace(":", "-") + ".pt"


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (its shard of a DTensor, else ``t``)."""
    return t.to_local() if is_dtensor(t) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t`` (a DTensor gathered: a collective, every rank)."""
    return t.full_tensor() if is_dtensor(t) else t


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """``t`` of every rank, stacked along a new first dimension (a collective, every rank)."""
    out = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, t.contiguous())
    return torch.stack(out)


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full tensor, DDP's ``module.`` prefix removed (FSDP2's DTensors gathered:
    a collective, every rank)."""
    return {k.removeprefix("module."): full(v).detach().clone()
            for k, v in module.state_dict().items()}


def digest(module: torch.nn.Module) -> str:
    """A hash of the full weights (:func:`full_state`: every rank)."""
    h = hashlib.sha256()
    for t in full_state(module).values():
        h.update(t.cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def local_elems(module: torch.nn.Module) -> dict[str, int]:
    """Each parameter's number of elements on this rank (a shard's under FSDP2)."""
    return {n.removeprefix("module."): local(p).numel() for n, p in module.named_parameters()}


def write_results(out: str, rank: int, results: dict) -> None:
    """This rank's results so far, as ``OUT/rank{r}.json`` (written after each case: a later failure keeps them)."""
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def shutdown() -> None:
    """Leave the process group on every rank before exit: gloo's worker threads, torn down by static
    destructors instead, sometimes abort the process ("terminate called without an active exception")."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
