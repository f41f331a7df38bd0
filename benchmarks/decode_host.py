"""Host CPU cost of one decode call of ``stable_attn.attention`` on the Triton path, the two launches stubbed.

    TRITON_INTERPRET=1 python benchmarks/decode_host.py [--calls 2000] [--repeats 5]

What ``generate()`` sends every layer of every step: one query (or a few) against a KV cache, no gradient. The
two Triton launches of the decode path (``triton_decode.attn_decode_kernel`` and ``attn_decode_combine_kernel``)
are replaced by stubs that take the launch's arguments and return at once, so what is timed is everything the
host does around them: checks, options, the split plan, allocations, argument marshalling. CPU tensors under
``TRITON_INTERPRET=1`` stand in for CUDA ones (the launch path is the same; only the launch is stubbed).

Two rows per shape:

- ``generic``: ``stable_attn.call_cache.ENABLED = False``: every call goes through the checks, ``Options``,
  the backend rule, the ``torch.library`` op and ``triton_decode.forward`` (the path of every first call);
- ``planned``: the default: a call whose shapes, strides, dtypes, devices, grad mode and options match an
  earlier call's reuses that call's checked plan (stable_attn/call_cache.py) and the decode launcher's
  precomputed launch (kernels/decode_launch.py: constants, split count, strides, scratch partials).

Each figure: the median over ``--repeats`` rounds of the mean CPU time per call over ``--calls`` calls
(``time.process_time``, which moves less than wall time with the load of a shared machine; one thread).
``F.scaled_dot_product_attention`` on a tiny CPU problem (dispatch and compute) is the yardstick.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import cpu_model  # noqa: E402

import stable_attn  # noqa: E402
from stable_attn import call_cache  # noqa: E402
from stable_attn.kernels import triton_decode  # noqa: E402

# (name, B, Hq, Hkv, Nq, Nk, D, key padding mask)
SHAPES = (
    ("llama-8b step", 1, 32, 8, 1, 4096, 128, False),
    ("llama-8b step, kpm", 1, 32, 8, 1, 4096, 128, True),
    ("batch 8, 4 queries", 8, 16, 4, 4, 2048, 64, True),
)


class _Stub:
    """A Triton kernel whose launch does nothing: ``kernel[grid](**kwargs)`` returns at once."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs) -> None:
        self.launches += 1


def per_call_us(fn, calls: int, repeats: int) -> float:
    rounds = []
    for _ in range(repeats):
        fn()  # warm: the first call of a shape builds its plan
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        rounds.append((time.process_time() - t0) / calls * 1e6)
    return statistics.median(rounds)


def inputs(B, Hq, Hkv, Nq, Nk, D, kpm):
    # the cache's storage is longer than the keys seen (a static cache's slots): k, v are views of it
    cache = torch.zeros(2, B, Hkv, Nk + 64, D, dtype=torch.bfloat16)
    q = torch.zeros(B, Nq, Hq, D, dtype=torch.bfloat16).transpose(1, 2)  # transformers' [B, N, H, D] transposed
    mask = torch.ones(B, Nk, dtype=torch.bool) if kpm else None
    return q, cache[0, :, :, :Nk], cache[1, :, :, :Nk], mask


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    stub, combine = _Stub(), _Stub()
    triton_decode.attn_decode_kernel = stub
    triton_decode.attn_decode_combine_kernel = combine
    print(f"host CPU per decode call, launches stubbed ({cpu_model()}, torch {torch.__version__}, 1 thread; median "
          f"of {args.repeats} rounds of {args.calls} calls)")
    print(f"{'shape':<22} {'B Hq/Hkv Nq Nk D':<22} {'generic us':>11} {'planned us':>11} {'ratio':>6}")
    for name, B, Hq, Hkv, Nq, Nk, D, kpm in SHAPES:
        q, k, v, mask = inputs(B, Hq, Hkv, Nq, Nk, D, kpm)

        def call(q=q, k=k, v=v, mask=mask):
            return stable_attn.attention(q, k, v, causal=True, key_padding_mask=mask, backend="triton")

        row = {}
        for label, enabled in (("generic", False), ("planned", True)):
            call_cache.ENABLED = enabled
            before = stub.launches
            with torch.no_grad():
                row[label] = per_call_us(call, args.calls, args.repeats)
            assert stub.launches > before and combine.launches == stub.launches, "the decode path did not run"
        call_cache.ENABLED = True
        print(f"{name:<22} {f'{B} {Hq}/{Hkv} {Nq} {Nk} {D}':<22} {row['generic']:>11.1f} {row['planned']:>11.1f} "
              f"{row['generic'] / row['planned']:>5.1f}x")
    q = torch.randn(1, 4, 1, 16)
    kv = torch.randn(1, 4, 64, 16)
    with torch.no_grad():
        sdpa = per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, kv, kv), args.calls,
                           args.repeats)
    print(f"{'sdpa (computes)':<22} {'1 4/4 1 64 16':<22} {sdpa:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
