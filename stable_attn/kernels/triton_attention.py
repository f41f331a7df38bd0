"""Launchers for the Triton FlashAttention-2 kernels with the dynamic-max fix.

``forward`` and ``backward`` are what ``stable_attn.attention`` calls for ``backend="triton"``
(``forward_varlen`` / ``backward_varlen``: ``stable_attn.attention_varlen``, packed sequences); they
take ``options.Options`` and return exactly what ``reference.attention_forward`` /
``attention_backward`` return, computed by the kernels in ``triton_forward.py`` and
``triton_backward.py`` (no autograd anywhere on this path). Tiles, compile-time constants, grid
limits and the tensors' preparation come from ``triton_launch.py``; every kernel argument is passed
by name.
"""

from __future__ import annotations

import logging

import torch
import triton

from .. import rules
from .._checks import interpreting
from .._ops import MAX_KV_TILE_BYTES, TILE_HEAD_DIM, kv_tile_bytes, log_once
from ..options import BLOCK_N, Options
from ..stats import STATS_ENTROPY, RowStats
from . import triton_forward_ws
from . import triton_launch as launch
from .triton_backward import (
    attn_bwd_dkdv_kernel,
    attn_bwd_dkdv_varlen_kernel,
    attn_bwd_dq_kernel,
    attn_bwd_dq_varlen_kernel,
    attn_bwd_preprocess,
    attn_bwd_preprocess_varlen,
)
from .triton_backward_fused import backward_fused, backward_mode
from .triton_forward import attn_fwd_kernel, attn_fwd_varlen_kernel
from .triton_launch import BwdConfig, FwdConfig, Packed


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
            opts: Options, with_stats: bool, *, config: FwdConfig | None = None, sinks: torch.Tensor | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor, RowStats | None]:
    """Attention forward on the GPU (or the interpreter): ``(out, lse2, row_stats)`` like the reference.

    ``lse2`` is the base-2 log-sum-exp ``[B, Hq, Nq]`` (fp32, ``+inf`` for rows that see no key; with learned
    ``sinks`` ``[Hq]`` it counts the sink, as ``reference.attention_forward``'s).
    ``config`` overrides the tiling (tests use it to exercise several query-block sizes).
    ``STABLE_ATTN_FORWARD=gluon`` asks for the warp-specialized Gluon forward (gluon_forward.py) where it serves
    the call; it has never run on a GPU, so it is never the default (docs/lab/gluon-forward.md).
    """
    if triton_forward_ws.choice() == "gluon" and key_padding_mask is None and sinks is None and config is None:
        from . import gluon_forward  # Triton's experimental Gluon: imported only when asked for

        why = gluon_forward.serves(q, k, v, opts)
        if why is None:
            log_once("gluon", "STABLE_ATTN_FORWARD=gluon: the Gluon forward serves the calls it can; it has not been "
                              "checked on a GPU yet (benchmarks/gluon_check.py)", logging.WARNING)
            return gluon_forward.forward(q, k, v, opts, with_stats)
        log_once(f"gluon:{why}", f"STABLE_ATTN_FORWARD=gluon: the Triton forward serves this call ({why})")
    return _forward(q, k, v, key_padding_mask, opts, with_stats, config, None, sinks)


def forward_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, opts: Options,
                   with_stats: bool, *, config: FwdConfig | None = None, sinks: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, RowStats | None]:
    """Forward over packed sequences (FlashAttention's varlen layout), one launch for all of them.

    q ``[total_q, Hq, D]``, k/v ``[total_k, Hkv, D]``; sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
    of q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k/v (int32 ``[batch + 1]``); ``max_seqlen_*`` must be
    at least every sequence's length (not checked here: that would read the device). Returns
    ``(out [total_q, Hq, D], lse2 [Hq, total_q], row_stats)`` with row statistics shaped ``[1, Hq, total_q]``;
    every sequence's rows are bit for bit what :func:`forward` gives on that sequence alone (same key
    blocks from its first key, causal/window aligned bottom-right per sequence), with dropout seeded
    ``opts.seed + b`` for sequence ``b``.
    """
    packed = launch.packed_launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _forward(q, k, v, None, opts, with_stats, config, packed, sinks)


def _forward(q, k, v, key_padding_mask, opts, with_stats, config, packed: Packed | None, sinks=None):
    launch.check_device(q)
    q, k, v = launch.dense_last(q), launch.dense_last(k), launch.dense_last(v)
    if packed is None:
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        rows = (B, Hq, Nq)
    else:
        _, Hq, D = q.shape
        Hkv = k.shape[1]
        B, Nq = packed.batch, packed.max_q
        rows = (Hq, q.shape[0])
    launch.check_heads(Hq)
    dtype = q.dtype
    block_n = opts.key_block
    Dv = v.shape[-1]  # the value head dim: apart from D in multi-head latent attention (never padded to D)
    block_d, block_dv = launch.head_block(D), launch.head_block(Dv)
    kv_bytes = kv_tile_bytes(block_n, D, Dv, q.element_size())
    if kv_bytes > MAX_KV_TILE_BYTES:  # the ops send these calls to the PyTorch path (_ops.triton_gap)
        dims = f"head dim {D}" if Dv == D else f"head dims {D} (q, k) and {Dv} (v)"
        raise ValueError(f"block_n={block_n} with {dims} ({dtype}) needs K and V tiles of {kv_bytes} bytes, more "
                         f"than the {MAX_KV_TILE_BYTES} bytes of shared memory the kernel may use; use a smaller "
                         f"block_n (the default is {BLOCK_N})")
    with_stats = int(with_stats)  # a stats.STATS_* level (True: the row statistics without the entropy)
    cc = launch.capability(q.device)
    consts, compile_opts = launch.launch_constants(
        "fwd", D, dtype, cc, **launch.feature_flags(opts),
        kpm=(key_padding_mask is not None) if packed is None else None, mode=opts.mode, stats=with_stats,
        block_n=block_n, forced_block_n=opts.key_block_given, tma=launch.tma_compatible(k, v),
        upcast=interpreting(), config=config, sinks=sinks is not None, value_dim=Dv)
    block_n, tile_n = consts["BLOCK_N"], consts["TILE_N"]
    heads = Hq * launch.dv_blocks(consts)  # grid rows: each head's programs over V's column blocks
    launch.check_heads(Hq, heads // Hq)

    # the output has v's head dim (contiguous when it differs from q's: _checks.output_like)
    out = launch.empty_like(q) if Dv == D else launch.empty((*q.shape[:-1], Dv), dtype, q.device)
    lse2 = launch.empty(rows, torch.float32, q.device)
    if with_stats:
        st = RowStats.empty(rows, q.device, alloc=launch.empty, entropy=with_stats == STATS_ENTROPY)
        sat, fixed, max_logit, sink, entropy = st.saturated.view(torch.int8), *st.tensors()[1:]
        if not st.has_entropy:
            entropy = lse2  # never touched: STATS is a compile-time 1
    else:
        sat = fixed = max_logit = sink = entropy = lse2  # never touched: STATS is a compile-time False
    # the learned sinks as the kernels read them: fp32, one per query head (never touched without HAS_SINKS)
    sinks_in = lse2 if sinks is None else sinks.to(torch.float32).contiguous()
    tie2, min_shift2, max_shift2 = rules.rule_constants(dtype, opts.mode)
    sc = launch.kernel_scalars(opts, dtype)
    args = dict(Out=out, Lse=lse2, StSat=sat, StFixed=fixed, StMax=max_logit, StSink=sink, StEnt=entropy, Sinks=sinks_in,
                **launch.strides("q", q), **launch.strides("k", k), **launch.strides("v", v),
                **launch.strides("o", out), Hq=Hq, G=Hq // Hkv, window=sc["window"], qk_scale2=sc["qk_scale2"],
                cap_scale=sc["cap_scale"], cap_log2e=sc["cap_log2e"], tie2=tie2,
                sat2=rules.sat_tolerance2(dtype), min_shift2=min_shift2, max_shift2=max_shift2, beta=opts.beta,
                seed=sc["seed"], drop_p=sc["drop_p"], keep_frac=1.0 - opts.dropout_p, **consts, **compile_opts)
    n_m = triton.cdiv(Nq, consts["BLOCK_M"])
    # with TMA K and V go in as descriptors (the kernels read the pointers otherwise)
    describe = launch.descriptor if packed is None else launch.packed_descriptor
    k_in, v_in = (describe(k, tile_n, block_d), describe(v, block_n, block_dv)) if consts["TMA"] else (k, v)
    if packed is None:
        kpm = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else lse2
        kpm_stride = kpm.stride(0) if key_padding_mask is not None else 0
        # sm_90 / sm_100: the warp-specialized variant where it serves and compiles (triton_forward_ws.py)
        ws = triton_forward_ws.use(cc, q.is_cuda, consts, packed=False)
        for b_first, nb in launch.batches(B):
            grid = (n_m, heads, nb)
            kw = dict(Q=q, K=k_in, V=v_in, KPM=kpm, stride_kpmb=kpm_stride, Nq=Nq, Nk=Nk, b_first=b_first, **args)
            ws = ws and triton_forward_ws.launch(grid, cc, consts, **kw)  # False: it did not compile
            if not ws:
                attn_fwd_kernel[grid](**kw)
    elif min(n_m, Hq, B) > 0:
        attn_fwd_varlen_kernel[(n_m, heads, B)](Q=q, K=k_in, V=v_in, CuQ=packed.cu_q, CuK=packed.cu_k,
                                             total_q=q.shape[0], **args)
        rows = (1, *rows)  # the statistics as one batch element: what AttentionStats.update reads
    row_stats = st.view(rows) if with_stats else None
    return out, lse2, row_stats


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse2: torch.Tensor, key_padding_mask: torch.Tensor | None, opts: Options, *,
             config: BwdConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2 backward from the saved ``out`` and base-2 ``lse2``: ``(dq, dk, dv)``.

    Two kernels (dK/dV, dQ) by default; ``STABLE_ATTN_BACKWARD=fused`` (or ``fused-atomic``) runs the
    fused prototype of ``triton_backward_fused.py`` instead (opt-in: docs/ARCHITECTURE.md says why), where v's head
    dim is q's and at most 256 (the prototype has no value head dim of its own and no wider tiles: the two kernels
    serve the rest).
    """
    mode = backward_mode()
    if mode != "two-kernel" and _fused_serves(q, v):
        return backward_fused(do, q, k, v, out, lse2, key_padding_mask, opts, atomic=mode == "fused-atomic",
                              config=config)
    return _backward(do, q, k, v, out, lse2, key_padding_mask, opts, config, None)


def backward_varlen(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse2: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                    max_seqlen_k: int, opts: Options, *, config: BwdConfig | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`forward_varlen` from its ``out`` and ``lse2 [Hq, total_q]``: ``(dq, dk, dv)``, packed.

    Three launches for all sequences, no atomics; each sequence's gradients are bit for bit those of
    :func:`backward` on that sequence alone with the same tiling (for finite inputs). With ``cfg.tma``
    (sm_90) the streamed tiles come through descriptors over the packed tensors: the rows they read
    past a sequence's end are the next sequence's. The dQ kernel zeroes the key rows it reads there; in
    the dK/dV kernel the query rows add exact zeros for finite inputs (an inf or NaN in the next
    sequence's q or dO would reach this sequence's dK/dV, as it reaches the loss anyway).
    """
    packed = launch.packed_launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    mode = backward_mode()  # STABLE_ATTN_BACKWARD, as in backward()
    if mode != "two-kernel" and _fused_serves(q, v):
        return backward_fused(do, q, k, v, out, lse2, None, opts, atomic=mode == "fused-atomic", config=config,
                              packed=packed)
    return _backward(do, q, k, v, out, lse2, None, opts, config, packed)


def _fused_serves(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fused prototype serves these head dims: V's is q's, at most ``TILE_HEAD_DIM`` (its tiles were
    never chosen wider; the two kernels serve the rest)."""
    return v.shape[-1] == q.shape[-1] <= TILE_HEAD_DIM


def _backward(do, q, k, v, out, lse2, key_padding_mask, opts, config, packed: Packed | None):
    launch.check_device(q)
    q, k, v, out, do = (launch.dense_last(x) for x in (q, k, v, out, do))
    lse2 = lse2.contiguous()
    if packed is None:
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
    else:
        _, Hq, D = q.shape
        Hkv = k.shape[1]
        B, Nq, Nk = packed.batch, packed.max_q, packed.max_k
    launch.check_heads(Hq)
    dtype = q.dtype
    Dv = v.shape[-1]  # dO, O, V and dV have v's head dim; q, dQ, K and dK q's
    block_d, block_dv = launch.head_block(D), launch.head_block(Dv)
    kernel = dict(head_dim=D, dtype=dtype, cc=launch.capability(q.device), **launch.feature_flags(opts),
                  kpm=(key_padding_mask is not None) if packed is None else None,
                  tma=launch.tma_compatible(q, k, v, do), upcast=interpreting(), config=config, value_dim=Dv)
    # each gradient kernel's constexprs and compile options, in one dict (one BwdConfig for both)
    dkdv_consts, dq_consts = ({**c, **o} for c, o in (launch.launch_constants(kind, **kernel)
                                                      for kind in ("bwd_dkdv", "bwd_dq")))

    delta = launch.empty(lse2.shape, torch.float32, q.device)
    dq, dk, dv = launch.empty_like(q), launch.empty_like(k), launch.empty_like(v)
    sc = launch.kernel_scalars(opts, dtype)
    # what the dK/dV and dQ kernels share: the tensors read, their strides, the scalars
    shared = dict(K=k, V=v, Q=q, DO=do, Lse=lse2, Delta=delta, **launch.strides("q", q), **launch.strides("k", k),
                  **launch.strides("v", v), **launch.strides("do", do), Hq=Hq, G=Hq // Hkv, window=sc["window"],
                  qk_scale2=sc["qk_scale2"], cap_scale=sc["cap_scale"], cap_log2e=sc["cap_log2e"], scale=opts.scale,
                  seed=sc["seed"], drop_p=sc["drop_p"], keep_scale=sc["keep_scale"])
    dkdv = dict(shared, DK=dk, DV=dv, **launch.strides("dk", dk), **launch.strides("dv", dv), **dkdv_consts)
    dqk = dict(shared, DQ=dq, **launch.strides("dq", dq), **dq_consts)
    # with TMA the streamed operands go in as descriptors (the kernels read the pointers otherwise): Q and dO
    # of the dK/dV kernel, K and V of the dQ kernel
    describe = launch.descriptor if packed is None else launch.packed_descriptor
    m1, n2 = dkdv_consts["BLOCK_M"], dq_consts["BLOCK_N"]
    if dkdv_consts["TMA"]:
        dkdv.update(Q=describe(q, m1, block_d), DO=describe(do, m1, block_dv))
    if dq_consts["TMA"]:
        dqk.update(K=describe(k, n2, block_d), V=describe(v, n2, block_dv))
    pre = dict(Out=out, DO=do, Delta=delta, **launch.strides("o", out), **launch.strides("do", do), Hq=Hq, HEAD_D=Dv,
               BLOCK_D=block_dv, BLOCK_M=64)
    if packed is not None:
        _backward_varlen(packed, Hq, Hkv, q.shape[0], pre, dkdv, dqk)
        return dq, dk, dv

    kpm = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else lse2
    lengths = dict(KPM=kpm, stride_kpmb=kpm.stride(0) if key_padding_mask is not None else 0, Nq=Nq, Nk=Nk)
    for b_first, nb in launch.batches(B):
        attn_bwd_preprocess[(triton.cdiv(Nq, 64), Hq, nb)](Nq=Nq, b_first=b_first, **pre)
        attn_bwd_dkdv_kernel[(triton.cdiv(Nk, dkdv_consts["BLOCK_N"]), Hkv, nb)](b_first=b_first, **lengths, **dkdv)
        attn_bwd_dq_kernel[(triton.cdiv(Nq, dq_consts["BLOCK_M"]), Hq, nb)](b_first=b_first, **lengths, **dqk)
    return dq, dk, dv

def _backward_varlen(packed: Packed, Hq: int, Hkv: int, total_q: int, pre: dict, dkdv: dict, dq: dict) -> None:
    """The three varlen launches, each over (block of the longest sequence, head, sequence); ``pre``, ``dkdv``
    and ``dq``: the preprocess', the dK/dV and the dQ kernel's named arguments but the sequences' bounds."""
    B = packed.batch
    if min(B, Hq, packed.max_q) > 0:
        attn_bwd_preprocess_varlen[(triton.cdiv(packed.max_q, 64), Hq, B)](CuQ=packed.cu_q, total_q=total_q, **pre)
    bounds = dict(CuQ=packed.cu_q, CuK=packed.cu_k, total_q=total_q)
    if min(B, packed.max_k) > 0:  # keys no query sees get zeros here
        attn_bwd_dkdv_varlen_kernel[(triton.cdiv(packed.max_k, dkdv["BLOCK_N"]), Hkv, B)](**bounds, **dkdv)
    if min(B, Hq, packed.max_q) > 0:
        attn_bwd_dq_varlen_kernel[(triton.cdiv(packed.max_q, dq["BLOCK_M"]), Hq, B)](**bounds, **dq)
