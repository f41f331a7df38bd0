"""Repeated no-gradient calls (stable_attn/call_cache.py) and the prepared decode launch (kernels/decode_launch.py).

* a call that repeats an earlier call's signature gives the bits of the full path (``call_cache.ENABLED = False``:
  checks, options, the op, a launch prepared for that call alone), on fresh data every call (the reused scratch
  partials must not leak), on the decode kernel, the training kernel and the PyTorch path, and against the oracle;
* bad input still raises with its message after a good call of the same shapes (the checks ran on the first
  call of each signature; a changed type, dtype, grad flag or option is another signature);
* the decode path reads no tensor value on the host (what a CUDA graph or a compiled step needs): the whole
  in-op path runs on meta tensors, the kernels stubbed.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from closeness import close

import stable_attn
from stable_attn import call_cache
from stable_attn.kernels import decode_plan, naive
from stable_attn.kernels import triton_decode as td
from stable_attn.options import Options

attention_mod = importlib.import_module("stable_attn.attention")


def make(B, Hq, Hkv, Nq, Nk, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Nq, Hq, D, generator=g).to(dtype).transpose(1, 2)  # as transformers passes it
    k = torch.randn(B, Hkv, Nk + 5, D, generator=g).to(dtype)[:, :, :Nk]  # a view of a longer cache
    v = torch.randn(B, Hkv, Nk + 5, D, generator=g).to(dtype)[:, :, :Nk]
    kpm = torch.rand(B, Nk, generator=g) > 0.2
    kpm[0, :] = False  # a row without keys
    k[0, 0, 3] *= 40  # a huge logit for some rows
    return q, k, v, kpm


CASES = [
    # (backend, B, Hq, Hkv, Nq, Nk, kw): the decode kernel, the training kernel (17 queries), the PyTorch path
    ("triton", 2, 4, 2, 1, 77, dict(causal=True)),
    ("triton", 1, 4, 1, 3, 70, dict(causal=True, window=40, sinks=True)),
    ("triton", 2, 2, 2, 2, 50, dict(softcap=5.0, stabilize="paper")),
    ("triton", 1, 2, 1, 17, 40, dict(causal=True)),
    ("torch", 2, 4, 2, 1, 77, dict(causal=True)),
]


@pytest.mark.parametrize(("backend", "B", "Hq", "Hkv", "Nq", "Nk", "kw"), CASES)
def test_a_repeated_call_gives_the_full_paths_bits(backend, B, Hq, Hkv, Nq, Nk, kw, monkeypatch):
    kw = dict(kw)
    with_sinks = kw.pop("sinks", False)
    got, want = [], []
    for enabled in (True, False):
        monkeypatch.setattr(call_cache, "ENABLED", enabled)
        call_cache._calls.clear()
        outs = got if enabled else want
        for seed in range(3):  # the first call runs the checks; the others repeat its signature on new data
            q, k, v, kpm = make(B, Hq, Hkv, Nq, Nk, 16, torch.bfloat16, seed)
            sinks = torch.randn(Hq, generator=torch.Generator().manual_seed(seed)) if with_sinks else None
            with torch.no_grad():
                outs.append(stable_attn.attention(q, k, v, key_padding_mask=kpm, sinks=sinks, backend=backend,
                                                  block_n=16, **kw))
        if enabled:
            assert len(call_cache._calls) == 1
    for seed, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"call {seed}"
    oracle_kw = {name: kw[name] for name in ("causal", "window", "softcap") if name in kw}
    want64 = naive.attention(q.double(), k.double(), v.double(), scale=0.25, key_padding_mask=kpm, sinks=sinks,
                             **oracle_kw)  # the last call against the fp64 oracle
    close(got[-1], want64, 4, torch.bfloat16, "repeated call vs oracle")


def test_bad_input_still_raises_after_a_good_call_of_the_same_shapes():
    q, k, v, kpm = make(1, 2, 2, 1, 64, 16, torch.float32, seed=0)
    with torch.no_grad():
        stable_attn.attention(q, k, v, key_padding_mask=kpm, backend="torch", block_n=16)
        with pytest.raises(ValueError, match="stabilize=1"):
            stable_attn.attention(q, k, v, key_padding_mask=kpm, backend="torch", block_n=16, stabilize=1)
        with pytest.raises(ValueError, match="scale=nan"):
            stable_attn.attention(q, k, v, key_padding_mask=kpm, backend="torch", block_n=16, scale=float("nan"))
        with pytest.raises(TypeError, match="key_padding_mask must be a bool"):
            stable_attn.attention(q, k, v, key_padding_mask=kpm.int(), backend="torch", block_n=16)
        with pytest.raises((TypeError, ValueError), match="dtype"):
            stable_attn.attention(q, k, v.double(), key_padding_mask=kpm, backend="torch", block_n=16)
        with pytest.raises(TypeError, match="causal"):
            stable_attn.attention(q, k, v, key_padding_mask=kpm, backend="torch", block_n=16, causal="yes")
    # a call that needs a gradient is another signature: autograd gets its op
    q.requires_grad_(True)
    out = stable_attn.attention(q, k, v, key_padding_mask=kpm, backend="torch", block_n=16)
    assert out.grad_fn is not None


class _Stub:
    def __init__(self):
        self.grids = []

    def __getitem__(self, grid):
        return lambda **kwargs: self.grids.append((grid, kwargs))


def test_the_decode_path_reads_no_tensor_value_on_the_host(monkeypatch):
    """What runs inside the op for a decoding step (``attention._forward``: the split count, the prepared launch,
    its allocations and arguments) on meta tensors, which have no values: any host read would raise."""
    decode, combine = _Stub(), _Stub()
    monkeypatch.setattr(td, "attn_decode_kernel", decode)
    monkeypatch.setattr(td, "attn_decode_combine_kernel", combine)
    B, Hq, Hkv, Nk, D = 2, 8, 2, 4096, 64
    q = torch.empty(B, Hq, 1, D, dtype=torch.bfloat16, device="meta")
    k = torch.empty(B, Hkv, Nk, D, dtype=torch.bfloat16, device="meta")
    kpm = torch.empty(B, Nk, dtype=torch.bool, device="meta")
    sinks = torch.empty(Hq, device="meta")
    opts = Options(scale=0.125, causal=True, backend="triton", forward_only=True)
    for _ in range(2):  # prepared, then reused
        out, lse, _ = attention_mod._forward(q, k, k, sinks, kpm, None, opts, 0)
    assert out.shape == (B, Hq, 1, D) and out.device.type == "meta" and lse.shape == (B, Hq, 1)
    split = decode_plan.split_keys(B, Hkv, Nk, opts.key_block)
    (grid, args), = decode.grids[-1:]
    assert grid == (decode_plan.num_splits(Nk, split), Hkv, B) and args["split"] == split
    assert len(decode.grids) == len(combine.grids) == 2
