"""When the op takes the decode path, and how it splits the keys: one place for both backends.

The decode path (``reference_decode.py`` on the PyTorch path, ``triton_decode.py`` on the GPU) serves short
queries against a long cache, what ``generate()`` sends every step: it splits the keys into contiguous
*splits*, walks each split with the rule from the initial state, and merges the splits by their offsets
(docs/ALGORITHM.md, "Decode: split keys"). The split boundaries change the rule's decisions, so they are a
function of the problem's shape alone, never of the device: both backends, on any GPU or on the CPU, cut
the keys at the same multiples of the key block and take the same decisions.

:func:`takes_decode` says which calls go there (``attention()``'s forward, ``stable_attn.attention._forward``):

- no gradient is needed (``Options.forward_only``: set by ``attention()`` when autograd will not ask for a
  backward): training keeps the training kernels' partition;
- ``Nq <= MAX_QUERIES`` (16) and at least ``MIN_KEY_BLOCKS`` (2) key blocks of keys;
- no ``attn_mask`` tensor (a ``key_padding_mask``, what transformers passes for a decoding step, is taken),
  no dropout, no statistics (a call with an ``AttentionStats`` falls back to the training path, which
  computes them: the decode kernel does not);
- causal (bottom-right), window, softcap, GQA/MQA and every stabilize mode are served.
"""

from __future__ import annotations

import math

MAX_QUERIES = 16  # longest query the decode path takes
MIN_KEY_BLOCKS = 2  # fewest key blocks of keys worth splitting
# Programs the split aims for: about two per SM of an H100/H200 (132 SMs; A100: 108, 2.4 per SM). A fixed
# number, not the device's: the split boundaries are decisions of the rule, the same on every machine.
TARGET_PROGRAMS = 256


def takes_decode(nq: int, nk: int, key_block: int, *, forward_only: bool, has_attn_mask: bool, dropout_p: float,
                 with_stats: int) -> bool:
    """Whether a dense forward goes to the decode path (the cases in this module's docstring)."""
    return (forward_only and not has_attn_mask and dropout_p == 0 and not with_stats
            and 1 <= nq <= MAX_QUERIES and nk >= MIN_KEY_BLOCKS * key_block)


def split_keys(batch: int, kv_heads: int, nk: int, key_block: int) -> int:
    """Keys per split (a multiple of ``key_block``): the ``ceil(nk / key_block)`` key blocks shared out over
    about ``TARGET_PROGRAMS / (batch * kv_heads)`` splits, at least one block each."""
    blocks = max(1, math.ceil(nk / key_block))
    splits = max(1, TARGET_PROGRAMS // max(1, batch * kv_heads))
    return math.ceil(blocks / splits) * key_block


def num_splits(nk: int, split: int) -> int:
    """Splits of ``split`` keys covering ``nk`` keys (at least one, so that a row without keys has a state)."""
    return max(1, math.ceil(nk / split))


def check_split(split: int, key_block: int) -> None:
    """A split given by a caller (tests, benchmarks) must hold whole key blocks."""
    if not (isinstance(split, int) and split >= key_block and split % key_block == 0):
        raise ValueError(f"split={split!r} must be a positive multiple of the key block ({key_block} keys): the "
                         "splits' boundaries must be boundaries of the rule's partition")
