"""Deprecated: moved to :mod:`stable_attn.monitor.verdict` (issue 29). This name is an alias of that module,
kept so that old imports work; import it from ``stable_attn.monitor.verdict`` instead."""

import sys
import warnings

from ..monitor import verdict as _moved

warnings.warn("stable_attn.callbacks.verdict moved to stable_attn.monitor.verdict; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
