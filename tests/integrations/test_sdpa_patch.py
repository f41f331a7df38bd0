"""patch_sdpa(): a nanoGPT-style model gets the same logits and gradients, and sdpa comes back after."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stable_attn.integrations.sdpa as sdpa_mod
from stable_attn.integrations.sdpa import is_sdpa_patched, patch_sdpa, unpatch_sdpa

ORIGINAL = F.scaled_dot_product_attention


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, block_size: int = 32, n_layer: int = 2, n_embd: int = 32, n_head: int = 4,
                 dropout: float = 0.0):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def logits_and_grads(model, idx):
    model.zero_grad(set_to_none=True)
    logits = model(idx)
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls that reach stable_attn.attention through the patch."""
    seen = []
    real = sdpa_mod.attention

    def counting(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(sdpa_mod, "attention", counting)
    yield seen
    unpatch_sdpa()
    assert F.scaled_dot_product_attention is ORIGINAL


def test_nanogpt_same_logits_and_gradients_and_restored(spy):
    torch.manual_seed(0)
    model = GPT()
    idx = torch.randint(0, 64, (3, 24), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = logits_and_grads(model, idx)
    assert spy == []
    with patch_sdpa(backend="torch") as handle:
        assert F.scaled_dot_product_attention is not ORIGINAL and is_sdpa_patched() and handle.active
        logits, grads = logits_and_grads(model, idx)
    assert F.scaled_dot_product_attention is ORIGINAL and not is_sdpa_patched() and not handle.active
    assert len(spy) == 2 and all(kw["causal"] is True and kw["attn_mask"] is None for kw in spy)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
    scale = max(g.abs().max().item() for g in ref_grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6 * scale, msg=name)


def test_permanent_patch_restore_and_nesting(spy):
    handle = patch_sdpa()
    assert F.scaled_dot_product_attention is handle.wrapper
    unpatch_sdpa()
    assert F.scaled_dot_product_attention is ORIGINAL and not handle.active
    handle.restore()  # idempotent
    outer = patch_sdpa(beta=4.0)
    inner = patch_sdpa(stabilize="paper")
    with pytest.raises(RuntimeError, match="restore the later patch first"):
        outer.restore()
    q = torch.randn(1, 2, 5, 8)
    F.scaled_dot_product_attention(q, q, q)
    assert spy[-1]["stabilize"] == "paper"
    inner.restore()
    F.scaled_dot_product_attention(q, q, q)
    assert spy[-1]["beta"] == 4.0 and spy[-1]["stabilize"] is True
    outer.restore()
    assert F.scaled_dot_product_attention is ORIGINAL


def _inputs(hq=4, hkv=4, nq=7, nk=7, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, nq, d, generator=g).to(dtype)
    k = torch.randn(2, hkv, nk, d, generator=g).to(dtype)
    v = torch.randn(2, hkv, nk, d, generator=g).to(dtype)
    return q, k, v


def _bool_mask():
    m = torch.rand(2, 1, 7, 9, generator=torch.Generator().manual_seed(3)) > 0.3
    m[..., 0] = True
    return m


SERVED = {
    "plain": (dict(), {}),
    "causal": (dict(), {"is_causal": True}),
    "causal top-left Nq<Nk": (dict(nq=5, nk=9), {"is_causal": True}),
    "bool mask": (dict(nk=9), {"attn_mask": _bool_mask()}),
    "float mask": (dict(nk=9), {"attn_mask": torch.randn(1, 4, 7, 9)}),
    "gqa + scale": (dict(hkv=2), {"enable_gqa": True, "scale": 0.3, "is_causal": True}),
}


@pytest.mark.parametrize("case", list(SERVED))
def test_served_calls_match_sdpa(case, spy):
    shape, kwargs = SERVED[case]
    q, k, v = (t.requires_grad_() for t in _inputs(**shape))
    ref = ORIGINAL(q, k, v, **kwargs)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a served call never warns
        with patch_sdpa():
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert len(spy) == 1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(torch.autograd.grad(out.square().sum(), (q, k, v)), ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_dropout_is_served_and_drops(spy):
    q, k, v = _inputs()
    with patch_sdpa():
        torch.manual_seed(0)
        dropped = F.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
        clean = F.scaled_dot_product_attention(q, k, v)
    assert [kw["dropout_p"] for kw in spy] == [0.4, 0.0]
    assert (dropped - clean).abs().max() > 1e-2


def test_a_value_head_dim_apart_from_the_querys_is_served(spy):
    q, k, _ = _inputs()
    v = _inputs(d=4)[2]
    with patch_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert len(spy) == 1 and out.shape == (*q.shape[:3], 4)
    torch.testing.assert_close(out, ORIGINAL(q, k, v, is_causal=True), rtol=1e-5, atol=1e-6)


PASSED_ON = {
    "float64": (lambda: _inputs(dtype=torch.float64), {}, "dtypes torch.float64"),
    "head dim 640": (lambda: _inputs(d=640), {}, "head dim 640 > 512"),
    "rank 3": (lambda: tuple(t[0] for t in _inputs()), {}, "inputs of rank 3"),
    "learned mask": (lambda: _inputs(), {"attn_mask": torch.zeros(7, 7, requires_grad=True)}, "requires grad"),
}


@pytest.mark.parametrize("case", list(PASSED_ON))
def test_other_calls_go_to_the_original_with_one_warning(case, spy):
    make, kwargs, reason = PASSED_ON[case]
    q, k, v = make()
    sdpa_mod._warned.clear()
    with patch_sdpa():
        with pytest.warns(RuntimeWarning, match=reason):
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            F.scaled_dot_product_attention(q, k, v, **kwargs)  # the same reason warns only once
    assert spy == []
    torch.testing.assert_close(out, ORIGINAL(q, k, v, **kwargs), rtol=0, atol=0)


def test_a_scale_options_refuse_goes_to_the_original(spy):
    """scale=1e-39 is finite and positive, but scale * log2(e) is below fp32's normal range, which
    options.scale_problem (what attention() raises on) refuses: the patch must not serve it."""
    q, k, v = _inputs()
    sdpa_mod._warned.clear()
    with patch_sdpa(), pytest.warns(RuntimeWarning, match=r"scale=1e-39"):
        out = F.scaled_dot_product_attention(q, k, v, scale=1e-39)
    assert spy == []
    torch.testing.assert_close(out, ORIGINAL(q, k, v, scale=1e-39), rtol=0, atol=0)


def test_invalid_calls_still_raise_like_sdpa(spy):
    q, k, v = _inputs(hkv=2)
    with patch_sdpa(), pytest.warns(RuntimeWarning, match="head counts"), pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)  # GQA shapes without enable_gqa=True: sdpa's own error


def test_patch_options_are_checked_before_patching():
    with pytest.raises(ValueError, match="beta=1.0"):
        patch_sdpa(beta=1.0)
    with pytest.raises(ValueError, match="backend='cuda'"):
        patch_sdpa(backend="cuda")
    assert F.scaled_dot_product_attention is ORIGINAL


def test_transformers_sdpa_models_are_routed_too(spy):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=idx).logits
        with patch_sdpa():
            out = model(input_ids=idx).logits
    assert len(spy) == 2
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
