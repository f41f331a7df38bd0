"""benchmarks/tensor_core_training.py: the emulated arms' arithmetic and the A/B's core at tiny size."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from stable_attn import attention
from stable_attn.kernels import reference
from stable_attn.options import Options

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import tensor_core_training as tct  # noqa: E402

BF16 = torch.bfloat16


def qkv(B=2, H=2, N=40, D=16, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [(2 * torch.randn(B, H, N, D, generator=g)).to(BF16).requires_grad_(requires_grad) for _ in range(3)]


@pytest.mark.parametrize("fix", ["off", "ours"])
def test_fp32_matmul_arithmetic_is_the_ops_torch_path(fix):
    # with fp32 products the emulated forward is the PyTorch path bit for bit, O and the saved lse; so the
    # h100 arms differ from the op only in the tensor-core arithmetic of P-bar V
    q, k, v = qkv()
    out, lse2, _ = tct.emulated_forward(q, k, v, fix, model="fp32_matmul")
    opts = Options.create(head_dim=16, causal=True, stabilize=fix == "ours", backend="torch")
    ref_out, ref_lse2, _ = reference.attention_forward(q, k, v, opts=opts)
    assert torch.equal(out, ref_out) and torch.equal(lse2, ref_lse2)


@pytest.mark.parametrize("fix", ["off", "ours"])
def test_backward_is_the_ops_backward(fix):
    q, k, v = qkv(requires_grad=True)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(BF16)
    out = tct.EmulatedAttention.apply(q, k, v, fix, "fp32_matmul", [])
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = attention(q, k, v, causal=True, stabilize=fix == "ours", backend="torch")
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    assert torch.equal(out, ref)
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.equal(g, r)


def test_h100_arithmetic_differs_from_fp32_pbar_v():
    q, k, v = qkv(seed=1)
    twin = attention(q, k, v, causal=True, stabilize=False, pv_fp32=True, backend="torch")
    for fix in ("off", "ours"):
        out, _, res = tct.emulated_forward(q, k, v, fix)
        assert not torch.equal(out, twin)
        assert (out.float() - twin.float()).abs().max() < 0.1  # a few bf16 roundings, not another answer
    with pytest.raises(ValueError, match="fix='paper'"):
        tct.emulated_forward(q, k, v, "paper")


def test_drift_share():
    a = torch.zeros(6, 6)
    assert tct.drift(a, a) == (0.0, None)
    b = torch.outer(torch.arange(6.0), torch.ones(6))  # rank one: all its energy in one direction
    norm, share = tct.drift(b, a)
    assert norm == pytest.approx(float(b.norm())) and share == pytest.approx(1.0)
    assert tct.random_top_share(32, trials=4) < 0.3


TINY = ["--steps", "4", "--log-every", "2", "--width", "32", "--heads", "2", "--seq", "32", "--batch", "2"]


def test_tiny_ab_run(tmp_path):
    path = tmp_path / "ab.json"
    assert tct.main([*TINY, "--json", str(path), "--plot", str(tmp_path / "ab.png"),
                     "--table", str(tmp_path / "ab.txt"), "--save-weights", str(tmp_path / "w.pt")]) == 0
    shares = tct.agreement(tct.parse(TINY), str(tmp_path / "w.pt"))
    assert set(shares) == {"off", "ours"} and all(0 <= x <= 1 for v in shares.values() for x in v)
    data = json.loads(path.read_text())
    assert data["steps"] == [0, 2, 4]
    for name in ("off", "ours"):
        tr = data["arms"][name]
        assert tr["drift_q"][0] == [0.0, 0.0] and tr["drift_k"][0] == [0.0, 0.0]  # the same initial weights
        later = [d for row in tr["drift_q"][1:] + tr["drift_k"][1:] for d in row]
        assert all(math.isfinite(d) for d in later) and any(d > 0 for d in later)  # the arithmetic differs
        assert len(tr["o_error"][-1]) == 2 and len(tr["pbar"][-1]) == 2
    assert data["arms"]["twin"]["pbar"][-1] == []
    assert "steps per arm: 4" in (tmp_path / "ab.txt").read_text()
    assert len(data["ours_vs_off_q"]) == 3 and data["ours_vs_off_q"][0] == [0.0, 0.0]
    # the control arms on the PyTorch path, merged with the A/B: the twin is the same run bit for bit
    control = tmp_path / "control.json"
    assert tct.main([*TINY, "--arms", "off_cpu", "--json", str(control), "--plot", str(tmp_path / "c.png")]) == 0
    assert any(d > 0 for d in json.loads(control.read_text())["arms"]["off_cpu"]["drift_q"][-1])  # bf16 P-bar
    merged = tmp_path / "merged.txt"
    assert tct.main(["--from-json", str(path), str(control), "--plot", str(tmp_path / "m.png"),
                     "--table", str(merged)]) == 0
    assert "| off_cpu |" in merged.read_text() and "| ours |" in merged.read_text()
    other = tmp_path / "other.json"
    assert tct.main([*TINY, "--seed", "1", "--arms", "off_cpu", "--json", str(other), "--plot",
                     str(tmp_path / "o.png")]) == 0
    with pytest.raises(ValueError, match="seed differs"):
        tct.main(["--from-json", str(path), str(other), "--plot", str(tmp_path / "x.png")])
