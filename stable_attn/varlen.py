"""``stable_attn.attention_varlen``: packed sequences in FlashAttention's varlen layout, and its torch.library op.

The op is ``stable_attn::attention_varlen_fwd`` / ``stable_attn::attention_varlen_bwd`` with fake
implementations and an autograd formula, like ``attention()``'s (attention.py): ``torch.compile`` keeps it
in the graph as one call. Backend ``"triton"`` is ``triton_attention.forward_varlen`` / ``backward_varlen``
(all sequences in one launch, nothing padded), ``"torch"`` is ``kernels/reference_varlen.py`` (one
reference call per sequence). Both compute, for every sequence, what ``attention()`` computes on that
sequence alone, with the same options and statistics.

The checks that read ``cu_seqlens``' values (starts at 0, non-decreasing, ends at the token count, no
sequence longer than ``max_seqlen``) run inside the op, on the host, so that tracing never depends on
tensor data: one small device-to-host copy (a sync on the GPU) per distinct ``cu_seqlens`` tensor, not
per call: a model's layers share one tensor per forward, so an L-layer forward and backward pay one
copy (:func:`check_cu_seqlens_values`).
"""

from __future__ import annotations

import weakref

import torch

from .attention import (
    STATS_RESULTS,
    autocast_inputs,
    check_stats,
    draw_seed,
    empty_stats,
    resolve_backend,
    seed_value,
    stats_like,
    unit_last_stride,
)
from .kernels import reference_varlen, rules
from .options import DEFAULTS, Options, Stabilize, op_schema
from .stats import AttentionStats, RowStats

_FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
    f"SymInt max_seqlen_k, Tensor? seed, bool with_stats, {op_schema()}) -> (Tensor, Tensor, {STATS_RESULTS})"
)
_BWD_SCHEMA = (
    "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    f"SymInt max_seqlen_q, SymInt max_seqlen_k, Tensor? seed, {op_schema()}) -> (Tensor, Tensor, Tensor)"
)


def _is_int(x: object) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def check_varlen_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int) -> None:
    """Shapes, dtypes and devices of a varlen call (no tensor values are read: safe to trace)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            hint = " (batched [B, H, N, D] inputs go to stable_attn.attention)" if t.dim() == 4 else ""
            raise ValueError(f"{name} must have rank 3 [total, H, D] (FlashAttention's varlen layout), got shape "
                             f"{tuple(t.shape)}{hint}")
        if t.dtype not in rules.SUPPORTED_DTYPES:
            raise TypeError(f"{name}.dtype={t.dtype} is not supported; use bfloat16, float16 or float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    total_q, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [total_k, Hkv, D], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[2] != D:
        raise ValueError(f"k head dim {k.shape[2]} does not match q head dim {D} (q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)} as [total, H, D])")
    if not 1 <= D <= 256:
        raise ValueError(f"head dim D={D} is not supported; use 1 <= D <= 256 (the last dim of [total, H, D])")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q heads Hq={Hq} must be a multiple of k/v heads Hkv={Hkv} (GQA/MQA; q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)} as [total, H, D])")
    if total_q == 0 or k.shape[0] == 0:
        raise ValueError(f"the packed sequences must hold at least one token, got total_q={total_q}, "
                         f"total_k={k.shape[0]}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be an int32 tensor [batch + 1], got {type(cu).__name__}")
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must be an int32 tensor of shape [batch + 1] (batch >= 1), got dtype "
                             f"{cu.dtype} and shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device}, q on {q.device}; put it on q's device")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got shapes "
                         f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not (_is_int(m) and m >= 1):
            raise ValueError(f"{name}={m!r} must be a positive int (the longest sequence's length)")


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


def _forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, with_stats, *options):
    check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    opts = Options.from_op_args(options, seed_value(seed))
    if opts.backend == "triton":
        from .kernels import triton_attention

        impl = triton_attention.forward_varlen
    else:
        impl = reference_varlen.forward_varlen
    out, lse, rs = impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts, with_stats)
    if rs is None:
        return (out, lse, *empty_stats(q))
    return out, lse, rs.saturated, rs.fixed_blocks, rs.max_logit, rs.first_key_prob


def _backward_impl(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, *options):
    opts = Options.from_op_args(options, seed_value(seed))
    do = do.contiguous()
    if opts.backend == "triton":
        from .kernels import triton_attention

        impl = triton_attention.backward_varlen
    else:
        impl = reference_varlen.backward_varlen
    return impl(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts)


_varlen_fwd = torch.library.custom_op("stable_attn::attention_varlen_fwd", _forward_impl, mutates_args=(),
                                      schema=_FWD_SCHEMA)
_varlen_bwd = torch.library.custom_op("stable_attn::attention_varlen_bwd", _backward_impl, mutates_args=(),
                                      schema=_BWD_SCHEMA)


@_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, with_stats, *options):
    total_q, Hq, _ = q.shape
    lse = q.new_empty((Hq, total_q), dtype=torch.float32)
    return (torch.empty_like(q), lse, *(stats_like((1, Hq, total_q), q) if with_stats else empty_stats(q)))


@_varlen_bwd.register_fake
def _(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, seed, _with_stats, *options = inputs
    ctx.max_seqlens = (max_q, max_k)
    ctx.options = options
    ctx.n_inputs = len(inputs)
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k, seed)


def _backward(ctx, do, dlse, *unused):
    q, k, v, out, lse, cu_q, cu_k, seed = ctx.saved_tensors
    dq, dk, dv = _varlen_bwd(do, q, k, v, out, lse, cu_q, cu_k, *ctx.max_seqlens, seed, *ctx.options)
    return dq, dk, dv, *([None] * (ctx.n_inputs - 3))  # no gradient for cu_seqlens, lengths, seed, options


_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


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
) -> torch.Tensor:
    """Attention over packed sequences with the dynamic-max fix; FlashAttention's varlen layout.

    For every sequence ``b`` computes exactly what :func:`stable_attn.attention` computes on it alone:
    queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` attend to keys and values
    ``k/v[cu_seqlens_k[b]:cu_seqlens_k[b+1]]`` and nothing else; no padding is materialized.

    Args:
        q: ``[total_q, Hq, D]``; k, v: ``[total_k, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA/MQA); dtypes
            bfloat16, float16, float32; ``D <= 256``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` on q's device: sequence offsets, starting at 0,
            non-decreasing, ending at ``total_q`` / ``total_k``. A sequence with no keys outputs zeros.
        max_seqlen_q, max_seqlen_k: ints at least the longest query / key sequence (the kernels' grid).
        causal, window: per sequence, aligned bottom-right as in :func:`stable_attn.attention` (query
            ``i`` of a sequence stands at ``p = i + len_k - len_q``).
        scale, softcap, stabilize, beta, backend, block_n: as in :func:`stable_attn.attention`.
        dropout_p: attention dropout; sequence ``b`` draws the mask :func:`stable_attn.attention` would
            draw on it alone with Philox seed ``seed + b`` (one seed drawn per call).
        stats: an :class:`AttentionStats` to accumulate per-head row statistics into, exactly as
            :func:`stable_attn.attention` does (every packed row counts once).

    Returns:
        ``[total_q, Hq, D]``.
    """
    q, k, v = autocast_inputs(q, k, v)
    check_varlen_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    opts = Options.create(head_dim=q.shape[-1], causal=causal, scale=scale, window=window, softcap=softcap,
                          dropout_p=dropout_p, stabilize=stabilize, beta=beta, backend=backend, block_n=block_n)
    check_stats(stats)
    # as one batch element: the whole packed tensor must fit the kernels' 32-bit offsets
    impl = resolve_backend(opts.backend, q[None], False, k[None])
    q, k, v = unit_last_stride(q, k, v)
    collect = stats is not None and stats.enabled
    outs = _varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, draw_seed(opts.dropout_p),
                       collect, *opts.replace(backend=impl).op_args())
    if collect:
        stats.update(RowStats(*outs[2:]))
    return outs[0]
