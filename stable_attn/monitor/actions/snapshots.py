"""In-memory snapshots of a run's training state, for rolling back over a spike.

A snapshot holds everything one optimizer step changes: model parameters and buffers, optimizer
state (AdamW moments and step counters, param-group learning rates), learning-rate schedulers, the
precision plugin (the AMP grad scaler), and the torch random number generators. Restoring all of it
makes the run continue exactly as a run that never saw the batches consumed since the snapshot:
same weights, same optimizer moments, same schedule position, and the same random draws (dropout)
for the batches that follow.

Snapshots live in memory on the parameters' own device (a copy is fast, and a spike must be undone
within one step); they cost one extra copy of the model and optimizer state. :func:`snapshot_state`
and :func:`snapshot_from_state` turn one into plain tensors and dicts for a checkpoint and back (the
engine saves the last one with its state, so a resumed run rolls back to the same state as a run
that was never interrupted). A training-loop adapter says what to snapshot with :class:`Trainables`.
"""

from __future__ import annotations

import contextlib
import copy
import signal
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

__all__ = ["Snapshot", "SnapshotProblem", "Trainables", "check_snapshot", "restore_snapshot", "sigint_held",
           "snapshot_from_state", "snapshot_problem", "snapshot_state", "take_snapshot"]


@dataclass
class Trainables:
    """What one optimizer step changes, as a training loop holds it.

    Attributes:
        step: optimizer steps done so far (the snapshot is "the state at ``step``").
        model: the module whose ``state_dict`` holds every trained parameter and buffer.
        optimizers: their state (moments, step counts, param-group learning rates).
        schedulers: learning-rate schedulers, or anything else with ``state_dict``/``load_state_dict``.
        precision: one more such object, or None: Lightning's precision plugin, or an AMP ``GradScaler``.
    """

    step: int
    model: torch.nn.Module
    optimizers: Sequence[Any]
    schedulers: Sequence[Any] = ()
    precision: Any | None = None


@dataclass
class Snapshot:
    """Training state after ``step`` optimizer steps."""

    step: int
    model: dict[str, torch.Tensor]
    optimizers: list[dict[str, Any]]
    schedulers: list[dict[str, Any]]
    precision: dict[str, Any]
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None


def _clone_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()}


def take_snapshot(state: Trainables) -> Snapshot:
    """Copy the training state (every rank keeps its own)."""
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return Snapshot(
        step=int(state.step),
        model=_clone_tensors(state.model.state_dict()),
        # deepcopy clones the tensors: optimizer state is updated in place by the next step.
        optimizers=[copy.deepcopy(opt.state_dict()) for opt in state.optimizers],
        schedulers=[copy.deepcopy(s.state_dict()) for s in state.schedulers],
        precision=copy.deepcopy(state.precision.state_dict()) if state.precision is not None else {},
        cpu_rng=torch.get_rng_state(),
        cuda_rng=cuda_rng,
    )


def restore_snapshot(state: Trainables, snapshot: Snapshot) -> None:
    """Put the state saved in ``snapshot`` back, in place (the optimizer keeps its parameter objects).

    The snapshot stays intact, so it can be restored again: ``Optimizer.load_state_dict`` adopts the
    tensors it is given when device and dtype already match, and the next step would update them in
    place, so it gets copies.
    """
    # Copies first (an interrupt here changes nothing), then every load with Ctrl-C held back: a
    # KeyboardInterrupt between the model and the optimizer would leave the weights of one step with the
    # optimizer state of another, and an exit checkpoint would keep that mix.
    optimizers = [copy.deepcopy(saved) for saved in snapshot.optimizers]
    schedulers = [copy.deepcopy(saved) for saved in snapshot.schedulers]
    precision = copy.deepcopy(snapshot.precision) if snapshot.precision and state.precision is not None else None
    if len(optimizers) != len(state.optimizers) or len(schedulers) != len(state.schedulers):
        raise ValueError(f"the rollback snapshot holds {len(optimizers)} optimizers and {len(schedulers)} schedulers, "
                         f"the run {len(state.optimizers)} and {len(state.schedulers)}; nothing was restored")
    with sigint_held():
        with torch.no_grad():
            state.model.load_state_dict(snapshot.model, strict=True)
        for opt, saved in zip(state.optimizers, optimizers, strict=True):
            opt.load_state_dict(saved)
        for scheduler, saved in zip(state.schedulers, schedulers, strict=True):
            scheduler.load_state_dict(saved)
        if precision is not None:
            state.precision.load_state_dict(precision)
        torch.set_rng_state(snapshot.cpu_rng)
        if snapshot.cuda_rng is not None:
            torch.cuda.set_rng_state_all(snapshot.cuda_rng)


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """Hold back SIGINT (Ctrl-C) for the block: one that arrives meanwhile is delivered to the handler that
    was installed (Python's raises KeyboardInterrupt) when the block ends, so the block runs whole. The
    handler is put back whatever happens. Off the main thread (no signal arrives there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:  # installed outside Python: cannot be put back
        yield
        return
    caught: list[Any] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(signal.SIGINT, caught[0])
            elif previous == signal.SIG_DFL:
                raise KeyboardInterrupt


def snapshot_state(snapshot: Snapshot) -> dict[str, Any]:
    """The snapshot as a dict of tensors, lists and numbers (what ``torch.load(weights_only=True)`` reads);
    it shares the snapshot's tensors (a checkpoint writes them, nothing changes them)."""
    return {f.name: getattr(snapshot, f.name) for f in fields(Snapshot)}


_DAMAGED = "the checkpoint's rollback snapshot is damaged"
_FIX = "resume from a checkpoint this run wrote, or delete its rollback snapshot to start the history afresh"


class SnapshotProblem(ValueError):
    """A damaged snapshot: :attr:`problem` names the entry and what is wrong with it (the message adds where the
    snapshot came from, a checkpoint, and what to do); the recovery ring reports ``problem`` with its file."""

    def __init__(self, problem: str) -> None:
        super().__init__(f"{_DAMAGED}: {problem}; {_FIX}")
        self.problem = problem


def _described(value: Any) -> str:
    return f"a {type(value).__name__}" if isinstance(value, (dict, list, tuple, torch.Tensor)) else repr(value)


def _refuse(field: str, value: Any, accepted: str, described: str | None = None) -> SnapshotProblem:
    shown = described or _described(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return SnapshotProblem(f"{field} is {shown}, expected {accepted}")


def tensors_in(value: Any, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a nest of dicts, lists and tuples, with its place (``optimizers[0]['state'][3]['exp_avg']``)."""
    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from tensors_in(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from tensors_in(v, f"{where}[{i}]")


def _check_types(state: dict[str, Any]) -> None:
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise _refuse("step", step, "an int >= 0")
    model = state["model"]
    if not isinstance(model, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in model.items()):
        raise _refuse("model", model, "a dict of parameter and buffer names to tensors")
    for name in ("optimizers", "schedulers"):
        value = state[name]
        if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
            raise _refuse(name, value, "a list of state_dict() dicts")
    for i, opt in enumerate(state["optimizers"]):
        if not isinstance(opt.get("state"), dict) or not isinstance(opt.get("param_groups"), list):
            raise _refuse(f"optimizers[{i}]", opt, "an optimizer's state_dict() (with 'state' and 'param_groups')")
    if not isinstance(state["precision"], dict):
        raise _refuse("precision", state["precision"], "a state_dict() dict")
    rng = state["cpu_rng"]
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8 or rng.dim() != 1:
        raise _refuse("cpu_rng", rng, "a 1-d uint8 tensor (torch.get_rng_state())")
    cuda = state["cuda_rng"]
    if cuda is not None and not (isinstance(cuda, list) and all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda)):
        raise _refuse("cuda_rng", cuda, "None or a list of uint8 tensors (torch.cuda.get_rng_state_all())")
    for where, t in tensors_in(state["optimizers"], "optimizers"):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise _refuse(where, t, "finite values (no non-finite update is ever applied)", "a tensor with NaN or inf")


def snapshot_from_state(state: dict[str, Any]) -> Snapshot:
    """The inverse of :func:`snapshot_state`; ValueError naming the field of a damaged state (missing, of the
    wrong type, or optimizer state with NaN or inf: a run never snapshots a state a non-finite update made).
    What only the model can tell (shapes, NaN weights) is :func:`check_snapshot`'s."""
    if not isinstance(state, dict):
        raise _refuse("the snapshot", state, "a dict written by snapshot_state")
    missing = [f.name for f in fields(Snapshot) if f.name not in state]
    if missing:
        raise SnapshotProblem(f"it lacks {missing} (it was not written by snapshot_state)")
    _check_types(state)
    return Snapshot(**{f.name: state[f.name] for f in fields(Snapshot)})


def check_snapshot(snapshot: Snapshot, state: Trainables) -> None:
    """Raise ValueError (:class:`SnapshotProblem`), naming the entry, unless ``snapshot`` (loaded from a checkpoint)
    fits ``state`` (:func:`snapshot_problem`). Called at resume, so that a damaged snapshot fails there and not at
    the first rollback, half-restored."""
    problem = snapshot_problem(snapshot, state)
    if problem is not None:
        raise SnapshotProblem(problem)


def snapshot_problem(snapshot: Snapshot, state: Trainables) -> str | None:
    """What keeps ``snapshot`` from being restored into ``state`` (None: nothing): the same model entries with the
    same shapes and dtypes, weights finite wherever the model's are, as many optimizers (with the same parameter
    groups and sizes, their state shaped like its parameters) and schedulers. Every load a restore does is then
    sure to succeed, so a restore is never partial."""
    own = state.model.state_dict()
    missing, extra = sorted(set(own) - set(snapshot.model)), sorted(set(snapshot.model) - set(own))
    if missing or extra:
        return f"its model entries differ from the model's (missing {missing[:5]}, unexpected {extra[:5]})"
    for name, t in snapshot.model.items():
        mine = own[name]
        if t.shape != mine.shape or t.dtype != mine.dtype:
            return f"model[{name!r}] is {t.dtype} {tuple(t.shape)}, the model's is {mine.dtype} {tuple(mine.shape)}"
        if t.is_floating_point() and not bool(torch.isfinite(t).all()) and bool(torch.isfinite(mine).all()):
            return _refuse(f"model[{name!r}]", t, "finite values like the model's", "a tensor with NaN or inf").problem
    for what, saved, live in (("optimizers", snapshot.optimizers, state.optimizers),
                              ("schedulers", snapshot.schedulers, state.schedulers)):
        if len(saved) != len(live):
            return f"it holds {len(saved)} {what}, the run has {len(live)}"
    for i, (saved, opt) in enumerate(zip(snapshot.optimizers, state.optimizers, strict=True)):
        groups = opt.param_groups
        sizes = [len(g["params"]) for g in groups]
        saved_sizes = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in saved["param_groups"]]
        if saved_sizes != sizes:
            return f"optimizers[{i}] has parameter groups of sizes {saved_sizes}, the run's optimizer {sizes}"
        params = [p for g in groups for p in g["params"]]
        ids = [pid for g in saved["param_groups"] for pid in g["params"]]
        index = dict(zip(ids, params, strict=True))
        for pid, entry in saved["state"].items():
            param = index.get(pid)
            if param is None or not isinstance(entry, dict):
                return _refuse(f"optimizers[{i}]['state'][{pid!r}]", entry,
                               "the state of one of its parameters").problem
            for key, t in entry.items():
                if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape != param.shape:
                    return (f"optimizers[{i}]['state'][{pid!r}][{key!r}] is {tuple(t.shape)}, its parameter is "
                            f"{tuple(param.shape)}")
    return None
