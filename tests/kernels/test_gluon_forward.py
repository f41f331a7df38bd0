"""The Gluon forward (kernels/gluon_forward.py): what can be checked without a GPU.

Gluon kernels do not run under ``TRITON_INTERPRET=1`` in Triton 3.9, so its numbers are checked on a GPU
(benchmarks/gluon_check.py, first step of benchmarks/gpu_check.sh, against kernels/reference.py and the current
kernel's decisions). On the CPU: it compiles for sm_90 and sm_100 into the pipelines it is written as
(producer/consumer split with its register budgets, TMA, wgmma or tcgen05, mbarriers; on sm_90 no spill; the figures
of docs/lab/gluon-forward.md), calls it does not serve raise naming the argument, and the key blocks it walks
(``triton_tiles.key_range``, which the Triton kernels call too; run under the interpreter) are checked against every
visible (query row, key) pair.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from stable_attn import rules
from stable_attn.kernels import gluon_forward
from stable_attn.kernels.triton_tiles import key_range
from stable_attn.options import Options
from stable_attn.stats import STATS_ENTROPY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = [  # (cc, D, causal, mode, stats): the fix with every statistic, and the plain kernel
    (90, 128, True, rules.MODE_EXACT, STATS_ENTROPY),
    (90, 64, False, rules.MODE_EXACT, 0),
    (90, 128, False, rules.MODE_OFF, 0),
]
SM100 = (100, 128, False, rules.MODE_EXACT, STATS_ENTROPY)


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    # a fresh interpreter without TRITON_INTERPRET (this process runs the interpreter)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import gluon_resources as g; "
            f"print(json.dumps([g.compile_one('gluon', cc, d, m, c, s) for cc, d, c, m, s in {VARIANTS + [SM100]!r}]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("i", range(len(VARIANTS)))
def test_compiles_to_a_warp_specialized_pipeline_on_sm90(compiled, i):
    row = compiled[i]
    assert row["error"] is None, row["error"]
    # the loader gives its registers back (setmaxnreg 24) and the consumer takes them (240 of the 168 at launch)
    assert row["setmaxnreg"] and row["setmaxnreg_values"] == [gluon_forward.LOADER_REGS.value, 240], row
    assert row["TMA"] and row["wgmma"] and row["mbarrier"] and not row["tcgen05"], row
    assert row["spill"] == 0, row
    assert row["regs"] <= gluon_forward.MAX_REGS[90], row
    # Q and the K/V ring fit in the 227 KiB of shared memory a block may use
    assert row["shared"] <= 232448, row
    # one key block per consumer iteration: QK^T (D / 16 wgmma k-steps per warp), P-bar V (BLOCK_N / 16) and in
    # the exact mode the tensor-core row sum (BLOCK_N / 16 more)
    sums = 2 if row["mode"] == "exact" else 1
    assert row["loop_mma"] == row["d"] // 16 + sums * gluon_forward.BLOCK_N // 16, row


def test_serves_only_what_it_implements():
    q = torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16)
    opts = Options.create(head_dim=64, causal=True)
    assert "sm_90" in gluon_forward.serves(q, q, q, opts)
    with pytest.raises(ValueError, match="q on cpu"):
        gluon_forward.forward(q, q, q, opts)
    assert "head dim 32" in gluon_forward.serves(q[..., :32], q[..., :32], q[..., :32],
                                                 Options.create(head_dim=32))
    assert "Hq a multiple of Hkv" in gluon_forward.serves(q, torch.zeros(1, 3, 16, 64, dtype=torch.bfloat16),
                                                          torch.zeros(1, 3, 16, 64, dtype=torch.bfloat16), opts)
    assert "one key" in gluon_forward.serves(q, q[:, :, :0], q[:, :, :0], opts)
    assert "dtype torch.float16" in gluon_forward.serves(q.half(), q.half(), q.half(), opts)
    assert "mode=2" in gluon_forward.serves(q, q, q, Options.create(head_dim=64, stabilize="paper"))
    assert "window" in gluon_forward.serves(q, q, q, Options.create(head_dim=64, window=8))
    assert "key_block=64" in gluon_forward.serves(q, q, q, Options.create(head_dim=64, block_n=64))
    assert "pv_fp32" in gluon_forward.serves(q, q, q, Options.create(head_dim=64, pv_fp32=True))
    scaled = Options.create(head_dim=64, scale=2.0 * rules.FUSED_SCALE_MAX)
    assert rules.score_form(False, scaled.qk_scale2) == rules.SCORES_SCALED
    assert "qk_scale2" in gluon_forward.serves(q, q, q, scaled)


def test_compiles_to_a_tcgen05_pipeline_on_sm100(compiled):
    row = compiled[-1]
    assert row["error"] is None, row["error"]
    # loader 24 registers, consumer 256; TMA, tcgen05 (no wgmma), mbarriers
    assert row["setmaxnreg"] and row["setmaxnreg_values"] == [gluon_forward.LOADER_REGS.value, 256], row
    assert row["TMA"] and row["tcgen05"] and row["mbarrier"] and not row["wgmma"], row
    assert row["shared"] <= 232448, row
    # S = Q K^T, P-bar V and the two row-sum products per iteration (tcgen05: one instruction per 16-deep k-step)
    assert row["loop_mma"] == row["d"] // 16 + 2 * gluon_forward.BLOCK_N // 16, row


def test_the_launcher_takes_it_only_when_asked_and_served(monkeypatch, caplog):
    """``STABLE_ATTN_FORWARD=gluon`` reaches the Gluon forward where it serves the call; where it does not (here:
    a CPU tensor), the Triton forward serves it with a log line saying why; unset, it is never consulted."""
    from stable_attn.kernels import triton_attention

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    q[..., 0, :] = k[..., 0, :]  # a query tied with two keys at its max
    k[..., 1, :] = k[..., 0, :]
    opts = Options.create(head_dim=64, causal=True)
    plain = triton_attention.forward(q, k, v, None, opts, True)
    monkeypatch.setenv("STABLE_ATTN_FORWARD", "gluon")
    with caplog.at_level("INFO", logger="stable_attn"):
        asked = triton_attention.forward(q, k, v, None, opts, True)
    assert torch.equal(asked[0], plain[0]) and torch.equal(asked[1], plain[1])
    assert "the Triton forward serves this call (q on cpu" in caplog.text
    # served: the Gluon forward's own result comes back (its GPU run is benchmarks/gluon_check.py's)
    served = []
    monkeypatch.setattr(gluon_forward, "serves", lambda *a: None)
    monkeypatch.setattr(gluon_forward, "forward", lambda *a: served.append(a) or plain)
    assert triton_attention.forward(q, k, v, None, opts, True) is plain and len(served) == 1
    triton_attention.forward(q, k, v, None, opts, True, sinks=torch.zeros(2))  # sinks: not served, not asked
    assert len(served) == 1
    monkeypatch.delenv("STABLE_ATTN_FORWARD")
    triton_attention.forward(q, k, v, None, opts, True)
    assert len(served) == 1
    monkeypatch.setenv("STABLE_ATTN_FORWARD", "fast")
    with pytest.raises(ValueError, match="STABLE_ATTN_FORWARD='fast'.*'gluon'"):
        triton_attention.forward(q, k, v, None, opts, True)


@triton.jit
def _key_range_kernel(QLo, Nq, Nk, Window, Out, N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    i = tl.arange(0, N)
    nq = tl.load(Nq + i)
    nk = tl.load(Nk + i)
    ranges = key_range(tl.load(QLo + i), nq, nk, nk - nq, tl.load(Window + i), CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
    for j in tl.static_range(4):
        tl.store(Out + 4 * i + j, ranges[j])


def _blocks(keys: np.ndarray, block_n: int) -> list[int]:
    return sorted({int(j) // block_n * block_n for j in keys})


@pytest.mark.parametrize("block_m, block_n", [(128, 128), (128, 64), (64, 64), (16, 128), (32, 32)])
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_key_blocks_are_those_with_a_visible_key(causal, window, block_m, block_n):
    """``triton_tiles.key_range``, which the Triton kernels and the Gluon forward's ``_key_blocks`` (no window, 128 x
    128) call, against every (query row, key) pair of the row block, causal and window aligned bottom-right
    (``pos_offset = Nk - Nq``): ``[lo, hi)`` walks exactly the blocks holding a key some real row sees, and
    ``[mid_lo, mid_hi)`` exactly the blocks every row of the ``BLOCK_M`` tile sees in full (the window's bound
    taken from the tile's last row, present or not: never a block a real row sees only in part). Odd lengths,
    more queries than keys (causal rows that see nothing) and the row blocks at both ends."""
    lengths = (1, 7, 62, 64, 65, 100, 129, 300)  # Nk - Nq = +-1, 2, 3: diagonals by a block edge
    windows = (1, 5, 64, 1000) if window else (0,)
    cases = [(q_lo, nq, nk, w) for nq in lengths for nk in lengths for w in windows for q_lo in range(0, nq, block_m)]
    n = triton.next_power_of_2(len(cases))
    cols = [torch.tensor([c[i] for c in cases] + [cases[0][i]] * (n - len(cases)), dtype=torch.int32)
            for i in range(4)]
    out = torch.full((n, 4), -1, dtype=torch.int32)
    _key_range_kernel[(1,)](*cols, out, N=n, CAUSAL=causal, WINDOW=window, BLOCK_M=block_m, BLOCK_N=block_n)
    for (q_lo, nq, nk, w), (lo, mid_lo, mid_hi, hi) in zip(cases, out.tolist()):
        keys = np.arange(nk)[None, :]
        pos = np.arange(q_lo, q_lo + block_m)[:, None] + nk - nq  # each row's diagonal key
        seen = np.ones((block_m, nk), dtype=bool)
        if causal:
            seen &= keys <= pos
        if window:
            seen &= keys > pos - w
        real = seen[: min(block_m, nq - q_lo)]
        where = f"q_lo={q_lo}, Nq={nq}, Nk={nk}, window={w}: {lo, mid_lo, mid_hi, hi}"
        assert lo <= mid_lo <= mid_hi <= hi and all(x % block_n == 0 for x in (lo, mid_lo, mid_hi, hi)), where
        assert list(range(lo, hi, block_n)) == _blocks(np.flatnonzero(real.any(axis=0)), block_n), where
        in_full = [b for b in range(0, nk, block_n) if b + block_n <= nk and seen[:, b:b + block_n].all()]
        assert list(range(mid_lo, mid_hi, block_n)) == in_full, where
