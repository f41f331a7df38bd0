"""stable_attn: flash attention that does not blow up BF16 training.

Importing the package registers the ``"stable_attn"`` attention implementation with Hugging Face
transformers (when transformers is installed), so ``attn_implementation="stable_attn"`` works.
"""

from __future__ import annotations

from .attention import attention
from .stats import AttentionStats

__version__ = "0.1.0"

__all__ = ["AttentionStats", "attention", "__version__"]
