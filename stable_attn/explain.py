"""``stable_attn.explain(model, batch)``: which attention each layer runs, which path serves it, and why."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, TextIO

import torch
from torch import nn

WANTS = ("batch must be a dict of the model's inputs (e.g. {'input_ids': ids, 'attention_mask': mask}) or an "
         "integer tensor of input ids [B, N]")


def _inputs(batch: Any) -> dict[str, Any]:
    """The keyword arguments ``model(**...)`` gets: a mapping as it is, a tensor of token ids as ``input_ids``."""
    if isinstance(batch, Mapping):
        return dict(batch)
    if isinstance(batch, torch.Tensor) and not batch.is_floating_point() and not batch.is_complex():
        return {"input_ids": batch}
    got = f"a {batch.dtype} tensor" if isinstance(batch, torch.Tensor) else type(batch).__name__
    raise TypeError(f"stable_attn.explain: {WANTS}; got {got}")


def explain(model: nn.Module, batch: Mapping[str, Any] | torch.Tensor, *,
            file: TextIO | None = None) -> list[dict[str, Any]]:
    """Run the model once on ``batch`` (eagerly, without gradients) and print, for every attention layer, the
    attention implementation it runs (its config's ``_attn_implementation`` at this call: a config shared with
    another model may have switched it) and, for layers on ``"stable_attn"``, which path serves it on a CUDA
    device and, where it is not the fused kernel, why and what to change.

    ``batch``: a dict of the model's inputs (``model(**batch)``) or an integer tensor of input ids
    (``model(input_ids=batch)``); anything else raises a one-line TypeError saying so.

    Works on the CPU too (where everything runs on the PyTorch path): it reports what would serve each
    layer on CUDA, from the same decision the attention function takes there. A ``torch.compile``-d model
    is run through its original module. Returns one dict per attention call: ``layer`` (the module's
    qualified name), ``attention`` (the implementation the layer ran), ``path``, ``reason`` (None on the fused
    kernel) and ``device`` (of this run). Layers that never reached stable_attn have the path None.
    """
    from .integrations.transformers import dispatch
    from .integrations.transformers.models import attention_modules
    from .integrations.transformers.swap import SHARED_CONFIG_HINT, implementations_line, layer_implementation

    inputs = _inputs(batch)
    model = getattr(model, "_orig_mod", model)
    modules = attention_modules(model)
    names = {id(m): n for n, m in modules}
    runs = {n: layer_implementation(m) for n, m in modules}
    was_training = model.training
    with dispatch.recording() as calls, torch.no_grad():
        model(**inputs)
    model.train(was_training)
    rows = []
    for c in calls:
        layer = names.get(id(c["module"]), type(c["module"]).__name__)
        rows.append({"layer": layer, "attention": runs.get(layer, layer_implementation(c["module"])),
                     "path": c["path"], "reason": c["reason"], "device": c["device"]})
    seen = {r["layer"] for r in rows}
    rows += [{"layer": n, "attention": runs[n], "path": None,
              "reason": f"runs {runs[n]!r} (its config's _attn_implementation), not stable_attn", "device": None}
             for n in names.values() if n not in seen]
    out = file or sys.stdout
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    what = implementations_line([m for _, m in modules]) if modules else "no attention layer found"
    print(f"stable_attn.explain: {type(model).__name__} (attn_implementation={impl!r}; its attention layers: "
          f"{what}), what serves each attention layer on a CUDA device:", file=out)
    for r in rows:
        line = f"  {r['layer']}: {r['path'] or repr(r['attention'])}"
        if r["reason"]:
            line += f" -- {r['reason']}"
        print(line, file=out)
    if any(r["path"] is None for r in rows):
        print(f"  (a layer not on stable_attn: load the model with attn_implementation='stable_attn'; if it was, "
              f"{SHARED_CONFIG_HINT})", file=out)
    if any(r["device"] == "cpu" for r in rows):
        print("  (this run was on the CPU, where every layer runs on the PyTorch path)", file=out)
    return rows
