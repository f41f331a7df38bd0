"""The dense launchers beyond CUDA's grid limits (65535 in a grid's second and third dimensions).

A batch larger than the limit runs in several launches, each over ``b_first + program_id(2)`` of the
whole tensors; the result must be the single launch's, bit for bit, forward and backward, dropout
included (its Philox counters derive from the batch index). Heads beyond the limit are refused with
a ValueError. Under the interpreter the limits are patched small, so the chunking runs on tiny shapes.
"""

from __future__ import annotations

import sys

import pytest
import torch
from packing import cu, packed_inputs

import stable_attn
from stable_attn.kernels import triton_attention as ta
from stable_attn.kernels import triton_launch as launch
from stable_attn.options import Options

KERNELS = ("attn_fwd_kernel", "attn_bwd_preprocess", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")


class Launches:
    """Records every grid the dense launchers use, then launches the real kernel."""

    def __init__(self, monkeypatch) -> None:
        self.grids: dict[str, list[tuple]] = {name: [] for name in KERNELS}
        for name in KERNELS:
            monkeypatch.setattr(ta, name, self._spy(name, getattr(ta, name)))

    def _spy(self, name, kernel):
        grids = self.grids[name]

        class Spy:
            def __getitem__(self, grid):
                grids.append(grid)
                return kernel[grid]

        return Spy()


def _inputs(B, Hq, Hkv, N, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, N, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, N, D, generator=g).to(dtype)
    do = torch.randn(B, Hq, N, D, generator=g).to(dtype)
    kpm = torch.rand(B, N, generator=g) >= 0.2
    return q, k, v, do, kpm


def _run(q, k, v, do, kpm, opts):
    out, lse2, rs = ta.forward(q, k, v, kpm, opts, True)
    grads = ta.backward(do, q, k, v, out, lse2, kpm, opts)
    return out, lse2, rs, grads


CASES = {
    "causal-gqa-kpm-dropout-bf16": dict(dtype=torch.bfloat16, Hq=4, Hkv=2, kpm=True,
                                        opts=dict(causal=True, dropout_p=0.3)),
    "window-softcap-dropout-fp16": dict(dtype=torch.float16, Hq=2, Hkv=1, kpm=False,
                                        opts=dict(causal=True, window=9, softcap=4.0, dropout_p=0.2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_batch_beyond_the_grid_limit_runs_in_chunks_with_the_same_bits(monkeypatch, name):
    c = CASES[name]
    B, N, D = 5, 23, 16
    q, k, v, do, kpm = _inputs(B, c["Hq"], c["Hkv"], N, D, c["dtype"], seed=len(name))
    kpm = kpm if c["kpm"] else None
    opts = Options(scale=0.25, block_n=16, seed=2**33 + 5, **c["opts"])
    launches = Launches(monkeypatch)
    out1, lse1, rs1, grads1 = _run(q, k, v, do, kpm, opts)
    assert all(len(g) == 1 and g[0][2] == B for g in launches.grids.values())  # one launch each, as before
    monkeypatch.setattr(launch, "MAX_GRID_Z", 2)
    launches = Launches(monkeypatch)
    out, lse, rs, grads = _run(q, k, v, do, kpm, opts)
    for kernel, grids in launches.grids.items():  # batches (0, 1), (2, 3), (4)
        assert [g[2] for g in grids] == [2, 2, 1], kernel
    assert torch.equal(out, out1) and torch.equal(lse, lse1)
    for f in ("saturated", "fixed_blocks", "max_logit", "sink_mass"):
        assert torch.equal(getattr(rs, f), getattr(rs1, f)), f
    for what, a, b in zip(("dq", "dk", "dv"), grads, grads1, strict=True):
        assert torch.equal(a, b), what
    # the case is not vacuous: dropout drew a different mask in every batch element
    no_drop = ta.forward(q, k, v, kpm, opts.replace(dropout_p=0.0), False)[0]
    assert all(not torch.equal(out[b], no_drop[b]) for b in range(B))


def test_a_batch_beyond_the_grid_limit_through_attention(monkeypatch):
    """The public path: attention() with the limit patched gives the unpatched call's output and gradients."""
    B, Hq, N, D = 3, 2, 17, 16
    q, k, v, do, _ = _inputs(B, Hq, Hq, N, D, torch.bfloat16, seed=3)
    seed = torch.tensor(1234, dtype=torch.int64)
    monkeypatch.setattr(sys.modules["stable_attn.attention"], "draw_seed", lambda p: seed if p > 0 else None)

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = stable_attn.attention(*leaves, causal=True, dropout_p=0.25, backend="triton", block_n=16)
        out.backward(do)
        return out.detach(), [t.grad for t in leaves]

    out1, grads1 = run()
    monkeypatch.setattr(launch, "MAX_GRID_Z", 1)
    out, grads = run()
    assert torch.equal(out, out1)
    for a, b in zip(grads, grads1, strict=True):
        assert torch.equal(a, b)


def test_heads_beyond_the_grid_limit_are_refused(monkeypatch):
    monkeypatch.setattr(launch, "MAX_GRID_Y", 3)
    q, k, v, do, _ = _inputs(1, 4, 2, 8, 16, torch.float32, seed=4)
    with pytest.raises(ValueError, match=r"Hq=4 query heads: .* CUDA allows at most 3; split the heads"):
        ta.forward(q, k, v, None, Options(), False)
    with pytest.raises(ValueError, match=r"Hq=4 query heads"):
        ta.backward(do, q, k, v, q, torch.zeros(1, 4, 8), None, Options())
    lens = [3, 5]
    pq, pk, pv, _ = packed_inputs(lens, lens, 4, 2, 16, torch.float32, seed=4)
    with pytest.raises(ValueError, match=r"Hq=4 query heads"):
        ta.forward_varlen(pq, pk, pv, cu(lens), cu(lens), 5, 5, Options(), False)
    q3, k3, v3, _, _ = _inputs(1, 3, 1, 8, 16, torch.float32, seed=4)
    ta.forward(q3, k3, v3, None, Options(), False)  # at the limit: served


def test_heads_times_v_blocks_beyond_the_grid_limit_name_both(monkeypatch):
    """Above 256 columns each head has a grid row per V block: the refusal names the heads and the blocks."""
    monkeypatch.setattr(launch, "MAX_GRID_Y", 7)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 4, 512, generator=g) for _ in range(3))
    with pytest.raises(ValueError, match=r"Hq=2 query heads: the Triton kernels launch 2 x \d+ V blocks = \d+ "
                                         r"grid rows and CUDA allows at most 7"):
        ta.forward(q, k, v, None, Options.create(head_dim=512), False)
