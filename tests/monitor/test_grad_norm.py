"""The monitor's gradient norm: replicated (plain, DDP) and sharded (FSDP2 DTensor) gradients."""

from __future__ import annotations

import os

import pytest
import torch
from distributed_helpers import run_ranks

from stable_attn.monitor.grad_norm import nonfinite_grads, total_grad_norm

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_plain_gradients_match_clip_grad_norm():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model(torch.randn(5, 8)).pow(2).sum().backward()
    model[0].bias.grad = None  # parameters without gradients are left out, as in clip_grad_norm_
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert float(total_grad_norm(model.parameters())) == pytest.approx(float(expected), rel=1e-6)
    assert total_grad_norm(torch.nn.Linear(2, 2).parameters()) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_grads_sees_one_bad_element(bad, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)).to(dtype)
    model(torch.randn(5, 8, dtype=dtype)).sum().backward()
    empty = torch.nn.Parameter(torch.zeros(0, dtype=dtype))
    empty.grad = torch.zeros(0, dtype=dtype)  # an empty gradient is fine (max-abs has no identity)
    params = [*model.parameters(), empty]
    assert nonfinite_grads(params).item() == 0.0
    model[1].weight.grad[2, 7] = bad
    flag = nonfinite_grads(params)
    assert flag.shape == () and flag.dtype == torch.float32 and flag.item() == 1.0
    huge = torch.nn.Linear(2, 2)
    huge.weight.grad = torch.full((2, 2), 3e38)  # finite, though its squared norm would overflow
    assert nonfinite_grads(huge.parameters()).item() == 0.0
    assert nonfinite_grads(torch.nn.Linear(2, 2).parameters()) is None


def test_fsdp2_sharded_gradients_two_processes(tmp_path):
    for res in run_ranks(os.path.join(HERE, "fsdp_grad_norm_run.py"), [str(tmp_path)], tmp_path, 180):
        assert res["dtensor"] and res["local_elems"] < res["full_elems"]  # really sharded
        assert res["norm"] == pytest.approx(res["expected"], rel=1e-5)
        assert res["shard_only"] < 0.9 * res["expected"]  # the local shards alone would be wrong
