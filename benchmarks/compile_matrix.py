"""The torch.compile matrix as a table: per cell, which op serves each attention layer, graph breaks, host reads.

For each family (tests/integrations/tiny_models.py), input kind, ``use_cache`` and gradient checkpointing, one
training step (forward + backward) of ``torch.compile(model, fullgraph=False, backend=<recorder>)`` (dynamo's
graphs run as captured; the test suite runs the same graphs through ``aot_eager``):
the stable_attn ops in the captured graphs (``dense``, ``varlen``, ``4D`` for the PyTorch path's arbitrary mask),
the graph breaks (graphs - 1) and whose code broke them, and the host reads the fused ops make while the
step runs (``varlen._host_values``, the varlen op's one read of ``cu_seqlens``; compiled code has no other
read of ours). Without ``fullgraph`` so that a break is counted instead of raised; the test suite asserts the
same cells with ``fullgraph=True`` (tests/integrations/test_compile_matrix.py).

    python benchmarks/compile_matrix.py            # markdown table on stdout (~5-10 min on 2 CPU cores)
    python benchmarks/compile_matrix.py --families llama gemma2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "integrations"))

import torch  # noqa: E402
from test_compile_matrix import KINDS, Recorder, breaks_in_stable_attn, build, make_batch  # noqa: E402
from tiny_models import NAMES  # noqa: E402

from stable_attn import varlen  # noqa: E402

SHORT = {"stable_attn.attention_fwd.default": "dense", "stable_attn.attention_varlen_fwd.default": "varlen"}


def cell(name: str, kind: str, use_cache: bool, checkpointing: bool) -> dict:
    torch._dynamo.reset()
    model = build(name, "stable_attn", checkpointing)
    batch = make_batch(kind)
    recorder = Recorder(aot=False)  # the captured graphs run as captured: the ops and their reads are the same
    compiled = torch.compile(model, backend=recorder)
    reads = []
    real = varlen._host_values

    def counting(cu):
        reads.append(cu.numel())
        return real(cu)

    # tracing reads nothing (the ops' fake implementations), so the first step counts what every step reads
    varlen._host_values = counting
    try:
        compiled(**batch, use_cache=use_cache).loss.backward()
    finally:
        varlen._host_values = real
    paths = ["4D" if four_d else SHORT.get(op, op) for op, four_d in recorder.attention_calls()]
    ours = 0
    if len(recorder.graphs) > 1:  # whose code broke the graph
        torch._dynamo.reset()
        ours = len(breaks_in_stable_attn(torch._dynamo.explain(model)(**make_batch(kind), use_cache=use_cache)))
    return {"paths": paths, "breaks": len(recorder.graphs) - 1, "ours": ours, "reads": len(reads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(NAMES), choices=NAMES)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, dynamo graphs, CPU; paths of layers 0 and 1; breaks (stable_attn's); host reads "
          "per step")
    print()
    print("| family | input | use_cache | checkpointing | paths | graph breaks (ours) | host reads / step |")
    print("|---|---|---|---|---|---|---|")
    for name in args.families:
        for kind in KINDS:
            for use_cache, checkpointing in ((True, False), (False, False), (False, True), (True, True)):
                t = time.perf_counter()
                r = cell(name, kind, use_cache, checkpointing)
                print(f"| {name} | {kind} | {use_cache} | {'on' if checkpointing else 'off'} | {', '.join(r['paths'])} "
                      f"| {r['breaks']} ({r['ours']}) | {r['reads']} |", flush=True)
                print(f"  ({time.perf_counter() - t:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
