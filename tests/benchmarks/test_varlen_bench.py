"""benchmarks/varlen.py on a tiny problem: the document mixes, the padded layout and a whole run."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
_spec = importlib.util.spec_from_file_location("varlen_bench", os.path.join(ROOT, "benchmarks", "varlen.py"))
vb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vb)


@pytest.mark.parametrize("mix", ["equal", "uniform", "one_long"])
@pytest.mark.parametrize("tokens", [256, 1000])
def test_lengths_sum_to_the_tokens(mix, tokens):
    lens = vb.lengths(mix, tokens)
    assert sum(lens) == tokens and min(lens) >= 1 and len(lens) > 1


def test_padded_layout_holds_the_same_tokens():
    lens = [3, 1, 5]
    x = torch.randn(sum(lens), vb.H, vb.D)
    padded = vb._pad(x, lens)
    assert padded.shape == (3, vb.H, 5, vb.D)
    assert torch.equal(vb._unpad(padded, lens), x)
    assert padded[1, :, 1:].abs().sum() == 0


def test_a_run_prints_both_layouts_and_writes_json(tmp_path, capsys):
    out = tmp_path / "v.json"
    assert vb.main(["--tokens", "96", "--repeats", "1", "--mixes", "uniform", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["impl"] for r in rows] == ["varlen", "padded"]
    assert rows[1]["time_vs_padded"] == 1.0 and all(r["fwd_bwd_ms"] > 0 for r in rows)
    assert "varlen" in capsys.readouterr().out
