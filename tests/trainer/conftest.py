"""Fixtures for the transformers.Trainer callback tests: one torch thread, pre-trained tiny GPT-2 weights."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # so the tests and the DDP script share trainer_lm

from trainer_lm import pretrain  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model runs far slower with 2 intra-op threads on a loaded 2-core box than with one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory) -> str:
    """Tiny GPT-2 weights trained past the steep first descent (callback_lm.pretrain): the detectors see a
    loss near its plateau, as in a fine-tuning run."""
    path = tmp_path_factory.mktemp("trainer_weights") / "tiny_gpt2.pt"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pretrain(path)
    finally:
        torch.set_num_threads(threads)
    return str(path)
