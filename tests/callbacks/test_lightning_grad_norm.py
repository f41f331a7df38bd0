"""The Lightning adapter's gradient norm: the strategy decides (FSDP1 asks its root wrapper), else the monitor's."""

from __future__ import annotations

import pytest
import torch

from stable_attn.callbacks.lightning import strategy_grad_norm
from stable_attn.monitor.grad_norm import total_grad_norm


class FSDPStrategy:  # named as Lightning's: the adapter looks at the strategy's type name
    model = None  # no FullyShardedDataParallel root (yet): the plain norm


def test_without_an_fsdp1_root_the_norm_is_the_monitors():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model(torch.randn(5, 8)).pow(2).sum().backward()
    expected = float(total_grad_norm(model.parameters()))
    for strategy in (None, object(), FSDPStrategy()):
        assert float(strategy_grad_norm(model.parameters(), strategy=strategy)) == pytest.approx(expected, rel=0)
    assert strategy_grad_norm(torch.nn.Linear(2, 2).parameters(), strategy=FSDPStrategy()) is None
