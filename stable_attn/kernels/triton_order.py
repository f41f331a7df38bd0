"""The order in which a causal launch hands out its query blocks: the longest first.

With ``causal`` the programs of one (batch, head) do unequal work: query block ``m`` walks the key blocks up to
the diagonal, so the cost grows with ``m`` (with a window it grows, then stays flat). The GPU hands programs to
SMs in launch order, ``program_id(0)`` fastest; if the cheap blocks go first, the last programs to start are the
longest ones and the launch ends ragged. :func:`query_block` reverses ``program_id(0)`` where the kernels are
causal, so each (batch, head)'s longest query blocks start first and its shortest fill the tail (FlashAttention-3
launches its causal grids longest first too). Which program computes which block is all that changes: every
block is computed by the same code on the same inputs, so the outputs are the same bits
(tests/kernels/test_causal_order.py). benchmarks/causal_order.py simulates the makespan of both orders.
Non-causal blocks cost the same, and keep their order (the kernels compile as before).

The dense forward and dQ kernels take it; the dK/dV kernel's key block ``n`` walks the queries from
the diagonal to the end, so its natural order is already the longest first.

Where: dense launches on the GPUs of the sm_90 tile rows (H100/H200, B200/B300: ``triton_launch.tile_generation``
90), where the simulation was run (132 SMs) and where the compiled forward stays as it was (registers, spills,
shared memory, loop SASS; dQ at D = 128: one register more; benchmarks/kernel_resources.py). On sm_80 the published
rule's D = 64 forward then spilled 8 bytes (none in natural order), and the varlen forward's loop grew by one or
two instructions in two sm_90 variants: sm_80, sm_120 and the varlen kernels keep the natural order. The choice
travels in the kernels' ``CAUSAL`` constexpr (:func:`causal_constant`): ``HEAVY_FIRST`` (2) is causal, longest
first; ``True`` is causal in natural order; every other use of ``CAUSAL`` only asks whether it is set.
"""

from __future__ import annotations

import triton
import triton.language as tl

_HEAVY_FIRST = 2
HEAVY_FIRST = tl.constexpr(_HEAVY_FIRST)  # the CAUSAL constexpr of a causal launch handing out its longest blocks first


def causal_constant(causal: bool, generation: int, kind: str, packed: bool, equal_dims: bool = True) -> bool | int:
    """The ``CAUSAL`` constexpr of a launch of kernel ``kind`` (``packed``: the varlen kernel) on a GPU of tile rows
    ``generation`` (``triton_launch.tile_generation``): ``HEAVY_FIRST`` for the dense causal forward and dQ on sm_90
    rows, else ``causal``. ``equal_dims``: V's head dim is the query's; where it is not, the natural order (the
    reversed index's extra register made the 192 / 128 dQ kernel spill 16 bytes on sm_90)."""
    heavy = causal and generation == 90 and kind in ("fwd", "bwd_dq") and not packed and equal_dims
    return _HEAVY_FIRST if heavy else causal


@triton.jit
def query_block(Nq, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr):
    """This program's query block among the ``cdiv(Nq, BLOCK_M)`` of its (batch, head): the longest first where
    ``CAUSAL`` is ``HEAVY_FIRST`` (dense launches only: their grid's ``program_id(0)`` ranges over exactly those
    blocks, so the reversal reads the grid's size, a special register)."""
    if CAUSAL == HEAVY_FIRST:
        tl.static_assert(not VARLEN)
        return tl.num_programs(0) - 1 - tl.program_id(0)
    return tl.program_id(0)
