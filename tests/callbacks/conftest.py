"""The Lightning callback tests run on one torch thread (``one_thread`` and ``pretrained``: tests/conftest.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so the tests and the DDP script share callback_lm


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread."""
