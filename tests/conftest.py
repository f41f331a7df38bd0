"""Test-wide setup.

Triton kernels run on the CPU through Triton's interpreter; the flag must be in the environment
before any kernel is decorated, so it is set here, before any test module imports stable_attn's
Triton code. On a GPU machine set STABLE_ATTN_TEST_DEVICE=cuda to run the same tests on CUDA.
"""

import os

if os.environ.get("STABLE_ATTN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
