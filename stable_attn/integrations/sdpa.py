"""``patch_sdpa()``: route ``torch.nn.functional.scaled_dot_product_attention`` to stable_attn.

For code that calls ``F.scaled_dot_product_attention`` itself (nanoGPT and most hand-written models),
this is the whole switch::

    with stable_attn.patch_sdpa():          # a context manager ...
        loss = model(x).loss

    handle = stable_attn.patch_sdpa(beta=4.0)  # ... or permanent: installed on the call,
    ...                                        # until handle.restore() or stable_attn.unpatch_sdpa()

The wrapper computes what sdpa computes, except that a query row whose mask hides every key gets
zeros (sdpa gives NaN). Calls it can serve go to :func:`stable_attn.attention`:
4D ``[B, H, N, D]`` float16/bfloat16/float32 tensors with ``D, Dv <= 512`` (v's head dim may differ), no mask, a
boolean mask (True = attend) or an additive float mask, ``is_causal`` (sdpa aligns it top-left when
``Nq != Nk``; that case is served with an explicit mask), ``enable_gqa``, ``dropout_p`` and ``scale``.
Every other call (other ranks or dtypes, nested tensors, a key head dim different from the query's,
batch broadcasting, a scale outside what options.scale_problem accepts, invalid argument combinations that
sdpa itself rejects) goes to the function that was installed before the patch, with a one-time
``RuntimeWarning`` naming the reason. The rules are :func:`stable_attn._checks.sdpa_problem` (here
``unsupported_reason``): whatever ``attention()`` would refuse falls back.

Caveats:
- The patch replaces the attribute ``torch.nn.functional.scaled_dot_product_attention``. Code that did
  ``from torch.nn.functional import scaled_dot_product_attention`` before the patch holds the original
  function and is not affected; so is code that calls ``torch._C._nn.scaled_dot_product_attention``.
- Anything that looks the attribute up at call time is affected, including transformers'
  ``attn_implementation="sdpa"`` (for transformers models, prefer ``attn_implementation="stable_attn"``:
  it also serves padding, sliding windows and softcapping on the fast path).
- Patches nest; restore them in reverse order (``unpatch_sdpa()`` restores all of them).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .._checks import layout_doubt
from .._checks import sdpa_problem as unsupported_reason
from ..attention import attention
from ..options import DEFAULTS, Stabilize, model_options

_active: list[SdpaPatch] = []
_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"stable_attn.patch_sdpa: this scaled_dot_product_attention call runs unstabilized on the original "
            f"function because of {reason} (warned once per reason)",
            RuntimeWarning,
            stacklevel=3,
        )



def _sdpa_layout(query: torch.Tensor, key: torch.Tensor, causal: bool) -> str | None:
    """None (``attention()``'s wrong-layout check runs) where the shapes look like ``[B, N, H, D]``, else ``"bhnd"``:
    sdpa's callers cannot say their layout, so the strict mode's rule for shapes that fit both does not apply."""
    return None if layout_doubt(query, key, causal) is not None else "bhnd"

class SdpaPatch:
    """One installed patch (what :func:`patch_sdpa` returns); also a context manager.

    ``restore()`` puts back the function that was installed before this patch; it is idempotent and
    refuses (RuntimeError) while a later patch is still installed on top of this one.
    """

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.previous: Callable = F.scaled_dot_product_attention
        self.wrapper = self._make_wrapper()
        self.active = True
        F.scaled_dot_product_attention = self.wrapper
        _active.append(self)

    def _make_wrapper(self) -> Callable:
        previous, options = self.previous, self.options

        @functools.wraps(previous)
        def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                         scale=None, enable_gqa=False, **extra):
            reason = unsupported_reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, extra)
            if reason is not None:
                _warn_once(reason)
                if enable_gqa:  # only passed when set: torch < 2.5 has no such argument
                    extra["enable_gqa"] = enable_gqa
                return previous(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                scale=scale, **extra)
            causal = bool(is_causal)
            Nq, Nk = query.shape[2], key.shape[2]
            if causal and Nq != Nk:
                # sdpa's is_causal is aligned top-left (query i sees keys j <= i); stable_attn's bottom-right
                attn_mask = torch.ones(Nq, Nk, dtype=torch.bool, device=query.device).tril()
                causal = False
            return attention(query, key, value, causal=causal, scale=scale, attn_mask=attn_mask,
                             dropout_p=float(dropout_p), layout=_sdpa_layout(query, key, causal), **options)

        scaled_dot_product_attention.stable_attn_patch = self
        return scaled_dot_product_attention

    def restore(self) -> None:
        """Put back the function this patch replaced."""
        if not self.active:
            return
        if F.scaled_dot_product_attention is not self.wrapper:
            raise RuntimeError(
                "stable_attn.patch_sdpa: scaled_dot_product_attention was replaced again after this patch; restore "
                "the later patch first (patches nest), or call stable_attn.unpatch_sdpa() to restore all of them"
            )
        F.scaled_dot_product_attention = self.previous
        self.active = False
        _active.remove(self)

    def __enter__(self) -> SdpaPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        return f"SdpaPatch(active={self.active}, options={self.options})"


def patch_sdpa(
    *,
    stabilize: Stabilize = DEFAULTS["stabilize"],
    beta: float = DEFAULTS["beta"],
    backend: str = DEFAULTS["backend"],
    block_n: int | None = DEFAULTS["block_n"],
    pv_fp32: bool = DEFAULTS["pv_fp32"],
) -> SdpaPatch:
    """Replace ``torch.nn.functional.scaled_dot_product_attention`` with a stable_attn wrapper, now.

    Returns the :class:`SdpaPatch` handle: use it as a context manager (``with patch_sdpa(): ...``
    restores on exit) or keep it and call ``.restore()`` (or :func:`unpatch_sdpa`) later. The options
    are those of :func:`stable_attn.attention`; they are checked here, before anything is patched.
    """
    options = {"stabilize": stabilize, "beta": beta, "backend": backend, "block_n": block_n, "pv_fp32": pv_fp32}
    return SdpaPatch(model_options(options, where="patch_sdpa"))


def unpatch_sdpa() -> None:
    """Restore every active :func:`patch_sdpa` patch, newest first (no-op when none is active)."""
    while _active:
        _active[-1].restore()


def is_sdpa_patched() -> bool:
    """Whether a :func:`patch_sdpa` patch is currently installed."""
    return bool(_active)


__all__ = ["SdpaPatch", "is_sdpa_patched", "patch_sdpa", "unpatch_sdpa", "unsupported_reason"]
