"""The recovery ring (``on_spike="recover"``): the last snapshots of a run, in host memory or as files, each one
verified before anything of it reaches the model.

**Files.** A ring over ``snapshot_memory_limit`` keeps each snapshot as one ``torch.save`` file,
``snapshot-step=<step>-rank=<rank>.pt`` under ``{log_dir}/recovery``, holding the snapshot and its manifest: for
every tensor its place, dtype, shape, bytes and CRC-32. It is written as ``<name>.partial`` and renamed, so a run
killed while writing leaves no half file under a ring name; when the ring starts, the files this rank's earlier
runs left (whole or ``.partial``) are deleted, never read.

**Restoring** (:meth:`SnapshotRing.choose`): the snapshot a recovery wants, and each older one, is read into a
staging copy on the host and verified: the file is there and readable, its tensors match the manifest (dtype,
shape, bytes, checksum), its fields have the right types and the optimizer state is finite, and it fits the run
(:func:`~stable_attn.monitor.actions.snapshots.snapshot_problem`: the model's entries, shapes and dtypes, finite
weights, the optimizers' groups). The newest snapshot that passed on every rank (one all-gather of each rank's
verdicts) is restored; none: the action stops the run with a checkpoint, nothing restored. Snapshots newer than the
one restored are dropped only after it was chosen.

**Write errors** (a full disk, an I/O error): training goes on and the ring degrades, said in
:attr:`SnapshotRing.failures` (the action logs and alerts it): its snapshots move to host memory when the ring
fits in half the memory the host has available (over ``snapshot_memory_limit``: the disk is gone, and a ring in
memory is better than none), else the ring is switched off (every snapshot dropped; a spike that calls for a
recovery then stops the run with a checkpoint). The half-written file is deleted.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .snapshots import (
    Snapshot,
    SnapshotProblem,
    Trainables,
    snapshot_from_state,
    snapshot_problem,
    snapshot_state,
    take_snapshot,
    tensors_in,
)

__all__ = ["RING_DIR", "RING_FORMAT", "RingChoice", "RingEntry", "RingFileError", "SnapshotRing",
           "host_memory_available", "read_snapshot", "ring_file", "ring_layout", "snapshot_bytes", "write_snapshot"]

#: The ring's folder under the run's log directory.
RING_DIR = "recovery"
#: What a ring file says it is; a file without it (or of another version) is not restored.
RING_FORMAT = "stable_attn.recovery-ring/1"
_RING_FILE = re.compile(r"snapshot-step=(\d+)-rank=(\d+)\.pt(?:\.partial)?")


def ring_file(step: int, rank: int) -> str:
    """The name of rank ``rank``'s snapshot of ``step``."""
    return f"snapshot-step={step}-rank={rank}.pt"


def ring_layout(rollback_steps: int, rollback_every: int) -> tuple[int, int]:
    """``(spacing, length)`` of the snapshot ring: a snapshot every ``spacing`` steps, ``length`` kept."""
    spacing = min(rollback_every, rollback_steps)
    return spacing, math.ceil(rollback_steps / spacing) + 1


def _to_host(value: Any) -> Any:
    """``value``'s tensors on the host; those already there are kept (take_snapshot's copies, not the run's)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_host(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_host(v) for v in value)
    return value


def snapshot_bytes(snapshot: Snapshot) -> int:
    """Bytes of the tensors a snapshot holds (weights, optimizer state, schedulers, precision plugin)."""
    total = 0
    for name in ("model", "optimizers", "schedulers", "precision"):
        for _, t in tensors_in(getattr(snapshot, name), name):
            total += t.numel() * t.element_size()
    return total


def host_memory_available() -> int | None:
    """Bytes of host memory available now (Linux's ``MemAvailable``, else the free pages); None if unknown."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def said(exc: BaseException) -> str:
    """An error in one line: ``OSError: ENOSPC (No space left on device)`` for an OSError with an errno, else its
    type and the first line of its message."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{type(exc).__name__}: {errno.errorcode.get(exc.errno, exc.errno)} ({os.strerror(exc.errno)})"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def _size(n: int) -> str:
    return f"{n} bytes" if n < 10**6 else f"{n / 1e6:.1f} MB"


class RingFileError(Exception):
    """A ring snapshot that may not be restored; :attr:`problem` says why (``"is missing"``, ...)."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


def _crc(t: torch.Tensor) -> int:
    flat = t.detach().contiguous().reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy()) if flat.numel() else 0


def _manifest(state: dict[str, Any]) -> list[list[Any]]:
    """``[place, dtype, shape, bytes, CRC-32]`` of every tensor of a snapshot's state, in a fixed order."""
    return [[where, str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size(), _crc(t)]
            for name, value in state.items() for where, t in tensors_in(value, name)]


def write_snapshot(snapshot: Snapshot, path: str) -> None:
    """``snapshot`` and its manifest to ``path``, through ``path + ".partial"`` (deleted if the write fails)."""
    state = snapshot_state(snapshot)
    payload = {"format": RING_FORMAT, "manifest": _manifest(state), "snapshot": state}
    partial = path + ".partial"
    try:
        torch.save(payload, partial)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise


_CHECKED = ((1, "dtype"), (2, "shape"), (3, "bytes"), (4, "CRC-32"))


def read_snapshot(path: str, step: int) -> Snapshot:
    """The snapshot of ``step`` in ``path``, read into host memory and checked against its manifest and for its
    fields' types; :class:`RingFileError` says what is wrong (missing, unreadable, damaged)."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise RingFileError("is missing") from None
    except Exception as exc:  # a truncated or overwritten file: torch's zip reader, the unpickler
        raise RingFileError(f"cannot be read ({said(exc)})") from None
    if not (isinstance(payload, dict) and payload.get("format") == RING_FORMAT
            and isinstance(payload.get("manifest"), list) and isinstance(payload.get("snapshot"), dict)):
        raise RingFileError(f"is not a ring snapshot ({RING_FORMAT}: a manifest and a snapshot)")
    state, written = payload["snapshot"], payload["manifest"]
    read = _manifest(state)
    if len(written) != len(read):
        raise RingFileError(f"holds {len(read)} tensors, its manifest lists {len(written)}")
    for w, r in zip(written, read, strict=True):
        if not isinstance(w, list) or len(w) != len(r) or w[0] != r[0]:
            raise RingFileError(f"holds {r[0]} where its manifest lists {w!r:.80}")
        for i, what in _CHECKED:
            if w[i] != r[i]:
                raise RingFileError(f"{r[0]} has {what} {r[i]}, its manifest says {w[i]}")
    try:
        snapshot = snapshot_from_state(state)
    except SnapshotProblem as exc:
        raise RingFileError(exc.problem) from None
    if snapshot.step != step:
        raise RingFileError(f"holds the state of step {snapshot.step}, not {step}")
    return snapshot


@dataclass
class RingEntry:
    """One snapshot of the ring, with the loss and gradient-norm detectors as they were then: in host memory
    (``snapshot``) or in a file (``path``, the snapshot dropped from memory)."""

    step: int
    snapshot: Snapshot | None
    detectors: dict[str, list[dict[str, Any]]] | None
    path: str | None = None

    def load(self, state: Trainables | None = None) -> Snapshot:
        """The snapshot, read from its file if it is on disk (a staging copy: nothing of the run is touched) and,
        with ``state``, checked to fit it; :class:`RingFileError` says why it may not be restored."""
        if self.snapshot is not None:
            snapshot = self.snapshot
        else:
            assert self.path is not None
            snapshot = read_snapshot(self.path, self.step)
        problem = snapshot_problem(snapshot, state) if state is not None else None
        if problem is not None:
            raise RingFileError(problem)
        return snapshot

    @property
    def where(self) -> str:
        """The entry, as an alert names it: ``recovery/snapshot-step=8-rank=0.pt`` or ``the in-memory ...``."""
        if self.path is None:
            return f"the in-memory snapshot of step {self.step}"
        return f"{RING_DIR}/{os.path.basename(self.path)}"

    def drop(self) -> None:
        """Delete the entry's file (an entry in memory: nothing to do)."""
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)


@dataclass
class RingChoice:
    """What :meth:`SnapshotRing.choose` found: the entry to restore and its verified staging copy (None: no
    snapshot passed on every rank), and the snapshots passed over on the way."""

    entry: RingEntry | None
    snapshot: Snapshot | None
    #: This rank's snapshots that failed their check: (entry, problem), newest first.
    failed: list[tuple[RingEntry, str]] = field(default_factory=list)
    #: Every rank's snapshots newer than the chosen one that failed (or, with no snapshot at all, step None):
    #: (rank, step), the same list on every rank.
    passed_over: list[tuple[int, int | None]] = field(default_factory=list)


class SnapshotRing:
    """The last ``length`` snapshots, one every ``spacing`` optimizer steps, in host memory, or on disk when
    they would take more than ``memory_limit`` bytes of it (see the module for files, checks and write errors).

    The choice is made at the first snapshot: ``length x`` its bytes against ``memory_limit`` (None: never on
    disk; 0: always). Files are deleted when the ring moves past them, when a restore abandons them and by
    :meth:`clear`."""

    def __init__(self, spacing: int, length: int, memory_limit: int | None = None, directory: str | None = None,
                 rank: int = 0) -> None:
        self.spacing, self.length = spacing, length
        self.memory_limit, self.directory, self.rank = memory_limit, directory, rank
        self.entries: deque[RingEntry] = deque()
        #: Decided at the first snapshot (None before): whether the snapshots are files.
        self.on_disk: bool | None = None
        #: One snapshot's bytes, measured at the first snapshot.
        self.snapshot_bytes: int | None = None
        #: A snapshot could not be written and the ring did not fit in memory: it holds and takes no snapshot.
        self.off = False
        #: What went wrong writing snapshots, ``(path, what happened)``, until the action reads them (it logs and
        #: alerts).
        self.failures: list[tuple[str, str]] = []

    def start(self, directory: str | None, rank: int) -> None:
        """A run starts: every snapshot dropped, the decisions of an earlier run forgotten, and the files of this
        rank that an earlier run left in ``directory`` deleted."""
        self.clear()
        self.directory, self.rank = directory, rank
        self.on_disk, self.snapshot_bytes, self.off, self.failures = None, None, False, []
        if directory is not None and os.path.isdir(directory):
            self._remove_stale()

    def _remove_stale(self) -> None:
        assert self.directory is not None
        for name in os.listdir(self.directory):  # an earlier run's files of this rank: never read again
            match = _RING_FILE.fullmatch(name)
            if match is not None and int(match.group(2)) == self.rank:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.directory, name))

    def due(self, step: int) -> bool:
        return not self.off and step % self.spacing == 0 and not (self.entries and self.entries[-1].step == step)

    def _decide(self, snapshot: Snapshot) -> None:
        self.snapshot_bytes = snapshot_bytes(snapshot)
        self.on_disk = self.memory_limit is not None and self.length * self.snapshot_bytes > self.memory_limit
        if self.on_disk:
            if self.directory is None:
                raise ValueError(f"the recovery ring needs {self.length} x {self.snapshot_bytes} bytes, over "
                                 f"snapshot_memory_limit={self.memory_limit}, and has no directory for its files; "
                                 "start the engine with a log_dir")
            os.makedirs(self.directory, exist_ok=True)
            self._remove_stale()

    def take(self, state: Trainables, detectors: dict[str, list[dict[str, Any]]] | None = None) -> None:
        if self.off:
            return
        snapshot = take_snapshot(state)
        # Host copies: the ring holds several states and must not take the accelerator's memory.
        for name in ("model", "optimizers", "schedulers", "precision"):
            setattr(snapshot, name, _to_host(getattr(snapshot, name)))
        if self.on_disk is None:
            self._decide(snapshot)
        entry = RingEntry(snapshot.step, snapshot, detectors)
        if self.on_disk:
            assert self.directory is not None
            path = os.path.join(self.directory, ring_file(snapshot.step, self.rank))
            try:
                write_snapshot(snapshot, path)
            except Exception as exc:  # ENOSPC, EIO, torch's zip writer: training goes on, the ring degrades
                self._degrade(path, exc)
                if self.off:
                    return
            else:
                entry.path, entry.snapshot = path, None
        self.entries.append(entry)
        while len(self.entries) > self.length:
            self.entries.popleft().drop()

    def _degrade(self, path: str, exc: BaseException) -> None:
        need = self.length * (self.snapshot_bytes or 0)
        available = host_memory_available()
        if available is not None and need <= available // 2:
            self.on_disk = False  # the snapshots already written stay files; the next ones are kept in memory
            then = (f"the ring keeps its snapshots in host memory from now on ({_size(need)}, {_size(available)} "
                    "available)")
        else:
            self.off = True
            self.clear()
            shown = _size(available) if available is not None else "an unknown amount"
            then = (f"recovery is off for the rest of the run: the ring's {_size(need)} do not fit in half "
                    f"the host memory available ({shown}), so a spike that calls for a recovery stops the run "
                    "with a checkpoint")
        self.failures.append((path, f"could not be written ({said(exc)}); {then}"))

    def candidates(self, step: int, back: int) -> list[RingEntry]:
        """The snapshot a recovery at ``step`` wants (the newest taken at least ``back`` steps before it, else the
        oldest), then every older one, newest first; none is dropped."""
        entries = list(self.entries)
        if not entries:
            return []
        wanted = next((i for i in reversed(range(len(entries))) if entries[i].step <= step - back), 0)
        return entries[wanted::-1]

    def choose(self, step: int, back: int, state: Trainables,
               all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> RingChoice:
        """The snapshot to restore for a recovery at ``step``: every candidate (:meth:`candidates`) is read and
        verified against ``state``; with ``all_gather`` (several ranks: called once, on every rank) each rank's
        verdicts are shared and the newest snapshot that passed on every rank is chosen. Nothing is dropped and
        nothing of the run is touched (:meth:`keep_through` drops the newer ones once it is restored)."""
        candidates = self.candidates(step, back)
        failed: list[tuple[RingEntry, str]] = []
        good: list[int] = []
        staged: tuple[RingEntry, Snapshot] | None = None
        for entry in candidates:
            try:
                snapshot = entry.load(state)
            except RingFileError as exc:
                failed.append((entry, exc.problem))
                continue
            good.append(entry.step)
            if staged is None:  # the newest good one stays staged; older ones are read again if chosen
                staged = (entry, snapshot)
            del snapshot
        mine = torch.full((2, self.length), -1, dtype=torch.float64)
        for i, entry in enumerate(candidates):
            mine[0, i] = entry.step
            mine[1, i] = 1.0 if entry.step in good else 0.0
        table = all_gather(mine).reshape(-1, 2, self.length).cpu() if all_gather is not None else mine[None]
        verdicts = [{int(s): bool(ok) for s, ok in zip(row[0].tolist(), row[1].tolist(), strict=True) if s >= 0}
                    for row in table]
        common = set.intersection(*({s for s, ok in v.items() if ok} for v in verdicts))
        chosen = max(common) if common else None
        passed_over = []
        for rank, v in enumerate(verdicts):
            if not v:
                passed_over.append((rank, None))
            passed_over += [(rank, s) for s, ok in sorted(v.items(), reverse=True)
                            if not ok and (chosen is None or s > chosen)]
        failed = [(e, p) for e, p in failed if chosen is None or e.step > chosen]
        if chosen is None:
            return RingChoice(None, None, failed, passed_over)
        entry = next(e for e in candidates if e.step == chosen)
        if staged is not None and staged[0] is entry:
            return RingChoice(entry, staged[1], failed, passed_over)
        staged = None
        try:  # another rank's newest good snapshot is older than this rank's: read it again
            snapshot = entry.load(state)
        except RingFileError as exc:
            raise RuntimeError(f"the recovery snapshot {entry.where} passed its check a moment ago and now "
                               f"{exc.problem}; the other ranks have restored it, so this rank cannot go on") from None
        return RingChoice(entry, snapshot, failed, passed_over)

    def keep_through(self, entry: RingEntry) -> None:
        """Drop every snapshot newer than ``entry`` (the trajectory a restore of ``entry`` abandons)."""
        while self.entries and self.entries[-1] is not entry:
            self.entries.pop().drop()

    def clear(self) -> None:
        """Drop every snapshot (and its file)."""
        while self.entries:
            self.entries.pop().drop()

    @property
    def steps(self) -> list[int]:
        return [e.step for e in self.entries]
