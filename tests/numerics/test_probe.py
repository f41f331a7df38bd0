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

    def spy(call, name, dtype, fixes, backend, *rest):
        recorder_calls.append(call)
        return original(call, name, dtype, fixes, backend, *rest)

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


# ---------------------------------------------------------------------------------------------------
# --arithmetic: the replay on emulated tensor cores


def test_arithmetic_flag_parses_and_bad_values_name_the_accepted_ones(capsys):
    from stable_attn.cli import build_parser

    args = build_parser().parse_args(["probe", "--arithmetic", "h100", "--rows", "64"])
    assert args.arithmetic == "h100" and args.rows == 64
    assert build_parser().parse_args(["probe"]).arithmetic is None
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["probe", "--arithmetic", "h200"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--arithmetic" in err and "'h200'" in err and all(m in err for m in ("a100", "h100", "b200", "ieee"))
    model = tiny_model("gpt2-tiny")
    ids = torch.zeros(1, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"arithmetic='v100'.*accepted values.*'a100', 'h100', 'b200', 'ieee'"):
        probe(model, ids, arithmetic="v100")
    with pytest.raises(ValueError, match=r"max_rows=0"):
        probe(model, ids, arithmetic="h100", max_rows=0)
    with pytest.raises(ValueError, match=r"--rows must be >= 1, got 0"):
        probe_mod.main(["--arithmetic", "h100", "--rows", "0"])


def test_probe_h100_reports_every_layer_from_the_labs_functions(monkeypatch):
    model = tiny_model("llama-tiny", seed=3)  # GQA and RoPE
    ids = torch.randint(1, 256, (2, 24), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 24, dtype=torch.int64)
    mask[0, :5] = 0  # left padding: a key padding mask, so every fix walks 64-key blocks
    calls = []
    real = probe_mod.lab.tensor_core_attention

    def spy(q, k, v, rows, fixes, **kw):
        res = real(q, k, v, rows, fixes, **kw)
        calls.extend((q, k, v, rows, fix, kw, res[fix].out) for fix in fixes)
        return res

    monkeypatch.setattr(probe_mod.lab, "tensor_core_attention", spy)
    report = probe(model, ids, mask, fixes=("off", "ours"), arithmetic="h100", max_rows=100)
    assert [x.name for x in report.layers] == ["layer0", "layer1"]
    assert [(c[4], c[5]["model"]) for c in calls] == [("off", "h100"), ("ours", "h100")] * 2
    seen_rows = 2 * 4 * 24 - 4 * 5  # the padded query rows of batch 0 see no key
    for layer, (q, k, v, rows, fix, kw, out) in zip([x for x in report.layers for _ in (0, 1)], calls):
        assert layer.rows == 100 and layer.rows_total == seen_rows and rows.shape == (100, 3)
        r = layer.fixes[fix]
        # the kernel's partition with the rule (the default 128 keys); off with a padding mask the 64-key tile
        assert r.key_block == (128 if fix == "ours" else 64)
        # the reported O statistics are those of the lab's output against the oracle on the same rows
        exact = probe_mod.naive.attention(q, k, v, **kw_without_model(kw))[rows[:, 0], rows[:, 1], rows[:, 2]]
        expect = probe_mod.error_stats(out, exact, probe_mod.row_unit(exact))
        assert r.o == expect
        assert r.o.rms < 2.0 and r.delta.rms < 2.0
    assert report.as_dict()["arithmetic"] == "h100" and "emulated h100" in report.verdict()
    assert "layer1 100/" in report.table() and "verdict:" in report.table()


def kw_without_model(kw):
    return {n: kw[n] for n in ("causal", "scale", "key_padding_mask", "attn_mask", "window", "softcap")}


def test_cli_arithmetic_json(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert probe_mod.main(["--config", "gpt2-tiny", "--batch", "1", "--seq-len", "20", "--fixes", "off,ours",
                           "--arithmetic", "ieee", "--rows", "30", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "emulated ieee" in printed and "layer1 30/80" in printed and "key blocks: off 128, ours 128" in printed
    data = json.loads(out.read_text())
    assert data["arithmetic"] == "ieee" and data["max_rows"] == 30 and data["verdict"].startswith("verdict:")
    assert [x["rows"] for x in data["layers"]] == [30, 30]


def _layer(name, t_off, t_on):
    def fr(t):
        st = probe_mod.ErrorStats(n=100, mean=0.01 * t, t=t, rms=0.5, max_abs=1.0)
        return probe_mod.FixResult(o=st, delta=probe_mod.ErrorStats(100, 0.0, 0.5, 0.2, 0.5), fixed_rate=0.0)
    return probe_mod.LayerReport(name, (1, 1, 8, 4), 0.0, 0.0, 0.0, {"off": fr(t_off), "ours": fr(t_on)}, rows=100)


def test_verdict_says_what_to_do():
    v = probe_mod.verdict
    assert "keep the fix on" in v([_layer("layer0", -5.0, 1.0), _layer("layer1", 1.0, 0.5)], "h100")
    assert "(layer0)" in v([_layer("layer0", -5.0, 1.0), _layer("layer1", 1.0, 0.5)], "h100")
    assert "does not remove" in v([_layer("layer0", -5.0, -4.0)], "a100")
    assert "stabilize=False" in v([_layer("layer0", 1.0, 3.5)])
    none = v([_layer("layer0", 2.9, -2.0)], "h100")
    assert "no layer's O or delta is biased" in none and "2.90" in none and "emulated h100" in none


def test_a_model_folder_without_tokenizer_files_probes_the_texts_bytes(tmp_path):
    """transformers 5 builds an empty-vocabulary tokenizer for such a folder (every text zero tokens): the probe
    reads the text's bytes as ids instead of calling the text empty."""
    tiny_model("gpt2-tiny", 0).save_pretrained(tmp_path / "model")
    model, tokenizer = probe_mod._load(str(tmp_path / "model"), 0)
    assert tokenizer is None and model.config.n_layer == tiny_model("gpt2-tiny", 0).config.n_layer
    ids = probe_mod._batch("hello, probe", tokenizer, model.config.vocab_size, 1, 8, 0)
    assert ids[0].tolist() == list(b"hello, p")
    with pytest.raises(ValueError, match="the file is empty"):
        probe_mod._batch("", None, 256, 1, 8, 0)


def test_probe_refuses_what_it_cannot_replay():
    """Learned sinks (gpt-oss) would be replayed as plain softmax attention: the probe says so instead."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
                       layer_types=["full_attention"])
    torch.manual_seed(0)
    model = GptOssForCausalLM._from_config(cfg, attn_implementation="eager")
    with pytest.raises(ValueError, match="the probe does not replay learned sinks"):
        probe(model, torch.randint(1, 64, (1, 8)), fixes=("off",))
    assert integration.attention_function.attention is probe_mod.attention
