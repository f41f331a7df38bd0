"""benchmarks/decode_resources.py: the decode kernel compiles for sm_90 without spills, its loop uses the tensor
cores, and the bytes model reads the cache once where the training kernel reads it G times."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import decode_resources as dr  # noqa: E402


def test_the_decode_kernel_reads_each_kv_head_once_per_split():
    r = dr.bytes_row(1, 32, 8, 4096, 128)
    assert r["decode_kv"] == 1 and r["training_kv"] == 4 and r["splits"] == 32 and r["programs"] == 256
    assert 1.0 < r["decode_total"] < 1.1  # the partials cost a few percent at 4k context
    assert dr.bytes_row(1, 64, 1, 4096, 128)["decode_kv"] == 1  # G = 64: still one row block


def test_the_decode_kernel_compiles_for_sm90_without_spills():
    # compiled in a fresh process: under TRITON_INTERPRET (set for the test session) kernels cannot compile
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import decode_resources as dr; "
            "print(json.dumps(dr.compile_row(90, 128, 1, True, 4, 1, 64)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["spill"] == 0 and row["loop_mma"] > 0 and row["rows"] == 16
