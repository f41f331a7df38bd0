"""Hugging Face transformers: ``attn_implementation="stable_attn"``.

:func:`register` adds two functions to transformers under the name ``"stable_attn"``:

- :func:`stable_attn_mask`, the mask builder (``AttentionMaskInterface``). Models call it through
  ``create_causal_mask`` / ``create_sliding_window_causal_mask`` / ``create_bidirectional_mask`` and pass
  whatever it returns, untouched, to the attention function. It recognizes the mask patterns the fused
  kernel takes as flags -- causal (bottom-right aligned, as with a KV cache), causal with a left sliding
  window, bidirectional -- each with an optional key-padding mask, and returns a :class:`StableAttnMask`
  describing them: no ``[B, 1, Nq, Nk]`` tensor is built. The mask ``masking_utils`` builds for packed
  sequences (``position_ids`` that restart, no 2D mask, no cache) over a causal or sliding-window
  pattern is recognized too and becomes a :class:`StableAttnMask` holding the documents' ``cu_seqlens``;
  a static cache's prefill is causal over its filled prefix (while compiling, a prefix whose length is a
  tensor: the keys are rotated so that it ends at the last key), and any single query (decoding) a key mask.
  Anything else (chunked or block-wise attention, custom ``or``/``and`` mask functions) gets the exact
  boolean 4D mask from transformers' own ``sdpa_mask``,
  which the attention op serves on its PyTorch path (stabilized, slower; the op logs that once).
- :func:`stable_attn_attention_forward`, the attention function (``AttentionInterface``). It maps the
  model's arguments (``scaling``, ``dropout``, ``softcap``, ``sliding_window``, GQA key/value heads) to
  :func:`stable_attn.attention` and returns ``(out [B, N, H, D], None)``. Packed documents (padding-free
  training, e.g. ``DataCollatorWithFlattening``) go to :func:`stable_attn.attention_varlen`, one
  sequence per document and no padding, whatever ``use_cache`` is: from the packed mask above, from
  FlashAttention's ``cu_seq_lens_q/k`` and ``max_length_q/k`` keyword arguments, or, with a plain causal
  mask (a cache makes ``masking_utils`` skip packing), from ``position_ids`` as ``flash_attention_2``
  reads them (see :func:`packed_documents`).

Recognition reads the closures transformers' ``masking_utils`` builds (``causal_mask_function``,
``and_masks(sliding_window_overlay(W), causal_mask_function)``, ``bidirectional_mask_function``) when eager;
under ``torch.compile`` (whose dynamo does not expose a closure's cells) it infers the pattern from static
information and checks it against the mask function on the device (:mod:`.masks`). Documents are found on
the device with static shapes, so ``torch.compile(model, fullgraph=True)`` traces every common input onto
the fused ops without a graph break. If a future transformers builds its masks differently, recognition
fails and the exact 4D mask is used: slower (a WARNING on CUDA, see :mod:`.dispatch` and
:func:`stable_attn.explain`), never wrong.

Options per model (``stabilize``, ``beta``, ``backend``, ``block_n``): :func:`configure`, or a dict in the
model config, ``config.stable_attn = {"beta": 4.0}`` (saved with the config). Per-layer statistics:
:func:`attach_stats` / :func:`detach_stats`. Features the fused op cannot compute (attention weights for
``output_attentions=True``, attention sinks, sparse-attention indices, T5-style ``position_bias``, a
learned (requires-grad) additive mask, ``value`` head dim != ``query`` head dim) raise at the first
forward, naming the feature and the model. A model whose attention does not dispatch through
``AttentionInterface`` never reaches stable_attn; :func:`attach_stats` and :func:`configure` raise for it.

The package, one module each: :mod:`.masks` (the mask builder and :class:`StableAttnMask`), :mod:`.dispatch`
(which path serves each layer, the slow-path warning),
:mod:`.attention_function` (the attention function), :mod:`.registry` (:func:`register`), :mod:`.models`
(attention modules, :func:`configure`, statistics) and :mod:`.swap` (switching the models inside a training
module). Every name is importable from here. Imports are absolute (``stable_attn.integrations...``), so
this package never stands in for the ``transformers`` library it integrates with.
"""

from __future__ import annotations

from stable_attn.integrations.transformers.attention_function import stable_attn_attention_forward
from stable_attn.integrations.transformers.masks import (
    StableAttnMask,
    recognize_mask_function,
    stable_attn_mask,
)
from stable_attn.integrations.transformers.masks import packed_documents as packed_documents
from stable_attn.integrations.transformers.masks import recognize_packed_mask_function as recognize_packed_mask_function
from stable_attn.integrations.transformers.models import OPTION_DEFAULTS as OPTION_DEFAULTS
from stable_attn.integrations.transformers.models import (
    attach_stats,
    attention_modules,
    configure,
    detach_stats,
    model_options_of,
)
from stable_attn.integrations.transformers.registry import ALIAS, NAME, register
from stable_attn.integrations.transformers.swap import find_hf_models as find_hf_models
from stable_attn.integrations.transformers.swap import prepare_models as prepare_models
from stable_attn.integrations.transformers.swap import swap_attention as swap_attention

# the public names; the others imported above are importable from here too
__all__ = [
    "ALIAS",
    "NAME",
    "StableAttnMask",
    "attach_stats",
    "attention_modules",
    "configure",
    "detach_stats",
    "model_options_of",
    "recognize_mask_function",
    "register",
    "stable_attn_attention_forward",
    "stable_attn_mask",
]

# importing the integration registers it (import stable_attn may have left that to this moment: on_import.py)
register()
