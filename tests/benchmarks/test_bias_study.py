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
    assert set(cells) == {("exact_rounded_bf16", "-")} | {(m, f) for m in ("e_fp8_h100", "e_fp8_ieee")
                                                         for f in ("off", "ours", "paper")}
    assert cells[("e_fp8_h100", "off")]["rows_with_two_pbar_ones"] == 1.0  # four ties: P-bar = 1.0 in E4M3 too
    assert cells[("e_fp8_h100", "ours")]["rows_with_two_pbar_ones"] == 0.0
    assert "P-bar e4m3" in capsys.readouterr().out
    # the study's V is E4M3-representable: the oracle sees what the product sees
    gen = torch.Generator().manual_seed(0)
    _, v = bias_study.make_inputs("tied-k4", 4, 64, 8, gen)
    fp8 = bias_study.arithmetic.fp8_values(v)
    assert torch.equal(fp8.to(torch.float8_e4m3fn).to(torch.bfloat16), fp8) and not torch.equal(fp8, v)
