"""The warp-specialized forward (kernels/triton_forward_ws.py) computes the current kernel's bits.

Under the interpreter (which runs a ``warp_specialize`` loop as a plain loop and reads tensor descriptors) both
forwards run on the same inputs with the same tiles (K and V through descriptors, several query blocks, a
partial last one): out and lse equal bit for bit, in every mode, causal or not, ``Nq != Nk``, GQA, learned sinks,
ties at the max and huge logits; and against the fp64 oracle. Which launches take it (``serves``, ``use``), and the
fallback when it does not compile.
"""

from __future__ import annotations

import os

import pytest
import torch
from closeness import close

from stable_attn.kernels import naive, triton_forward_ws
from stable_attn.kernels import triton_attention as ta
from stable_attn.kernels import triton_launch as launch
from stable_attn.options import Options

DEVICE = os.environ.get("STABLE_ATTN_TEST_DEVICE", "cpu")
TILES = launch.FwdConfig(block_m=32, num_warps=4, num_stages=1, tma=True)


def inputs(B, Hq, Hkv, Nq, Nk, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g)
    k = torch.randn(B, Hkv, Nk, D, generator=g)
    v = torch.randn(B, Hkv, Nk, D, generator=g)
    q[0, 0, :5] = q[0, 0, 5]  # ties at the max: equal rows
    k[0, 0, 9] *= 50  # huge logits
    return [t.to(torch.bfloat16).to(DEVICE) for t in (q, k, v)]


@pytest.mark.parametrize(("mode", "causal", "Hq", "Hkv", "Nq", "Nk", "sinks"), [
    ("exact", True, 2, 1, 70, 70, False),
    ("paper", True, 2, 2, 40, 90, False),
    ("off", False, 2, 1, 50, 75, False),
    ("exact", False, 1, 1, 33, 64, True),
])
def test_the_warp_specialized_forward_gives_the_current_kernels_bits(mode, causal, Hq, Hkv, Nq, Nk, sinks,
                                                                      monkeypatch):
    q, k, v = inputs(2, Hq, Hkv, Nq, Nk, 16, seed=Nq)
    s = torch.randn(Hq, generator=torch.Generator().manual_seed(1)).to(DEVICE) if sinks else None
    stabilize = {"exact": True, "paper": "paper", "off": False}[mode]
    opts = Options.create(head_dim=16, causal=causal, stabilize=stabilize, block_n=16)
    runs, launched = {}, []
    real = triton_forward_ws.attn_fwd_ws_kernel

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(triton_forward_ws, "attn_fwd_ws_kernel", Spy())
    for how in ("classic", "ws"):
        monkeypatch.setenv("STABLE_ATTN_FORWARD", how)
        launched.clear()
        runs[how] = ta.forward(q, k, v, None, opts, False, config=TILES, sinks=s)[:2]
        assert bool(launched) == (how == "ws")
    for a, b in zip(runs["ws"], runs["classic"], strict=True):
        assert torch.equal(a, b)
    want = naive.attention(q.double(), k.double(), v.double(), causal=causal, scale=opts.scale, sinks=s)
    close(runs["ws"][0], want, 4, torch.bfloat16, "ws forward vs oracle")


def test_which_launches_take_it(monkeypatch):
    flags = dict(causal=True, window=False, softcap=False, dropout=False, kpm=False)
    plain, _ = launch.launch_constants("fwd", 128, torch.bfloat16, 90, **flags)
    assert plain["TMA"] and triton_forward_ws.serves(plain, packed=False)
    assert not triton_forward_ws.serves(plain, packed=True)
    for extra in ({"window": True}, {"kpm": True}, {"softcap": True}, {"dropout": True}):
        consts, _ = launch.launch_constants("fwd", 128, torch.bfloat16, 90, **{**flags, **extra})
        assert not triton_forward_ws.serves(consts, packed=False), extra
    stats, _ = launch.launch_constants("fwd", 128, torch.bfloat16, 90, **flags, stats=1)
    assert not triton_forward_ws.serves(stats, packed=False)
    monkeypatch.delenv("STABLE_ATTN_FORWARD", raising=False)
    assert triton_forward_ws.use(90, True, plain, False) and triton_forward_ws.use(100, True, plain, False)
    assert not triton_forward_ws.use(80, True, plain, False) and not triton_forward_ws.use(120, True, plain, False)
    assert not triton_forward_ws.use(90, False, plain, False)  # the interpreter: the current kernel unless forced
    monkeypatch.setenv("STABLE_ATTN_FORWARD", "classic")
    assert not triton_forward_ws.use(90, True, plain, False)
    monkeypatch.setenv("STABLE_ATTN_FORWARD", "fast")
    with pytest.raises(ValueError, match="STABLE_ATTN_FORWARD='fast'"):
        triton_forward_ws.use(90, True, plain, False)


@pytest.mark.parametrize(("outcome", "taken"), [("error", False), ("no split", False), ("split", True)])
def test_it_is_taken_only_where_it_compiles_to_a_warp_split(outcome, taken, monkeypatch, caplog):
    """``launch`` compiles once per set of constants (``warmup``) and launches only a kernel whose PTX holds the
    producer/consumer split; otherwise the caller's current kernel serves, logged once."""
    from triton.errors import TritonError

    class Compiled:
        asm = {"ptx": "setmaxnreg.inc.sync.aligned.u32 240;" if outcome == "split" else "mma.sync"}

    class Kernel:
        warmups, launches = 0, 0

        def warmup(self, grid, **kwargs):
            Kernel.warmups += 1
            if outcome == "error":
                raise TritonError("no warp specialization here")
            return Compiled()

        def __getitem__(self, grid):
            def run(**kwargs):
                Kernel.launches += 1
            return run

    monkeypatch.delenv("STABLE_ATTN_FORWARD", raising=False)
    monkeypatch.setattr(triton_forward_ws, "attn_fwd_ws_kernel", Kernel())
    monkeypatch.setattr(triton_forward_ws, "_compiles", {})
    plain = {"TMA": True, "TILE_N": 16, "BLOCK_N": 16, "STATS": 0, "WINDOW": False, "SOFTCAP": False,
             "DROPOUT": False, "HAS_KPM": False}
    for _ in range(3):
        assert triton_forward_ws.launch((1,), 100, plain, Q=None) is taken
    assert Kernel.warmups == 1 and Kernel.launches == (3 if taken else 0)
    assert triton_forward_ws.use(100, True, plain, False) is taken  # the answer is kept
    assert ("not used on sm_100" in caplog.text) is not taken
