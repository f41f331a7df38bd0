"""The probe on tiny random models (fp32 parameters computing in bf16): capture, replay, JSON."""

import json
import math

import pytest
import torch

import stable_attn.integrations.transformers as integration
from stable_attn.numerics import probe as probe_mod
from stable_attn.numerics.probe import probe, tiny_model


def finite_stats(d):
    assert set(d) >= {"n", "mean", "t", "rms", "max_abs", "biased"}
    for key in ("mean", "t", "rms", "max_abs"):
        assert math.isfinite(d[key]), (key, d)
    assert d["n"] > 0


def test_probe_gpt2_json(tmp_path):
    model = tiny_model("gpt2-tiny", seed=1)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    report = probe(model, ids)
    path = tmp_path / "probe.json"
    report.write_json(str(path))
    data = json.loads(path.read_text())
    assert data["model"] == "GPT2LMHeadModel" and data["dtype"] == "bf16" and data["tokens"] == 48
    assert math.isfinite(data["loss"]) and data["loss"] > 0
    assert [layer["name"] for layer in data["layers"]] == ["layer0", "layer1"]
    for layer in data["layers"]:
        assert layer["shape"] == [2, 4, 24, 16]
        assert 0.0 <= layer["saturation"] <= 1.0 and 0.0 < layer["sink_mass"] <= 1.0
        assert math.isfinite(layer["max_logit"])
        assert set(layer["fixes"]) == {"off", "ours", "paper"}
        for fix, r in layer["fixes"].items():
            finite_stats(r["o"])
            finite_stats(r["delta"])
            assert r["o"]["n"] == 2 * 4 * 24  # every query row sees a key (causal)
            # a faithful replay errs by about one bf16 rounding per element, not more
            assert r["o"]["rms"] < 2.0 and r["delta"]["rms"] < 2.0, (fix, r)
            assert (r["fixed_rate"] == 0) == (fix == "off") or layer["saturation"] == 0
    assert "layer1" in report.table() and "ours" in report.table()


def test_probe_llama_padding_captures_masks_and_grads():
    model = tiny_model("llama-tiny", seed=2)  # GQA (4 query heads, 2 KV heads), RoPE
    ids = torch.randint(1, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 20, dtype=torch.int64)
    mask[1, :6] = 0  # left padding
    recorder_calls = []
    original = probe_mod._replay

    def spy(call, name, dtype, fixes, backend):
        recorder_calls.append(call)
        return original(call, name, dtype, fixes, backend)

    probe_mod._replay = spy
    try:
        report = probe(model, ids, mask, fixes=("off", "ours"))
    finally:
        probe_mod._replay = original
    assert [c.layer for c in recorder_calls] == [0, 1]
    for call in recorder_calls:
        assert call.q.shape == (2, 4, 20, 16) and call.k.shape == (2, 2, 20, 16)
        assert call.q.dtype == torch.bfloat16  # autocast: the model computes in bf16
        assert call.kwargs["causal"] is True
        kpm = call.kwargs["key_padding_mask"]
        assert kpm is not None and kpm.sum().item() == 40 - 6 and not kpm[1, :6].any()
        assert call.do is not None and call.do.shape == call.q.shape
        assert call.do.abs().sum() > 0
    assert report.tokens == 34
    assert set(report.layers[0].fixes) == {"off", "ours"}
    # the model is left as it was found
    assert model.config._attn_implementation != probe_mod.PROBE_NAME
    assert all(not hasattr(m, "stable_attn_options") for _, m in integration.attention_modules(model))
    assert integration.attention_function.attention is probe_mod.attention


def test_probe_rejects_bad_arguments():
    model = tiny_model("gpt2-tiny")
    ids = torch.zeros(1, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="fixes="):
        probe(model, ids, fixes=("on",))
    with pytest.raises(ValueError, match="input_ids"):
        probe(model, ids.float())
    with pytest.raises(ValueError, match="dtype="):
        probe(model, ids, dtype=torch.float32)
    with pytest.raises(ValueError, match="config="):
        tiny_model("gpt5-huge")


def test_cli_entry_points(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 3)
    out = tmp_path / "p.json"
    assert probe_mod.main(["--config", "gpt2-tiny", "--text", str(text), "--batch", "1", "--seq-len", "16",
                           "--fixes", "off,ours", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "layer0" in printed and f"wrote {out}" in printed
    data = json.loads(out.read_text())
    assert data["tokens"] == 16 and set(data["layers"][1]["fixes"]) == {"off", "ours"}


def test_cli_writes_json_only_when_asked(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert probe_mod.main(["--config", "gpt2-tiny", "--batch", "1", "--seq-len", "16", "--fixes", "off"]) == 0
    printed = capsys.readouterr().out
    assert "layer0" in printed and "wrote" not in printed
    assert list(tmp_path.iterdir()) == []
