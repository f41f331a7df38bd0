"""stable_attn: flash attention that does not blow up BF16 training.

Importing the package registers the ``"stable_attn"`` attention implementation (and its mask
builder) with Hugging Face transformers when transformers is installed, so
``attn_implementation="stable_attn"`` works right away. The Lightning callback lives in
:mod:`stable_attn.callbacks` (imported on demand: it needs Lightning).
"""

from __future__ import annotations

import importlib.util

from .attention import attention
from .integrations.sdpa import patch_sdpa, unpatch_sdpa
from .stats import AttentionStats

__version__ = "0.1.0"


def register() -> bool:
    """Register ``"stable_attn"`` with transformers (idempotent). Returns False without transformers."""
    if importlib.util.find_spec("transformers") is None:
        return False
    from .integrations import transformers as _hf

    _hf.register()
    return True


register()

__all__ = ["AttentionStats", "attention", "patch_sdpa", "register", "unpatch_sdpa", "__version__"]
