"""Checked calls of ``attention()`` remembered by signature, so that a repeated call pays for no check twice.

``generate()`` calls ``attention()`` once per layer per step with the same shapes, strides, dtypes, devices and
options; only the data change. Everything ``attention()`` decides before it launches (the tensors' checks, the
``Options`` and their checks, the backend, whether the decode path serves the call) reads those and nothing else,
never a tensor's values. So an eager call that needs no gradient, whose :func:`signature` equals that of an earlier
call that passed every check and ran, gets that call's decisions back (:func:`get`) and goes straight to the
implementation: the checks are not dropped, they ran on the first call of the signature, which is also the call
that raises for bad input with the usual message (a signature is remembered only after its call succeeded).

The signature holds each tensor's type, shape, strides, dtype, device and ``requires_grad``; the grad mode; the
scalar options with their types (``stabilize=1`` is refused where ``True`` is accepted, and ``1 == True``);
whether Triton interprets. Calls it cannot describe take the full path every time: tensor subclasses, an active
``__torch_function__`` or ``__torch_dispatch__`` mode (they expect to see the op), an active functorch transform
(``torch.vmap``, ``torch.func.grad``/``jvp``: their wrappers' Python type is ``torch.Tensor``, so the type test
lets them through, but only the op's dispatch unwraps them), an active forward-AD level (a dual tensor is a plain
tensor too; the checks refuse forward mode, every call), autocast, and, in
``attention()``, an ``attn_mask``, ``stats``, dropout (a fresh seed per call), traced calls (``torch.compile``
keeps the op in its graph) and calls that need a gradient (autograd needs the op).

``ENABLED = False`` turns it off (benchmarks/decode_host.py compares both; tests compare the outputs bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import forward_ad

from ._checks import interpreting

ENABLED = True
MAX_CALLS = 64  # signatures kept (a dynamic KV cache adds one per generated token: every layer shares it)
_calls: dict[tuple, Callable] = {}
_Tensor = torch.Tensor
_transform = torch._C._functorch.peek_interpreter_stack  # None outside vmap/grad/jvp; one C call, no allocation


def signature(tensors: tuple, values: tuple) -> tuple | None:
    """The call's signature (module docstring), or None where the call must take the full path."""
    if torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack():
        return None
    # wrappers of a plain type: a transform's tensors exist only inside it, a dual tensor only inside its level
    if _transform() is not None or forward_ad._current_level >= 0:
        return None
    described = []
    for x in tensors:
        if x is None:
            described.append(None)
        elif type(x) is _Tensor:
            described.append((x.shape, x.stride(), x.dtype, x.device, x.requires_grad))
        else:
            return None
    q = tensors[0]
    if q is None or torch.is_autocast_enabled(q.device.type):
        return None
    return (*described, values, tuple(map(type, values)), torch.is_grad_enabled(), interpreting())


def get(key: tuple | None) -> Callable | None:
    """The remembered implementation of a signature, or None."""
    return None if key is None else _calls.get(key)


def remember(key: tuple | None, call: Callable) -> None:
    """Keep ``call`` for ``key`` (after the call with that signature succeeded)."""
    if key is None:
        return
    if len(_calls) >= MAX_CALLS:
        _calls.clear()
    _calls[key] = call
