"""The transformers.Trainer callback tests run on one torch thread (``one_thread`` and ``pretrained``, the
tiny GPT-2 weights shared with the Lightning callback tests: tests/conftest.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so the tests and the DDP script share trainer_lm


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread."""
