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

__all__ = ["REPLAY_VERDICTS", "VARIANTS", "Replay", "default_loss", "diagnose", "model_identity", "replay_bundle",
           "replay_step", "table", "verdict", "write_replay_bundle"]

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
    from ...integrations.transformers.registry import NAMES

    hf = _hf_model(model)
    impl = getattr(hf.config, "_attn_implementation", None)
    if impl not in NAMES:
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
BUNDLE_VERSION = 2


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

    if metric not in ("loss", "grad_norm") or run_variant not in VARIANTS:
        raise ValueError(f"metric={metric!r}, run_variant={run_variant!r}: use 'loss' or 'grad_norm', and one of "
                         f"{tuple(VARIANTS)}")
    hf = _hf_model(model)
    os.makedirs(path, exist_ok=True)
    hf.save_pretrained(os.path.join(path, BUNDLE_MODEL))
    torch.save([_tensors_only(b) for b in batches], os.path.join(path, BUNDLE_BATCHES))
    meta = {"version": BUNDLE_VERSION, "step": int(step), "metric": metric, "threshold": float(threshold),
            "run_variant": run_variant, "dtype": str(next(hf.parameters()).dtype).removeprefix("torch."),
            "model": model_identity(hf)}
    with open(os.path.join(path, BUNDLE_META), "w") as f:
        json.dump(meta, f, indent=1)
    return path


#: Config entries that say how the model was loaded or run, not which model it is.
_CONFIG_NOT_IDENTITY = ("_name_or_path", "_commit_hash", "transformers_version", "dtype", "torch_dtype", "use_cache",
                        "_attn_implementation", "_attn_implementation_internal", "_attn_implementation_autoset")
_BUNDLE_DTYPES = ("float32", "float16", "bfloat16", "float64")


def model_identity(hf: torch.nn.Module) -> dict[str, Any]:
    """What a bundle records of its model, to refuse replaying it on another: the class, a hash of the config
    (without the entries that only say how it was loaded) and every parameter's shape."""
    import hashlib
    import json

    config = {k: v for k, v in hf.config.to_dict().items() if k not in _CONFIG_NOT_IDENTITY}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    return {"class": type(hf).__name__, "config_sha256": digest,
            "parameters": {name: list(p.shape) for name, p in hf.named_parameters()}}


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def _bundle_meta(meta_path: str) -> dict[str, Any]:
    """The bundle's ``replay.json``, every field checked; a ValueError naming the field otherwise."""
    import json

    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except ValueError as err:  # also UnicodeDecodeError
        raise ValueError(f"{meta_path}: not readable JSON ({_first_line(err)})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: holds a {type(meta).__name__}, not an object")
    if meta.get("version") != BUNDLE_VERSION:
        raise ValueError(f"{meta_path}: bundle version {meta.get('version')!r}; this stable_attn reads "
                         f"{BUNDLE_VERSION}")
    checks = {"step": lambda v: type(v) is int,
              "metric": lambda v: v in ("loss", "grad_norm"),
              "threshold": lambda v: type(v) in (int, float),
              "run_variant": lambda v: isinstance(v, str) and v in VARIANTS,
              "dtype": lambda v: v in _BUNDLE_DTYPES,
              "model": lambda v: (isinstance(v, dict) and isinstance(v.get("class"), str)
                                  and isinstance(v.get("config_sha256"), str)
                                  and isinstance(v.get("parameters"), dict))}
    for name, ok in checks.items():
        if name not in meta:
            raise ValueError(f"{meta_path}: field {name!r} is missing")
        if not ok(meta[name]):
            raise ValueError(f"{meta_path}: field {name!r} = {str(meta[name])[:80]!r} is not valid")
    return meta


def _check_identity(path: str, recorded: Mapping[str, Any], hf: torch.nn.Module) -> None:
    """Refuse a model folder that is not the model the bundle recorded (swapped or edited)."""
    found = model_identity(hf)
    if recorded["class"] != found["class"]:
        raise ValueError(f"{path}: the bundle recorded model class {recorded['class']!r}, the model folder holds "
                         f"{found['class']!r}")
    for name, shape in recorded["parameters"].items():
        if name not in found["parameters"]:
            raise ValueError(f"{path}: parameter {name!r} of the recorded model is not in the model folder")
        if list(shape) != found["parameters"][name]:
            raise ValueError(f"{path}: parameter {name!r} has shape {found['parameters'][name]} in the model "
                             f"folder, the bundle recorded {shape}")
    extra = sorted(set(found["parameters"]) - set(recorded["parameters"]))
    if extra:
        raise ValueError(f"{path}: parameter {extra[0]!r} is in the model folder, not in the recorded model")
    if recorded["config_sha256"] != found["config_sha256"]:
        raise ValueError(f"{path}: the model folder's config.json differs from the config the bundle recorded "
                         "(field 'model.config_sha256')")


def _load_model(path: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    folder = os.path.join(path, BUNDLE_MODEL)
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the refusal below is the one line; no load report, no progress bar
    hf_logging.disable_progress_bar()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="stable_attn", dtype=dtype,
                                                           local_files_only=True, output_loading_info=True,
                                                           ignore_mismatched_sizes=True)
    except Exception as err:  # a damaged folder fails in many ways (safetensors, json, a missing file)
        raise ValueError(f"{folder}: the model does not load ({_first_line(err)})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    for kind in ("missing_keys", "mismatched_keys", "unexpected_keys"):
        found = sorted(info.get(kind) or (), key=str)  # mismatched: (name, shape in the file, shape of the model)
        if found:  # transformers would run with freshly initialised weights in their place
            name, *shapes = found[0] if isinstance(found[0], tuple) else (found[0],)
            detail = f" (shape {list(shapes[0])}, the model's {list(shapes[1])})" if len(shapes) == 2 else ""
            raise ValueError(f"{folder}: tensor {name!r} is {kind.split('_')[0]} in the weights file{detail}")
    try:
        return model.to(device)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"--device {device!r}: {_first_line(err)}") from None


def _tensors_to(batch: Any, device: str) -> Any:
    return {k: v.to(device) for k, v in batch.items()} if isinstance(batch, dict) else batch.to(device)


def _check_batches(batches_path: str, batches: Any, vocab: int) -> None:
    """Micro-batches the default loss can run: token-id tensors (or dicts holding ``input_ids``) within the
    vocabulary."""
    if not isinstance(batches, list) or not batches:
        raise ValueError(f"{batches_path}: holds {'[]' if isinstance(batches, list) else type(batches).__name__}; "
                         "a bundle keeps a non-empty list of micro-batches")
    for i, batch in enumerate(batches):
        fields = batch if isinstance(batch, dict) else {"input_ids": batch}
        if "input_ids" not in fields:
            raise ValueError(f"{batches_path}: micro-batch {i} has no 'input_ids'")
        for key, value in fields.items():
            where = f"{batches_path}: micro-batch {i}, tensor {str(key)[:40]!r}"
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{where} is a {type(value).__name__}, not a tensor")
            if key in ("input_ids", "labels") and (value.dtype.is_floating_point or value.dtype == torch.bool
                                                   or value.dim() != 2 or value.shape[-1] == 0):
                raise ValueError(f"{where}: {value.dtype} of shape {list(value.shape)}; token ids are an integer "
                                 "tensor (batch, length)")
        ids = fields["input_ids"]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"{batches_path}: micro-batch {i}, tensor 'input_ids': ids in [{int(ids.min())}, "
                             f"{int(ids.max())}], the model's vocabulary is [0, {vocab - 1}]")


def replay_bundle(path: str, variants: Sequence[str] = DEFAULT_VARIANTS, device: str = "cpu") -> dict[str, Any]:
    """Load a bundle written by :func:`write_replay_bundle`, replay it, and return the table's data:
    ``{"step", "metric", "threshold", "run_variant", "variants", "verdict"}``.

    A damaged, truncated or edited bundle, or one whose model folder is not the model it recorded, raises one
    ValueError naming the file and the field or tensor; nothing is replayed."""
    meta_path = os.path.join(path, BUNDLE_META)
    if not os.path.isfile(meta_path):
        raise ValueError(f"{path!r} is no replay bundle (no {BUNDLE_META}); write one with write_replay_bundle or "
                         "diagnose_spikes=True")
    meta = _bundle_meta(meta_path)
    batches_path = os.path.join(path, BUNDLE_BATCHES)
    try:
        batches = torch.load(batches_path, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as err:  # truncated zip, edited pickle
        raise ValueError(f"{batches_path}: not readable ({_first_line(err)})") from None
    model = _load_model(path, getattr(torch, meta["dtype"]), device)
    _check_identity(path, meta["model"], model)
    model.train()  # the step was a training step (dropout draws from the same seed in every variant)
    _check_batches(batches_path, batches, int(model.get_input_embeddings().num_embeddings))
    batches = [_tensors_to(b, device) for b in batches]
    run_variant = meta["run_variant"]
    names = tuple(variants) + (() if run_variant in variants else (run_variant,))
    try:
        replay = replay_step(model, batches, run_variant=run_variant, variants=names)
    except (RuntimeError, ValueError, TypeError, IndexError) as err:  # batches the checks let through, the model not
        raise ValueError(f"{batches_path}: the micro-batches do not run through the model "
                         f"({_first_line(err)})") from None
    return {"step": meta["step"], "metric": meta["metric"], "threshold": float(meta["threshold"]), **replay.as_dict(),
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
