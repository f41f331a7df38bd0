"""Data for the GPT-2 example: real English text and a real tokenizer, both built offline.

Nothing here downloads anything. The default corpus is assembled from text that every CPython
installation ships:

- ``pydoc_data.topics``: the language reference as ``help()`` shows it (~465 KB of prose);
- the docstrings of the pure-Python standard library (modules, classes, functions), read with
  :mod:`ast` from the source files, never imported (importing ``this`` or ``antigravity`` has side
  effects, and importing 500 modules is slow);
- ``.txt``/``.rst`` files that live beside those modules (for instance ``email/architecture.rst``).

Directories that Linux distributions often split into separate packages (``test``, ``idlelib``,
``tkinter``, ``lib2to3``, ``distutils``, ``ensurepip``, ...) are left out, so that the corpus is the
same on most machines. **The text depends on the Python version** (3.11 and 3.12 document different
things): the corpus is the same bytes on every machine with the same Python version and an unpatched
standard library. Caches are therefore kept per Python version, and the tokenizer cache is keyed by
a hash of the corpus bytes, so a machine whose standard library differs rebuilds rather than reuses.

A byte-level BPE (the scheme GPT-2 uses) is trained on that corpus with the ``tokenizers`` package,
so the example runs a real tokenizer without fetching GPT-2's from a hub. The split into training
and validation is by document (a document never straddles the split) and is decided by a hash of
the document's name, so adding a document elsewhere does not move the others.

For the GPU preset, ``load_data`` also takes a text file of your own, or a nanoGPT-style ``.bin``
file of uint16 GPT-2 token ids (OpenWebText prepared offline), read through ``np.memmap``.

This file is self-contained (numpy, torch, tokenizers): ``examples/train_gpt2.py`` imports it by path.
"""

from __future__ import annotations

import ast
import gc
import hashlib
import json
import os
import re
import sys
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

# Bump when the corpus recipe changes, so stale caches are not reused.
CORPUS_VERSION = 1
EOS_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 4096
# nanoGPT's .bin files hold GPT-2 ids: 50257 tokens, end-of-text 50256; nanoGPT pads the embedding to
# 50304 (a multiple of 64) for speed.
GPT2_VOCAB_SIZE = 50304
GPT2_EOS_ID = 50256

# Directories (at any depth below the stdlib root) whose content varies between distributions or is
# not prose: tests hold data files and odd encodings, the rest are often separate OS packages.
_EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "lib2to3",
        "distutils",
        "ensurepip",
        "lib-dynload",
        "__pycache__",
        "pydoc_data",
    }
)
_MIN_DOC_CHARS = 200


@dataclass(frozen=True)
class Document:
    """One unit of the corpus; the train/validation split never cuts through one."""

    name: str
    text: str


# --------------------------------------------------------------------------------------------------
# Corpus


def default_cache_dir() -> Path:
    """``$STABLE_ATTN_CACHE``, else ``$XDG_CACHE_HOME/stable_attn``, else ``~/.cache/stable_attn``."""
    if os.environ.get("STABLE_ATTN_CACHE"):
        return Path(os.environ["STABLE_ATTN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stable_attn"


def _version_dir(cache_dir: str | os.PathLike | None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "gpt2_data" / f"py{sys.version_info.major}.{sys.version_info.minor}"


_HEADING_RULE = re.compile(r"^\s*([*=\-~^#+`'\"]){3,}\s*$")
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+[\w:-]+::\s?")
_COMMENT = re.compile(r"^\s*\.\.(\s|$)")
_DOCTEST = re.compile(r"^\s*(>>>|\.\.\.)(\s|$)")
# Inline markup may wrap onto the next line but never crosses a blank line (a paragraph break).
_INLINE = r"(?:[^`\n]|\n(?![ \t]*\n))"
_ROLE = re.compile(rf":[a-zA-Z][\w:.-]*:``?[~!]?({_INLINE}*?)(?:\s*<[^>]*>)?``?")
_LINK = re.compile(rf"`({_INLINE}+?)\s*<[^>]*>`_{{1,2}}")
_LITERAL = re.compile(rf"``({_INLINE}+?)``")
_INTERPRETED = re.compile(rf"`({_INLINE}+?)`_{{0,2}}")
_MANY_BLANKS = re.compile(r"\n{3,}")


def clean_markup(text: str) -> str:
    """Strip reST markup lightly so the model learns prose, not markup.

    Heading rules (``****``), roles (``:func:`len``` -> ``len``), literals, link targets, directive
    markers and doctest prompt lines go; everything else is kept verbatim (indentation included).
    """
    lines = []
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if _HEADING_RULE.match(line) or _DOCTEST.match(line):
            continue
        directive = _DIRECTIVE.match(line)
        if directive:
            line = directive.group(1) + line[directive.end() :]
        elif _COMMENT.match(line):
            continue
        lines.append(line.rstrip())
    text = "\n".join(lines)
    for pattern in (_ROLE, _LINK, _LITERAL, _INTERPRETED):
        text = pattern.sub(r"\1", text)
    return _MANY_BLANKS.sub("\n\n", text).strip()


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(root: Path) -> list[Path]:
    """``.py``, ``.txt`` and ``.rst`` files below ``root`` outside excluded directories, sorted by
    their relative path (not by ``os.walk`` order, which depends on the file system)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning here skips the big test trees instead of listing and discarding them.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith("config-")]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith((".py", ".txt", ".rst")))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _collect_docstrings(body: list[ast.stmt], out: list[str]) -> None:
    # Docstrings only live in statement bodies, so walk statements in source order and never
    # descend into expressions (a full ast.walk spends most of its time there).
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                out.append(doc)
        for name in ("body", "orelse", "finalbody"):
            inner = getattr(node, name, None)
            if isinstance(inner, list):
                _collect_docstrings(inner, out)
        for clause in getattr(node, "handlers", []) + getattr(node, "cases", []):
            _collect_docstrings(clause.body, out)


def _module_docstrings(path: Path) -> str:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return ""
    docs = [ast.get_docstring(tree, clean=True) or ""]
    _collect_docstrings(tree.body, docs)
    return "\n\n".join(cleaned for cleaned in map(clean_markup, docs) if cleaned)


def corpus_documents() -> list[Document]:
    """Build the default corpus from this interpreter's standard library (uncached, a few seconds).

    The order is fixed (topics by key, then files by relative path), so the result is a pure
    function of the installed standard library. An installation that ships only ``.pyc`` files
    yields the topics alone.
    """
    import pydoc_data.topics

    topics = ((key, clean_markup(pydoc_data.topics.topics[key])) for key in sorted(pydoc_data.topics.topics))
    docs = [Document(f"topic:{key}", text) for key, text in topics if len(text) >= _MIN_DOC_CHARS]
    root = _stdlib_root()
    # Parsing allocates millions of AST nodes without reference cycles; the cyclic garbage collector
    # would scan them over and over for nothing (a third of the build time).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        docs.extend(_stdlib_documents(root))
    finally:
        if gc_was_enabled:
            gc.enable()
    return docs


def _stdlib_documents(root: Path) -> Iterator[Document]:
    for path in _stdlib_files(root):
        rel = path.relative_to(root)
        if path.suffix == ".py":
            text = _module_docstrings(path)
            name = "module:" + rel.with_suffix("").as_posix().replace("/", ".")
        else:
            try:
                text = clean_markup(path.read_text(encoding="utf-8"))
            except UnicodeDecodeError:
                continue
            name = "file:" + rel.as_posix()
        if len(text) >= _MIN_DOC_CHARS:
            yield Document(name, text)


def _atomic_write(path: Path, data: bytes) -> None:
    # Several processes (DDP ranks, parallel tests) may build the same cache entry at once.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _documents_to_bytes(docs: Sequence[Document]) -> bytes:
    lines = [json.dumps({"name": d.name, "text": d.text}, ensure_ascii=False, sort_keys=True) for d in docs]
    return ("\n".join(lines) + "\n").encode("utf-8")


def _documents_from_bytes(data: bytes) -> list[Document]:
    return [Document(**json.loads(line)) for line in data.decode("utf-8").splitlines() if line]


def corpus_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where :func:`build_corpus` caches the corpus (JSON lines, one document per line)."""
    return _version_dir(cache_dir) / f"corpus-v{CORPUS_VERSION}.jsonl"


def build_corpus(cache_dir: str | os.PathLike | None = None) -> list[Document]:
    """The default corpus, read from the cache or built and cached (see the module docstring)."""
    path = corpus_path(cache_dir)
    if path.is_file():
        return _documents_from_bytes(path.read_bytes())
    docs = corpus_documents()
    _atomic_write(path, _documents_to_bytes(docs))
    return docs


def corpus_digest(docs: Sequence[Document]) -> str:
    """A short hash of the documents' bytes: the key of every cache derived from them."""
    return hashlib.sha256(_documents_to_bytes(docs)).hexdigest()[:16]


def read_text_documents(path: str | os.PathLike) -> list[Document]:
    """A user's text file as documents: paragraphs separated by one or more blank lines.

    Short paragraphs are merged with the next ones until a document holds at least ~2000
    characters, so the split by document is not a split by line.
    """
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text.replace("\r\n", "\n")) if p.strip()]
    docs: list[Document] = []
    current: list[str] = []
    size = 0
    for paragraph in paragraphs:
        current.append(paragraph)
        size += len(paragraph)
        if size >= 2000:
            docs.append(Document(f"{Path(path).name}:{len(docs)}", "\n\n".join(current)))
            current, size = [], 0
    if current:
        docs.append(Document(f"{Path(path).name}:{len(docs)}", "\n\n".join(current)))
    return docs


def split_documents(docs: Sequence[Document], val_fraction: float = 0.1) -> tuple[list[Document], list[Document]]:
    """Split by document: a document goes to validation when the hash of its name falls below
    ``val_fraction``. Both sides are kept non-empty when there are at least two documents."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must lie strictly between 0 and 1")
    train: list[Document] = []
    val: list[Document] = []
    for doc in docs:
        h = int.from_bytes(hashlib.sha256(doc.name.encode("utf-8")).digest()[:8], "big") / 2.0**64
        (val if h < val_fraction else train).append(doc)
    if len(docs) >= 2 and (not train or not val):
        # Tiny inputs: fall back to the last document(s) in order rather than an empty side.
        n_val = max(1, min(len(docs) - 1, round(len(docs) * val_fraction)))
        train, val = list(docs[:-n_val]), list(docs[-n_val:])
    return train, val


# --------------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(docs: Iterable[Document], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train a byte-level BPE (GPT-2's scheme) on ``docs``; ``EOS_TOKEN`` gets id 0.

    Byte-level means every string round-trips exactly and no token is ever unknown.
    Returns a ``tokenizers.Tokenizer``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not isinstance(vocab_size, int) or not 257 <= vocab_size <= 65535:
        raise ValueError(
            f"vocab_size={vocab_size!r} must be an int in [257, 65535] (256 bytes + end-of-text, "
            "and ids must fit the uint16 token files)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((d.text for d in docs), trainer=trainer)
    return tokenizer


def load_tokenizer(
    docs: Sequence[Document],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    cache_dir: str | os.PathLike | None = None,
):
    """The tokenizer for ``docs``: from ``tokenizer-<vocab>-<digest>.json`` in the cache, or trained
    with :func:`train_tokenizer` and saved there."""
    from tokenizers import Tokenizer

    path = _version_dir(cache_dir) / f"tokenizer-{vocab_size}-{corpus_digest(docs)}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tokenizer = train_tokenizer(docs, vocab_size)
    _atomic_write(path, tokenizer.to_str().encode("utf-8"))
    return tokenizer


def encode_documents(tokenizer, docs: Sequence[Document]) -> np.ndarray:
    """Concatenate the documents' token ids, each followed by the end-of-text id (uint16)."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    if eos is None:
        raise ValueError(f"tokenizer has no {EOS_TOKEN!r} token; train it with train_tokenizer()")
    if tokenizer.get_vocab_size() > 65536:
        raise ValueError(f"tokenizer vocab size {tokenizer.get_vocab_size()} does not fit uint16")
    pieces = []
    for enc in tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False):
        pieces.append(np.asarray(enc.ids, dtype=np.uint16))
        pieces.append(np.asarray([eos], dtype=np.uint16))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


# --------------------------------------------------------------------------------------------------
# Token blocks


class TokenBlocks(Dataset):
    """Blocks of ``block_size`` consecutive token ids, as ``torch.long`` tensors ``[block_size]``.

    Feed a block as both ``input_ids`` and ``labels`` to a Hugging Face causal LM (it shifts the
    labels itself). ``tokens`` is an array/tensor, or the path of a uint16 token file; a file is
    opened with ``np.memmap`` lazily in each process, so DataLoader workers never pickle the data.
    ``start``/``end`` select a token range; ``stride`` (default ``block_size``: no overlap) is the
    distance between block starts.
    """

    def __init__(
        self,
        tokens: np.ndarray | torch.Tensor | str | os.PathLike,
        block_size: int,
        *,
        start: int = 0,
        end: int | None = None,
        stride: int | None = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a positive int")
        stride = block_size if stride is None else stride
        if not isinstance(stride, int) or stride < 1:
            raise ValueError(f"stride={stride!r} must be a positive int")
        self._path: Path | None = None
        self._array: np.ndarray | None = None
        if isinstance(tokens, (str, os.PathLike)):
            self._path = Path(tokens)
            total = self._open().shape[0]
        elif isinstance(tokens, torch.Tensor):
            self._array = tokens.detach().cpu().numpy().reshape(-1)
            total = self._array.shape[0]
        elif isinstance(tokens, np.ndarray):
            self._array = tokens.reshape(-1)
            total = self._array.shape[0]
        else:
            raise TypeError(
                f"tokens={type(tokens).__name__} is not accepted; pass a numpy array, a torch tensor "
                "or the path of a uint16 token file"
            )
        end = total if end is None else end
        if not 0 <= start <= end <= total:
            raise ValueError(f"start={start!r}, end={end!r} must satisfy 0 <= start <= end <= {total}")
        self.block_size = block_size
        self.stride = stride
        self.start = start
        self.end = end
        self._len = 0 if end - start < block_size else (end - start - block_size) // stride + 1

    def _open(self) -> np.ndarray:
        if self._array is None:
            self._array = load_token_file(self._path)
        return self._array

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if state["_path"] is not None:
            state["_array"] = None
        return state

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> torch.Tensor:
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} blocks")
        s = self.start + index * self.stride
        block = np.asarray(self._open()[s : s + self.block_size], dtype=np.int64)
        return torch.from_numpy(block)


def load_token_file(path: str | os.PathLike) -> np.memmap:
    """A nanoGPT-style token file (raw little-endian uint16 ids, no header) as a read-only memmap."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file {str(path)!r} does not exist")
    size = path.stat().st_size
    if size == 0 or size % 2:
        raise ValueError(f"token file {str(path)!r} has {size} bytes; a uint16 token file has a positive even size")
    return np.memmap(path, dtype="<u2", mode="r")


@dataclass
class LMData:
    """What the training script needs: datasets, vocabulary size, and where the text came from."""

    train: TokenBlocks
    val: TokenBlocks
    vocab_size: int
    eos_id: int | None
    tokenizer: object | None  # a tokenizers.Tokenizer for text sources, None for token files
    source: str


def _check_ids(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    # Out-of-range ids would crash the embedding lookup deep inside a CUDA kernel; check a prefix
    # (a full scan of a 17 GB file would take minutes).
    head = np.asarray(tokens[: 1 << 22])
    if head.size and int(head.max()) >= vocab_size:
        raise ValueError(
            f"{what} holds token id {int(head.max())} >= vocab_size={vocab_size}; pass the vocabulary "
            "size the file was tokenized with"
        )


def load_data(
    data: str | os.PathLike | None = None,
    *,
    block_size: int,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    val_fraction: float = 0.1,
    cache_dir: str | os.PathLike | None = None,
    token_vocab_size: int = GPT2_VOCAB_SIZE,
    token_eos_id: int = GPT2_EOS_ID,
) -> LMData:
    """Training and validation blocks for the example.

    - ``data=None``: the standard-library corpus with a BPE of ``vocab_size`` trained on it (cached).
    - a text file (any suffix but ``.bin``): its paragraphs as documents, with a BPE trained on it.
    - a ``.bin`` file: nanoGPT uint16 GPT-2 ids, vocabulary ``token_vocab_size``. Validation is the
      sibling ``val.bin`` when ``data`` is ``train.bin`` and it exists; otherwise the last
      ``val_fraction`` of the file, cut at an end-of-text id (``token_eos_id``) so no document
      straddles the split.
    """
    if data is None:
        docs = build_corpus(cache_dir)
        source = f"Python {sys.version_info.major}.{sys.version_info.minor} standard-library docs"
    else:
        path = Path(data)
        if not path.is_file():
            raise FileNotFoundError(f"data={str(data)!r} is not a file (expected a text file or a .bin)")
        if path.suffix == ".bin":
            return _load_bin(path, block_size, val_fraction, token_vocab_size, token_eos_id)
        docs = read_text_documents(path)
        source = f"text file {path}"
        if len(docs) < 2:
            raise ValueError(f"data={str(data)!r} holds {len(docs)} document(s); need at least 2 to split")
    train_docs, val_docs = split_documents(docs, val_fraction)
    tokenizer = load_tokenizer(train_docs, vocab_size, cache_dir)
    train_tokens = encode_documents(tokenizer, train_docs)
    val_tokens = encode_documents(tokenizer, val_docs)
    return LMData(
        train=TokenBlocks(train_tokens, block_size),
        val=TokenBlocks(val_tokens, block_size),
        vocab_size=tokenizer.get_vocab_size(),
        eos_id=tokenizer.token_to_id(EOS_TOKEN),
        tokenizer=tokenizer,
        source=f"{source}: {len(train_docs)} train / {len(val_docs)} val documents, "
        f"{train_tokens.size} / {val_tokens.size} tokens",
    )


def _load_bin(path: Path, block_size: int, val_fraction: float, vocab_size: int, eos_id: int) -> LMData:
    tokens = load_token_file(path)
    _check_ids(tokens, vocab_size, f"token file {str(path)!r}")
    sibling = path.with_name("val.bin")
    if path.name == "train.bin" and sibling.is_file():
        _check_ids(load_token_file(sibling), vocab_size, f"token file {str(sibling)!r}")
        train = TokenBlocks(path, block_size)
        val = TokenBlocks(sibling, block_size)
    else:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r} must lie strictly between 0 and 1")
        cut = int(tokens.shape[0] * (1.0 - val_fraction))
        # Move the cut to just after the next end-of-text id, scanning a bounded window.
        window = np.asarray(tokens[cut : cut + (1 << 20)])
        hits = np.flatnonzero(window == eos_id)
        if hits.size:
            cut += int(hits[0]) + 1
        train = TokenBlocks(path, block_size, end=cut)
        val = TokenBlocks(path, block_size, start=cut)
    return LMData(
        train=train,
        val=val,
        vocab_size=vocab_size,
        eos_id=eos_id,
        tokenizer=None,
        source=f"token file {path}: {train.num_tokens} train / {val.num_tokens} val tokens",
    )


# --------------------------------------------------------------------------------------------------
# Spike injection


def corrupt_batch(input_ids: torch.Tensor, vocab_size: int, *, seed: int = 0) -> torch.Tensor:
    """A copy of ``input_ids`` with every token replaced by an id drawn uniformly from the vocabulary.

    Used by ``--inject-spike-at`` to make one real, large loss spike. Why uniform ids: for *any*
    model distribution ``p``, the expected cross-entropy on uniformly drawn targets is
    ``-mean_v log p(v) >= ln(vocab_size)`` (Gibbs' inequality, equality only for a uniform ``p``),
    while a model that has learned anything scores below ``ln(vocab_size)`` on real text. A model
    that has learned English puts tiny mass on most ids, so the corrupted loss is far above the clean
    one (several nats), for exactly one step. Shuffling the real tokens instead would keep the
    unigram statistics and raise the loss much less. Same shape, dtype and device; seeded, so a
    rerun injects the same batch.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"input_ids must be an int32/int64 torch.Tensor, got "
            f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}"
        )
    if not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size!r} must be an int >= 2")
    generator = torch.Generator().manual_seed(seed)
    junk = torch.randint(0, vocab_size, tuple(input_ids.shape), generator=generator, dtype=input_ids.dtype)
    return junk.to(input_ids.device)
