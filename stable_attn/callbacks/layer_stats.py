"""Deprecated: moved to :mod:`stable_attn.monitor.layer_stats` (issue 29). This name is an alias of that module,
kept so that old imports work; import it from ``stable_attn.monitor.layer_stats`` instead."""

import sys
import warnings

from ..monitor import layer_stats as _moved

warnings.warn("stable_attn.callbacks.layer_stats moved to stable_attn.monitor.layer_stats; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
