"""benchmarks/generate_speed.py on two new tokens: both implementations decode the same tokens, side by side."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
_spec = importlib.util.spec_from_file_location("generate_speed", os.path.join(ROOT, "benchmarks", "generate_speed.py"))
gs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gs)


def test_a_tiny_run_prints_both_implementations_side_by_side(capsys):
    threads = torch.get_num_threads()
    try:
        assert gs.main(["--new-tokens", "2", "--repeats", "1", "--models", "llama"]) == 0
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("machine: ") and "2 new tokens" in lines[1]
    assert lines[2].split()[:3] == ["model", "sdpa", "wall"]
    row = lines[3].split()
    assert row[0] == "llama" and len(row) == 7 and row[5].endswith("x") and float(row[5][:-1]) > 0


def test_the_two_implementations_must_agree(monkeypatch):
    real = gs.generate
    calls = []

    def diverging(model, prompt, new_tokens):
        out = real(model, prompt, new_tokens)
        calls.append(model.config._attn_implementation)
        return out + 1 if model.config._attn_implementation == "stable_attn" else out

    monkeypatch.setattr(gs, "generate", diverging)
    with pytest.raises(AssertionError, match="llama: stable_attn and sdpa generated different tokens"):
        gs.measure("llama", 2, 1)
    assert calls == ["sdpa", "stable_attn"]
    with pytest.raises(ValueError, match="--models: 'gpt5'"):
        gs.tiny_model("gpt5")
