"""Which path serves each attention layer, and saying so: never silently slow.

:func:`record` is called by the attention function for every layer it serves. It decides what would serve
the layer on a CUDA device -- the Triton kernels (dense or varlen) or the PyTorch path, and why -- and

- warns, once per model and reason, when a layer on a CUDA device is served by the PyTorch path for a
  reason other than being on the CPU (a materialized 4D mask, a problem too large for the kernels' offsets,
  what the kernels do not implement: float32 K and V tiles beyond their shared memory),
  naming the model, the reason and what to change. The warning works under ``torch.compile(fullgraph=True)``:
  :func:`warn_once` takes constant arguments and dynamo runs it while tracing (no graph break);
- feeds :func:`stable_attn.explain` (eager runs only), which prints, per layer, the path and the reason.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..._ops import backend_rule
from ...options import BLOCK_N

logger = logging.getLogger("stable_attn")

_warned: set[str] = set()

TRITON_DENSE = "fused kernel (stable_attn.attention)"
TRITON_VARLEN = "fused kernel, packed documents (stable_attn.attention_varlen)"
PYTORCH = "PyTorch path (stabilized, slower)"

@torch.compiler.assume_constant_result
def warn_once(key: str, message: str) -> bool:
    """Log ``message`` as a WARNING the first time ``key`` is seen (per process).

    Under ``torch.compile`` dynamo calls it while tracing (``assume_constant_result``: its arguments are
    constants), so a compiled model warns when it is compiled, without a graph break.
    """
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)
    return True


_ADVICE = {
    "attn_mask": "a materialized 4D attention mask: the pattern is not one the kernel takes as flags (causal, sliding "
               "window, padding, packed documents); chunked, block-wise (image tokens) and custom mask functions, "
               "a bidirectional sliding window and 4D masks passed in end up here. To reach the kernel: pass a 2D "
               "attention_mask (or none) and the model's own causal or sliding pattern",
    "size": "more than 2^31 elements of q, k or v in one batch element (beyond the kernels' 32-bit offsets): "
            "use a smaller batch element or shorter sequences",
    "kernel-gap": "a feature the Triton kernels do not implement yet (a head dim above 512, or float32 K and V "
                  "tiles of the key partition beyond the kernels' shared memory: a smaller block_n fits); the "
                  "PyTorch path serves it, stabilized and monitored",
}


# What explain() says where the PyTorch path serves a layer, by _ops.backend_rule's reason.
_CONFIGURED = {
    "backend": "configured: backend='torch' (configure() or config.stable_attn)",
    "pv_fp32": "configured: pv_fp32=True (P-bar V in fp32, a comparison variant the kernels do not compute)",
    "empty": "an empty batch (batch size 0): nothing to compute; the PyTorch path returns the empty output",
}


def serving(query: torch.Tensor, key: torch.Tensor, backend: str, attn_mask: torch.Tensor | None,
            varlen: bool, pv_fp32: bool = False, value: torch.Tensor | None = None,
            key_block: int | None = None) -> tuple[str, str | None]:
    """``(path, reason)``: what serves a layer's call on a CUDA device, and why, if not the fused kernel: the
    ops' own rule (``_ops.backend_rule``), asked for a CUDA device; packed documents count as one batch element
    (their head dim kept last, for the rule's head-dim test)."""
    q, k = (query.reshape(1, -1, query.shape[-1]), key.reshape(1, -1, key.shape[-1])) if varlen else (query, key)
    impl, reason = backend_rule(backend, q, attn_mask is not None, k, pv_fp32, cuda=True, v=value,
                                key_block=key_block or BLOCK_N)
    if impl == "triton":
        return (TRITON_VARLEN if varlen else TRITON_DENSE), None
    return PYTORCH, reason


_recording: list[dict[str, Any]] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[dict[str, Any]]]:
    """Collect one entry per attention call served (eager code only) while the context is open."""
    global _recording
    previous, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = previous


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _model_key(module: nn.Module) -> str:
    config = getattr(module, "config", None)
    return f"{id(config) if config is not None else id(module)}"


def record(module: nn.Module, query: torch.Tensor, key: torch.Tensor, backend: str, *,
           attn_mask: torch.Tensor | None, varlen: bool, who: str, pv_fp32: bool = False,
           value: torch.Tensor | None = None, key_block: int | None = None) -> None:
    """Note which path serves this call; warn once per model and reason when it is slow on a CUDA device."""
    path, reason = serving(query, key, backend, attn_mask, varlen, pv_fp32, value, key_block)
    if _recording is not None and not torch.compiler.is_compiling():
        _recording.append({"module": module, "path": path, "reason": _ADVICE.get(reason, _CONFIGURED.get(reason)),
                           "device": query.device.type, "varlen": varlen})
    if reason in _ADVICE and _on_cuda(query):
        warn_once(f"{_model_key(module)}:{reason}",
                  f"stable_attn: {who} runs on the PyTorch path on {query.device} (stabilized, several times slower "
                  f"than the fused kernel) because of {_ADVICE[reason]}. stable_attn.explain(model, batch) lists "
                  "every layer's path.")
