"""Padding-free training: packed documents through ``attn_implementation="stable_attn"``.

``DataCollatorWithFlattening`` packs a batch of documents into one row whose ``position_ids`` restart
at 0 for each document. The loss, the logits and every parameter gradient of the packed batch must
equal running each document on its own (through ``"eager"``, an independent implementation), with
the config's default ``use_cache`` (a cache is built, ``masking_utils`` then makes a plain causal mask
and the documents are read from ``position_ids``) and with ``use_cache=False`` (``masking_utils``
builds its packed-sequence mask, which the mask builder recognizes), on the PyTorch path and on the
Triton kernels under the interpreter. Every layer must be served by ``attention_varlen``; the dense
op never sees the packed batch, and the arbitrary-mask fallback (``attn_mask``) is never taken.
Families: Llama, Qwen3, GPT-2, Mistral (sliding window) and Gemma 2 (alternating sliding/global layers,
softcap). Tiny models (2 layers, width 32): the interpreter is slow.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import NAMES, config
from tiny_models import build as build_model
from transformers import DataCollatorWithFlattening
from transformers import masking_utils as mu

import stable_attn.integrations.transformers as st

VOCAB = 64
DOC_LENGTHS = (7, 1, 12, 5)  # a one-token document, one longer than the window (tiny_models.WINDOW)

st.register()

FAMILIES = NAMES


def build(name: str, impl: str) -> torch.nn.Module:
    return build_model(name, impl, VOCAB).eval()


def documents(lengths=DOC_LENGTHS, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def separately(name: str, docs: list[torch.Tensor]):
    """Loss over all predicted tokens, logits and gradients, each document run on its own by eager."""
    model = build(name, "eager")
    n_predicted = sum(len(d) - 1 for d in docs)
    total, logits = 0.0, []
    for d in docs:
        out = model(input_ids=d[None], labels=d[None] if len(d) > 1 else None, use_cache=False)
        logits.append(out.logits[0].detach())
        if len(d) > 1:  # a one-token document predicts nothing (its only label is the separator)
            total = total + out.loss * (len(d) - 1) / n_predicted
    total.backward()
    return total.detach(), torch.cat(logits), grads(model)


class Calls:
    """Spies on the two ops the attention function may call (``fallback``: calls with an ``attn_mask``)."""

    def __init__(self, monkeypatch):
        self.dense, self.varlen, self.fallback = 0, 0, 0
        real_dense, real_varlen = st.attention_function.attention, st.attention_function.attention_varlen

        def dense(*args, **kwargs):
            self.dense += 1
            self.fallback += kwargs.get("attn_mask") is not None
            return real_dense(*args, **kwargs)

        def varlen(*args, **kwargs):
            self.varlen += 1
            return real_varlen(*args, **kwargs)

        monkeypatch.setattr(st.attention_function, "attention", dense)
        monkeypatch.setattr(st.attention_function, "attention_varlen", varlen)


def assert_matches(name, loss, logits, got_grads, want, what, rtol=2e-5):
    want_loss, want_logits, want_grads = want
    torch.testing.assert_close(loss, want_loss, rtol=rtol, atol=1e-6, msg=lambda m: f"{what} loss: {m}")
    scale = want_logits.abs().max().item()
    torch.testing.assert_close(logits, want_logits, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what} logits: {m}")
    assert got_grads.keys() == want_grads.keys()
    top = max(g.abs().max().item() for g in want_grads.values())
    for n, g in want_grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=rtol, atol=rtol * top, msg=lambda m, n=n: f"{what} d{n}: {m}")


_REFERENCE: dict[str, tuple] = {}


def reference(name: str):
    if name not in _REFERENCE:
        _REFERENCE[name] = separately(name, documents())
    return _REFERENCE[name]


CASES = [(name, backend, use_cache) for name in FAMILIES for backend in ("torch", "triton") for use_cache in
         (None, False)]


@pytest.mark.parametrize(("name", "backend", "use_cache"), CASES)
def test_packed_batch_equals_documents_run_separately(monkeypatch, name, backend, use_cache):
    docs = documents()
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist(), "labels": d.tolist()}
                                                             for d in docs])
    assert batch["input_ids"].shape == (1, sum(DOC_LENGTHS)) and "attention_mask" not in batch
    model = build(name, "stable_attn")
    st.configure(model, backend=backend)
    calls = Calls(monkeypatch)
    extra = {} if use_cache is None else {"use_cache": use_cache}
    out = model(**batch, **extra)
    out.loss.backward()
    assert (calls.varlen, calls.dense, calls.fallback) == (2, 0, 0), "every layer on the varlen op, nothing else"
    assert_matches(name, out.loss.detach(), out.logits[0].detach(), grads(model), reference(name),
                   f"{name} {backend} use_cache={use_cache}")


@pytest.mark.parametrize("use_cache", [None, False])
def test_several_packed_rows_and_flash_kwargs(monkeypatch, use_cache):
    """Two packed rows (B = 2), each row's documents on their own; FlashAttention's cu_seq_lens kwargs too."""
    name = "llama"
    rows = [(5, 3, 4), (2, 10)]
    docs = [documents(r, seed=2 + i) for i, r in enumerate(rows)]
    collate = DataCollatorWithFlattening(return_tensors="pt")
    packed = [collate([{"input_ids": d.tolist(), "labels": d.tolist()} for d in row]) for row in docs]
    batch = {k: torch.cat([p[k] for p in packed]) for k in ("input_ids", "labels", "position_ids")}
    model = build(name, "stable_attn")
    calls = Calls(monkeypatch)
    extra = {} if use_cache is None else {"use_cache": use_cache}
    out = model(**batch, **extra)
    assert (calls.varlen, calls.dense, calls.fallback) == (2, 0, 0)
    flat = [d for row in docs for d in row]
    want_logits = separately(name, flat)[1]
    torch.testing.assert_close(out.logits.reshape(-1, VOCAB).detach(), want_logits, rtol=2e-5, atol=2e-5)

    # DataCollatorWithFlattening(return_flash_attn_kwargs=True): the cu_seq_lens the model forwards to attention
    one = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True)(
        [{"input_ids": d.tolist(), "labels": d.tolist()} for d in docs[0]])
    assert "cu_seq_lens_q" in one
    got = model(**one, **extra).logits[0].detach()
    torch.testing.assert_close(got, separately(name, docs[0])[1], rtol=2e-5, atol=2e-5)


def documents_of(mask: st.StableAttnMask) -> list[int]:
    """The documents' offsets of a mask's static-shape ``cu_seqlens`` (the trailing empty ones dropped)."""
    cu = mask.cu_seqlens.tolist()
    return cu[:cu.index(cu[-1]) + 1]


def test_packed_mask_is_recognized_and_means_what_masking_utils_builds():
    """create_causal_mask / create_sliding_window_causal_mask on packed positions: a StableAttnMask whose
    documents, written out, are exactly sdpa's materialized mask for the same arguments."""
    position_ids = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]])
    B, N = position_ids.shape
    for sliding in (None, 3):
        cfg = config("llama", VOCAB) if sliding is None else config("mistral", VOCAB)
        if sliding is not None:
            cfg.sliding_window = sliding
        embeds = torch.zeros(B, N, 32)
        make = mu.create_causal_mask if sliding is None else mu.create_sliding_window_causal_mask
        masks = {}
        for impl in ("stable_attn", "sdpa"):
            cfg._attn_implementation = impl
            masks[impl] = make(config=cfg, inputs_embeds=embeds, attention_mask=None, cache=None,
                               position_ids=position_ids)
        ours, exact = masks["stable_attn"], masks["sdpa"]
        assert isinstance(ours, st.StableAttnMask) and ours.causal and ours.window == sliding
        # found on the device with a static shape: B * N + 1 offsets, the unused ones the token count
        assert ours.cu_seqlens.tolist() == [0, 3, 4, 9, 11, 17] + [22] * 17 and ours.max_seqlen == N
        written = torch.zeros(B * N, B * N, dtype=torch.bool)
        cu = documents_of(ours)
        for a, b in zip(cu[:-1], cu[1:]):
            i = torch.arange(b - a)
            vis = i[None, :] <= i[:, None]
            if sliding is not None:
                vis &= i[None, :] > i[:, None] - sliding
            written[a:b, a:b] = vis
        blocks = torch.stack([written[r * N:(r + 1) * N, r * N:(r + 1) * N] for r in range(B)])
        assert torch.equal(blocks, exact[:, 0]), sliding
        assert not written[:N, N:].any()  # no document spans two rows


@pytest.mark.parametrize("remapped", [True, False])
@pytest.mark.parametrize("window", [None, 3])
def test_both_forms_of_the_packed_mask_are_recognized(remapped, window):
    """transformers composes the packed mask with the positions remapped (5.2x) or, earlier, without; a
    packed mask over a pattern the kernel cannot take (bidirectional, chunked) is not recognized."""
    segments = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    pattern = mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)
    if remapped:
        pattern = mu.remap_positions_for_packed_sequence(pattern, positions)
    fn = mu.and_masks(pattern, mu.packed_sequence_mask_function(segments))
    assert st.recognize_packed_mask_function(fn)[:2] == (True, window)
    built = st.stable_attn_mask(1, 8, mask_function=fn, local_size=window, q_length=8, q_offset=0)
    assert isinstance(built, st.StableAttnMask) and documents_of(built) == [0, 3, 5, 8]
    for other in (mu.bidirectional_mask_function, mu.chunked_causal_mask_function(2, torch.zeros(1, dtype=torch.long))):
        fn = mu.and_masks(other, mu.packed_sequence_mask_function(segments))
        assert st.recognize_packed_mask_function(fn) is None
        assert isinstance(st.stable_attn_mask(1, 8, mask_function=fn, q_length=8, q_offset=0), torch.Tensor)

def test_packed_documents_rule():
    pos = torch.tensor([[0, 1, 2, 0, 1, 5, 6, 0]])
    cu, longest = st.packed_documents(pos, 1)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 7, 8] and longest == 3
    assert st.packed_documents(torch.arange(9)[None] + 4, 3) is None  # one document per row: not packed
    cu, _ = st.packed_documents(torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]]), 2)
    assert cu.tolist() == [0, 2, 4, 8]
    with pytest.raises(ValueError, match="position_ids of shape"):
        st.packed_documents(torch.zeros(2, 5, dtype=torch.long), 3)


def test_padding_and_decoding_are_never_read_as_packed(monkeypatch):
    """Left padding makes position_ids non-monotone and decoding has q_length 1: both stay on the dense op."""
    model = build("llama", "stable_attn")
    calls = Calls(monkeypatch)
    ids = documents((9,), seed=5)[0].expand(2, 9).clone()
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert calls.varlen == 0 and calls.dense == 3 * 2


def test_statistics_are_per_document():
    """attach_stats on a packed batch: the same per-head totals as the documents run one by one (each
    document's first key is its own key 0, for the sink mass too)."""
    docs = documents()
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in docs])
    model = build("llama", "stable_attn")
    packed = st.attach_stats(model)
    with torch.no_grad():
        model(**batch)
    alone_model = build("llama", "stable_attn")
    alone = st.attach_stats(alone_model)
    with torch.no_grad():
        for d in docs:
            alone_model(input_ids=d[None])
    for layer, s in packed.items():
        a = alone[layer]
        assert int(s.calls) == 1 and int(a.calls) == len(docs)
        assert torch.equal(s.rows, a.rows) and int(s.rows[0]) == sum(DOC_LENGTHS)
        assert torch.equal(s.saturated_rows, a.saturated_rows) and torch.equal(s.fixed_blocks, a.fixed_blocks)
        torch.testing.assert_close(s.max_logit, a.max_logit, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s.sink_mass, a.sink_mass, rtol=1e-5, atol=1e-6)

def test_trainer_with_flattening_collator_trains_padding_free(monkeypatch, tmp_path):
    """transformers.Trainer + DataCollatorWithFlattening: every step on the varlen op, and the first
    step's logged loss is the loss of its documents run one by one (eager, the initial weights)."""
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(0)
    lengths = tuple(torch.randint(1, 30, (12,), generator=g).tolist())
    data = [{"input_ids": d.tolist(), "labels": d.tolist()} for d in documents(lengths, seed=7)]
    collate = DataCollatorWithFlattening()
    batches = []

    def recording(features):
        batches.append([f["input_ids"] for f in features])
        return collate(features)

    model = build("llama", "stable_attn")
    initial = copy.deepcopy(model)
    calls = Calls(monkeypatch)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, logging_steps=1,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=recording)
    trainer.train()
    assert (calls.varlen, calls.dense, calls.fallback) == (3 * 2, 0, 0)

    initial.set_attn_implementation("eager")
    docs = [torch.tensor(d) for d in batches[0]]
    n_predicted = sum(len(d) - 1 for d in docs)
    with torch.no_grad():
        want = sum(initial(input_ids=d[None], labels=d[None]).loss * (len(d) - 1) for d in docs if len(d) > 1)
    first_loss = trainer.state.log_history[0]["loss"]
    assert abs(first_loss - want.item() / n_predicted) < 1e-4 * abs(first_loss)

def test_architecture_doc_block_runs(monkeypatch):
    """docs/ARCHITECTURE.md's packed-training block runs as written, on the varlen op for every layer."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if "DataCollatorWithFlattening" in b)
    calls = Calls(monkeypatch)
    scope: dict = {}
    exec(compile(block, "docs/ARCHITECTURE.md", "exec"), scope)
    assert scope["batch"]["input_ids"].shape == (1, 35)
    assert (calls.varlen, calls.dense, calls.fallback) == (2, 0, 0)
    assert torch.isfinite(scope["loss"]) and all(p.grad is not None for p in scope["model"].parameters())
