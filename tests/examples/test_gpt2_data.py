"""examples/gpt2_data.py: the offline corpus, the BPE tokenizer, token blocks, token files, spikes."""

from __future__ import annotations

import importlib.util
import math
import pickle
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt2_data.py"


def _load_example():
    module = sys.modules.get("gpt2_data")
    if module is not None and Path(module.__file__).resolve() == EXAMPLE:
        return module
    spec = importlib.util.spec_from_file_location("gpt2_data", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpt2_data"] = module  # dataclasses and pickle look classes up by module name
    spec.loader.exec_module(module)
    return module


g = _load_example()
BLOCK = 64


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stable_attn_cache")


@pytest.fixture(scope="module")
def docs(cache_dir: Path) -> list:
    return g.build_corpus(cache_dir)


@pytest.fixture(scope="module")
def data(cache_dir: Path, docs: list):
    return g.load_data(block_size=BLOCK, cache_dir=cache_dir)


def test_corpus_is_english_prose(docs: list) -> None:
    text = "\n".join(d.text for d in docs)
    assert len(text) > 500_000
    words = Counter(re.findall(r"[a-z]+", text.lower()))
    top = [w for w, _ in words.most_common(10)]
    assert top[0] == "the"
    assert {"of", "to", "a", "is", "and"} <= set(top)
    printable = sum(ch.isascii() and (ch.isprintable() or ch in "\n\t") for ch in text)
    assert printable / len(text) > 0.99
    assert "``" not in text and ":func:`" not in text and ":class:`" not in text
    assert not re.search(r"^\*{4,}$", text, re.M), "heading rules were not stripped"
    kinds = Counter(d.name.split(":")[0] for d in docs)
    assert kinds["topic"] > 50 and kinds["module"] > 200 and "file:email/architecture.rst" in {d.name for d in docs}
    assert all(len(d.text) >= 200 for d in docs)


def test_corpus_is_deterministic_and_cached(cache_dir: Path, docs: list) -> None:
    cached = g.corpus_path(cache_dir)
    assert cached.is_file() and f"py{sys.version_info.major}.{sys.version_info.minor}" in str(cached)
    fresh = g.corpus_documents()
    assert g._documents_to_bytes(fresh) == cached.read_bytes()
    assert g.build_corpus(cache_dir) == fresh
    names = [d.name for d in fresh]
    assert len(set(names)) == len(names)


def test_clean_markup() -> None:
    raw = "Title\n*****\n\nUse :func:`len` or ``x + 1``, see `docs <https://x.org>`_.\n\n>>> 1 + 1\n2\n.. note::\n"
    assert g.clean_markup(raw) == "Title\n\nUse len or x + 1, see docs.\n\n2"


def test_split_is_by_document_and_stable(docs: list) -> None:
    train, val = g.split_documents(docs, 0.1)
    assert {d.name for d in train}.isdisjoint(d.name for d in val)
    assert len(train) + len(val) == len(docs)
    assert 0.05 < len(val) / len(docs) < 0.2
    # Adding a document does not move any other one across the split.
    train2, val2 = g.split_documents([g.Document("extra", "x" * 300), *docs], 0.1)
    assert {d.name for d in val} <= {d.name for d in val2} and {d.name for d in train} <= {d.name for d in train2}
    a, b = g.split_documents(docs[:2], 0.1)
    assert len(a) == 1 and len(b) == 1
    with pytest.raises(ValueError, match="val_fraction=1.5"):
        g.split_documents(docs, 1.5)


def test_tokenizer_round_trips_compresses_and_is_deterministic(data, docs: list) -> None:
    tok = data.tokenizer
    assert data.vocab_size == tok.get_vocab_size() == 4096
    assert data.eos_id == tok.token_to_id(g.EOS_TOKEN) == 0
    _, val = g.split_documents(docs, 0.1)
    samples = [
        val[0].text,
        "Unseen text: naïve café, 日本語, emoji 🙂,\ttabs and   spaces\r\n",
        " leading space and trailing ",
    ]
    for text in samples:
        assert tok.decode(tok.encode(text).ids) == text
    # A BPE that learned English merges common words: held-out text takes > 3 characters per token.
    val_text = "".join(d.text for d in val)
    assert len(val_text) / len(tok.encode(val_text).ids) > 3.0
    small = docs[:60]
    assert g.train_tokenizer(small, 600).to_str() == g.train_tokenizer(small, 600).to_str()
    with pytest.raises(ValueError, match="vocab_size=100"):
        g.train_tokenizer(small, 100)


def test_blocks_cover_the_token_stream(data) -> None:
    tokens = np.asarray(data.train._array)
    assert len(data.train) == tokens.size // BLOCK
    batch = torch.stack([data.train[i] for i in range(5)])
    assert batch.shape == (5, BLOCK) and batch.dtype == torch.long
    assert torch.equal(batch.flatten(), torch.from_numpy(tokens[: 5 * BLOCK].astype(np.int64)))
    assert torch.equal(data.train[-1], data.train[len(data.train) - 1])
    assert int(batch.max()) < data.vocab_size
    with pytest.raises(IndexError):
        data.train[len(data.train)]
    # Validation text is held-out prose that decodes back to text of a validation document.
    piece = data.tokenizer.decode(data.val[2].tolist()).split("\n")[1]
    assert len(piece) > 20 and piece in data.tokenizer.decode(np.asarray(data.val._array).tolist())
    overlapping = g.TokenBlocks(tokens[:100], 10, stride=3)
    assert len(overlapping) == 31 and overlapping[1].tolist() == tokens[3:13].tolist()
    with pytest.raises(ValueError, match="block_size=0"):
        g.TokenBlocks(tokens, 0)
    with pytest.raises(TypeError, match="tokens=list"):
        g.TokenBlocks([1, 2, 3], 2)


def _write_bin(path: Path, n: int, seed: int, eos_every: int = 97) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(0, g.GPT2_EOS_ID, size=n).astype(np.uint16)
    ids[eos_every - 1 :: eos_every] = g.GPT2_EOS_ID
    ids.tofile(path)
    return ids


def test_uint16_token_files(tmp_path: Path) -> None:
    train_ids = _write_bin(tmp_path / "train.bin", 5000, seed=0)
    val_ids = _write_bin(tmp_path / "val.bin", 700, seed=1)
    data = g.load_data(tmp_path / "train.bin", block_size=16)
    assert data.vocab_size == g.GPT2_VOCAB_SIZE and data.tokenizer is None and data.eos_id == g.GPT2_EOS_ID
    assert len(data.train) == 5000 // 16 and len(data.val) == 700 // 16
    assert data.train[7].tolist() == train_ids[7 * 16 : 8 * 16].tolist()
    assert data.val[3].tolist() == val_ids[48:64].tolist()
    # Pickling (DataLoader workers) carries the path, not the tokens.
    blob = pickle.dumps(data.train)
    assert len(blob) < 2000
    assert pickle.loads(blob)[7].tolist() == train_ids[7 * 16 : 8 * 16].tolist()

    ids = _write_bin(tmp_path / "owt.bin", 10_000, seed=2)
    data = g.load_data(tmp_path / "owt.bin", block_size=16, val_fraction=0.1)
    cut = data.val.start
    assert data.train.end == cut and 9000 < cut <= 9000 + 97
    assert ids[cut - 1] == g.GPT2_EOS_ID, "the split must fall right after an end-of-text token"
    assert data.val[0].tolist() == ids[cut : cut + 16].tolist()

    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="3 bytes"):
        g.load_data(tmp_path / "odd.bin", block_size=16)
    np.array([1, 2, 60000], dtype=np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(ValueError, match="token id 60000"):
        g.load_data(tmp_path / "big.bin", block_size=1)
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        g.load_data(tmp_path / "missing.bin", block_size=16)


def test_text_file_data(tmp_path: Path, docs: list) -> None:
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(d.text for d in docs[:40]), encoding="utf-8")
    data = g.load_data(path, block_size=32, vocab_size=512, cache_dir=tmp_path / "cache")
    assert data.vocab_size == 512 and len(data.train) > 100 and len(data.val) > 5
    assert "book.txt" in data.source
    text = data.tokenizer.decode(data.train[0].tolist())
    assert text and text in path.read_text(encoding="utf-8")


def _unigram_nll(train_tokens: np.ndarray, tokens: torch.Tensor, vocab_size: int) -> float:
    # Add-one unigram model of the training tokens: the simplest language model there is.
    counts = np.bincount(train_tokens.astype(np.int64), minlength=vocab_size) + 1.0
    logp = np.log(counts) - math.log(counts.sum())
    return float(-logp[tokens.numpy()].mean())


def test_corrupt_batch_raises_the_loss(data) -> None:
    batch = torch.stack([data.val[i] for i in range(16)])
    junk = g.corrupt_batch(batch, data.vocab_size, seed=3)
    assert junk.shape == batch.shape and junk.dtype == batch.dtype and junk.device == batch.device
    assert (junk != batch).float().mean() > 0.99
    assert int(junk.min()) >= 0 and int(junk.max()) < data.vocab_size
    assert torch.equal(junk, g.corrupt_batch(batch, data.vocab_size, seed=3))
    assert not torch.equal(junk, g.corrupt_batch(batch, data.vocab_size, seed=4))
    train = np.asarray(data.train._array)
    clean = _unigram_nll(train, batch, data.vocab_size)
    corrupted = _unigram_nll(train, junk, data.vocab_size)
    # Gibbs: uniform targets cost at least ln(V) under any model; the real text costs far less.
    assert corrupted > math.log(data.vocab_size) - 0.1
    assert corrupted > clean + 2.0, (clean, corrupted)
    with pytest.raises(TypeError, match="int32/int64"):
        g.corrupt_batch(batch.float(), data.vocab_size)
    with pytest.raises(ValueError, match="vocab_size=1"):
        g.corrupt_batch(batch, 1)
