"""The monitor tests' helper modules (``test_engine.Loop``, ``detectors/test_spikes.lm_trace``,
``detectors/detector_runs``) are imported by name from any of the mirrored folders."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _folder in (_HERE, os.path.join(_HERE, "detectors")):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)
