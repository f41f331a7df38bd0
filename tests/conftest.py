"""Test-wide setup.

Triton kernels run on the CPU through Triton's interpreter; the flag must be in the environment
before any kernel is decorated, so it is set here, before any test module imports stable_attn's
Triton code. On a GPU machine set STABLE_ATTN_TEST_DEVICE=cuda to run the same tests on CUDA.
"""

import os

if os.environ.get("STABLE_ATTN_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402 - after the flag above
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

CALLBACKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "callbacks")


@contextlib.contextmanager
def one_torch_thread():
    """The tiny models of the callback and monitor tests run far slower with 2 intra-op threads on a loaded
    2-core machine than with one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """One torch thread for the test (made autouse by the folders and modules that want it)."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory) -> str:
    """Path of tiny GPT-2 weights trained past the steep first descent (tests/callbacks/callback_lm.py:
    pretrain), shared by the Lightning and the transformers.Trainer callback tests: the detectors see a
    loss near its plateau, as in a fine-tuning run."""
    if CALLBACKS_DIR not in sys.path:
        sys.path.insert(0, CALLBACKS_DIR)
    from callback_lm import pretrain

    path = tmp_path_factory.mktemp("weights") / "tiny_gpt2.pt"
    with one_torch_thread():
        pretrain(path)
    return str(path)


@pytest.fixture(autouse=True)
def fresh_call_caches():
    """Every test starts with no remembered call (stable_attn/call_cache.py) and no prepared decode launch
    (kernels/decode_launch.py): its first call of a signature takes the full path, whatever a test patches."""
    from stable_attn import call_cache
    from stable_attn.kernels import decode_launch

    call_cache._calls.clear()
    decode_launch._prepared.clear()
    yield
