"""Deprecated: moved to :mod:`stable_attn.monitor.engine` (issue 29). This name is an alias of that module,
kept so that old imports work; import it from ``stable_attn.monitor.engine`` instead."""

import sys
import warnings

from ..monitor import engine as _moved

warnings.warn("stable_attn.callbacks.engine moved to stable_attn.monitor.engine; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
