"""``stable_attn.attention_varlen``: packed sequences in FlashAttention's varlen layout, and its torch.library op.

The op is ``stable_attn::attention_varlen_fwd`` / ``stable_attn::attention_varlen_bwd``, registered like
``attention()``'s by :func:`stable_attn._ops.define`: ``torch.compile`` keeps it in the graph as one call;
the shapes, dtypes and devices are checked in _checks.py (:func:`stable_attn._checks.packed_problem`).
Backend ``"triton"`` is ``triton_attention.forward_varlen`` / ``backward_varlen`` (all sequences in one
launch, nothing padded), ``"torch"`` is ``kernels/reference_varlen.py`` (one reference call per
sequence). Both compute, for every sequence, what ``attention()`` computes on that sequence alone, with
the same options and statistics.

The checks that read ``cu_seqlens``' values (starts at 0, non-decreasing, ends at the token count, no
sequence longer than ``max_seqlen``) run inside the op, on the host, so that tracing never depends on
tensor data: one small device-to-host copy (a sync on the GPU) per distinct ``cu_seqlens`` tensor, not
per call: a model's layers share one tensor per forward, so an L-layer forward and backward pay one
copy (:func:`check_cu_seqlens_values`).
"""

from __future__ import annotations

import weakref

import torch

from . import _ops
from ._checks import packed_problem, raise_problem, unit_last_stride
from ._ops import autocast_inputs, check_stats, draw_seed, resolve_backend
from .kernels import reference, reference_varlen
from .options import DEFAULTS, Options, Stabilize
from .stats import AttentionStats, RowStats

# id(cu_seqlens) -> (weak reference, _version, data_ptr, the (total, max_seqlen) pairs its values passed)
_CHECKED: dict[int, tuple[weakref.ref, int, int, set[tuple[int, int]]]] = {}
_MAX_CHECKED = 64  # tensors remembered at once (dead ones leave by themselves; beyond this the oldest goes)


def _host_values(cu: torch.Tensor) -> list[int]:
    """The one device-to-host read of a ``cu_seqlens`` tensor (the tests count these calls)."""
    return cu.tolist()


def _state(cu: torch.Tensor) -> tuple[int, int] | None:
    """What an in-place change or a new storage changes; None for inference tensors (no version counter)."""
    return None if cu.is_inference() else (cu._version, cu.data_ptr())


def _passed(cu: torch.Tensor, state: tuple[int, int] | None, against: tuple[int, int]) -> bool:
    entry = _CHECKED.get(id(cu))
    return state is not None and entry is not None and entry[0]() is cu and entry[1:3] == state and against in entry[3]


def _remember(cu: torch.Tensor, state: tuple[int, int] | None, against: tuple[int, int]) -> None:
    if state is None:  # an in-place change could not be seen: read again at every call
        return
    key = id(cu)
    entry = _CHECKED.get(key)
    if entry is not None and entry[0]() is cu and entry[1:3] == state:
        entry[3].add(against)
        return

    def forget(ref: weakref.ref, key: int = key) -> None:
        if key in _CHECKED and _CHECKED[key][0] is ref:  # not a newer tensor that got the same id
            del _CHECKED[key]

    _CHECKED.pop(key, None)
    while len(_CHECKED) >= _MAX_CHECKED:
        del _CHECKED[next(iter(_CHECKED))]
    _CHECKED[key] = (weakref.ref(cu, forget), *state, {against})


def check_cu_seqlens_values(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                            max_seqlen_q: int, max_seqlen_k: int) -> None:
    """The value checks of ``cu_seqlens``; errors name the argument and the values.

    Each tensor's values are read on the host (on the GPU, a device-to-host copy and a sync) the first
    time it is checked against a token count and ``max_seqlen``; the tensor is then remembered (a weak
    reference, its ``_version`` and ``data_ptr``), so calls with the same tensor, unchanged, against the
    same numbers read nothing. An in-place change bumps ``_version`` and is read again; writes that
    bypass the version counter (through ``.data``, DLPack, another library, a replayed CUDA graph) are
    not seen, and inference-mode tensors (no version counter) are read at every call. Under
    ``torch.compile`` the fake implementation reads nothing; the check runs when the compiled graph
    calls the op. Under CUDA graphs it runs during warm-up and capture (a tensor read in warm-up is
    remembered, so capture does not sync), never at replay: values copied into a captured graph's
    ``cu_seqlens`` are not checked, as FlashAttention checks none.
    """
    for name, cu, total, max_name, max_len in (("cu_seqlens_q", cu_seqlens_q, total_q, "max_seqlen_q", max_seqlen_q),
                                               ("cu_seqlens_k", cu_seqlens_k, total_k, "max_seqlen_k", max_seqlen_k)):
        state, against = _state(cu), (int(total), int(max_len))
        if _passed(cu, state, against) or (cu is cu_seqlens_q and name == "cu_seqlens_k" and
                                           against == (int(total_q), int(max_seqlen_q))):
            continue  # remembered, or k's offsets are q's, just checked against the same numbers
        c = _host_values(cu)
        shown = c if len(c) <= 12 else f"{c[:6]} ... {c[-6:]}"
        if c[0] != 0:
            raise ValueError(f"{name} must start at 0, got {shown}")
        if c[-1] != total:
            raise ValueError(f"{name} must end at the number of packed tokens {total}, got {shown}")
        lengths = [b - a for a, b in zip(c[:-1], c[1:])]
        if min(lengths) < 0:
            raise ValueError(f"{name} must be non-decreasing (sequence lengths >= 0), got {shown}")
        if max(lengths) > max_len:
            raise ValueError(f"{max_name}={max_len} is smaller than the longest sequence ({max(lengths)} tokens) of "
                             f"{name}")
        _remember(cu, state, against)
        _note_extent(cu, state, lengths)


# id(cu_seqlens) -> (weak reference, (_version, data_ptr), sequences up to the last non-empty one, longest)
_EXTENT: dict[int, tuple[weakref.ref, tuple[int, int], int, int]] = {}


def _note_extent(cu: torch.Tensor, state: tuple[int, int] | None, lengths: list[int]) -> None:
    """Remember, from the values the check just read, where the non-empty sequences end and the longest one."""
    if state is None:
        return
    used = max((i + 1 for i, n in enumerate(lengths) if n), default=0)
    while len(_EXTENT) >= _MAX_CHECKED:
        del _EXTENT[next(iter(_EXTENT))]
    key = id(cu)
    _EXTENT[key] = (weakref.ref(cu, lambda ref, key=key: _EXTENT.pop(key, None)
                                if key in _EXTENT and _EXTENT[key][0] is ref else None), state, used, max(lengths))


def launch_extent(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                  ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``cu_seqlens`` without their trailing empty sequences and the max lengths tightened to the longest, for
    the launch (the Triton grid is sequences x query blocks of ``max_seqlen_q``; the PyTorch path loops
    over the sequences).

    The transformers integration passes documents it found on the device with a static shape (``B * N + 1``
    offsets, the unused ones equal to the token count, ``max_seqlen`` = the row length ``N``) so that tracing
    reads no value; the values the check read are remembered with the tensor, so this reads nothing more.
    Tensors the check could not remember (inference tensors) are launched as they are.
    """
    if cu_seqlens_q is not cu_seqlens_k:
        return cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    entry = _EXTENT.get(id(cu_seqlens_q))
    if entry is None or entry[0]() is not cu_seqlens_q or entry[1] != _state(cu_seqlens_q):
        return cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    used, longest = entry[2], entry[3]
    cu = cu_seqlens_q[:used + 1]
    return cu, cu, min(max_seqlen_q, max(longest, 1)), min(max_seqlen_k, max(longest, 1))


def _forward(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts: Options,
             with_stats: int) -> tuple[torch.Tensor, torch.Tensor, RowStats | None]:
    check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = launch_extent(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                         max_seqlen_k)
    if opts.backend == "triton":
        from .kernels import triton_attention

        return triton_attention.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts,
                                               with_stats, sinks=sinks)
    return reference_varlen.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts,
                                           with_stats, sinks)


def _backward(do, q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts: Options):
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = launch_extent(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                         max_seqlen_k)
    if opts.backend == "triton":
        from .kernels import triton_attention

        impl = triton_attention.backward_varlen
    else:
        impl = reference_varlen.backward_varlen
    dq, dk, dv = impl(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts)
    # lse is [Hq, total_q]; the rows' delta [total_q, Hq] transposed to match
    dsinks = None if sinks is None else reference.sink_gradient(sinks, lse, reference.row_delta(do, out).t())
    return dq, dk, dv, dsinks


# lse is [Hq, total_q]; the statistics are one batch element [1, Hq, total_q] (what AttentionStats.update reads)
_varlen_fwd, _varlen_bwd = _ops.define(
    "attention_varlen", "Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k",
    _forward, _backward, rows=lambda q: ((q.shape[1], q.shape[0]), (1, q.shape[1], q.shape[0])),
)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = DEFAULTS["causal"],
    scale: float | None = DEFAULTS["scale"],
    window: int | None = DEFAULTS["window"],
    softcap: float | None = DEFAULTS["softcap"],
    dropout_p: float = DEFAULTS["dropout_p"],
    stabilize: Stabilize = DEFAULTS["stabilize"],
    beta: float = DEFAULTS["beta"],
    stats: AttentionStats | None = None,
    backend: str = DEFAULTS["backend"],
    block_n: int | None = DEFAULTS["block_n"],
    pv_fp32: bool = DEFAULTS["pv_fp32"],
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over packed sequences with the dynamic-max fix; FlashAttention's varlen layout.

    For every sequence ``b`` computes exactly what :func:`stable_attn.attention` computes on it alone:
    queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` attend to keys and values
    ``k/v[cu_seqlens_k[b]:cu_seqlens_k[b+1]]`` and nothing else; no padding is materialized.

    Args:
        q: ``[total_q, Hq, D]``; k: ``[total_k, Hkv, D]``, v: ``[total_k, Hkv, Dv]`` with ``Hq % Hkv == 0``
            (GQA/MQA); dtypes bfloat16, float16, float32; ``D, Dv <= 512`` (as in :func:`stable_attn.attention`).
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` on q's device: sequence offsets, starting at 0,
            non-decreasing, ending at ``total_q`` / ``total_k``. A sequence with no keys outputs zeros.
        max_seqlen_q, max_seqlen_k: ints at least the longest query / key sequence (the kernels' grid).
        causal, window: per sequence, aligned bottom-right as in :func:`stable_attn.attention` (query
            ``i`` of a sequence stands at ``p = i + len_k - len_q``).
        scale, softcap, stabilize, beta, backend, block_n, pv_fp32, sinks: as in :func:`stable_attn.attention`
            (each sequence's rows have the sink of their head).
        dropout_p: attention dropout; sequence ``b`` draws the mask :func:`stable_attn.attention` would
            draw on it alone with Philox seed ``seed + b`` (one seed drawn per call).
        stats: an :class:`AttentionStats` to accumulate per-head row statistics into, exactly as
            :func:`stable_attn.attention` does (every packed row counts once).

    Returns:
        ``[total_q, Hq, Dv]``.
    """
    q, k, v = autocast_inputs(q, k, v)
    raise_problem(packed_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks))
    opts = Options.create(head_dim=q.shape[-1], causal=causal, scale=scale, window=window, softcap=softcap,
                          dropout_p=dropout_p, stabilize=stabilize, beta=beta, backend=backend, block_n=block_n,
                          pv_fp32=pv_fp32)
    check_stats(stats)
    # as one batch element: the whole packed tensor must fit the kernels' 32-bit offsets
    impl = resolve_backend(opts.backend, q[None], False, k[None], opts.pv_fp32, v, opts.key_block)
    q, k, v = unit_last_stride(q, k, v)
    return _ops.run(_varlen_fwd, q, k, v, sinks, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                    draw_seed(opts.dropout_p), opts, impl, stats)
