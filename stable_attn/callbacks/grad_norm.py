"""Deprecated: moved to :mod:`stable_attn.monitor.grad_norm` (issue 29). This name is an alias of that module,
kept so that old imports work; import it from ``stable_attn.monitor.grad_norm`` instead."""

import sys
import warnings

from ..monitor import grad_norm as _moved

warnings.warn("stable_attn.callbacks.grad_norm moved to stable_attn.monitor.grad_norm; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
