"""The decode launch, prepared once per shape: what ``generate()`` repeats every layer of every step costs no host work.

A decoding step calls the decode path (``triton_decode.py``) once per layer with the same shapes, strides,
dtypes and options; only the tensors' data change. :class:`DecodeLaunch` computes from those once what the two
launches need: the kernel's constexprs and compile options (``triton_decode.decode_constants``), the split count
(``decode_plan.split_keys``: from the shapes alone, never from a device value), the grids, the strides and
scalars as the kernels' keyword arguments, and the checks the launcher makes (grid limits, the split).
:meth:`DecodeLaunch.run` then allocates the output and passes the tensors.

The splits' fp32 partials are scratch: written by the decode kernel and read by the combine kernel of the same
call, never returned. They are kept per (size, device, CUDA stream) and reused by the next call of the same size
on the same stream (launches on one stream run in order, so a later call cannot overwrite partials an earlier
one still reads), except while a CUDA graph is being captured: memory allocated then belongs to the graph's
pool, so a captured call allocates its own (a replay runs no host code at all).

:func:`prepared` keeps the launches by shape (what ``stable_attn.attention`` calls for the decode path on the Triton
backend); :func:`triton_decode.forward` builds one for a single call (tests, benchmarks, a given ``split``).
"""

from __future__ import annotations

import torch
import triton

from .. import rules
from .._checks import interpreting
from ..options import Options
from . import decode_plan
from . import triton_decode as td
from . import triton_launch as launch

MAX_PREPARED = 64  # launches kept by shape (a dynamic cache adds one per step, shared by every layer of the step)
_prepared: dict[tuple, DecodeLaunch] = {}
_scratch: dict[tuple, tuple[torch.Tensor, ...]] = {}


class DecodeLaunch:
    """The decode path's two launches for one shape of ``(q, k, v, key_padding_mask, sinks)`` and one ``Options``.

    Built from tensors of that shape (their values are not read); raises the launcher's ValueErrors."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
                 opts: Options, sinks: bool, split: int | None = None) -> None:
        launch.check_device(q)
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        Dv = v.shape[-1]  # the value head dim (the partials' and the output's)
        G = Hq // Hkv
        if Hkv > launch.MAX_GRID_Y:
            raise ValueError(f"Hkv={Hkv} KV heads: the decode kernel launches one grid row per KV head and CUDA "
                             f"allows at most {launch.MAX_GRID_Y}")
        block_n = opts.key_block
        if split is None:
            split = decode_plan.split_keys(B, Hkv, Nk, block_n)
        decode_plan.check_split(split, block_n)
        S = decode_plan.num_splits(Nk, split)
        upcast = interpreting()
        consts, compile_opts = td.decode_constants(
            D, q.dtype, launch.capability(q.device), groups=G, nq=Nq, causal=opts.causal,
            window=opts.window is not None, softcap=launch.score_form(opts), kpm=key_padding_mask is not None,
            mode=opts.mode, block_n=block_n, upcast=upcast, sinks=sinks, value_dim=Dv)
        tie2, min_shift2, max_shift2 = rules.rule_constants(q.dtype, opts.mode)
        sc = launch.kernel_scalars(opts, q.dtype)
        n_rb = triton.cdiv(G * Nq, consts["BLOCK_M"])
        self.dtype, self.device = q.dtype, q.device
        self.out_shape, self.rows = (B, Hq, Nq, Dv), (B, Hq, Nq)
        self.partial_shapes = ((B, Hq, Nq, S, Dv), (B, Hq, Nq, S))
        self.has_kpm, self.has_sinks = key_padding_mask is not None, sinks
        heads = Hkv * launch.dv_blocks(consts)  # grid rows: each KV head's programs over V's column blocks
        if heads > launch.MAX_GRID_Y:
            raise ValueError(f"Hkv={Hkv} KV heads with V's head dim {Dv} in {launch.dv_blocks(consts)} blocks: more "
                             f"than the {launch.MAX_GRID_Y} grid rows CUDA allows")
        self.grids = [((S * n_rb, heads, nb), b_first) for b_first, nb in launch.batches(B)]
        self.decode_args = dict(
            **launch.strides("q", q), **launch.strides("k", k), **launch.strides("v", v),
            stride_kpmb=key_padding_mask.stride(0) if key_padding_mask is not None else 0, Hq=Hq, G=G, Nq=Nq, Nk=Nk,
            window=sc["window"], split=split, n_splits=S, qk_scale2=sc["qk_scale2"], cap_scale=sc["cap_scale"],
            cap_log2e=sc["cap_log2e"], tie2=tie2, min_shift2=min_shift2, max_shift2=max_shift2, beta=opts.beta,
            **consts, **compile_opts)
        self.combine_grid = (B * Hq * Nq,) if B * Hq * Nq > 0 else None
        self.combine_args = dict(
            stride_ob=Hq * Nq * Dv, stride_oh=Nq * Dv, stride_on=Dv, Hq=Hq, Nq=Nq, n_splits=S, HEAD_D=Dv,
            BLOCK_D=launch.head_block(Dv), BLOCK_S=triton.next_power_of_2(S), DTYPE=consts["DTYPE"], UPCAST=upcast,
            num_warps=4, **launch.FWD_COMPILE_OPTIONS)  # no contraction: the mirror rounds each step

    def partials(self) -> tuple[torch.Tensor, ...]:
        """The splits' ``(acc, l, r, m)`` and an fp32 ``lse`` of the rows, scratch reused on this stream."""
        device = self.device
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (self.partial_shapes, device, stream)
        bufs = None if capturing else _scratch.get(key)
        if bufs is None:
            acc_shape, row_shape = self.partial_shapes
            bufs = (launch.empty(acc_shape, torch.float32, device),
                    *(launch.empty(row_shape, torch.float32, device) for _ in range(3)),
                    launch.empty(self.rows, torch.float32, device))
            if not capturing:
                if len(_scratch) >= MAX_PREPARED:
                    _scratch.clear()
                _scratch[key] = bufs
        return bufs

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
            sinks: torch.Tensor | None, *, fresh_lse: bool = True, partials: tuple | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse2)`` of tensors shaped as the ones this launch was built from (the caller's promise: the
        shapes, strides, dtypes and device are not checked again). ``fresh_lse=False``: ``lse2`` is scratch, for
        a caller that drops it; ``partials``: ``(acc, l, r, m)`` to write the splits' partials into."""
        out = launch.empty(self.out_shape, self.dtype, self.device)
        acc, l_s, r_s, m_s, lse2 = self.partials() if partials is None else (*partials, None)
        if fresh_lse or lse2 is None:
            lse2 = launch.empty(self.rows, torch.float32, self.device)
        kpm = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else lse2
        sinks_in = lse2 if sinks is None else sinks.to(torch.float32).contiguous()
        kernel = td.attn_decode_kernel  # read at each call: a test or benchmark may replace it
        for grid, b_first in self.grids:
            kernel[grid](Q=q, K=k, V=v, KPM=kpm, Acc=acc, Lsum=l_s, Roff=r_s, Mmax=m_s, Sinks=sinks_in,
                         b_first=b_first, **self.decode_args)
        if self.combine_grid is not None:
            td.attn_decode_combine_kernel[self.combine_grid](Acc=acc, Lsum=l_s, Roff=r_s, Mmax=m_s, Out=out, Lse=lse2,
                                                             **self.combine_args)
        return out, lse2


def prepared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None, opts: Options,
             sinks: torch.Tensor | None) -> DecodeLaunch:
    """The :class:`DecodeLaunch` of these tensors' shapes and ``opts``, built at its first call and kept."""
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device,
           None if key_padding_mask is None else key_padding_mask.stride(), sinks is None, opts, interpreting())
    found = _prepared.get(key)
    if found is None:
        found = DecodeLaunch(q, k, v, key_padding_mask, opts, sinks is not None)
        if len(_prepared) >= MAX_PREPARED:
            _prepared.clear()
        _prepared[key] = found
    return found
