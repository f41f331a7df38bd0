"""benchmarks/bias_study.py --pbar e4m3 (the FP8 study) on a few small trials."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bias_study  # noqa: E402


def test_fp8_study_runs_its_models_on_e4m3_values(tmp_path, capsys):
    out = tmp_path / "fp8.json"
    assert bias_study.main(["--pbar", "e4m3", "--trials", "12", "--keys", "64", "--head-dim", "8",
                            "--inputs", "tied-k4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["pbar"] == "e4m3"
    cells = {(c["model"], c["fix"]): c for c in data["cells"]}
    assert set(cells) == {("exact_rounded_bf16", "-")} | {(m, f) for m in ("e_fp8_h100", "e_fp8_ieee", "e_fp8_b200")
                                                         for f in ("off", "ours", "paper")}
    assert cells[("e_fp8_h100", "off")]["rows_with_two_pbar_ones"] == 1.0  # four ties: P-bar = 1.0 in E4M3 too
    assert cells[("e_fp8_h100", "ours")]["rows_with_two_pbar_ones"] == 0.0
    assert "P-bar e4m3" in capsys.readouterr().out
    # the study's V is E4M3-representable: the oracle sees what the product sees
    gen = torch.Generator().manual_seed(0)
    _, v = bias_study.make_inputs("tied-k4", 4, 64, 8, gen)
    fp8 = bias_study.arithmetic.fp8_values(v)
    assert torch.equal(fp8.to(torch.float8_e4m3fn).to(torch.bfloat16), fp8) and not torch.equal(fp8, v)


def test_asym_inputs_tie_k_keys_with_their_own_values():
    gen = torch.Generator().manual_seed(0)
    s, v = bias_study.make_asym_inputs("tied-closer", 2, 200, 64, 8, gen)
    assert torch.equal(s[:, 0], s[:, 1]) and bool((s[:, 2:] <= s[:, :1] - 11.9).all())  # bf16 rounding of the scores
    assert abs(float(v[:, :2].float().mean()) + 1) < 0.05 and abs(float(v[:, 2:].float().mean()) + 3) < 0.05
    assert v.dtype == torch.bfloat16


def test_asym_prediction_signs():
    p = bias_study.predicted_sign
    assert p("a_kernel", "tied-closer", 2, "off") == -1 and p("a_kernel", "tied-closer", 1, "off") == 1
    assert p("d_tensor_core_h100", "tied-farther", 4, "ours") == 1 and p("a_kernel", "same", 2, "off") == 0
    assert p("b_blockwise_bf16", "tied-farther", 2, "off") == -1 and p("b_blockwise_bf16", "same", 2, "paper") == 0


def test_asym_study_finds_the_tie_bias_in_fused_arithmetic(tmp_path):
    out = tmp_path / "asym.json"
    assert bias_study.main(["--study", "asym", "--trials", "60", "--keys", "64", "--head-dim", "16",
                            "--dists", "tied-closer", "--ks", "2", "--blocks", "64", "--tc-models", "b200",
                            "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    cells = {(c["model"], c["fix"]): c for c in data["cells"]}
    assert set(cells) == {("exact_rounded_bf16", "-")} | {(m, f) for m in ("a_kernel", "b_blockwise_bf16",
                                                                           "d_tensor_core_b200")
                                                          for f in ("off", "ours", "paper")}
    # tied V -1 against other V -3: in fused arithmetic the midpoint of (V1 + V2) / 2 rounds toward the others
    assert cells[("a_kernel", "off")]["t"] <= -3 and cells[("a_kernel", "ours")]["t"] <= -3
    assert cells[("d_tensor_core_b200", "off")]["mean"] == cells[("a_kernel", "off")]["mean"] or \
        cells[("d_tensor_core_b200", "off")]["t"] <= -3
    assert data["commit"] is None or len(data["commit"]) >= 40
