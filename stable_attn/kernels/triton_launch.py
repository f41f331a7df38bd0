"""What every Triton launch needs, shared by the launchers (``triton_attention``, ``triton_backward_fused``,
``triton_decode``) and by ``triton_aot``: the tile table, the compile-time constants, the tensors prepared.

Block sizes. The forward's key block ``BLOCK_N`` *is* the partition the stabilization rule sees, so
it is never tuned: ``opts.key_block`` (``opts.block_n`` or ``options.BLOCK_N``, 128), except where no rule sees it
(stabilize off without statistics, :func:`fwd_config`'s ``unseen``); with a 64-key partition a K tile may
hold two of its blocks (``FwdConfig.tile_n``), the rule still deciding per block. Everything else (query block,
warps, pipeline stages, and all backward tiles, which make no per-block decision) comes from the
small table in :func:`fwd_config` / :func:`bwd_config`, chosen by head dim and GPU generation so the
kernels fit in shared memory and do not spill (see benchmarks/kernel_resources.py). Every compile-time
constant of a launch comes from :func:`launch_constants`, which ``triton_aot`` (and so
benchmarks/kernel_resources.py) compiles with too.

Grid limits. CUDA allows at most 65535 programs in a grid's second and third dimensions (the heads
and the batch or the sequences). A dense batch beyond that runs in several launches whose programs
compute batch ``b_first + program_id(2)`` (:func:`batches`): same addresses, same dropout counters,
the same bits as one launch. More heads, or more packed sequences than that, raise a ValueError.

fp32 inputs run the same kernels with IEEE-exact fp32 dots (``input_precision="ieee"``, no TF32):
correct and memory-efficient, but without tensor cores, so slower than the 16-bit paths.

Under ``TRITON_INTERPRET=1`` (CPU tensors, the tests) the kernels get ``UPCAST=True``: the
interpreter cannot do bf16 arithmetic or bf16 ``tl.dot``, so operands are widened to fp32 after
loading while every rounding point stays an explicit cast to the input dtype.

The launchers call these helpers through the module (``launch.empty(...)``), so a test that replaces
one (the poisoned allocations, a smaller grid limit) replaces it for every launcher.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import rules
from .._checks import interpreting
from .._ops import TILE_HEAD_DIM, WIDE_TILE_COLS
from ..options import BLOCK_N, Options
from .triton_forward import dv_blocks as _dv_blocks
from .triton_order import causal_constant

# No implicit multiply-add contraction in the forward: P-bar's single rounding is the kernel's explicit
# ``tl.fma(x, qk_scale2, -r)`` (reference.fma_f32 on the PyTorch path), and nothing else may be fused
# behind the reference's back, whatever the compiler's default (Triton 3.9 contracts, 3.10 does not):
# with it, e.g. stabilize off's row-sum update ``l * alpha + sum(P-bar)`` would round once on the GPU
# and twice in reference.py (tests/kernels/test_rule_functions.py counts the loop's FFMAs).
FWD_COMPILE_OPTIONS = {"enable_fp_fusion": False}
TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
# Shared memory one block may use (bytes), per SM less the 1 KiB reserved per block (NVIDIA/cccl,
# cuda/__device/arch_traits.h): A100 (sm_80) 163 KiB, H100/H200 (sm_90) and B200/B300 (sm_100) 227 KiB,
# RTX 50-series (sm_120) 99 KiB.
SHARED_LIMIT = {80: 166912, 90: 232448, 100: 232448, 120: 101376}
GPU_NAMES = {80: "A100 (sm_80)", 90: "H100/H200 (sm_90)", 100: "B200/B300 (sm_100)", 120: "RTX 50-series (sm_120)"}
MAX_GRID_Z = 65535  # CUDA's limit on a grid's third dimension (the batch or the sequences)
MAX_GRID_Y = 65535  # and on its second (the heads)


@dataclass(frozen=True)
class FwdConfig:
    """Forward tiling: ``block_m`` query rows per program. ``block_n``: the key tile where no rule sees
    the partition (stabilize off, no statistics); ``None`` means the partition's (``opts.block_n``).
    ``tile_n``: two blocks of the partition per key tile (``2 * opts.block_n``; K comes as one tile,
    the rule still decides block by block: ``triton_forward.fwd_tile``); ``None``: one block.
    ``tma``: K and V come through tensor descriptors (sm_90, strides TMA accepts). ``head_chunk``: Q and K in
    chunks of this many columns (the query's head dim wider than a tile: :func:`wide_tiles`); ``dv_block``: V and
    the output split over programs of this many columns each; ``None``: whole."""

    block_m: int
    num_warps: int
    num_stages: int
    block_n: int | None = None
    tma: bool = False
    tile_n: int | None = None
    head_chunk: int | None = None
    dv_block: int | None = None


@dataclass(frozen=True)
class BwdConfig:
    """Backward tiling: dK/dV programs hold ``n1`` keys and step over ``m1`` queries (``warps1``,
    ``stages1``); dQ programs hold ``m2`` queries and step over ``n2`` keys (``warps2``, ``stages2``).
    ``tma``: the streamed tiles (Q, dO for dK/dV; K, V for dQ) come through tensor descriptors
    (sm_90 only; the launcher falls back to pointers where the strides do not allow it)."""

    m1: int
    n1: int
    warps1: int
    stages1: int
    m2: int
    n2: int
    warps2: int
    stages2: int
    tma: bool = False


def tile_generation(cc: int) -> int:
    """The rows of the tile table a GPU takes (the ``cc`` that :func:`fwd_config`, :func:`bwd_config` and
    :func:`row_sum_parts` receive): 90 for sm_90 up to sm_11x (Hopper and the datacenter Blackwells: 227 KiB of
    shared memory per block, TMA); 120 for sm_120 and later (RTX 50-series: 99 KiB per block): the sm_80 rows,
    which fit there, but one (see :func:`_table_config`); 80 for the others (sm_80; sm_86 and sm_89, which have
    99 KiB too, are not compiled by benchmarks/kernel_resources.py)."""
    if 90 <= cc < 120:
        return 90
    return 120 if cc >= 120 else 80


def gpu_name(cc: int) -> str:
    """How errors name a GPU generation."""
    return GPU_NAMES.get(cc, f"sm_{cc}")


def head_block(d: int) -> int:
    """Head dim padded to a power of two >= 16 (tl.dot's minimum); the padding is masked on load."""
    return max(16, triton.next_power_of_2(d))


def wide_tiles(dtype: torch.dtype, cc: int, plain: bool = True) -> FwdConfig:
    """The forward's tiling where a head dim is wider than a tile holds (``TILE_HEAD_DIM``, 256; Gemma 4's global
    layers: 512; ``cc``: the tile generation; ``plain``: no window, softcap, padding mask or dropout).

    The whole ``[BLOCK_M, 512]`` fp32 accumulator and the query tile do not fit in registers beside the score tile:
    every one-program tile compiled at D = 512 spilled on sm_90. So the scores come from column chunks of Q and K
    (``head_chunk``), loaded per key block (``triton_forward.chunked_products``: Q is never held whole), and V's
    head dim is split over programs (``dv_block`` columns each, ``triton_forward.dv_blocks``): every program of a
    row block recomputes the same scores, maxima, decisions and row sums, bit for bit, and owns its slice of the
    output. Both apply to whichever head dim is wider than they are (``launch_constants``). The tiles, the widest
    without spills (benchmarks/kernel_resources.py, bf16, causal, with and without statistics;
    docs/lab/head-dim-512-kernels.md): sm_90 plain 64 x 128 in 8 warps, 128-column chunks and V blocks (64 x 128 in
    4 warps spilled 504 bytes, 128 x 128 168, V blocks of 256 184); sm_90 with the optional features 32 x 128,
    64-column chunks and V blocks (128-column V blocks spilled 24 bytes with statistics); sm_80 and sm_120 32 x 128,
    64-column chunks, 128-column V blocks (64 x 128 spilled 288 bytes there, 368 with 128-column chunks)."""
    if cc == 90 and dtype != torch.float32:
        cfg = (FwdConfig(64, 8, 2, head_chunk=128, dv_block=128) if plain
               else FwdConfig(32, 8, 2, head_chunk=64, dv_block=64))
    else:
        cfg = FwdConfig(32, 8, 2, head_chunk=64, dv_block=128)
    # _ops.kv_tile_bytes counts the K and V tiles of these head dims at WIDE_TILE_COLS columns
    assert max(cfg.head_chunk, cfg.dv_block) <= WIDE_TILE_COLS
    return cfg


def fwd_config(block_d: int, block_n: int, dtype: torch.dtype, cc: int, *, mode: int = rules.MODE_EXACT,
               stats: bool = False, plain: bool = False, forced_block_n: bool = False,
               tma: bool = True, causal: bool = True) -> FwdConfig:
    """Forward tiling by padded head dim, key partition ``block_n`` and GPU generation ``cc`` (80, 90 or 120: the
    :func:`tile_generation` of the compute capability).

    The query tile and the fp32 accumulator live in registers; K and V tiles are pipelined through
    shared memory (``num_stages`` copies). Chosen so that no plain D <= 128 variant spills registers on
    sm_80 or sm_90 (benchmarks/kernel_resources.py) except stabilize off with statistics at D = 64 on
    sm_90 (8 / 32 bytes causal / not on the 128 x 128 tile, which runs at half the static R of the
    64 x 128 tile that does not spill; docs/lab/forward-issue-rate.md, "decisions per 128 keys").

    On sm_90, 16-bit, D <= 128, plain variants (``plain``: no window, softcap, padding mask or dropout),
    a 128-key partition (the default, ``options.BLOCK_N``, or ``block_n=128`` set by the user) takes
    FlashAttention's 128 x 128 tile, 8 warps, 2 stages, whatever the mode: one score product, K load,
    decision and pipeline step per 128 keys. At D = 128 it needs K and V through tensor descriptors
    (``tma``: the launcher found the strides TMA-compatible): with pointers the kernels spill; at D = 64
    pointer loads (descriptors lengthen the loop). Where no rule sees the key partition (``mode`` off,
    no ``stats``, ``block_n`` not ``forced_block_n`` by the user: ``unseen``) the plain variants take that
    tile whatever the partition.

    A 64-key partition set by the user (``block_n=64``) keeps its own tiles where a rule decides: at
    D = 128 two 64-key blocks per tile, the rule still per block (``tile_n``); at D = 64 one warpgroup
    (4 warps) over 128 query rows and one 64-key block per iteration, 3 stages (docs/BENCHMARKS.md). The
    launchers and ``triton_aot`` both reach all of this through :func:`launch_constants`, so they cannot
    disagree.

    Elsewhere (sm_80, fp32, the variants with optional features, other partitions) :func:`_table_config`;
    where no rule sees the partition there (``unseen``) it keeps 64-key tiles.
    """
    unseen = mode == rules.MODE_OFF and not stats and not forced_block_n
    if block_d > TILE_HEAD_DIM:  # the wider of the two head dims
        return wide_tiles(dtype, cc, plain)
    wide = cc == 90 and dtype != torch.float32 and (block_d <= 64 or block_d <= 128 and tma) and plain
    if wide and (unseen or block_n == 128):
        return FwdConfig(128, 8, 2, block_n=128 if unseen else None, tma=block_d > 64)
    if wide and mode != rules.MODE_OFF and block_n == 64:
        return FwdConfig(128, 4, 3) if block_d <= 64 else FwdConfig(128, 8, 2, tma=True, tile_n=128)
    if unseen:
        return dataclasses.replace(_table_config(block_d, 64, dtype, cc, plain=plain), block_n=64)
    return _table_config(block_d, block_n, dtype, cc, plain=plain, causal=causal, mode=mode, stats=stats)


def _table_config(block_d: int, block_n: int, dtype: torch.dtype, cc: int, *, plain: bool = False,
                  causal: bool = True, mode: int = rules.MODE_EXACT, stats: int = False) -> FwdConfig:
    """:func:`fwd_config` off its sm_90 wide tiles: by padded head dim, key partition and GPU generation.

    sm_80, 16-bit, plain, 128-key partition: the tiles measured best without spills
    (benchmarks/kernel_resources.py, docs/BENCHMARKS.md): at D = 128 64 x 128, 8 warps, 2 stages; at
    D = 64 128 x 128 with 8 warps, 2 stages, causal without statistics or in exact mode (``wide80``),
    else 32 x 128 with 4 warps (128 x 128 spills there: 112 bytes non-causal, 32 / 8 bytes causal off /
    paper with statistics; 64 x 128 spills 88 bytes non-causal). Otherwise fp32 inputs and partitions
    wider than 64 halve the query tile and the pipeline depth.
    """
    if cc != 90 and dtype != torch.float32 and block_n == 128 and plain and block_d in (64, 128):
        # sm_120 (RTX 50-series): where a rule decides, the sm_80 query tiles spill there (16 / 24 bytes causal
        # at D = 128 / 64 without statistics, 24 at D = 128 with); 32 rows do not, for 5% / 53% more issue
        # slots per query row at D = 128 / 64 (no spills, as everywhere in this table; unmeasured on a GPU)
        small = cc == 120 and (mode != rules.MODE_OFF or stats)
        if block_d == 128:
            return FwdConfig(32, 8, 2) if small else FwdConfig(64, 8, 2)
        wide80 = causal and (not stats or mode == rules.MODE_EXACT) and not small
        return FwdConfig(128, 8, 2) if wide80 else FwdConfig(32, 4, 2)
    if block_d <= 64:
        cfg = FwdConfig(128, 8, 3)
    elif block_d <= 128:
        cfg = FwdConfig(128, 8, 3) if cc == 90 else FwdConfig(64, 8, 2)
    else:
        cfg = FwdConfig(64, 8, 2) if cc == 90 else FwdConfig(32, 4, 2)
    if dtype == torch.float32 or block_n > 64:
        cfg = FwdConfig(max(32, cfg.block_m // 2), cfg.num_warps, max(1, cfg.num_stages - 1))
    return cfg


def row_sum_parts(cc: int, dtype: torch.dtype, block_n: int) -> int:
    """Accumulators of the exact mode's tensor-core row sum ``P-bar @ 1`` (``triton_forward.tc_row_sum_add``):
    2 on sm_90 with 16-bit inputs, one product per half of each ``block_n``-key block (its halves at least 16
    keys, ``tl.dot``'s smallest K), else 1. sm_90 (wgmma, benchmarks/kernel_resources.py): every exact
    variant's loop shorter, D = 64 560 -> 551 loop SASS causal, 570 -> 559 not, D = 128 631 -> 619; sm_80
    (mma.sync): longer (D = 64 675 -> 683) and D = 128 exact + stats spilled (8 / 48 bytes); the decode
    kernel keeps one (its own launch constants)."""
    return 2 if cc == 90 and dtype != torch.float32 and block_n >= 32 else 1


def bwd_config(block_d: int, dtype: torch.dtype, cc: int, tma: bool = True, heavy: bool = False) -> BwdConfig:
    """Backward tiling by padded head dim and GPU generation ``cc`` (:func:`tile_generation`; no partition
    constraint here).

    sm_90, 16-bit, D <= 128 (``tma``: the launcher found the strides TMA-compatible): the streamed
    tiles come through tensor descriptors, so no per-element addresses occupy registers, and the
    tiles are wide enough for wgmma and pipelined in 2 stages. dK/dV keeps a 128-key tile (two
    fp32 ``[128, D]`` accumulators, K and V in shared memory) and steps over 64 queries at D=64, 32 at
    D=128, the widest steps without spills; dQ holds 64 (D=64) or 128 (D=128) queries and steps over
    128 or 64 keys. ``heavy`` (dropout or softcap: Philox counters or the tanh tile stay live) takes
    narrower steps (16 queries for dK/dV; dQ 128 x 64 at D=64, 128 x 32 at D=128), again the widest
    without spills. Chosen by benchmarks/kernel_resources.py (R, registers, spills; docs/BENCHMARKS.md).
    Elsewhere (sm_80, fp32, D=256 and 512, strides TMA cannot take) pointer loads with the smaller tiles
    below, where the dK/dV kernel runs unpipelined (``stages1 = 1``): pipelined ones spilled.
    """
    if tma and cc == 90 and dtype != torch.float32 and block_d <= 128:
        if heavy:
            return BwdConfig(16, 128, 8, 2, 128, 64 if block_d <= 64 else 32, 8, 2, tma=True)
        if block_d <= 64:
            return BwdConfig(64, 128, 8, 2, 64, 128, 4, 2, tma=True)
        return BwdConfig(32, 128, 8, 2, 128, 64, 8, 2, tma=True)
    if block_d > TILE_HEAD_DIM:
        # head dim 512: the kernels hold whole rows ([16, 512] tiles of K, V and their fp32 gradients, or of Q, dO
        # and dQ); 16 keys x 16 queries is spill-free on sm_80 and sm_90, dense and packed, with or without the
        # heavy features (dQ over 32 queries spilled 24 bytes packed on sm_90, 128 with the features, 200 on sm_80)
        cfg = BwdConfig(16, 16, 8, 1, 16, 16, 4, 2 if cc == 90 else 1)
    elif block_d <= 64:
        cfg = BwdConfig(32, 64, 4, 1, 64, 64, 4, 3)
    elif block_d <= 128:
        dkdv = (32, 32, 4, 1) if cc == 90 else (32, 64, 8, 1)
        cfg = BwdConfig(*dkdv, 64, 32, 4, 3 if cc == 90 else 2)
    else:
        cfg = BwdConfig(16, 32, 8, 1, 32, 16, 4, 2 if cc == 90 else 1)
    if dtype == torch.float32:
        cfg = BwdConfig(max(16, cfg.m1 // 2), cfg.n1, cfg.warps1, 1, cfg.m2, max(16, cfg.n2 // 2), cfg.warps2,
                        max(1, cfg.stages2 - 1))
    return cfg


def tma_compatible(*xs: torch.Tensor) -> bool:
    """Whether TMA can address these ``[B, H, N, D]`` tensors: 16-byte aligned base and outer strides."""
    return all(x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])
               for x in xs)


def descriptor(x: torch.Tensor, rows: int, block_d: int):
    """A TMA descriptor over ``[B, H, N, D]`` loading ``rows x block_d`` tiles of one (batch, head)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, block_d])


def packed_descriptor(x: torch.Tensor, rows: int, block_d: int):
    """A TMA descriptor over packed ``[total, H, D]`` loading ``rows x block_d`` tiles of one head."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), [rows, 1, block_d])


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Output allocation, one place (the tests replace it to poison outputs with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def empty_like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def capability(device: torch.device) -> int:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return major * 10 + minor
    return 90  # interpreter: tile like Hopper so the tests exercise the GPU tiling


def check_device(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(f"the Triton kernels need CUDA tensors (got device={q.device}) or TRITON_INTERPRET=1 "
                         "set before triton is imported; use backend='torch' for the CPU path")


def dense_last(x: torch.Tensor) -> torch.Tensor:
    """The kernels index the head dim with stride 1; other strides may be anything."""
    return x if x.stride(-1) == 1 else x.contiguous()


def precision(dtype: torch.dtype, upcast: bool) -> str:
    # fp32 operands (fp32 inputs, or 16-bit inputs widened for the interpreter) must not go through
    # TF32; 16-bit operands ignore the setting.
    return "ieee" if upcast or dtype == torch.float32 else "tf32"


def kernel_scalars(opts: Options, dtype: torch.dtype) -> dict:
    """Kernel scalars: the values ``Options`` derives, which reference.py uses too (same fp32 values)."""
    return dict(
        window=opts.window if opts.window is not None else 0,
        qk_scale2=opts.qk_scale2,
        cap_scale=opts.cap_scale,
        cap_log2e=opts.cap_log2e,
        seed=opts.seed,
        drop_p=opts.dropout_p,
        keep_scale=opts.keep_scale,
    )


def feature_flags(opts: Options) -> dict:
    """The optional features of ``opts`` as :func:`launch_constants` takes them."""
    return dict(causal=opts.causal, window=opts.window is not None, softcap=score_form(opts),
                dropout=opts.dropout_p > 0)


def score_form(opts: Options) -> int:
    """The kernels' ``SOFTCAP`` constant for ``opts``: how a tile's scores are formed (``rules.SCORES_*``)."""
    return rules.score_form(opts.softcap is not None, opts.qk_scale2)


def launch_constants(kind: str, head_dim: int, dtype: torch.dtype, cc: int, *, causal: bool, window: bool,
                     softcap: int, dropout: bool, kpm: bool | None, mode: int = rules.MODE_EXACT,
                     stats: int = False, block_n: int = BLOCK_N, forced_block_n: bool = False, tma: bool = True,
                     upcast: bool = False, config: FwdConfig | BwdConfig | None = None, sinks: bool = False,
                     value_dim: int | None = None) -> tuple[dict, dict]:
    """``(constexprs, compile options)`` of the kernel ``kind`` (``"fwd"``, ``"bwd_dkdv"`` or ``"bwd_dq"``, dense
    or varlen): what the launchers below pass and what ``triton_aot`` compiles (benchmarks/kernel_resources.py
    measures it), derived in this one place so that the two cannot disagree.

    ``window``, ``dropout``: whether each feature is on; ``softcap``: the score form (``rules.SCORES_*``, from
    :func:`score_form`; a bool says softcap or the fused products); ``kpm``: whether a key padding mask
    is (dense kernels), ``None`` for the varlen kernels, which take none. ``block_n``: the key partition
    (``Options.key_block``), ``forced_block_n`` when the user set it; ``tma``: the strides TMA accepts;
    ``upcast``: the interpreter's fp32 operands; ``sinks``: learned sinks (the forward's ``HAS_SINKS``; the
    backward needs nothing for them); ``value_dim``: V's head dim where it differs from ``head_dim`` (multi-head
    latent attention: ``HEAD_DV``, padded to its own power of two ``BLOCK_DV``; the tiles are chosen by the wider
    of the two). ``config`` overrides the tiling (tests); the forward's
    is checked here (its ``tile_n``: one or two blocks of the partition). ``cc``: the GPU's compute
    capability (major * 10 + minor); its :func:`tile_generation` picks the tile table's row.
    """
    head_dv = head_dim if value_dim is None else value_dim
    block_d, block_dv = head_block(head_dim), head_block(head_dv)
    gen = tile_generation(cc)  # the tile table's row for this GPU
    consts = dict(CAUSAL=causal, WINDOW=window, SOFTCAP=softcap, DROPOUT=dropout, HEAD_D=head_dim, BLOCK_D=block_d,
                  DTYPE=TL_DTYPE[dtype], UPCAST=upcast, PREC=precision(dtype, upcast), HEAD_DV=head_dv,
                  BLOCK_DV=block_dv)
    block_d = max(block_d, block_dv)  # the tiles' row: the wider head dim
    if kpm is not None:
        consts["HAS_KPM"] = kpm
    # longest first (triton_order.py)
    consts["CAUSAL"] = causal_constant(causal, gen, kind, packed=kpm is None, equal_dims=head_dv == head_dim)
    if kind == "fwd":
        plain = not (window or softcap or dropout or kpm)
        if config is None and block_d > TILE_HEAD_DIM:
            config = wide_tiles(dtype, gen, plain)
        cfg = config or fwd_config(block_d, block_n, dtype, gen, mode=mode, stats=stats, plain=plain,
                                   forced_block_n=forced_block_n, tma=tma, causal=causal)
        if cfg.head_chunk is not None and cfg.head_chunk < consts["BLOCK_D"]:
            consts["BLOCK_D"] = cfg.head_chunk  # HEAD_D > BLOCK_D: the kernel walks Q and K in chunks
        if cfg.dv_block is not None and cfg.dv_block < consts["BLOCK_DV"]:
            consts["BLOCK_DV"] = cfg.dv_block  # HEAD_DV > BLOCK_DV: V's columns split over programs
        block_n = cfg.block_n or block_n
        tile_n = cfg.tile_n or block_n
        if tile_n not in (block_n, 2 * block_n):
            raise ValueError(f"config.tile_n={cfg.tile_n} with key blocks of {block_n}: accepted are None, {block_n} "
                             f"and {2 * block_n} (one or two blocks of the partition per key tile)")
        consts.update(MODE=mode, STATS=int(stats), BLOCK_M=cfg.block_m, BLOCK_N=block_n, TILE_N=tile_n, TMA=cfg.tma,
                      ROW_SUM_PARTS=row_sum_parts(gen, dtype, block_n), HAS_SINKS=sinks)
        return consts, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **FWD_COMPILE_OPTIONS)
    if kind not in ("bwd_dkdv", "bwd_dq"):
        raise ValueError(f"kind={kind!r}: one of 'fwd', 'bwd_dkdv', 'bwd_dq'")
    c = config or bwd_config(block_d, dtype, gen, tma, heavy=dropout or softcap)
    m, n, warps, stages = (c.m1, c.n1, c.warps1, c.stages1) if kind == "bwd_dkdv" else (c.m2, c.n2, c.warps2,
                                                                                         c.stages2)
    consts.update(BLOCK_M=m, BLOCK_N=n, TMA=c.tma)
    return consts, dict(num_warps=warps, num_stages=stages)


@dataclass(frozen=True)
class Packed:
    """A varlen launch: ``[total, H, D]`` tensors, sequence ``b`` at rows ``cu_q[b]:cu_q[b+1]`` of q and
    ``cu_k[b]:cu_k[b+1]`` of k/v; ``max_q``/``max_k`` size the grid (at least every sequence's length)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    @property
    def batch(self) -> int:
        return self.cu_q.numel() - 1


def packed_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int) -> Packed:
    """Check what the kernels rely on (the op checks the rest) and describe the launch."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1 or cu.device != q.device:
            raise ValueError(f"{name} must be a 1-D int32 tensor [batch + 1] on {q.device} (got dtype={cu.dtype}, "
                             f"shape={tuple(cu.shape)}, device={cu.device})")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (got {cu_seqlens_q.numel()} and "
                         f"{cu_seqlens_k.numel()})")
    if cu_seqlens_q.numel() - 1 > MAX_GRID_Z:  # the sequences are the grid's third dimension
        raise ValueError(f"at most {MAX_GRID_Z} sequences per call on the Triton backend (got "
                         f"{cu_seqlens_q.numel() - 1}); split the batch")
    # offsets inside one sequence are int32 (as inside one batch element of the dense path); the
    # sequences' first rows are int64
    for name, x, n in (("q", q, max_seqlen_q), ("k", k, max_seqlen_k), ("v", v, max_seqlen_k)):
        span = n * x.stride(0) + x.shape[1] * x.stride(1)
        if span >= 2**31:
            raise ValueError(f"{name}: one sequence spans {span} elements (max_seqlen={n}, strides {x.stride()}), "
                             f"more than the int32 offsets of the kernels address (< 2**31)")
    return Packed(cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), int(max_seqlen_q), int(max_seqlen_k))


def dv_blocks(consts: dict) -> int:
    """Programs per (query block, head): one per ``BLOCK_DV`` columns of V. The grid must match the count the
    forward and decode kernels derive, so it calls their constexpr function (plain Python on the host)."""
    return _dv_blocks(consts["HEAD_DV"], consts["BLOCK_DV"])


def check_heads(Hq: int, v_blocks: int = 1) -> None:
    """The heads (times V's column blocks above 256 columns) are the grid's second dimension; no launch splits
    them (the batch is split, see batches)."""
    if Hq * v_blocks > MAX_GRID_Y:
        rows = f"{Hq} x {v_blocks} V blocks = {Hq * v_blocks} grid rows" if v_blocks > 1 else "one grid row per head"
        raise ValueError(f"Hq={Hq} query heads: the Triton kernels launch {rows} and CUDA allows at most "
                         f"{MAX_GRID_Y}; split the heads over several calls")


def batches(B: int) -> list[tuple[int, int]]:
    """``(b_first, count)`` of each dense launch: the batch is the grid's third dimension, at most ``MAX_GRID_Z``.

    A launch's programs compute batch ``b_first + program_id(2)`` over the whole tensors (no views, no
    copies), so every address and every dropout counter is the one a single launch would use.
    """
    return [(b0, min(MAX_GRID_Z, B - b0)) for b0 in range(0, B, MAX_GRID_Z)]


def strides(name: str, x: torch.Tensor) -> dict[str, int]:
    """The kernels' stride arguments of tensor ``x`` as keywords: ``stride_{name}b``, ``stride_{name}h``,
    ``stride_{name}n`` of a dense ``[B, H, N, D]`` tensor, ``stride_{name}h`` and ``stride_{name}n`` of a packed
    ``[total, H, D]`` one (the head dim's stride is 1: :func:`dense_last`)."""
    if x.dim() == 4:
        return {f"stride_{name}b": x.stride(0), f"stride_{name}h": x.stride(1), f"stride_{name}n": x.stride(2)}
    return {f"stride_{name}h": x.stride(1), f"stride_{name}n": x.stride(0)}
