"""Property-based tests: any shape and option combination the op accepts equals the fp64 oracle."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stable_attn
from stable_attn.kernels import naive


@st.composite
def problems(draw):
    hkv = draw(st.integers(1, 3))
    return dict(
        b=draw(st.integers(1, 2)), hkv=hkv, g=draw(st.integers(1, 3)), nq=draw(st.integers(1, 80)),
        nk=draw(st.integers(1, 80)), d=draw(st.sampled_from([1, 8, 24, 40])), causal=draw(st.booleans()),
        window=draw(st.one_of(st.none(), st.integers(1, 30))), softcap=draw(st.one_of(st.none(), st.floats(1.0, 30.0))),
        padded=draw(st.booleans()), stabilize=draw(st.sampled_from([True, False, "paper"])),
        block_n=draw(st.sampled_from([16, 32, 64])), seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_any_problem_matches_the_oracle(p):
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(p["b"], p["hkv"] * p["g"], p["nq"], p["d"], generator=g, requires_grad=True)
    k, v = (torch.randn(p["b"], p["hkv"], p["nk"], p["d"], generator=g, requires_grad=True) for _ in range(2))
    kpm = (torch.rand(p["b"], p["nk"], generator=g) > 0.3) if p["padded"] else None
    kw = dict(causal=p["causal"], window=p["window"], softcap=p["softcap"], key_padding_mask=kpm)
    out = stable_attn.attention(q, k, v, stabilize=p["stabilize"], block_n=p["block_n"], **kw)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = naive.attention(qd, kd, vd, **kw)
    torch.testing.assert_close(out.double(), ref, atol=5e-6, rtol=1e-5)
    do = torch.randn(out.shape, generator=g)
    out.backward(do)
    ref.backward(do.double())
    for a, b in ((q, qd), (k, kd), (v, vd)):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=5e-5, rtol=1e-4)
