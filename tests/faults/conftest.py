"""The fault suite: tiny models on one torch thread, with the callback and Trainer test helpers importable."""

import os
import sys

import pytest

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for folder in ("callbacks", "trainer"):  # callback_lm (Lightning) and trainer_lm (transformers.Trainer)
    if os.path.join(_TESTS, folder) not in sys.path:
        sys.path.insert(0, os.path.join(_TESTS, folder))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread."""
