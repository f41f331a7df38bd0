"""stable_attn: flash attention that does not blow up BF16 training.

Importing the package registers the ``"stable_attn"`` attention implementation (and its mask
builder, and the alias ``"stable-attn"``) with Hugging Face transformers when transformers is installed, so
``attn_implementation="stable_attn"`` works right away; without transformers, :func:`attention`
works all the same. transformers is not imported here: the registration happens at once when its model
code is already loaded, else the moment it loads (:mod:`stable_attn.integrations.on_import`).
Lightning is never imported here: the callback lives in :mod:`stable_attn.callbacks` (imported on
demand). Triton is imported on the first call that runs a Triton kernel. ``benchmarks/import_time.py``
measures what the import costs.
"""

from __future__ import annotations

from ._version import __version__
from .attention import attention, set_layout_check
from .explain import explain
from .integrations.flash_compat import flash_attn_func, flash_attn_varlen_func
from .integrations.on_import import register_when_loaded
from .integrations.sdpa import patch_sdpa, unpatch_sdpa
from .stats import AttentionStats
from .varlen import attention_varlen


def register() -> bool:
    """Register ``"stable_attn"`` with transformers now, importing it (idempotent). Returns False without
    transformers. ``import stable_attn`` already arranges it (:func:`register_when_loaded`)."""
    try:
        from .integrations import transformers as _hf
    except ModuleNotFoundError as e:  # only a missing transformers; any other missing module is a bug
        if (e.name or "").split(".")[0] != "transformers":
            raise
        return False
    _hf.register()
    return True


register_when_loaded(register)

__all__ = [
    "AttentionStats", "attention", "attention_varlen", "explain", "flash_attn_func", "flash_attn_varlen_func",
    "patch_sdpa", "register", "set_layout_check", "unpatch_sdpa", "__version__",
]
