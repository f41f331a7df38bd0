"""The fault suite: tiny models on one torch thread, with the callback and Trainer test helpers importable."""

import os
import sys

import pytest

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# callback_lm (Lightning), trainer_lm (transformers.Trainer) and this folder's ring_loop
for folder in ("callbacks", "trainer", "faults"):
    if os.path.join(_TESTS, folder) not in sys.path:
        sys.path.insert(0, os.path.join(_TESTS, folder))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread."""


@pytest.fixture
def row(record_property):
    """``row(expected, got)``: what the case expects and what it got, one line each, for the table of
    benchmarks/fault_matrix.py (recorded before the test's assertions, so a failing case shows what it got)."""

    def record(expected: str, got: str) -> None:
        record_property("expected", expected)
        record_property("got", " ".join(str(got).split())[:160])

    return record


def outcome(fn, *args, **kwargs) -> str:
    """What calling ``fn`` did, in one line: ``"accepted"`` or the exception's type and message."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"
