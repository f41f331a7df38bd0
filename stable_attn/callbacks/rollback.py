"""Deprecated: moved to :mod:`stable_attn.monitor.rollback` (issue 29). This name is an alias of that module,
kept so that old imports work; import it from ``stable_attn.monitor.rollback`` instead."""

import sys
import warnings

from ..monitor import rollback as _moved

warnings.warn("stable_attn.callbacks.rollback moved to stable_attn.monitor.rollback; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
