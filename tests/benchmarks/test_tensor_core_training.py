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


def test_tie_block_rate_counts_pbar_ones_against_the_running_max():
    x = torch.full((1, 4, 4), -5.0)
    x[0, 1, :2] = 3.0  # row 1: keys 0 and 1 tie at its max
    x[0, 3, 0] = x[0, 3, 2] = 1.0  # row 3: a tie across the blocks of 2: block 1 sees one P-bar = 1, block 2 one
    x[0, 2, 1] = 2.0 + 2.0 ** -12  # row 2: keys 0 (-5) and 1; no tie
    # blocks of 4: one block a row, 4 rows; row 1 and row 3 hold two P-bar = 1.0
    assert tct.tie_block_rate(x, 4) == 2 / 4
    # blocks of 2: rows 0, 1 see block 1 only; rows 2, 3 see both: 6 (row, block) pairs; only row 1's block ties
    assert tct.tie_block_rate(x, 2) == 1 / 6


def test_spikes_follow_lightnings_rule():
    flat = [1.0] * 20
    assert tct.spikes(flat) == 0
    assert tct.spikes(flat[:15] + [3.5] + flat[:4]) == 1  # 3.5 - 1 > 2 * 1
    assert tct.spikes(flat[:15] + [2.9] + flat[:4]) == 0
    assert tct.spikes(flat[:5] + [math.nan]) == 1


def test_sink_data_starts_every_sequence_with_the_fixed_token():
    x, y = tct.batches(3, 4, 16, 0, "sinks")
    assert bool((x[..., 0] == tct.SINK_TOKEN).all()) and not bool((y == tct.SINK_TOKEN).any())
    x_text, y_text = tct.batches(3, 4, 16, 0, "text")
    assert torch.equal(x[..., 1:], x_text[..., 1:]) and torch.equal(y, y_text)


CONTROL = ["--control", "--steps", "6", "--log-every", "2", "--width", "16", "--heads", "2", "--seq", "16",
           "--batch", "2", "--paper-block", "8", "--warmup", "2"]


def test_control_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    ref = tct.train(tct.parse([*CONTROL, "--json", str(tmp_path / "r.json")]))
    args = tct.parse([*CONTROL, "--checkpoint", str(tmp_path / "c.pt"), "--checkpoint-every", "2"])

    class Stop(Exception):
        pass

    def stop_at_4(traces):
        if traces["steps"][-1] == 4:
            raise Stop

    with pytest.raises(Stop):  # killed after step 4's checkpoint
        tct.train(args, stop_at_4)
    resumed = tct.train(args)
    for name in ref["arms"]:
        assert resumed["arms"][name]["loss_every_step"] == ref["arms"][name]["loss_every_step"], name
        assert resumed["arms"][name]["drift_q"] == ref["arms"][name]["drift_q"], name
    assert set(ref["arms"]) == {*tct.CONTROL_ARMS, "twin"}
    b_paper = ref["arms"]["b_paper"]["ties"][-1]
    assert len(b_paper) == 2 and all(0 <= d["tie_rate"] <= 1 and 0 <= d["fired_rate"] <= 1 for d in b_paper)
    with pytest.raises(ValueError, match="another configuration"):
        tct.train(tct.parse([*CONTROL, "--seed", "3", "--checkpoint", str(tmp_path / "c.pt")]))
    # a shorter run's checkpoint continues into a longer run: the same steps as the longer run from scratch
    short = tct.parse([*CONTROL, "--steps", "4", "--checkpoint", str(tmp_path / "s.pt")])
    tct.train(short)
    longer = tct.train(tct.parse([*CONTROL, "--checkpoint", str(tmp_path / "s.pt")]))
    assert longer["arms"]["b_off"]["loss_every_step"] == ref["arms"]["b_off"]["loss_every_step"]


@pytest.mark.slow
def test_control_short_form(tmp_path):
    # the positive control's short form (minutes): two seeds, every arm, the summary table
    table = tmp_path / "control.txt"
    assert tct.main(["--control", "--steps", "60", "--log-every", "20", "--seeds", "0", "1",
                     "--json", str(tmp_path / "c.json"), "--table", str(table)]) == 0
    text = table.read_text()
    for name in (*tct.CONTROL_ARMS, "twin"):
        assert f"| {name} | 0 | 60 |" in text and f"| {name} | 1 | 60 |" in text
    data = json.loads((tmp_path / "c_seed1.json").read_text())
    assert data["args"]["data"] == "sinks" and data["steps"] == [0, 20, 40, 60]
    assert all(math.isfinite(x) for tr in data["arms"].values() for x in tr["loss_every_step"])
