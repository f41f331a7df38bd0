"""``stable_attn.explain(model, batch)``: which path serves each attention layer, and why."""

from __future__ import annotations

import sys
from typing import Any, TextIO

import torch
from torch import nn


def explain(model: nn.Module, batch: dict[str, Any], *, file: TextIO | None = None) -> list[dict[str, Any]]:
    """Run ``model(**batch)`` once (eagerly, without gradients) and print, for every attention layer, which
    path serves it on a CUDA device and, where it is not the fused kernel, why and what to change.

    Works on the CPU too (where everything runs on the PyTorch path): it reports what would serve each
    layer on CUDA, from the same decision the attention function takes there. A ``torch.compile``-d model
    is run through its original module. Returns one dict per attention call: ``layer`` (the module's
    qualified name), ``path``, ``reason`` (None on the fused kernel) and ``device`` (of this run).

    Only models running ``attn_implementation="stable_attn"`` are explained; layers that never reached
    stable_attn are listed with the path None.
    """
    from .integrations.transformers import dispatch
    from .integrations.transformers.models import attention_modules

    model = getattr(model, "_orig_mod", model)
    names = {id(m): n for n, m in attention_modules(model)}
    was_training = model.training
    with dispatch.recording() as calls, torch.no_grad():
        model(**batch)
    model.train(was_training)
    rows = [{"layer": names.get(id(c["module"]), type(c["module"]).__name__), "path": c["path"],
             "reason": c["reason"], "device": c["device"]} for c in calls]
    seen = {r["layer"] for r in rows}
    rows += [{"layer": n, "path": None, "reason": "did not run through stable_attn (attn_implementation?)",
              "device": None} for n in names.values() if n not in seen]
    out = file or sys.stdout
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    print(f"stable_attn.explain: {type(model).__name__} (attn_implementation={impl!r}), what serves each attention "
          "layer on a CUDA device:", file=out)
    for r in rows:
        line = f"  {r['layer']}: {r['path']}"
        if r["reason"]:
            line += f" -- {r['reason']}"
        print(line, file=out)
    if any(r["device"] == "cpu" for r in rows):
        print("  (this run was on the CPU, where every layer runs on the PyTorch path)", file=out)
    return rows
