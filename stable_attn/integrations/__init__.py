"""Integrations of :func:`stable_attn.attention` with the code people train with.

- :mod:`stable_attn.integrations.transformers`: ``attn_implementation="stable_attn"`` for Hugging Face
  models (registered with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``), per-layer
  statistics (``attach_stats``) and per-model options (``configure``).
- :mod:`stable_attn.integrations.sdpa`: ``patch_sdpa()`` for code that calls
  ``torch.nn.functional.scaled_dot_product_attention`` itself (nanoGPT style).

Nothing is imported here, so ``import stable_attn.integrations`` never pulls in transformers.
"""
