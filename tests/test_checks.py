"""_checks.py: the tensor rules attention(), attention_varlen() raise on and the sdpa patch falls back on.

The error messages of the two entry points are tested through them (test_attention.py,
kernels/test_varlen.py); here: the rules themselves, and that the patch serves nothing attention() refuses.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from stable_attn import _checks
from stable_attn.options import scale_problem


def _dense(b=2, hq=4, hkv=2, nq=5, nk=6, d=8, dtype=torch.float32):
    return tuple(torch.randn(b, h, n, d).to(dtype) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))


def test_valid_calls_have_no_problem():
    q, k, v = _dense()
    assert _checks.dense_problem(q, k, v) is None
    assert _checks.dense_problem(q, k, v, torch.ones(2, 6, dtype=torch.bool), torch.zeros(5, 6)) is None
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert _checks.packed_problem(q[0].transpose(0, 1), k[0, :, :5].transpose(0, 1), v[0, :, :5].transpose(0, 1),
                                  cu, cu, 3, 3) is None


def test_problems_carry_the_exception_type_and_raise_it():
    q, k, v = _dense()
    problem = _checks.dense_problem(q.double(), k, v)
    assert problem.error is TypeError and "q.dtype=torch.float64" in problem.message
    with pytest.raises(TypeError, match=r"q.dtype=torch.float64"):
        _checks.raise_problem(problem)
    _checks.raise_problem(None)


@pytest.mark.parametrize("m", [0, -1, True, 2.0, "4"])
def test_max_seqlen_must_be_a_positive_int_not_a_bool(m):
    q = torch.randn(5, 2, 8)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    problem = _checks.packed_problem(q, q, q, cu, cu, m, 5)
    assert problem.error is ValueError and f"max_seqlen_q={m!r}" in problem.message


def test_mask_broadcast_rule():
    shape = (2, 4, 5, 6)
    assert _checks.broadcasts(torch.ones(5, 6), shape) and _checks.broadcasts(torch.ones(2, 1, 1, 6), shape)
    assert not _checks.broadcasts(torch.ones(3, 1, 5, 6), shape)
    assert not _checks.broadcasts(torch.ones(1, 1, 1, 5, 6), shape)


def test_interpreter_test_reads_the_environment(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _checks.interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not _checks.interpreting()


def test_unit_last_stride_copies_only_what_needs_it():
    a = torch.randn(3, 4)
    b = a.t()
    out_a, out_b = _checks.unit_last_stride(a, b)
    assert out_a is a and out_b.stride(-1) == 1 and torch.equal(out_b, b)


SCALES = [None, 1, 0.3, 1e-30, 1e-39, 1e38, 3e38, True, float("inf"), float("nan"), -0.5, 0]
MASKS = [None, torch.ones(5, 6, dtype=torch.bool), torch.zeros(1, 4, 5, 6), torch.ones(5, 6, dtype=torch.int64),
         torch.ones(3, 1, 5, 6, dtype=torch.bool)]
SHAPES = [dict(), dict(hkv=4), dict(d=0), dict(d=513), dict(hkv=3), dict(nk=0), dict(dtype=torch.float64)]


def test_the_sdpa_patch_serves_only_calls_attention_accepts():
    """Every call sdpa_problem lets through passes dense_problem and options' scale rule (the drift this
    guards against: scale=1e-39 was served, and attention() then raised inside sdpa's call)."""
    served = 0
    for shape, mask, scale, gqa in itertools.product(SHAPES, MASKS, SCALES, (False, True)):
        q, k, v = _dense(**shape)
        reason = _checks.sdpa_problem(q, k, v, mask, 0.0, False, scale, gqa, {})
        if reason is None:
            served += 1
            assert _checks.dense_problem(q, k, v, attn_mask=mask) is None, (shape, scale)
            assert scale_problem(scale) is None, scale
    assert served > 0
    q, k, v = _dense()
    assert "scale=1e-39" in _checks.sdpa_problem(q, k, v, None, 0.0, False, 1e-39, True, {})
    assert "head dim D=0" in _checks.sdpa_problem(*_dense(hkv=4, d=0), None, 0.0, False, None, False, {})
