"""The CPU-testable parts of benchmarks/gpu_bench.py: arguments, shapes, FLOP counts, interleaving, table.

The timing itself needs a CUDA GPU; here a fake timer stands in for the CUDA events, so the
bookkeeping from measurements to the printed table is checked without one.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("gpu_bench", os.path.join(ROOT, "benchmarks", "gpu_bench.py"))
gb = importlib.util.module_from_spec(_spec)
sys.modules["gpu_bench"] = gb  # dataclasses look their module up there
_spec.loader.exec_module(gb)


def test_defaults_and_argument_errors():
    a = gb.parse_args([])
    assert a.n == [1024, 4096, 16384] and a.d == [64, 128] and a.causal == [True, False] and a.gqa
    assert a.impls == list(gb.IMPLS) and a.rounds >= 1
    a = gb.parse_args(["--n", "4096", "--d", "128", "--causal", "false", "--no-gqa", "--impls", "sdpa_flash",
                       "stable_exact"])
    assert (a.n, a.d, a.causal, a.gqa, a.impls) == ([4096], [128], [False], False, ["sdpa_flash", "stable_exact"])
    for bad in (["--causal", "maybe"], ["--impls", "stable_exact"], ["--rounds", "0"], ["--impls", "flash3"]):
        with pytest.raises(SystemExit):
            gb.parse_args(bad)


def test_shapes_cover_the_matrix_and_one_gqa_shape():
    s = gb.shapes([1024, 4096, 16384], [64, 128], [True, False], gqa=True)
    assert len(s) == 3 * 2 * 2 + 1
    assert s[0].d == 128 and s[0].causal  # the headline shapes first
    for x in s:
        assert x.b * x.n == gb.TOKENS and x.hq * x.d == gb.WIDTH
    gqa = [x for x in s if x.hq != x.hkv]
    assert len(gqa) == 1 and gqa[0].hq % gqa[0].hkv == 0 and "G=4" in gqa[0].name


@pytest.mark.parametrize("nq,nk", [(1, 1), (5, 5), (7, 3), (3, 7), (64, 100), (100, 64), (1, 9)])
def test_visible_pairs_count_the_mask(nq, nk):
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    assert gb.visible_pairs(nq, nk, True) == int((j <= i + nk - nq).sum())
    assert gb.visible_pairs(nq, nk, False) == nq * nk


def test_flops():
    s = gb.Shape(b=2, hq=4, hkv=4, n=8, d=16, causal=False)
    assert gb.flops(s, "fwd") == 4 * 2 * 4 * 64 * 16
    assert gb.flops(s, "bwd") == 2.5 * gb.flops(s, "fwd") and gb.flops(s, "fwd_bwd") == 3.5 * gb.flops(s, "fwd")
    causal = gb.Shape(b=2, hq=4, hkv=4, n=8, d=16, causal=True)
    assert gb.flops(causal, "fwd") == 4 * 2 * 4 * 36 * 16  # 8 * 9 / 2 visible pairs


def test_rel_error():
    want = torch.tensor([1.0, -4.0])
    assert gb.rel_error(want, want) == 0
    assert gb.rel_error(torch.tensor([1.0, -3.0]), want) == pytest.approx(0.25)


class FakeTimer:
    """Stands in for the CUDA events: a fixed time per (implementation, kind) plus a per-round drift."""

    def __init__(self, base: dict):
        self.base = base
        self.calls = []

    def __call__(self, fn, iters):
        impl, kind = fn()
        self.calls.append((impl, kind, iters))
        drift = 0.01 * len(self.calls)  # rises through the run: the median of interleaved rounds absorbs it
        return self.base[(impl, kind)] + drift, 0.1 * self.base[(impl, kind)]


def fake_fns(impls):
    return {i: {k: (lambda i=i, k=k: (i, k)) for k in gb.KINDS} for i in impls}


def test_measure_interleaves_rounds_and_takes_medians():
    impls = ["sdpa_flash", "stable_off", "stable_exact"]
    base = {(i, k): 1.0 + n + 0.1 * m for n, i in enumerate(impls) for m, k in enumerate(gb.KINDS)}
    timer = FakeTimer(base)
    iters = {key: 7 for key in base}
    got = gb.measure(fake_fns(impls), timer, iters, rounds=3)
    order = [c[0] for c in timer.calls[::len(gb.KINDS)]]
    assert order == impls + impls[1:] + impls[:1] + impls[2:] + impls[:2]  # rotated each round
    assert all(c[2] == 7 for c in timer.calls) and len(timer.calls) == 3 * len(base)
    for key, t in got.items():
        assert t["ms"] - base[key] == pytest.approx(0.01 * (1 + sorted(
            i for i, c in enumerate(timer.calls) if c[:2] == key)[1]))  # the middle round's drift
        assert t["cpu_ms"] == pytest.approx(0.1 * base[key])


def test_rows_and_table():
    shape = gb.Shape(b=1, hq=16, hkv=16, n=4096, d=128, causal=True)
    ms = {"sdpa_flash": 2.0, "stable_off": 2.5, "stable_exact": 2.6, "stable_exact_stats": 2.65}
    timings = {(i, k): dict(ms=t * gb.FLOP_FACTOR[k], cpu_ms=0.01) for i, t in ms.items() for k in gb.KINDS}
    timings[("stable_exact_stats", "fwd")]["cpu_ms"] = 10.0  # CPU slower than the GPU: launch-bound
    ok = dict(ok=True, error=None, out_err=1e-3, grad_err=2e-3)
    checks = {i: ok for i in ms}
    checks["sdpa_cudnn"] = dict(ok=False, error="not offered by this torch", out_err=None, grad_err=None)
    rows = gb.rows_for(shape, timings, checks)
    by = {r["impl"]: r for r in rows}
    assert by["stable_exact"]["fwd_bwd_speed_vs_sdpa_flash"] == pytest.approx(2.0 / 2.6)
    assert by["stable_exact"]["fwd_bwd_speed_vs_sdpa_cudnn"] is None
    assert by["stable_exact"]["fwd_tflops"] == pytest.approx(gb.flops(shape, "fwd") / 2.6 * 1e-9)
    assert by["stable_exact_stats"]["fwd_launch_bound"] and not by["stable_exact"]["fwd_launch_bound"]
    assert by["sdpa_cudnn"]["fwd_bwd_ms"] is None
    text = gb.table(rows)
    assert "| N=4096 D=128 causal (B=1 H=16) | stable_exact | 2.600 | 6.500 | 9.100 |" in text
    assert "stable_exact_stats (launch-bound)" in text and "FAILED: not offered by this torch" in text
    assert "| N=4096 D=128 causal (B=1 H=16) | +4.0% | +1.9% |" in text  # 2.6/2.5 and 2.65/2.6, fwd+bwd


def test_run_shape_checks_then_times_every_implementation():
    """The whole per-shape path on the CPU (SDPA's CPU flash kernel, our kernels under the interpreter),
    with a timer that runs each closure once: GQA expansion for SDPA, the checks, the autograd closures."""
    calls = []

    def timer(fn, iters):
        fn()
        calls.append(iters)
        return 1.0, 0.0

    # one of ours (the interpreter is slow); the others differ only in the op's arguments
    impls = gb.implementations(["sdpa_flash", "sdpa_cudnn", "stable_exact"])
    shape = gb.Shape(b=1, hq=4, hkv=2, n=40, d=16, causal=True)
    rows = gb.run_shape(shape, impls, rounds=2, target_ms=3.0, device="cpu", timer=timer)
    by = {r["impl"]: r for r in rows}
    assert set(by) == set(impls)
    assert not by["sdpa_cudnn"]["ok"] and by["sdpa_cudnn"]["fwd_ms"] is None  # no cuDNN attention on a CPU
    for name in ("sdpa_flash", "stable_exact"):
        r = by[name]
        assert r["ok"], (name, r["error"])
        assert r["out_err"] <= gb.TOLERANCE["out"] and r["grad_err"] <= gb.TOLERANCE["grad"]
        assert r["fwd_bwd_ms"] == 1.0 and r["fwd_bwd_speed_vs_sdpa_flash"] == 1.0
    assert by["sdpa_flash"]["out_err"] == 0
    # one calibration call per (impl, kind), then `rounds` timed calls of `iters` = target / 1 ms each
    assert calls[:6] == [1] * 6 and calls[6:] == [3] * 12


def test_main_without_a_gpu_says_so(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine
    assert gb.main(["--no-gqa"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_packed_shapes_fill_the_tokens():
    ps = gb.packed_shapes([64, 128])
    assert [p.d for p in ps] == [128, 64] and ps == gb.packed_shapes([64, 128])  # fixed seed: the same batches
    for p in ps:
        assert sum(p.lengths) == gb.TOKENS and p.hq * p.d == gb.WIDTH and len(p.lengths) > 1
        assert all(1 <= n <= gb.DOC_LENGTHS[1] for n in p.lengths)
        assert all(n >= gb.DOC_LENGTHS[0] for n in p.lengths[:-1])  # only the last one is cut
    p = gb.Packed((3, 5), hq=2, hkv=2, d=16)
    assert gb.packed_flops(p, "fwd") == 4 * 2 * (6 + 15) * 16  # causal pairs 3*4/2 + 5*6/2
    assert gb.packed_flops(p, "fwd_bwd") == 3.5 * gb.packed_flops(p, "fwd")


def test_packed_rows_and_table():
    p = gb.Packed((100, 28), hq=4, hkv=4, d=64)
    ms = {"stable_padded": 3.0, "stable_varlen": 2.0}
    timings = {(i, k): dict(ms=t * gb.FLOP_FACTOR[k], cpu_ms=0.01) for i, t in ms.items() for k in gb.KINDS}
    ok = dict(ok=True, error=None, out_err=0.0, grad_err=0.0)
    rows = gb.packed_rows(p, timings, {i: ok for i in ms})
    by = {r["impl"]: r for r in rows}
    assert by["stable_varlen"]["fwd_bwd_speed_vs_padded"] == pytest.approx(1.5)
    assert by["stable_padded"]["fwd_speed_vs_padded"] == 1.0
    assert by["stable_varlen"]["fwd_tflops"] == pytest.approx(gb.packed_flops(p, "fwd") / 2.0 * 1e-9)
    text = gb.packed_table(rows)
    assert "| 2 docs, 128 tokens (longest 100) D=64 causal H=4 | stable_varlen | 2.000 | 5.000 | 7.000 |" in text
    assert "| 1.50x | 1.50x | ok |" in text


def test_run_packed_checks_varlen_against_padded():
    """The packed path on the CPU (our kernels under the interpreter), each closure run once."""
    def timer(fn, iters):
        fn()
        return 1.0, 0.0

    p = gb.Packed((1, 17, 40), hq=2, hkv=1, d=16)
    rows = gb.run_packed(p, rounds=1, target_ms=2.0, device="cpu", timer=timer)
    by = {r["impl"]: r for r in rows}
    assert set(by) == set(gb.PACKED_IMPLS)
    for r in rows:
        assert r["ok"], r["error"]
        assert r["fwd_bwd_ms"] == 1.0 and r["fwd_bwd_speed_vs_padded"] == 1.0
    assert by["stable_varlen"]["out_err"] <= gb.TOLERANCE["out"] and by["stable_varlen"]["grad_err"] <= 0.05


def test_varlen_arguments():
    a = gb.parse_args(["--varlen-only"])
    assert a.varlen and a.varlen_only
    assert not gb.parse_args(["--no-varlen"]).varlen
    with pytest.raises(SystemExit):
        gb.parse_args(["--no-varlen", "--varlen-only"])


def test_decode_shapes_and_arguments():
    assert [(s.b, s.nk) for s in gb.decode_shapes()] == [(1, 4096), (32, 4096), (1, 32768), (32, 32768)]
    assert gb.parse_args([]).decode and not gb.parse_args(["--no-decode"]).decode
    assert gb.parse_args(["--decode-only"]).decode_only
    with pytest.raises(SystemExit):
        gb.parse_args(["--decode-only", "--no-decode"])


def test_run_decode_checks_then_times_the_decode_path(monkeypatch):
    """A decoding step on the CPU (SDPA's CPU flash kernel, the decode kernel under the interpreter) with a timer
    that runs each closure once: our rows come from the decode kernel, checked against SDPA, tokens/s = B / s."""
    from stable_attn.kernels import triton_decode
    from stable_attn.options import BLOCK_N

    calls = []
    real = triton_decode.forward
    monkeypatch.setattr(triton_decode, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def timer(fn, iters):
        fn()
        return 2.0, 0.0

    shape = gb.Decode(b=2, nk=2 * BLOCK_N + 8, hq=4, hkv=2, d=16)  # three key blocks of the default partition
    rows = gb.run_decode(shape, rounds=1, target_ms=2.0, device="cpu", timer=timer,
                         impls=("sdpa_flash", "stable_exact"))
    by = {r["impl"]: r for r in rows}
    assert by["stable_exact"]["ok"], by["stable_exact"]["error"]
    assert by["stable_exact"]["out_err"] <= gb.TOLERANCE["out"] and calls  # through the decode kernel
    assert by["stable_exact"]["ms"] == 2.0 and by["stable_exact"]["tokens_per_s"] == 1000.0
    assert by["stable_exact"]["speed_vs_sdpa_flash"] == 1.0
    assert f"| decode B=2 cache={2 * BLOCK_N + 8}" in gb.decode_table(rows)
