"""What the two ops (attention.py, varlen.py) share: backend choice, autocast, the dropout seed, and the
torch.library glue, written once.

:func:`define` registers a forward/backward pair ``stable_attn::<name>_fwd`` / ``_bwd`` with a fake (meta)
implementation and an autograd formula, so ``torch.compile`` keeps each op in the graph as one opaque call
and autograd never traces through a reference implementation. Both ops take ``q, k, v``, the learned
``sinks`` (``Tensor?``), then their own inputs (the masks, or ``cu_seqlens`` and the lengths), the dropout
seed as a tensor, ``with_stats`` (a ``stats.STATS_*`` level) and the
fields of :class:`stable_attn.options.Options` by name (``options.op_schema``); the forward returns
``out`` (``[..., Dv]``: v's head dim), ``lse`` and the statistics (:class:`stable_attn.stats.RowStats`, empty
placeholders when none are collected); the backward returns ``dq, dk, dv, dsinks`` (``dsinks`` an empty
tensor without sinks).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from ._checks import interpreting, output_like
from .options import BLOCK_N, Options, op_schema
from .stats import STATS_ENTROPY, AttentionStats, RowStats, stats_level

logger = logging.getLogger("stable_attn")

_logged_once: set[str] = set()


def log_once(key: str, message: str, level: int = logging.INFO) -> None:
    """Log ``message`` the first time ``key`` is seen in this process (the fallback notices)."""
    if key not in _logged_once:
        _logged_once.add(key)
        logger.log(level, message)


# The Triton kernels address one batch element's q/k/v/o with 32-bit offsets.
_TRITON_MAX_ELEMENTS_PER_BATCH = 2**31

# Why the PyTorch path serves a call the kernels could otherwise take (backend_rule's reasons).
REASONS = ("backend", "pv_fp32", "kernel-gap", "attn_mask", "empty", "size", "cpu")


def backend_rule(backend: str, q: torch.Tensor, has_attn_mask: bool, k: torch.Tensor | None = None,
                 pv_fp32: bool = False, *, cuda: bool, v: torch.Tensor | None = None,
                 key_block: int = BLOCK_N) -> tuple[str, str | None]:
    """The one rule of which implementation serves a call: ``("triton", None)`` or ``("torch", reason)``, the
    reason one of :data:`REASONS`. ``cuda``: whether the call's tensors are on a CUDA device (the serving check of
    the transformers integration and ``explain()`` ask what would serve there). ``q`` / ``k``: ``[B, ...]``, one
    batch element per first index (a packed call as one batch element), the head dim last; ``v``: its head dim
    (``kernel-gap``: what the kernels do not implement, :func:`triton_gap`); ``key_block``: the partition
    (``Options.key_block``), whose K and V tiles must fit the kernels' shared memory. Logs and raises nothing:
    :func:`resolve_backend` does, for the calls that run.
    """
    if backend == "torch":
        return "torch", "backend"
    if pv_fp32:  # a comparison variant (stable-attn replay, the numerics lab): the kernels keep P-bar V in bf16
        return "torch", "pv_fp32"
    if triton_gap(q, v, key_block) is not None:
        return "torch", "kernel-gap"
    if has_attn_mask:
        return "torch", "attn_mask"
    if q.shape[0] == 0:
        return "torch", "empty"  # an empty batch: nothing to launch; the PyTorch path returns the empty tensors
    if (backend == "triton" or cuda) and _elements_per_batch(q, k) >= _TRITON_MAX_ELEMENTS_PER_BATCH:
        return "torch", "size"
    if backend == "auto" and not cuda:
        return "torch", "cpu"
    return "triton", None


def _elements_per_batch(q: torch.Tensor, k: torch.Tensor | None) -> int:
    return max(math.prod(q.shape[1:]), 0 if k is None else math.prod(k.shape[1:]))


# What the Triton kernels do not serve yet: the PyTorch path serves it (stabilized), logged once
TRITON_MAX_HEAD_DIM = 512
# The widest head dim one tile of the forward and decode kernels holds; wider ones (Gemma 4's 512) are walked in
# column chunks of Q and K and split over programs in V's, at most WIDE_TILE_COLS columns each
# (triton_launch.wide_tiles)
TILE_HEAD_DIM = 256
WIDE_TILE_COLS = 128
# One K tile plus one V tile of a key block must fit in shared memory with room for the query tile (A100: 163 KiB)
MAX_KV_TILE_BYTES = 128 * 1024


def kv_tile_bytes(key_block: int, d: int, dv: int, element_size: int) -> int:
    """Bytes of one K and one V tile of ``key_block`` keys, each head dim padded to a power of two >= 16 (as
    ``triton_launch.head_block`` pads it); where either is above :data:`TILE_HEAD_DIM`, both come in chunks and
    blocks of at most :data:`WIDE_TILE_COLS` columns."""
    cols = [max(16, 1 << (x - 1).bit_length()) for x in (d, dv)]
    if max(cols) > TILE_HEAD_DIM:
        cols = [min(c, WIDE_TILE_COLS) for c in cols]
    return key_block * sum(cols) * element_size


def triton_gap(q: torch.Tensor, v: torch.Tensor | None, key_block: int = BLOCK_N) -> str | None:
    """Why the Triton kernels cannot serve these inputs (a phrase for the one-time log line), or None. Learned
    sinks they serve (forward, decode; the backward needs nothing for them), and a value head dim apart from the
    query's (each up to :data:`TRITON_MAX_HEAD_DIM`), where the ``key_block``-key K and V tiles fit
    (:data:`MAX_KV_TILE_BYTES`: float32 at head dim 256 fits 64-key blocks, not the default 128; at 512, whose
    tiles are column chunks, 128)."""
    d = q.shape[-1]
    dv = d if v is None else v.shape[-1]
    if max(d, dv) > TRITON_MAX_HEAD_DIM:
        return f"head dim {max(d, dv)} > {TRITON_MAX_HEAD_DIM}"
    tiles = kv_tile_bytes(key_block, d, dv, q.element_size())
    if tiles > MAX_KV_TILE_BYTES:
        dims = f"head dim {d}" if dv == d else f"head dims {d} / {dv}"
        return (f"{str(q.dtype).removeprefix('torch.')} at {dims} with {key_block}-key blocks (K and V tiles of "
                f"{tiles} bytes, above the kernels' {MAX_KV_TILE_BYTES}; a smaller block_n fits)")
    return None


def resolve_backend(backend: str, q: torch.Tensor, has_attn_mask: bool, k: torch.Tensor | None = None,
                    pv_fp32: bool = False, v: torch.Tensor | None = None, key_block: int = BLOCK_N) -> str:
    """Pick the implementation (:func:`backend_rule`), saying once where the PyTorch path serves a call on a CUDA
    device (or one that asked for Triton). Never drops the stabilization: what Triton cannot serve goes to torch."""
    if pv_fp32 and backend == "triton":
        raise ValueError("pv_fp32=True with backend='triton' is not supported: the Triton kernels compute "
                         "P-bar V in the input dtype; use backend='auto' or 'torch' (the PyTorch path serves it)")
    impl, reason = backend_rule(backend, q, has_attn_mask, k, pv_fp32, cuda=q.is_cuda, v=v, key_block=key_block)
    if backend == "triton" or q.is_cuda:
        if reason == "kernel-gap":
            gap = triton_gap(q, v, key_block)
            log_once(f"gap {gap}", f"stable_attn: {gap} is served by the PyTorch path (stabilized, slower than the "
                     "Triton kernel, which does not implement it)", logging.WARNING)
        elif reason == "pv_fp32":
            log_once("pv_fp32", "stable_attn: pv_fp32=True is served by the PyTorch path (P-bar V in fp32; slower "
                     "than the Triton kernel)", logging.WARNING)
        elif reason == "attn_mask":
            log_once("attn_mask", "stable_attn: an arbitrary attn_mask is served by the PyTorch path "
                     "(stabilized, slower than the Triton kernel)", logging.WARNING)
        elif reason == "size":
            log_once("int32", f"stable_attn: {_elements_per_batch(q, k)} elements per batch element exceed the "
                     "Triton kernels' 32-bit offsets; served by the PyTorch path (stabilized, slower)",
                     logging.WARNING)
    if impl == "triton" and not q.is_cuda and not interpreting():
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is "
                         "imported; use backend='torch' or 'auto' for the CPU path")
    return impl


def autocast_inputs(*xs):
    """Like F.scaled_dot_product_attention, attention runs in autocast's lower precision."""
    first = xs[0]
    if isinstance(first, torch.Tensor) and torch.is_autocast_enabled(first.device.type):
        dt = torch.get_autocast_dtype(first.device.type)
        return tuple(t.to(dt) if isinstance(t, torch.Tensor) else t for t in xs)
    return xs


def check_stats(stats: object) -> None:
    if stats is not None and not isinstance(stats, AttentionStats):
        raise TypeError(f"stats must be an AttentionStats or None, got {type(stats).__name__}")


def seed_value(seed: torch.Tensor | None) -> int:
    """The dropout seed an op received; it travels as a tensor so that drawing it is a graph op under
    torch.compile (no .item() in the traced code)."""
    return 0 if seed is None else int(seed)


def draw_seed(dropout_p: float) -> torch.Tensor | None:
    """A fresh Philox seed for a call with dropout, None without.

    Drawn from the CPU generator, whose state torch.utils.checkpoint restores for the recompute.
    """
    return torch.randint(0, 2**62, (), dtype=torch.int64) if dropout_p > 0 else None


def define(name: str, inputs: str, forward: Callable, backward: Callable,
           rows: Callable[[torch.Tensor], tuple[tuple, tuple]]) -> tuple[Any, Any]:
    """Register ``stable_attn::<name>_fwd`` and ``stable_attn::<name>_bwd``; returns the two ops.

    ``inputs``: the schema of the op's own arguments after ``q, k, v, sinks`` (``"Tensor? key_padding_mask,
    ..."``); the tensors among them are saved for the backward, the other values kept as they are.
    ``forward(q, k, v, sinks, *inputs, opts, with_stats) -> (out, lse, RowStats | None)`` and
    ``backward(do, q, k, v, sinks, out, lse, *inputs, opts) -> (dq, dk, dv, dsinks | None)`` are the
    implementations (``do`` contiguous); ``rows(q)`` is ``(lse shape, statistics shape)``, for the fake
    implementation.
    """
    is_tensor = tuple(arg.split()[0].startswith("Tensor") for arg in inputs.split(","))
    n = len(is_tensor)
    options = op_schema()
    fwd_schema = (f"(Tensor q, Tensor k, Tensor v, Tensor? sinks, {inputs}, Tensor? seed, int with_stats, "
                  f"{options}) -> (Tensor, Tensor, {RowStats.SCHEMA})")
    bwd_schema = (f"(Tensor do, Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor out, Tensor lse, {inputs}, "
                  f"Tensor? seed, {options}) -> (Tensor, Tensor, Tensor, Tensor)")

    def forward_impl(q, k, v, sinks, *args):
        own, seed, with_stats, opts = args[:n], args[n], args[n + 1], args[n + 2:]
        out, lse, row_stats = forward(q, k, v, sinks, *own, Options.from_op_args(opts, seed_value(seed)),
                                      with_stats)
        return out, lse, *(RowStats.like(q) if row_stats is None else row_stats).tensors()

    def backward_impl(do, q, k, v, sinks, out, lse, *args):
        own, seed, opts = args[:n], args[n], args[n + 1:]
        dq, dk, dv, dsinks = backward(do.contiguous(), q, k, v, sinks, out, lse, *own,
                                      Options.from_op_args(opts, seed_value(seed)))
        return dq, dk, dv, _no_sinks(q) if dsinks is None else dsinks

    fwd = torch.library.custom_op(f"stable_attn::{name}_fwd", forward_impl, mutates_args=(), schema=fwd_schema)
    bwd = torch.library.custom_op(f"stable_attn::{name}_bwd", backward_impl, mutates_args=(), schema=bwd_schema)

    @fwd.register_fake
    def _(q, k, v, sinks, *args):
        lse_rows, stats_rows = rows(q)
        level = args[n + 1]
        row_stats = RowStats.like(q, stats_rows, entropy=level == STATS_ENTROPY) if level else RowStats.like(q)
        return output_like(q, v), q.new_empty(lse_rows, dtype=torch.float32), *row_stats.tensors()

    @bwd.register_fake
    def _(do, q, k, v, sinks, *args):
        dsinks = _no_sinks(q) if sinks is None else torch.empty_like(sinks)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks

    def setup_context(ctx, inputs, output):
        q, k, v, sinks = inputs[:4]
        own, seed = inputs[4:4 + n], inputs[4 + n]
        ctx.options = inputs[6 + n:]
        ctx.values = tuple(x for x, t in zip(own, is_tensor) if not t)
        ctx.n_inputs = len(inputs)
        ctx.save_for_backward(q, k, v, sinks, output[0], output[1], *(x for x, t in zip(own, is_tensor) if t),
                              seed)

    def backward_formula(ctx, do, dlse, *unused):
        q, k, v, sinks, out, lse, *tensors, seed = ctx.saved_tensors
        saved, values = iter(tensors), iter(ctx.values)
        own = tuple(next(saved) if t else next(values) for t in is_tensor)
        dq, dk, dv, dsinks = bwd(do, q, k, v, sinks, out, lse, *own, seed, *ctx.options)
        # no gradient for the other inputs, seed, options
        return dq, dk, dv, None if sinks is None else dsinks, *([None] * (ctx.n_inputs - 4))

    fwd.register_autograd(backward_formula, setup_context=setup_context)
    return fwd, bwd


def recomputing() -> bool:
    """Whether this eager forward runs inside a backward pass: activation checkpointing recomputing it
    (``torch.utils.checkpoint``, reentrant or not, FSDP2's and transformers' wrappers). Its statistics were
    counted when the forward first ran. A compiled graph recomputes inside its own backward, never here."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _no_sinks(q: torch.Tensor) -> torch.Tensor:
    """The backward's ``dsinks`` output of a call without sinks (an op result cannot be None)."""
    return q.new_empty((0,), dtype=torch.float32)


def run(op: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, inputs: tuple,
        seed: torch.Tensor | None, opts: Options, backend: str, stats: AttentionStats | None) -> torch.Tensor:
    """Call a forward op of :func:`define` on ``backend`` and fold its statistics into ``stats`` (once per
    forward: a recompute under activation checkpointing runs the same op, and folds nothing)."""
    level = stats_level(stats)
    outs = op(q, k, v, sinks, *inputs, seed, level, *opts.replace(backend=backend).op_args())
    if level and outs[2].numel() > 0 and not recomputing():  # an empty batch has no rows to fold in
        stats.update(RowStats(*outs[2:]))
    return outs[0]
