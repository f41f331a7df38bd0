"""The "stable_attn" mask builder, options, statistics and refusals of the transformers integration."""

from __future__ import annotations

import copy
import inspect
import itertools
import subprocess
import sys
from unittest import mock

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers import masking_utils as mu
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

import stable_attn.integrations.transformers as st
from stable_attn import AttentionStats

st.register()

# transformers >= 5.1x builds masks from q_length/q_offset, 5.0 from cache_position
NEW_SIGNATURE = "q_length" in inspect.signature(mu.sdpa_mask).parameters


def query_args(q_length: int, q_offset: int) -> dict:
    if NEW_SIGNATURE:
        return {"q_length": q_length, "q_offset": q_offset}
    return {"cache_position": torch.arange(q_offset, q_offset + q_length)}


LLAMA = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64)


def llama(impl: str = "stable_attn", **config_overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = copy.deepcopy(LLAMA)
    for k, v in config_overrides.items():
        setattr(config, k, v)
    return LlamaForCausalLM._from_config(config, attn_implementation=impl).eval()


def ids(batch: int = 2, n: int = 10) -> torch.Tensor:
    return torch.randint(0, 64, (batch, n), generator=torch.Generator().manual_seed(0))


def meaning(m: st.StableAttnMask, batch: int) -> torch.Tensor:
    """The boolean [B, 1, Nq, Nk] mask a StableAttnMask stands for, written out naively (with ``kv_used``, the
    keys after the first ``kv_used`` are seen by no query and the kernel gets the first ``kv_used`` only)."""
    used = m.kv_length if m.kv_used is None else m.kv_used
    q = torch.arange(m.q_length)[:, None] + (used - m.q_length)
    k = torch.arange(used)[None, :]
    visible = torch.ones(m.q_length, used, dtype=torch.bool)
    if m.causal:
        visible &= k <= q
        if m.window is not None:
            visible &= k > q - m.window
    out = visible.expand(batch, 1, m.q_length, used)
    if m.key_padding_mask is not None:
        out = out & m.key_padding_mask[:, None, None, :]
    return torch.nn.functional.pad(out, (0, m.kv_length - used), value=False)


def padding(batch: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, length, dtype=torch.bool)
    for b in range(batch):
        left, right = torch.randint(0, 3, (2,), generator=g).tolist()
        mask[b, :left] = False
        mask[b, length - right:] = False
    return mask


CASES = list(itertools.product(
    ["causal", "window", "bidirectional"],
    # (q_length, kv_length, q_offset, kv_offset): prefill, decode, chunked prefill, sliding cache, static cache
    [(5, 5, 0, 0), (1, 9, 8, 0), (3, 12, 9, 0), (1, 5, 10, 6), (4, 7, 7, 4), (3, 8, 2, 0)],
    [None, "pad", "ones"],
))


@pytest.mark.parametrize("kind, sizes, pad", CASES)
def test_compact_mask_means_exactly_what_sdpa_mask_builds(kind, sizes, pad):
    q_len, kv_len, q_off, kv_off = sizes
    batch = 3
    fn = {"causal": mu.causal_mask_function, "window": mu.sliding_window_causal_mask_function(4),
          "bidirectional": mu.bidirectional_mask_function}[kind]
    attention_mask = None
    if pad == "pad":
        attention_mask = padding(batch, kv_off + kv_len, seed=q_len * 31 + kv_len)
    elif pad == "ones":
        attention_mask = torch.ones(batch, kv_off + kv_len, dtype=torch.bool)
    args = dict(batch_size=batch, kv_length=kv_len, kv_offset=kv_off, **query_args(q_len, q_off),
                mask_function=fn, attention_mask=attention_mask, local_size=4 if kind == "window" else None)
    ours = st.stable_attn_mask(**args)
    exact = mu.sdpa_mask(**args, allow_is_causal_skip=False)
    aligned = kind == "bidirectional" or q_off - kv_off == kv_len - q_len
    # a static cache: a causal query sees no key after the last query, so the first ones are a causal prefix
    prefix = kind != "bidirectional" and q_len <= q_off + q_len - kv_off < kv_len
    if not aligned and not prefix:  # positions the kernel's bottom-right alignment cannot express: the exact mask
        assert isinstance(ours, torch.Tensor) and torch.equal(ours, exact)
        return
    assert isinstance(ours, st.StableAttnMask)
    assert (ours.causal, ours.window) == {"causal": (True, None), "window": (True, 4),
                                          "bidirectional": (False, None)}[kind]
    assert (ours.kv_used is not None) == prefix
    if not prefix:
        assert (ours.key_padding_mask is None) == (pad != "pad" or bool(attention_mask.all()))
    assert torch.equal(meaning(ours, batch), exact.expand(batch, 1, q_len, kv_len))


PACKED = torch.tensor([[0, 0, 0, 1, 1, 1]] * 2)  # two documents of three tokens per row


@pytest.mark.parametrize("make", [
    lambda: mu.and_masks(mu.causal_mask_function, lambda b, h, q, k: k % 2 == 0),
    lambda: mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function),
    lambda: mu.chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long)),
    lambda: mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(PACKED)),
    lambda: mu.and_masks(mu.sliding_window_overlay(2), mu.bidirectional_mask_function),  # a window, not causal
    lambda: (lambda b, h, q, k: k <= q),  # behaves causal, but is not transformers' function: not trusted
])
def test_other_patterns_get_the_exact_mask(make):
    args = dict(batch_size=2, kv_length=6, **query_args(6, 0), mask_function=make(),
                attention_mask=torch.tensor([[True] * 6, [False] + [True] * 5]))
    ours = st.stable_attn_mask(**args)
    assert isinstance(ours, torch.Tensor) and ours.dtype == torch.bool
    assert torch.equal(ours, mu.sdpa_mask(**args, allow_is_causal_skip=False))


@pytest.mark.parametrize(("q_offset", "window"), [(0, None), (3, None), (0, 3), (3, 3)])
def test_traced_static_prefill_is_the_causal_prefix_rotated(q_offset, window):
    """A static cache's prefill while tracing (its query offset a 0-dim tensor, the keys the whole cache): a
    causal mask whose filled prefix ends at ``kv_end``; the keys rotated so that it ends at the last key,
    the empty slots masked, the same attention as sdpa's exact mask (padding and a window included).
    transformers 5.0 passes ``cache_position`` instead: non-contiguous positions get the exact mask."""
    from stable_attn import AttentionStats, attention
    from stable_attn.integrations.transformers.masks import rotate_filled_prefix

    if not NEW_SIGNATURE:
        args = dict(batch_size=1, kv_length=8, mask_function=mu.causal_mask_function,
                    cache_position=torch.tensor([3, 5]))
        ours = st.stable_attn_mask(**args)
        assert isinstance(ours, torch.Tensor)
        assert torch.equal(ours, mu.sdpa_mask(**args, allow_is_causal_skip=False))
        return

    B, Nq, Nk = 2, 3, 10
    pad = torch.ones(B, Nk, dtype=torch.bool)
    pad[1, :2] = False  # left padding of the second row
    config = LlamaConfig(sliding_window=window)
    fn = mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)
    args = dict(batch_size=B, kv_length=Nk, mask_function=fn, attention_mask=pad, local_size=window, config=config,
                q_length=Nq)
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        ours = st.stable_attn_mask(**args, q_offset=torch.tensor(q_offset), allow_is_causal_skip=True)
    assert isinstance(ours, st.StableAttnMask) and ours.causal and ours.window == window
    assert int(ours.kv_end) == q_offset + Nq
    exact = mu.sdpa_mask(**args, q_offset=q_offset, allow_is_causal_skip=False)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, 2, n, 8, generator=g) for n in (Nq, Nk, Nk))
    k_rot, v_rot, kpm = rotate_filled_prefix(k, v, ours.key_padding_mask, ours.kv_end, keep_first=window is None)
    got_stats, want_stats = AttentionStats(), AttentionStats()
    got = attention(q, k_rot, v_rot, causal=True, window=window, key_padding_mask=kpm, stats=got_stats)
    want = attention(q, k, v, attn_mask=exact, stats=want_stats)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_stats.max_logit, want_stats.max_logit)
    if window is None:  # key 0 kept at position 0: the sink statistic is key 0's (an empty slot's before)
        assert want_stats.sink_mass.min() > 0.01
        torch.testing.assert_close(got_stats.sink_mass, want_stats.sink_mass, rtol=1e-5, atol=1e-6)
    else:  # a window measures positions: the plain rotation, whose position 0 is an empty slot (documented)
        assert torch.equal(got_stats.sink_mass, torch.zeros_like(got_stats.sink_mass))


@pytest.mark.parametrize("make", [lambda: mu.causal_mask_function, lambda: mu.sliding_window_causal_mask_function(3),
                                  lambda: mu.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long))])
def test_a_single_query_is_a_key_mask_whatever_the_pattern(make):
    """Decoding (one query per row): the exact mask is a key mask, so the kernel takes it as key padding
    (non-causal), including a static cache's tensor query offset and patterns it has no flag for."""
    padding = torch.tensor([[True] * 10, [False, False] + [True] * 8])
    args = dict(batch_size=2, kv_length=10, mask_function=make(), q_length=1, q_offset=torch.tensor(6),
                attention_mask=padding)
    ours = st.stable_attn_mask(**args)
    exact = mu.sdpa_mask(**args, allow_is_causal_skip=False)
    assert isinstance(ours, st.StableAttnMask) and not ours.causal and ours.window is None
    assert torch.equal(ours.key_padding_mask, exact[:, 0, 0])


def test_static_cache_prefill_is_a_causal_prefix():
    """A static cache's prefill (eager): causal over the filled prefix of the cache, the empty slots
    after it cut off (no query sees them); the keys the kernel sees, written out, are sdpa's mask."""
    padding = torch.tensor([[True] * 5, [False, False] + [True] * 3])
    args = dict(batch_size=2, kv_length=12, mask_function=mu.causal_mask_function, q_length=3,
                q_offset=torch.tensor(2), attention_mask=padding)
    ours = st.stable_attn_mask(**args)
    exact = mu.sdpa_mask(**args, allow_is_causal_skip=False)
    assert isinstance(ours, st.StableAttnMask) and ours.causal and ours.kv_used == 5
    written = torch.zeros(2, 3, 12, dtype=torch.bool)
    i = torch.arange(3)[:, None]
    j = torch.arange(5)[None, :]
    written[:, :, :5] = (j <= i + 5 - 3) & ours.key_padding_mask[:, None, :]
    assert torch.equal(written, exact[:, 0])


def test_register_is_idempotent_and_installs_both_functions():
    st.register()
    st.register()
    assert AttentionInterface()["stable_attn"] is st.stable_attn_attention_forward
    assert AttentionMaskInterface()["stable_attn"] is st.stable_attn_mask


def test_transformers_accepts_the_name_at_run_time():
    """transformers treats a name containing "flash" as a hub kernel and raises; ours must switch in."""
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16))
    model.set_attn_implementation(st.NAME)
    assert model.config._attn_implementation == st.NAME
    with pytest.raises(Exception, match="flash"):
        model.set_attn_implementation("flash_" + st.NAME)


def test_causal_lm_without_padding_builds_no_4d_mask(monkeypatch):
    seen = []
    real = st.attention_function.attention

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(st.attention_function, "attention", spy)
    model = llama()
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    model(input_ids=ids(), attention_mask=mask)
    assert len(seen) == 2
    for kw in seen:
        assert kw["attn_mask"] is None and kw["causal"] is True and kw["window"] is None
        assert torch.equal(kw["key_padding_mask"], mask.bool())
    seen.clear()
    model(input_ids=ids())
    assert all(kw["attn_mask"] is None and kw["key_padding_mask"] is None and kw["causal"] for kw in seen)


def test_output_attentions_raises_naming_feature_and_model():
    model = llama()
    with pytest.raises(ValueError, match=r"output_attentions=True.*|LlamaAttention") as err:
        model(input_ids=ids(), output_attentions=True)
    assert "LlamaAttention" in str(err.value) and "output_attentions" in str(err.value)
    model = llama(output_attentions=True)
    with pytest.raises(ValueError, match="output_attentions"):
        model(input_ids=ids())


class _Module(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("kwarg, words", [("position_bias", "position_bias"), ("indices", "sparse attention")])
def test_unsupported_model_features_raise(kwarg, words):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=words) as err:
        st.stable_attn_attention_forward(_Module(), q, q, q, None, **{kwarg: torch.zeros(1)})
    assert "_Module" in str(err.value)


def test_sinks_and_a_value_head_dim_are_served():
    """``s_aux`` (gpt-oss's sinks) reaches the op as ``sinks``; a value head dim apart from the query's gives an
    output with v's head dim (nothing padded); both as the fp64 oracle."""
    from stable_attn.kernels import naive

    q = torch.randn(1, 2, 4, 8)
    sinks = torch.tensor([0.5, -1.0])
    out, _ = st.stable_attn_attention_forward(_Module(), q, q, q[..., :4], None, scaling=0.5, s_aux=sinks)
    assert out.shape == (1, 4, 2, 4)
    want = naive.attention(q, q, q[..., :4], causal=True, scale=0.5, sinks=sinks)
    torch.testing.assert_close(out.transpose(1, 2).double(), want, rtol=1e-5, atol=1e-6)


def test_bad_masks_raise():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="attention mask of type str"):
        st.stable_attn_attention_forward(_Module(), q, q, q, "causal")
    with pytest.raises(ValueError, match="learned additive attention mask"):
        st.stable_attn_attention_forward(_Module(), q, q, q, torch.zeros(4, 4, requires_grad=True))
    stale = st.StableAttnMask(True, None, None, q_length=4, kv_length=5)
    with pytest.raises(RuntimeError, match="kv_length=5"):
        st.stable_attn_attention_forward(_Module(), q, q, q, stale)
    with pytest.raises(ValueError, match=r"_Module.*head dim D=600"):
        big = torch.randn(1, 1, 2, 600)
        st.stable_attn_attention_forward(_Module(), big, big, big, None)


def test_options_from_configure_and_from_config(monkeypatch):
    seen = []
    real = st.attention_function.attention

    def spy(*args, **kwargs):
        seen.append({k: kwargs[k] for k in ("stabilize", "beta", "backend", "block_n")})
        return real(*args, **kwargs)

    monkeypatch.setattr(st.attention_function, "attention", spy)
    model = llama(stable_attn={"beta": 4.0, "stabilize": "paper"})
    model(input_ids=ids())
    assert seen[-1] == {"stabilize": "paper", "beta": 4.0, "backend": "auto", "block_n": None}
    st.configure(model, stabilize=False, beta=3.0, backend="torch", block_n=16)  # takes precedence
    model(input_ids=ids())
    assert seen[-1] == {"stabilize": False, "beta": 3.0, "backend": "torch", "block_n": 16}
    assert len(seen) == 4
    with pytest.raises(ValueError, match="stabilize='yes'"):
        st.configure(model, stabilize="yes")
    with pytest.raises(ValueError, match=r"unknown keys \['betta'\]"):
        llama(stable_attn={"betta": 4.0})(input_ids=ids())
    with pytest.raises(ValueError, match=r"LlamaAttention.*beta=0.5"):
        llama(stable_attn={"beta": 0.5})(input_ids=ids())


def test_attach_and_detach_stats():
    model = llama()
    stats = st.attach_stats(model)
    assert list(stats) == ["layer0", "layer1"]
    assert st.attach_stats(model) == stats and all(st.attach_stats(model)[k] is stats[k] for k in stats)
    model(input_ids=ids(2, 10))
    for s in stats.values():
        assert isinstance(s, AttentionStats) and s.calls == 1
        assert s.rows.tolist() == [20] * 4  # per query head: batch 2 x 10 rows
    stats["layer1"].enabled = False
    model(input_ids=ids())
    assert stats["layer0"].calls == 2 and stats["layer1"].calls == 1
    st.detach_stats(model)
    model(input_ids=ids())
    assert stats["layer0"].calls == 2
    assert not any(hasattr(m, "stable_attn_stats") for _, m in st.attention_modules(model))


def test_attention_modules_finds_the_modules_the_function_receives():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=3, n_head=4))
    names = [n for n, _ in st.attention_modules(gpt2)]
    assert names == ["transformer.h.0.attn", "transformer.h.1.attn", "transformer.h.2.attn"]
    with pytest.raises(ValueError, match="Linear has no attention module"):
        st.attach_stats(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        st.attention_modules("gpt2")


def test_import_stable_attn_alone_registers_with_transformers():
    """In a fresh interpreter (this one already called register()), the import is the whole switch."""
    code = (
        "import stable_attn\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "from transformers.modeling_utils import AttentionInterface\n"
        "from stable_attn.integrations import transformers as st\n"
        "assert AttentionInterface()['stable_attn'] is st.stable_attn_attention_forward\n"
        "assert AttentionMaskInterface()['stable_attn'] is st.stable_attn_mask\n"
        "config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,\n"
        "                     num_attention_heads=2, max_position_embeddings=16)\n"
        "model = LlamaForCausalLM._from_config(config, attn_implementation='stable_attn')\n"
        "stats = st.attach_stats(model)\n"
        "model(input_ids=__import__('torch').zeros(1, 4, dtype=__import__('torch').long))\n"
        "assert stats['layer0'].calls == 1\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_traced_recognition_checks_what_it_infers():
    """While tracing, closures cannot be read: the pattern is inferred from static information and checked
    against the mask function on the device. A packed causal mask passes (documents read from the mask); a
    block-wise overlay (image tokens bidirectional) that looks the same from outside fails loudly; a chunked
    mask (its local_size is not the config's sliding window) is not taken for a window."""
    segments = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    packed = mu.and_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, positions),
                          mu.packed_sequence_mask_function(segments))
    blocks = torch.tensor([[-1, 0, 0, 0, -1, -1, -1, -1]])
    with_blocks = mu.and_masks(mu.or_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, positions),
                                           mu.blockwise_overlay(blocks)), mu.packed_sequence_mask_function(segments))
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        # masking_utils turns the causal skip off exactly when it packs: that is how a packed closure is told
        ours = st.stable_attn_mask(1, 8, mask_function=packed, q_length=8, q_offset=0, allow_is_causal_skip=False)
        assert isinstance(ours, st.StableAttnMask) and ours.causal and ours.window is None
        assert ours.cu_seqlens.tolist()[:4] == [0, 3, 5, 8] and set(ours.cu_seqlens.tolist()[3:]) == {8}
        with pytest.raises(RuntimeError, match="not the causal/window/packed pattern"):
            st.stable_attn_mask(1, 8, mask_function=with_blocks, q_length=8, q_offset=0, allow_is_causal_skip=False)
        # a sliding window with a cache (the skip allowed): not packed, no documents in the mask; its pattern is
        # checked (a packed closure taken for a plain window fails loudly)
        window = mu.sliding_window_causal_mask_function(3)
        config = LlamaConfig(sliding_window=3)
        plain = st.stable_attn_mask(1, 8, mask_function=window, local_size=3, q_length=8, q_offset=0, config=config,
                                    allow_is_causal_skip=True)
        assert isinstance(plain, st.StableAttnMask) and plain.window == 3 and plain.cu_seqlens is None
        with pytest.raises(RuntimeError, match="not the causal/window/packed pattern"):
            st.stable_attn_mask(1, 8, mask_function=packed, local_size=3, q_length=8, q_offset=0, config=config,
                                allow_is_causal_skip=True)
        chunked = mu.chunked_causal_mask_function(3, torch.zeros(1, dtype=torch.long))
        config = LlamaConfig(sliding_window=None)
        # a prefill after 2 cached tokens: not the packed path, and the chunk size is not taken for a window
        got = st.stable_attn_mask(1, 10, mask_function=chunked, local_size=3, q_length=8, q_offset=2, config=config)
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, mu.sdpa_mask(1, 8, 10, q_offset=2, mask_function=chunked, allow_is_causal_skip=False))
