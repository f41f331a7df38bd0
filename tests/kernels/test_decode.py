"""The decode path (kernels/decode_plan.py, reference_decode.py, triton_decode.py): split keys, the rule per split.

Three kinds of checks, on small shapes the interpreter runs in seconds (key blocks of 16 or 32 keys, so a
cache of a few hundred keys has many blocks and several splits):

* **decisions**: on inputs whose scores are exact in fp32 whatever the summation order (margins.on_grid,
  many ties at the max), the kernel's per-split offsets ``r`` and maxima ``m`` are the PyTorch mirror's bits,
  in every mode, causal or not, with a window, GQA, key padding;
* **accuracy**: on random inputs (ties at the max, rows without keys, huge logits, odd cache lengths, window,
  softcap, GQA, 1 to 16 queries) the output is within a few ulps of the fp64 oracle and of the training
  kernel's (not bit-equal to the latter: split restarts change offsets, docs/ALGORITHM.md "Decode: split
  keys"); ``lse`` within fp32 noise;
* **dispatch**: which ``attention()`` calls take the path, on both backends.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from closeness import close
from margins import on_grid, scores_exact_in_fp32

import stable_attn
from stable_attn import rules
from stable_attn.kernels import decode_launch, decode_plan, naive, reference, reference_decode
from stable_attn.kernels import triton_attention as ta
from stable_attn.kernels import triton_decode as td
from stable_attn.options import Options

DEVICE = os.environ.get("STABLE_ATTN_TEST_DEVICE", "cpu")


def make(B, Hq, Hkv, Nq, Nk, D, dtype, seed, qk_std=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=g) * qk_std
    k = torch.randn(B, Hkv, Nk, D, generator=g) * qk_std
    v = torch.randn(B, Hkv, Nk, D, generator=g)
    return [t.to(dtype).to(DEVICE) for t in (q, k, v)]


def tie_grid(B, Hq, Hkv, Nq, Nk, D, dtype, seed, level):
    """q, k on a coarse grid (scores small integers times 1/4, plus ``level`` via dimension 0: the sign of the
    max): exact in fp32 in any order, many exact ties at every row's max, in every block and split."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-1, 2, (B, Hq, Nq, D), generator=g).float()
    k = torch.randint(-1, 2, (B, Hkv, Nk, D), generator=g).float()
    q[..., 0], k[..., 0] = level, 1.0
    v = torch.randn(B, Hkv, Nk, D, generator=g)
    q, k = on_grid(q), on_grid(k)
    assert scores_exact_in_fp32(q, k)
    return [t.to(dtype).to(DEVICE) for t in (q, k, v)]


def padding(B, Nk, seed, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    kpm = torch.rand(B, Nk, generator=g) > 0.2
    if empty_row:
        kpm[0] = False  # batch element 0 sees no key at all
    return kpm.to(DEVICE)


# --------------------------------------------------------------------------------------------- the plan


def test_split_keys_share_the_blocks_out_over_the_target_programs():
    assert decode_plan.split_keys(1, 8, 4096, 64) == 128  # 64 blocks over 32 splits: 2 blocks each
    assert decode_plan.split_keys(1, 8, 32768, 64) == 1024  # 512 blocks over 32 splits
    assert decode_plan.split_keys(32, 8, 4096, 64) == 4096  # 256 programs already: one split
    assert decode_plan.split_keys(1, 1, 100, 64) == 64  # never less than a block
    for B, H, N, bn in [(1, 8, 4097, 64), (3, 2, 333, 16), (2, 4, 32768, 128)]:
        split = decode_plan.split_keys(B, H, N, bn)
        S = decode_plan.num_splits(N, split)
        assert split % bn == 0 and (S - 1) * split < N <= S * split
        assert B * H * S <= decode_plan.TARGET_PROGRAMS or split == bn


@pytest.mark.parametrize("split", [0, 40, 8, 1.5])
def test_a_split_that_cuts_a_key_block_is_refused(split):
    with pytest.raises(ValueError, match="multiple of the key block"):
        decode_plan.check_split(split, 16)


# --------------------------------------------------------------------------------------------- decisions

DECISION_CASES = [
    # (mode, causal, window, G, Nq, Nk, kpm, level)
    (rules.MODE_EXACT, False, None, 1, 1, 197, False, 0.0),
    (rules.MODE_EXACT, True, None, 4, 5, 200, True, 2.0),
    (rules.MODE_EXACT, True, 40, 2, 16, 161, False, -2.0),
    (rules.MODE_PAPER, False, 70, 4, 3, 190, True, 2.0),
    (rules.MODE_OFF, True, None, 1, 2, 130, True, 0.0),
    (rules.MODE_EXACT, True, None, 8, 9, 140, True, 2.0),  # 72 packed rows: two row blocks of 64
]


@pytest.mark.parametrize("mode,causal,window,G,Nq,Nk,kpm,level", DECISION_CASES)
def test_split_offsets_are_the_mirrors_bits(mode, causal, window, G, Nq, Nk, kpm, level):
    """Every split's final offset ``r`` and max ``m`` (the state the rule's decisions leave) are the same bits
    on the kernel and on the PyTorch mirror, where the scores are exact; ``l`` and ``acc`` within fp32
    summation-order noise. And the rule does fire in these splits (the ties are real)."""
    Hkv = 2
    q, k, v = tie_grid(2, Hkv * G, Hkv, Nq, Nk, 16, torch.bfloat16, seed=Nk, level=level)
    mask = padding(2, Nk, seed=Nk, empty_row=False) if kpm else None
    opts = Options(causal=causal, window=window, mode=mode, scale=0.25, block_n=16)
    split = 48  # three blocks per split, the last split short
    got = td.forward(q, k, v, mask, opts, split=split, return_partials=True)[3]
    want = reference_decode.partials(q, k, v, mask, opts, split)
    acc, l_s, r_s, m_s = (x.cpu() for x in got)
    assert torch.equal(r_s, want[2]) and torch.equal(m_s, want[3])
    torch.testing.assert_close(l_s, want[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(acc, want[0], rtol=1e-5, atol=1e-5)
    if mode != rules.MODE_OFF:  # some split's offset was moved off its max by a fire
        assert (r_s > m_s).any()


def test_a_split_restarts_the_offset():
    """A split starts from the initial state. Key 0 scores 8, every other key 0 (ties in every block): the
    training walk keeps the offset at key 0's score and never fires again (the ties lie far below it), while
    every later split restarts, fires on its own ties at 0 and takes the shifted offset of 0."""
    q, k, v = tie_grid(1, 2, 2, 1, 128, 16, torch.bfloat16, seed=0, level=1.0)
    k[..., 0] = 0.0
    k[..., 1:] = 0.0
    k[:, :, 0, 0] = 8.0
    opts = Options(scale=0.25, block_n=16)
    r_s = td.forward(q, k, v, None, opts, split=32, return_partials=True)[3][2].cpu()
    top = torch.tensor(8.0) * torch.tensor(opts.qk_scale2, dtype=torch.float32)
    shifted = rules.shifted_offset(torch.zeros(()), opts.beta, *rules.rule_constants(torch.bfloat16, opts.mode)[1:])
    assert torch.equal(r_s[..., 0], torch.full_like(r_s[..., 0], float(top)))
    assert torch.equal(r_s[..., 1:], torch.full_like(r_s[..., 1:], float(shifted)))
    lse = td.forward(q, k, v, None, opts, split=32)[1].cpu()
    assert (lse - oracle_lse2(q, k, opts, None)).abs().max() <= LSE_TOL[opts.mode]  # the same softmax all the same


# --------------------------------------------------------------------------------------------- accuracy


# |lse2 - the oracle's|: exact mode's row sum adds P-bar rounded to bf16 (relative error <= 2^-9 per weight:
# log2(1 + 2^-9) in lse2), the other modes add the fp32 P-bar
LSE_TOL = {rules.MODE_EXACT: math.log2(1 + 2.0**-9) + 1e-5, rules.MODE_PAPER: 1e-5, rules.MODE_OFF: 1e-5}


def oracle_lse2(q, k, opts, kpm):
    """The fp64 base-2 log-sum-exp of every row, ``[B, Hq, Nq]`` (+inf where a row sees no key, as the kernels)."""
    per_batch = naive.scores(q.cpu(), k.cpu(), causal=opts.causal, scale=opts.scale, window=opts.window,
                             softcap=opts.softcap, key_padding_mask=None if kpm is None else kpm.cpu())
    lse = torch.stack([torch.logsumexp(s, -1) for s in per_batch]) / math.log(2)
    return torch.where(torch.isinf(lse), torch.full_like(lse, math.inf), lse).float()


def oracle(q, k, v, opts, kpm):
    return naive.attention(q.cpu(), k.cpu(), v.cpu(), causal=opts.causal, scale=opts.scale, window=opts.window,
                           softcap=opts.softcap, key_padding_mask=None if kpm is None else kpm.cpu())


ACCURACY_CASES = [
    # (G, Nq, Nk, causal, window, softcap, kpm, qk_std)
    (1, 1, 257, False, None, None, True, 1.0),
    (4, 1, 199, True, None, None, True, 1.0),
    (4, 3, 161, True, 50, None, False, 1.0),
    (2, 16, 130, True, None, 2.0, True, 2.0),
    (1, 7, 211, False, 64, 5.0, False, 1.0),
    (4, 2, 150, False, None, None, False, 30.0),  # huge logits: |s| in the hundreds
]


@pytest.mark.parametrize("G,Nq,Nk,causal,window,softcap,kpm,qk_std", ACCURACY_CASES)
@pytest.mark.parametrize("mode", [rules.MODE_EXACT, rules.MODE_OFF])
def test_decode_matches_the_oracle_and_the_training_kernel(G, Nq, Nk, causal, window, softcap, kpm, qk_std, mode):
    Hkv, D = 2, 16
    q, k, v = make(2, Hkv * G, Hkv, Nq, Nk, D, torch.bfloat16, seed=Nk + Nq, qk_std=qk_std)
    if qk_std == 1.0:  # copies of one key: ties at the max in several splits
        k[:, :, 5] = k[:, :, 70] = k[:, :, 71] = k[:, :, 140] = q[:, 0, -1]
    mask = padding(2, Nk, seed=Nk) if kpm else None
    opts = Options(causal=causal, window=window, softcap=softcap, mode=mode, scale=1 / math.sqrt(D), block_n=16)
    out, lse, _ = td.forward(q, k, v, mask, opts, split=32)
    mirror, lse_m, _ = reference_decode.attention_forward(q, k, v, mask, opts, split=32)
    train, lse_t, _ = ta.forward(q, k, v, mask, opts, False)
    exact = oracle(q, k, v, opts, mask)
    close(out, exact, 4, torch.bfloat16, "decode vs oracle")
    close(mirror, exact, 4, torch.bfloat16, "mirror vs oracle")
    close(out, train, 4, torch.bfloat16, "decode vs training kernel")
    close(out, mirror, 2, torch.bfloat16, "decode vs mirror")
    want = oracle_lse2(q, k, opts, mask)
    finite = torch.isfinite(want)
    for what, x in (("decode", lse), ("mirror", lse_m), ("training", lse_t)):
        x = x.cpu()
        assert torch.equal(x[~finite], want[~finite]), what
        err = (x[finite].double() - want[finite].double()).abs() / want[finite].double().abs().clamp(min=1)
        assert err.max() <= LSE_TOL[mode], f"{what} lse2: {err.max():.3g}"
    if kpm:  # batch element 0 sees no key: zeros and lse = +inf, as the training kernel
        assert (out[0] == 0).all() and (lse[0] == math.inf).all()


def test_huge_tied_logits_stay_finite_and_correct():
    """Tied maxima near +1e4 in every split (the published rule underflows there): the split rule shifts
    each split's offset by at most MAX_SHIFT, and the output is the oracle's."""
    q, k, v = make(1, 4, 2, 1, 160, 16, torch.bfloat16, seed=3)
    q[..., 0], q[..., 1:] = 100.0, 0.0
    k[..., 0], k[..., 1:] = 0.0, 0.0
    k[:, :, [3, 7, 40, 41, 100, 159], 0] = 100.0
    opts = Options(scale=1.0, block_n=16)
    out, _, _ = td.forward(q, k, v, None, opts, split=32)
    close(out, oracle(q, k, v, opts, None), 2, torch.bfloat16, "huge ties")


# --------------------------------------------------------------------------------------------- dispatch


@pytest.fixture
def decode_calls(monkeypatch):
    """Counts the decode forwards of each backend."""
    calls = {"torch": 0, "triton": 0}

    def counting(module, name, key):
        real = getattr(module, name)

        def spy(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)

    counting(reference_decode, "attention_forward", "torch")
    counting(decode_launch.DecodeLaunch, "run", "triton")  # every route to the decode kernel
    return calls


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_takes_the_decode_path_for_a_decoding_step(backend, decode_calls):
    """No gradient needed, one query against a padded cache of several blocks: the decode path, on both
    backends, with the same output as the decode functions give (the torch backend: the same bits)."""
    q, k, v = make(2, 4, 2, 1, 100, 16, torch.bfloat16, seed=1)
    kpm = padding(2, 100, seed=1, empty_row=False)
    with torch.no_grad():
        out = stable_attn.attention(q, k, v, key_padding_mask=kpm, backend=backend, block_n=16)
    assert decode_calls[backend] == 1
    opts = Options(scale=0.25, block_n=16)
    want = reference_decode.attention_forward(q, k, v, kpm, opts)[0]
    if backend == "torch":
        assert torch.equal(out, want)
    else:
        close(out, want, 2, torch.bfloat16, "triton decode vs torch decode")


@pytest.mark.parametrize("case", ["grad", "stats", "attn_mask", "dropout", "17 queries", "one block"])
def test_other_calls_keep_the_training_path(case, decode_calls):
    Nq, Nk = (17, 100) if case == "17 queries" else (1, 16 if case == "one block" else 100)
    q, k, v = make(1, 2, 2, Nq, Nk, 16, torch.float32, seed=2)
    kw = dict(backend="torch", block_n=16)
    if case == "grad":
        q.requires_grad_(True)
    if case == "stats":
        kw["stats"] = stable_attn.AttentionStats()
    if case == "attn_mask":
        kw["attn_mask"] = torch.ones(Nq, Nk, dtype=torch.bool)
    if case == "dropout":
        kw["dropout_p"] = 0.1
    with torch.set_grad_enabled(case == "grad"):
        out = stable_attn.attention(q, k, v, **kw)
    assert decode_calls["torch"] == 0
    if case in ("grad", "17 queries", "one block"):  # the training path's bits
        opts = Options(scale=0.25, block_n=16)
        assert torch.equal(out.detach(), reference.attention_forward(q.detach(), k, v, None, None, opts)[0])


def test_the_decode_path_runs_under_torch_compile(decode_calls):
    """The decision reads requires_grad and the grad mode, which dynamo guards on: compiled, the op still
    takes the decode path and gives the eager result."""
    q, k, v = make(1, 4, 2, 1, 100, 16, torch.float32, seed=4)
    f = torch.compile(lambda a, b, c: stable_attn.attention(a, b, c, backend="torch", block_n=16), fullgraph=True)
    with torch.no_grad():
        got = f(q, k, v)
    assert decode_calls["torch"] == 1
    want = reference_decode.attention_forward(q, k, v, None, Options(scale=0.25, block_n=16))[0]
    assert torch.equal(got, want)
