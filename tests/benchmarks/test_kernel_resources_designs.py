"""benchmarks/kernel_resources.py --designs: the two backward designs side by side, from rows of --json."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "kernel_resources.py")
_spec = importlib.util.spec_from_file_location("kernel_resources", SCRIPT)
kr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kr)


def row(kernel, m, n, warps, mma, issue, regs=200, spill=0, variant=None):
    return dict(variant=variant or f"{kernel}-bf16-D64-causal-sm90", kernel=kernel, cc=90, dtype="bf16", d=64,
                causal=True, block_m=m, block_n=n, warps=warps, regs=regs, spill_bytes=spill, mma_clk=mma,
                issue_clk=issue, R=issue / mma, shared=0, limit=1, wgmma=True, loop_sass=1, compile_s=0.0)


ROWS = [row("bwd_dkdv", 64, 128, 8, 1024.0, 918.0), row("bwd_dq", 64, 128, 4, 768.0, 483.0),
        row("bwd_fused", 64, 128, 8, 1280.0, 1500.0, regs=255, spill=56),
        row("bwd_dq", 64, 128, 4, 768.0, 483.0, variant="bwd_dq-bf16-D64-causal-varlen-sm90")]  # no pair: left out


def test_per_tile_scales_to_a_128_by_128_tile():
    assert kr.per_tile(ROWS[0]) == (2048.0, 1836.0)  # two 64 x 128 steps


def test_designs_add_the_two_kernels_and_bound_each_by_its_slower_unit():
    lines = kr.backward_designs(ROWS).splitlines()
    assert len(lines) == 4  # header, rule, two-kernel, fused
    two, fused = (line.split(" | ") for line in lines[2:])
    assert two[4:] == ["two-kernel", "64x128/8 + 64x128/4", "200 / 200", "0 / 0", "3584", "2802", "0.78", "3584",
                       "1.00 |"]
    # the fused loop is issue-bound: its bound is its issue clocks (3000), 3000 / 3584 of the two kernels'
    assert fused[4:] == ["bwd_fused", "64x128/8", "255", "56", "2560", "3000", "1.17", "3000", "0.84 |"]


def test_from_json_reprints_without_compiling(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS[:3]))
    done = subprocess.run([sys.executable, SCRIPT, "--designs", "--from-json", str(path)], capture_output=True,
                          text=True, check=True, env=dict(os.environ, PYTHONPATH=ROOT))
    fused = "| 90 | bf16 | 64 | True | bwd_fused | 64x128/8 | 255 | 56 | 2560 | 3000 | 1.17 | 3000 | 0.84 |"
    assert fused in done.stdout
