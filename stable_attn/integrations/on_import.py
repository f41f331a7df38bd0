"""Registering ``"stable_attn"`` with transformers when transformers loads, not when stable_attn does.

Importing transformers' model code (``transformers.modeling_utils``) takes seconds; a user of
:func:`stable_attn.attention` alone should not pay them. Every way of building a transformers model imports
``transformers.modeling_utils`` before it reads ``attn_implementation``, so registering the moment that module
has loaded is as good as registering at ``import stable_attn``. :func:`register_when_loaded` registers at once
when transformers' model code is already loaded; otherwise it puts a finder on ``sys.meta_path`` that wraps
the loading of ``transformers.modeling_utils`` and ``transformers.masking_utils`` and registers when the
first has loaded and neither is still executing (their imports may nest), then leaves ``sys.meta_path``. When
transformers loads because :mod:`stable_attn.integrations.transformers` is being imported, that package registers
at the end of its own import instead (it cannot be used half-imported).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

MODEL_CODE = "transformers.modeling_utils"
WATCHED = (MODEL_CODE, "transformers.masking_utils")
# our integration registers itself when its import is done (its __init__'s last line)
INTEGRATION = "stable_attn.integrations.transformers"


class _RegisterAfterLoad(MetaPathFinder):
    """Finds nothing itself: hands the other finders' spec back with its loader's ``exec_module`` wrapped."""

    def __init__(self, then: Callable[[], Any]) -> None:
        self.then = then
        self.executing: set[str] = set()
        self.done = False

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname not in WATCHED or self.done:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            self.executing.add(fullname)
            try:
                run(module)
            finally:
                self.executing.discard(fullname)
            self._maybe_register()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's loader only
        return spec

    def _maybe_register(self) -> None:
        if self.done or self.executing or MODEL_CODE not in sys.modules:
            return
        self.done = True
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        integration = sys.modules.get(INTEGRATION)
        if integration is not None and not hasattr(integration, "register"):
            return  # transformers loads because our integration is being imported: it registers when done
        self.then()


def register_when_loaded(register: Callable[[], Any]) -> bool:
    """Call ``register`` now if transformers' model code is loaded (returns True), else when it loads (False).
    Without transformers installed nothing is waited for (False)."""
    if MODEL_CODE in sys.modules:
        register()
        return True
    if any(isinstance(f, _RegisterAfterLoad) for f in sys.meta_path):
        return False
    try:
        installed = importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):  # a broken or blocked transformers: as if absent
        installed = False
    if installed:
        sys.meta_path.insert(0, _RegisterAfterLoad(register))
    return False
