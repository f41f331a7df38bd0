"""Deprecated: moved to :mod:`stable_attn.monitor.alerting` (issue 29). This name is an alias of that module,
kept so that old imports work; import it from ``stable_attn.monitor.alerting`` instead."""

import sys
import warnings

from ..monitor import alerting as _moved

warnings.warn("stable_attn.callbacks.alerting moved to stable_attn.monitor.alerting; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
