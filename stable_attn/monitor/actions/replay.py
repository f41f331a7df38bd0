"""Replay a spiking step three ways: was the spike the attention numerics or the data?

:func:`replay_step` re-runs, on the model's current weights (the pre-step weights when it is called before the
optimizer step, as the engine does with ``diagnose_spikes=True``), the forward and backward of the step's
micro-batches once per variant of the attention arithmetic (:data:`VARIANTS`):

- ``"off"``: plain FlashAttention-2 (``stabilize=False``), ``P-bar`` rounded to the input dtype before ``P-bar V``;
- ``"ours"``: our rule (``stabilize=True``);
- ``"fp32_pv"``: no rule, ``P-bar V`` in fp32 (``pv_fp32=True``, the PyTorch path): Qiu & Yao show that fp32 for that
  product alone stabilises training.

Each variant's loss (the mean over the micro-batches) and total gradient norm are compared with the detector's
threshold in :func:`verdict`: ``"data"`` when every variant still spikes, ``"numerical"`` when the run's own setting
spikes and a variant with the fix or with fp32 ``P-bar V`` does not, ``"unclear"`` otherwise (for instance when the
run's own setting does not spike again). Cost: one forward and backward per variant and micro-batch, on alert steps
only; the model's gradients, RNG streams, train/eval mode, weights, attention options and statistics are as they
were afterwards, also when a forward raises.

The variants are switched on the model's ``"stable_attn"`` attention layers (``module.stable_attn_options``, the
place :func:`stable_attn.integrations.transformers.configure` writes), so replay needs a transformers model that
runs ``attn_implementation="stable_attn"``. Under DDP the engine does not replay (a backward outside DDP's forward
would confuse its reducer): docs/DETECTORS.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import names

__all__ = ["REPLAY_VERDICTS", "VARIANTS", "Replay", "default_loss", "diagnose", "replay_bundle", "replay_step",
           "table", "verdict", "write_replay_bundle"]

log = logging.getLogger("stable_attn")

#: The attention options of each variant, as ``configure()`` takes them.
VARIANTS: Mapping[str, Mapping[str, Any]] = {
    "off": {"stabilize": False, "pv_fp32": False},
    "ours": {"stabilize": True, "pv_fp32": False},
    "fp32_pv": {"stabilize": False, "pv_fp32": True},
    "paper": {"stabilize": "paper", "pv_fp32": False},  # only as the run's own variant
}
#: The variants replayed by default (``"paper"`` is replayed only as the run's own).
DEFAULT_VARIANTS = ("off", "ours", "fp32_pv")
#: What :func:`verdict` returns.
REPLAY_VERDICTS = ("numerical", "data", "unclear")
#: The variants that remove the bias the fix is for: a spike that disappears under one of them is numerical.
_FIXING = ("ours", "fp32_pv")

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
#: diagnose_spikes keeps the first this many spikes of a run as bundles, under ``{log_dir}/BUNDLES_DIR/step-N``.
MAX_BUNDLES = 3
BUNDLES_DIR = "replay"


@dataclass
class Replay:
    """What :func:`replay_step` measured: per variant ``{"loss": float, "grad_norm": float}`` (NaN where a
    value was not finite), and the variant the run itself used."""

    results: dict[str, dict[str, float]] = field(default_factory=dict)
    run_variant: str = "ours"

    def as_dict(self) -> dict[str, Any]:
        return {"run_variant": self.run_variant, "variants": {k: dict(v) for k, v in self.results.items()}}


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The one transformers model inside ``model`` (``model`` itself if it is one)."""
    from ...integrations.transformers.swap import find_hf_models

    found = list(find_hf_models(model).values())
    if len(found) != 1:
        raise ValueError(f"replay needs exactly one transformers PreTrainedModel in model={type(model).__name__}, "
                         f"found {len(found)}; pass loss_fn and a transformers model")
    return found[0]


def default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The causal-LM loss of a transformers model on a batch: ``model(**batch).loss``, with ``labels`` the
    ``input_ids`` when the batch has none; a tensor batch is the ``input_ids``."""
    hf = _hf_model(model)
    if isinstance(batch, torch.Tensor):
        batch = {"input_ids": batch}
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise TypeError(f"replay's default loss takes a tensor of token ids or a dict with 'input_ids', got "
                        f"{type(batch).__name__}; pass loss_fn(model, batch) -> loss")
    batch = dict(batch)
    batch.setdefault("labels", batch["input_ids"])
    loss = hf(**batch).loss
    if loss is None:
        raise ValueError(f"{type(hf).__name__} returned no loss for the batch; pass loss_fn(model, batch) -> loss")
    return loss


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from ...integrations.transformers import attention_modules

    hf = _hf_model(model)
    impl = getattr(hf.config, "_attn_implementation", None)
    if impl != "stable_attn":
        raise ValueError(f"replay switches the attention arithmetic of 'stable_attn' layers; "
                         f"{type(hf).__name__} runs attn_implementation={impl!r}: load it with "
                         "attn_implementation='stable_attn' (or let the callback swap it)")
    return [m for _, m in attention_modules(hf)]


def run_variant_of(model: torch.nn.Module) -> str:
    """The variant the model's attention layers run now (the first layer's options; ``"paper"`` for the published
    rule)."""
    from ...integrations.transformers.models import model_options_of

    opts = model_options_of(_attention_modules(model)[0])
    if opts.get("pv_fp32"):
        return "fp32_pv"
    return {True: "ours", False: "off", "paper": "paper"}[opts["stabilize"]]


def variants_with(run_variant: str) -> tuple[str, ...]:
    """The three variants, and the run's own if it is none of them."""
    return DEFAULT_VARIANTS if run_variant in DEFAULT_VARIANTS else (*DEFAULT_VARIANTS, run_variant)


_ABSENT = object()


@contextlib.contextmanager
def _variant(modules: Sequence[torch.nn.Module], options: Mapping[str, Any]) -> Iterator[None]:
    """Every layer runs ``options`` over its own; its options and statistics as they were afterwards."""
    from ...integrations.transformers.models import model_options_of

    saved = [(m, m.__dict__.get("stable_attn_options", _ABSENT), getattr(m, "stable_attn_stats", None))
             for m in modules]
    enabled = [(s, s.enabled) for _, _, s in saved if s is not None]
    try:
        for m, _, stats in saved:
            m.stable_attn_options = {**model_options_of(m), **options}
            if stats is not None:
                stats.enabled = False  # replay's forwards are no training forwards: they must not count
        yield
    finally:
        for m, own, _ in saved:
            if own is _ABSENT:
                m.__dict__.pop("stable_attn_options", None)
            else:
                m.stable_attn_options = own
        for stats, flag in enabled:
            stats.enabled = flag


def _norm(params: Sequence[torch.nn.Parameter]) -> float:
    grads = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else 0.0


def _finite(x: float) -> float:
    return x if math.isfinite(x) else math.nan


def replay_step(model: torch.nn.Module, batches: Sequence[Any], loss_fn: LossFn | None = None,
                variants: Sequence[str] = DEFAULT_VARIANTS, *, run_variant: str = "ours",
                autocast_dtype: torch.dtype | None = None) -> Replay:
    """Re-run the step's forward and backward on ``batches`` once per variant (see the module).

    Args:
        model: the module the step trained (its one transformers model runs ``"stable_attn"``).
        batches: the step's micro-batches, as the training step received them.
        loss_fn: ``loss_fn(model, batch) -> loss``; default :func:`default_loss`.
        variants: names from :data:`VARIANTS`.
        run_variant: the variant the run itself trains with (``"ours"`` with ``stabilize=True``).
        autocast_dtype: run the forwards under ``torch.autocast`` with this dtype (what the training step ran
            under, e.g. ``torch.bfloat16`` for ``precision="bf16-mixed"``); None: no autocast.
    """
    unknown = [v for v in (*variants, run_variant) if v not in VARIANTS]
    if unknown or not variants:
        raise ValueError(f"variants={tuple(variants)!r}, run_variant={run_variant!r}: use names from {tuple(VARIANTS)}")
    if not batches:
        raise ValueError("batches=[]: replay needs the step's micro-batches")
    loss_fn = loss_fn or default_loss
    modules = _attention_modules(model)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    device = params[0].device if params else torch.device("cpu")
    cuda = [device] if device.type == "cuda" else []
    rng = torch.random.get_rng_state()
    cuda_rng = [torch.cuda.get_rng_state(d) for d in cuda]
    out = Replay(run_variant=run_variant)
    try:
        for name in variants:
            for p in params:
                p.grad = None
            losses = []
            with torch.random.fork_rng(devices=cuda), _variant(modules, VARIANTS[name]):
                torch.random.set_rng_state(rng)  # every variant draws the same dropout as the step did
                for d, state in zip(cuda, cuda_rng):
                    torch.cuda.set_rng_state(state, d)
                for batch in batches:
                    autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                                else contextlib.nullcontext())
                    with autocast:
                        loss = loss_fn(model, batch)
                    (loss.float() / len(batches)).backward()
                    losses.append(float(loss.detach().float()))
            out.results[name] = {"loss": _finite(sum(losses) / len(losses)), "grad_norm": _finite(_norm(params))}
    finally:
        for p, g in zip(params, grads):
            p.grad = g
    return out


def verdict(replay: Replay, metric: str, threshold: float) -> str:
    """``"data"``, ``"numerical"`` or ``"unclear"`` for a spike of ``metric`` (``"loss"`` or ``"grad_norm"``)
    above ``threshold`` (the detector's, in the metric's units): a variant spikes when its value is above the
    threshold or not finite (see the module)."""
    if metric not in ("loss", "grad_norm"):
        raise ValueError(f"metric={metric!r} is not supported; use 'loss' or 'grad_norm'")
    if not math.isfinite(threshold):
        return "unclear"
    spiked = {name: not (r[metric] <= threshold) for name, r in replay.results.items()}  # NaN spikes
    if spiked and all(spiked.values()):
        return "data"
    if spiked.get(replay.run_variant) and any(not spiked[n] for n in _FIXING
                                              if n in spiked and n != replay.run_variant):
        return "numerical"
    return "unclear"


# ---------------------------------------------------------------- bundles: a step kept for `stable-attn replay`
#: Files of a replay bundle (a folder): the transformers model as save_pretrained writes it, the micro-batches,
#: and what the alert said.
BUNDLE_MODEL, BUNDLE_BATCHES, BUNDLE_META = "model", "batches.pt", "replay.json"
BUNDLE_VERSION = 1


def _tensors_only(batch: Any) -> Any:
    """The batch with its tensors on the CPU (dicts and sequences kept); anything else is refused."""
    if isinstance(batch, torch.Tensor):
        return batch.detach().cpu()
    if isinstance(batch, Mapping):
        return {str(k): _tensors_only(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [_tensors_only(v) for v in batch]
    if batch is None or isinstance(batch, (int, float, bool, str)):
        return batch
    raise TypeError(f"a replay bundle keeps tensors, dicts and lists of them; the batch holds {type(batch).__name__}")


def write_replay_bundle(path: str, model: torch.nn.Module, batches: Sequence[Any], *, step: int, metric: str,
                        threshold: float, run_variant: str = "ours") -> str:
    """Write the step (the transformers model's current weights, its micro-batches, the alert's metric and
    threshold) to the folder ``path`` for ``stable-attn replay path``; returns ``path``. Costs one copy of the
    model on disk."""
    import json
    import os

    if metric not in ("loss", "grad_norm") or run_variant not in VARIANTS:
        raise ValueError(f"metric={metric!r}, run_variant={run_variant!r}: use 'loss' or 'grad_norm', and one of "
                         f"{tuple(VARIANTS)}")
    hf = _hf_model(model)
    os.makedirs(path, exist_ok=True)
    hf.save_pretrained(os.path.join(path, BUNDLE_MODEL))
    torch.save([_tensors_only(b) for b in batches], os.path.join(path, BUNDLE_BATCHES))
    meta = {"version": BUNDLE_VERSION, "step": int(step), "metric": metric, "threshold": float(threshold),
            "run_variant": run_variant, "dtype": str(next(hf.parameters()).dtype).removeprefix("torch.")}
    with open(os.path.join(path, BUNDLE_META), "w") as f:
        json.dump(meta, f, indent=1)
    return path


def replay_bundle(path: str, variants: Sequence[str] = DEFAULT_VARIANTS, device: str = "cpu") -> dict[str, Any]:
    """Load a bundle written by :func:`write_replay_bundle`, replay it, and return the table's data:
    ``{"step", "metric", "threshold", "run_variant", "variants", "verdict"}``."""
    import json
    import os

    meta_path = os.path.join(path, BUNDLE_META)
    if not os.path.isfile(meta_path):
        raise ValueError(f"{path!r} is no replay bundle (no {BUNDLE_META}); write one with write_replay_bundle or "
                         "diagnose_spikes=True")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("version") != BUNDLE_VERSION:
        raise ValueError(f"{meta_path}: bundle version {meta.get('version')!r}; this stable_attn reads "
                         f"{BUNDLE_VERSION}")
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, meta.get("dtype", "float32"))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(path, BUNDLE_MODEL), attn_implementation="stable_attn",
                                                 dtype=dtype, local_files_only=True).to(device)
    model.train()  # the step was a training step (dropout draws from the same seed in every variant)
    batches = torch.load(os.path.join(path, BUNDLE_BATCHES), map_location=device, weights_only=True)
    run_variant = meta["run_variant"]
    names = tuple(variants) + (() if run_variant in variants else (run_variant,))
    replay = replay_step(model, batches, run_variant=run_variant, variants=names)
    return {"step": meta["step"], "metric": meta["metric"], "threshold": meta["threshold"], **replay.as_dict(),
            "verdict": verdict(replay, meta["metric"], meta["threshold"])}


def table(result: Mapping[str, Any]) -> str:
    """The replay as a plain-text table and one verdict line."""
    lines = [f"replay of step {result['step']}: the spike of {result['metric']} above {result['threshold']:.4g} "
             f"(the run trains with {result['run_variant']!r})",
             f"{'variant':<10} {'loss':>12} {'grad_norm':>12}  spikes"]
    for name, r in result["variants"].items():
        value = r[result["metric"]]
        spikes = "yes" if not value <= result["threshold"] else "no"
        lines.append(f"{name:<10} {r['loss']:>12.6g} {r['grad_norm']:>12.6g}  {spikes}")
    meaning = {"numerical": "the spike disappears with the fix or with fp32 P-bar V: the attention numerics",
               "data": "the spike stays in every variant: the data (or the optimisation), not the attention "
                       "numerics",
               "unclear": "neither: the run's own variant does not spike again, or no fixing variant removes it "
                          "while another does not"}
    lines.append(f"verdict: {result['verdict']} ({meaning[result['verdict']]})")
    return "\n".join(lines)


def diagnose(root: torch.nn.Module | None, batches: Sequence[Any], *, step: int, metric_name: str, threshold: float,
             world_size: int, is_zero: bool, log_dir: str | None, bundles: list[str], name: str) -> dict[str, Any]:
    """``diagnose_spikes``: replay the step three ways on its batches (the weights are still the pre-step ones when
    the engine calls it, before the optimizer step) and say whether the spike is numerical or the data; the first
    :data:`MAX_BUNDLES` spikes are written as bundles on rank zero (their paths appended to ``bundles``). Never
    raises: a replay that cannot run says why in the result."""
    metric = {names.LOSS: "loss", names.GRAD_NORM: "grad_norm"}.get(metric_name)
    if metric is None:
        return {"skipped": f"no replay for the metric {metric_name!r}"}
    if world_size > 1:
        return {"skipped": "not replayed under DDP (a backward outside DDP's forward would confuse its reducer)"}
    if not batches or root is None:
        return {"skipped": "the training loop passed no batches for this step (MonitorEngine.add_batch)"}
    try:
        run_variant = run_variant_of(root)
        result = replay_step(root, batches, run_variant=run_variant, variants=variants_with(run_variant))
        found = verdict(result, metric, threshold)
    except Exception as exc:  # a diagnosis is a courtesy: it never costs the alert or the run
        log.warning("%s: the spike at step %d was not replayed: %s: %s", name, step, type(exc).__name__, exc)
        return {"error": f"{type(exc).__name__}: {exc}"}
    diagnosis = {"metric": metric, "threshold": threshold, **result.as_dict(), "verdict": found}
    if is_zero and log_dir and len(bundles) < MAX_BUNDLES:
        try:
            path = os.path.join(log_dir, BUNDLES_DIR, f"step-{step}")
            bundles.append(write_replay_bundle(path, root, batches, step=step, metric=metric, threshold=threshold,
                                               run_variant=run_variant))
            diagnosis["bundle"] = os.path.basename(path)
        except Exception as exc:
            log.warning("%s: no replay bundle for step %d: %s: %s", name, step, type(exc).__name__, exc)
    return diagnosis
