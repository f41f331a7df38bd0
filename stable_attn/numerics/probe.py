"""Probe a transformers model: per attention layer, is the rounding error of ``O`` and ``delta`` biased?

The paper's chain is: biased rounding error in ``O = P-bar V`` -> ``delta = rowsum(dO * O)`` -> the
gradient of the scores -> coherent weight updates. :func:`probe` measures the first two links on
the user's own model and data:

1. one forward and backward pass (eval mode, LM loss or a fixed random projection of the output),
   with every attention call routed through stable_attn; each layer's ``q, k, v`` (post-RoPE, as
   the attention function receives them), its mask arguments and the gradient of its output ``dO``
   are captured;
2. each layer is replayed on those captured tensors with the fix off, ours and the paper's, in the
   compute dtype (bf16: the kernel's arithmetic), and against the float64 oracle
   (:mod:`stable_attn.kernels.naive`) on the same inputs.

Reported per layer: saturation (rows where two or more keys' ``P-bar`` would round to 1.0), max
logit, sink mass, and for ``O`` and ``delta`` the mean signed error (bias), its t-statistic over rows
and the RMS error, in units of one bf16 rounding (``2^-8`` times the row's RMS of ``O``, or times
``sum |dO * O|`` for ``delta``). Rows are treated as independent samples; rows of one layer share
weights, so read ``|t|`` as a screening statistic, not a calibrated test.

With ``arithmetic="h100"`` (``"a100"``, ``"ieee"``; CLI ``--arithmetic``) step 2 replays ``O`` of up to
``max_rows`` sampled rows a layer on the numerics lab's tensor-core models instead
(:func:`stable_attn.numerics.arithmetic.tensor_core_attention`: ``q.k^T``, ``P-bar V`` and our rule's row
sum as the Triton forward issues them on that GPU), and :func:`verdict` reads the layers into one line.

CLI: ``stable-attn probe --config gpt2-tiny --text FILE`` (see :func:`add_probe_arguments`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..attention import attention
from ..kernels import naive
from ..options import DEFAULTS, FIX_NAMES, model_options
from ..stats import AttentionStats
from . import arithmetic as lab
from . import tensor_core
from .bias import BF16_UNIT_ROUNDOFF, BIAS_T, ErrorStats, error_stats, row_unit

PROBE_NAME = "stable_attn_probe"  # private AttentionInterface name used only while probing
FIXES = FIX_NAMES
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ARITHMETICS = tensor_core.MODELS  # --arithmetic: the tensor-core models of the lab
MAX_ROWS = 1024  # default rows a layer under an emulated arithmetic (~2 Nk D multiply-adds each, per fix)


@dataclass
class _Call:
    """One attention call captured during the probe's forward and backward pass."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kwargs: dict[str, Any]
    do: torch.Tensor | None = None


@dataclass
class FixResult:
    """Errors of one layer replayed with one setting of the fix."""

    o: ErrorStats
    delta: ErrorStats
    fixed_rate: float  # key blocks per row where the rule shifted the offset
    key_block: int | None = None  # the key partition of the emulated kernel (None: the backend's own)

    def as_dict(self) -> dict[str, Any]:
        d = {"o": self.o.as_dict(), "delta": self.delta.as_dict(), "fixed_rate": self.fixed_rate}
        if self.key_block is not None:
            d["key_block"] = self.key_block
        return d


@dataclass
class LayerReport:
    name: str
    shape: tuple[int, ...]  # q: [B, Hq, Nq, D]
    saturation: float
    max_logit: float
    sink_mass: float
    fixes: dict[str, FixResult] = field(default_factory=dict)
    rows: int = 0  # query rows measured (with an emulated arithmetic: the sample)
    rows_total: int = 0  # query rows of the call that see a key
    seconds: float = 0.0  # time of the replay

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "saturation": self.saturation,
                "max_logit": self.max_logit, "sink_mass": self.sink_mass, "rows": self.rows,
                "rows_total": self.rows_total, "seconds": self.seconds,
                "fixes": {k: v.as_dict() for k, v in self.fixes.items()}}


@dataclass
class ProbeReport:
    """What :func:`probe` measured; :meth:`table` prints it, :meth:`as_dict` is the JSON."""

    model: str
    dtype: str
    backend: str
    tokens: int
    loss: float
    layers: list[LayerReport]
    arithmetic: str | None = None  # tensor-core model of the replay (None: the backend's own arithmetic)
    max_rows: int | None = None  # rows sampled per layer under an emulated arithmetic

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "backend": self.backend, "tokens": self.tokens,
                "loss": self.loss, "arithmetic": self.arithmetic, "max_rows": self.max_rows,
                "unit_o": "2^-8 * rms(O_row)", "unit_delta": "2^-8 * sum|dO * O| per row",
                "bias_t": BIAS_T, "verdict": self.verdict(), "layers": [layer.as_dict() for layer in self.layers]}

    def verdict(self) -> str:
        """One line: is any layer biased with the fix off, with it on, and what to do about it."""
        return verdict(self.layers, self.arithmetic)

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=1)

    def table(self) -> str:
        head = (f"{'layer':<8} {'sat':>6} {'maxlogit':>8} {'sink':>6} {'fix':<6} {'O mean':>8} {'O t':>7} "
                f"{'O rms':>6} {'d mean':>8} {'d t':>7} {'d rms':>6} {'fired':>6}")
        where = (f"backend {self.backend}" if self.arithmetic is None else
                 f"P-bar V and q.k^T on emulated {self.arithmetic} tensor cores (stable_attn.numerics.tensor_core)")
        lines = [f"probe: {self.model}, {self.dtype} compute, {where}, {self.tokens} tokens, loss {self.loss:.4f}",
                 "errors vs float64 oracle in units of one bf16 rounding; t = mean / s.e. over rows; "
                 "* = |t| >= 3"]
        if self.arithmetic is not None:
            sampled = [f"{x.name} {x.rows}/{x.rows_total}" for x in self.layers]
            blocks = ", ".join(f"{f} {r.key_block}" for f, r in self.layers[0].fixes.items()) if self.layers else ""
            lines.append(f"emulated rows per layer (sampled uniformly over batch, heads and positions, at most "
                         f"{self.max_rows}): {', '.join(sampled)}; key blocks: {blocks}; replay "
                         f"{sum(x.seconds for x in self.layers):.1f} s")
        lines += [head, "-" * len(head)]
        for layer in self.layers:
            for i, (fix, r) in enumerate(layer.fixes.items()):
                lead = (f"{layer.name:<8} {layer.saturation:6.3f} {layer.max_logit:8.2f} {layer.sink_mass:6.3f}"
                        if i == 0 else " " * 31)
                o_flag = "*" if r.o.biased else " "
                d_flag = "*" if r.delta.biased else " "
                lines.append(f"{lead} {fix:<6} {r.o.mean:8.4f} {r.o.t:6.2f}{o_flag} {r.o.rms:6.3f} "
                             f"{r.delta.mean:8.4f} {r.delta.t:6.2f}{d_flag} {r.delta.rms:6.3f} {r.fixed_rate:6.3f}")
        lines.append(self.verdict())
        return "\n".join(lines)


def _biased_layers(layers: Sequence[LayerReport], fix: str) -> list[str]:
    return [x.name for x in layers if fix in x.fixes and (x.fixes[fix].o.biased or x.fixes[fix].delta.biased)]


def verdict(layers: Sequence[LayerReport], arithmetic: str | None = None) -> str:
    """The probe's one-line verdict from its layers: fix off (``"off"``) against ours (``"ours"``).

    Biased means ``|t| >= 3`` for ``O`` or ``delta`` of a layer (a screening threshold: rows of a
    layer share weights). The paper's rule (``"paper"``) is reported in the table, not judged here.
    """
    under = "under the backend's arithmetic" if arithmetic is None else f"under emulated {arithmetic} tensor cores"
    fixes = {f for x in layers for f in x.fixes}
    if not layers or not fixes & {"off", "ours"}:
        return "verdict: none (probe with --fixes off,ours to compare the fix off and on)"
    worst = max(((abs(r.o.t), x.name, "O", f) for x in layers for f, r in x.fixes.items()
                 if math.isfinite(r.o.t)), default=(0.0, "-", "O", "-"))
    worst = max([worst] + [(abs(r.delta.t), x.name, "delta", f) for x in layers for f, r in x.fixes.items()
                           if math.isfinite(r.delta.t)])
    rows = max(x.rows for x in layers)
    off, on = _biased_layers(layers, "off"), _biased_layers(layers, "ours")
    n = len(layers)
    if "off" in fixes and "ours" in fixes:
        if off and not on:
            return (f"verdict: {under}, O or delta is biased with the fix off in {len(off)} of {n} layers "
                    f"({', '.join(off)}) and in none with stabilize=True: keep the fix on for this model.")
        if off and on:
            return (f"verdict: {under}, biased with the fix off ({', '.join(off)}) and still with stabilize=True "
                    f"({', '.join(on)}): the fix does not remove this bias here; do not rely on it for this model, "
                    "and open an issue with this output (--json PATH).")
        if on:
            return (f"verdict: {under}, biased only with stabilize=True ({', '.join(on)}): the fix adds a bias "
                    "here; train with stabilize=False and open an issue with this output (--json PATH).")
        return (f"verdict: {under}, no layer's O or delta is biased with the fix off or on (largest |t| "
                f"{worst[0]:.2f}: {worst[1]} {worst[2]}, fix {worst[3]}; up to {rows} rows a layer): this batch "
                "shows no rounding bias for the fix to remove; probe a trained checkpoint or more rows "
                "(--rows) before concluding that the model never shows one.")
    fix = "off" if "off" in fixes else "ours"
    hit = off if fix == "off" else on
    if hit:
        return f"verdict: {under}, biased with fix {fix} in {', '.join(hit)}; probe with --fixes off,ours to compare."
    return (f"verdict: {under}, no layer is biased with fix {fix} (largest |t| {worst[0]:.2f}); "
            "probe with --fixes off,ours to compare.")


# ---------------------------------------------------------------------------------------------------
# Capture


class _Recorder:
    def __init__(self, modules: list[nn.Module]):
        self.index = {id(m): i for i, m in enumerate(modules)}
        self.calls: list[_Call] = []
        self.current: int | None = None

    def attention_function(self, module, query, key, value, attention_mask, **kwargs):
        """Registered under :data:`PROBE_NAME`: note which layer is calling, then run stable_attn's."""
        from ..integrations import transformers as integration

        self.current = self.index.get(id(module))
        try:
            return integration.stable_attn_attention_forward(module, query, key, value, attention_mask, **kwargs)
        finally:
            self.current = None

    def recording_attention(self, q, k, v, **kwargs):
        """Stands in for :func:`stable_attn.attention` inside the integration while probing."""
        out = attention(q, k, v, **kwargs)
        if self.current is None:
            return out
        if kwargs.get("sinks") is not None or v.shape[-1] != q.shape[-1]:
            # the replay recomputes plain softmax attention with q's head dim: it would analyse another layer
            raise ValueError("the probe does not replay learned sinks or a value head dim apart from the query's "
                             f"(got sinks: {kwargs.get('sinks') is not None}, head dims {q.shape[-1]} / {v.shape[-1]})")
        if torch.is_autocast_enabled(q.device.type):
            # the op computes in autocast's dtype (RoPE models hand it fp32 q, k): record what it computes on
            dt = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dt), k.to(dt), v.to(dt)
        call = _Call(self.current, q.detach().clone(), k.detach().clone(), v.detach().clone(),
                     {n: kwargs.get(n) for n in ("causal", "scale", "key_padding_mask", "attn_mask", "window",
                                                 "softcap")})
        self.calls.append(call)
        if out.requires_grad:
            def keep_grad(grad, call=call):
                call.do = grad.detach().clone()
            out.register_hook(keep_grad)
        return out


@contextmanager
def _routed_through(model: nn.Module, recorder: _Recorder):
    """Switch ``model`` to the probe's attention function and restore everything afterwards."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from ..integrations import transformers as integration

    AttentionInterface.register(PROBE_NAME, recorder.attention_function)
    AttentionMaskInterface.register(PROBE_NAME, integration.stable_attn_mask)
    previous = model.config._attn_implementation
    was_training = model.training
    original = integration.attention_function.attention
    integration.attention_function.attention = recorder.recording_attention
    try:
        model.set_attn_implementation(PROBE_NAME)
        model.eval()  # no dropout: the replay must see the same probabilities
        yield
    finally:
        integration.attention_function.attention = original
        model.set_attn_implementation(previous)
        model.train(was_training)


def _loss(model: nn.Module, output: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
          seed: int) -> torch.Tensor:
    """Next-token loss when the model has logits, else a fixed random projection of its output."""
    logits = getattr(output, "logits", None)
    if logits is not None and logits.dim() == 3 and input_ids.shape[1] > 1:
        target = input_ids[:, 1:].clone()
        if attention_mask is not None:
            target = target.masked_fill(attention_mask[:, 1:] == 0, -100)
        return nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                           target.reshape(-1), ignore_index=-100)
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None:
        hidden = output[0]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    proj = torch.randn(hidden.shape[1:], generator=gen).to(hidden.device)
    return (hidden.float() * proj).sum() / hidden.numel()


# ---------------------------------------------------------------------------------------------------
# Replay


def _replay(call: _Call, name: str, dtype: torch.dtype, fixes: Sequence[str], backend: str,
            arithmetic: str | None = None, max_rows: int = MAX_ROWS, seed: int = 0) -> LayerReport:
    """Replay one captured call with each fix; with ``arithmetic``, ``O`` of up to ``max_rows`` sampled rows
    comes from :func:`stable_attn.numerics.arithmetic.tensor_core_attention` under that tensor-core model."""
    start = time.perf_counter()
    q, k, v = (t.to(dtype) for t in (call.q, call.k, call.v))
    kw = call.kwargs
    exact = naive.attention(q, k, v, **kw)
    do = call.do.to(dtype) if call.do is not None else torch.zeros_like(q)
    B, H, N, D = q.shape
    rows_o = exact.reshape(-1, D)
    do_rows = do.double().reshape(-1, D)
    unit_o = row_unit(rows_o)
    seen = (unit_o > 0).nonzero()[:, 0]  # rows that see no key carry no error scale
    if arithmetic is None:
        sel = seen
    else:
        gen = torch.Generator().manual_seed(seed)
        sel = seen[torch.randperm(seen.numel(), generator=gen)[:max_rows]].sort().values
    rows_o, do_rows, unit_o = rows_o[sel], do_rows[sel], unit_o[sel]
    delta_exact = (do_rows * rows_o).sum(dim=-1, keepdim=True)
    unit_d = BF16_UNIT_ROUNDOFF * (do_rows * rows_o).abs().sum(dim=-1)
    keep_d = unit_d > 0  # rows that get no gradient carry no error scale for delta
    rows3 = torch.stack([sel // (H * N), sel // N % H, sel % N], dim=1)
    report = LayerReport(name, tuple(q.shape), 0.0, 0.0, 0.0, rows=sel.numel(), rows_total=seen.numel())
    # the scores q.k^T do not depend on the fix: one emulated pass computes them for every fix
    emulated = None if arithmetic is None else lab.tensor_core_attention(q, k, v, rows3, fixes, model=arithmetic, **kw)
    for i, fix in enumerate(fixes):
        stats = AttentionStats()
        out = attention(q, k, v, **kw, stabilize=FIXES[fix], stats=stats, backend=backend)
        summary = stats.summary()
        if i == 0:
            report.saturation, report.max_logit = summary["saturation"], summary["max_logit"]
            report.sink_mass = summary["sink_mass"]
        fixed_rate, key_block = summary["fixed_rate"], None
        if arithmetic is None:
            o_rows = out.reshape(-1, D)[sel]
        else:
            res = emulated[fix]
            o_rows, fixed_rate, key_block = res.out.to(dtype), res.fired_rate, res.key_block
        # delta as the kernel's backward computes it: fp32 sum of dO * O, both in the compute dtype
        delta = (do_rows.to(dtype).float() * o_rows.float()).sum(dim=-1, keepdim=True)
        report.fixes[fix] = FixResult(
            o=error_stats(o_rows, rows_o, unit_o),
            delta=error_stats(delta[keep_d], delta_exact[keep_d], unit_d[keep_d]),
            fixed_rate=fixed_rate,
            key_block=key_block,
        )
    report.seconds = time.perf_counter() - start
    return report


def probe(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    fixes: Sequence[str] = ("off", "ours", "paper"),
    dtype: torch.dtype = torch.bfloat16,
    backend: str = DEFAULTS["backend"],
    seed: int = 0,
    arithmetic: str | None = None,
    max_rows: int = MAX_ROWS,
) -> ProbeReport:
    """Measure, per attention layer of a transformers ``model``, the bias of ``O`` and ``delta``.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention dispatches through
            ``AttentionInterface`` (any model that supports ``attn_implementation="sdpa"``).
        input_ids: ``[B, N]`` token ids; attention_mask: optional ``[B, N]`` (1 = token, 0 = padding).
        fixes: which settings of the fix to replay: any of ``"off"``, ``"ours"``, ``"paper"``.
        dtype: the compute dtype of the replay (bf16 is what the paper studies; fp16 is accepted).
            A float32 model runs its probe pass under autocast to this dtype.
        backend: stable_attn backend for the capture and the replay (``"auto"``: Triton on CUDA).
        seed: seeds the random output projection used as loss for models without logits, and the
            row sample of an emulated arithmetic.
        arithmetic: None (the backend's own arithmetic), or a tensor-core model of
            :mod:`stable_attn.numerics.tensor_core` (``"a100"``, ``"h100"``, ``"ieee"``): each layer's
            ``q.k^T`` and ``P-bar V`` (and our rule's row sum) are replayed as the Triton forward runs
            them on that GPU (:func:`stable_attn.numerics.arithmetic.tensor_core_attention`), on the CPU.
        max_rows: under an emulated arithmetic, query rows per layer (sampled uniformly over batch,
            heads and positions among rows that see a key): the emulation runs at tens of millions of
            multiply-adds a second, about ``2 Nk D`` a row and fix.
    """
    from ..integrations import transformers as integration

    if not isinstance(model, nn.Module) or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64,
                                                                                                     torch.int32):
        raise ValueError(f"input_ids must be an integer tensor [B, N], got {getattr(input_ids, 'shape', input_ids)!r}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    bad = [f for f in fixes if f not in FIXES]
    if bad or not fixes:
        raise ValueError(f"fixes={list(fixes)!r}: use a non-empty subset of {list(FIXES)}")
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype={dtype} is not supported; use torch.bfloat16 or torch.float16")
    if arithmetic is not None and arithmetic not in ARITHMETICS:
        raise ValueError(f"arithmetic={arithmetic!r} is not a tensor-core model; accepted values: "
                         f"{(None, *ARITHMETICS)}")
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows={max_rows!r}: use an int >= 1")

    modules = [m for _, m in integration.attention_modules(model)]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention module that dispatches through "
                         "transformers' AttentionInterface; the probe cannot reach it")
    saved = [getattr(m, "stable_attn_options", None) for m in modules]
    for m in modules:
        m.stable_attn_options = model_options({"backend": backend}, where="probe")
    recorder = _Recorder(modules)
    device = input_ids.device
    param_dtype = next(model.parameters()).dtype
    use_autocast = param_dtype == torch.float32
    try:
        with _routed_through(model, recorder):
            model.zero_grad(set_to_none=True)
            with torch.autocast(device_type=device.type, dtype=dtype, enabled=use_autocast):
                output = model(input_ids=input_ids, attention_mask=attention_mask)
                loss = _loss(model, output, input_ids, attention_mask, seed)
            loss.backward()
            model.zero_grad(set_to_none=True)
    finally:
        for m, s in zip(modules, saved):
            if s is None:
                del m.stable_attn_options
            else:
                m.stable_attn_options = s
    if not recorder.calls:
        raise RuntimeError(f"no attention call of {type(model).__name__} reached the probe")
    per_layer: dict[int, int] = {}
    layers = []
    for call in recorder.calls:
        j = per_layer.get(call.layer, 0)
        per_layer[call.layer] = j + 1
        name = f"layer{call.layer}" + (f".{j}" if j else "")
        layers.append(_replay(call, name, dtype, fixes, backend, arithmetic, max_rows, seed * 1000 + len(layers)))
    tokens = int(attention_mask.sum()) if attention_mask is not None else input_ids.numel()
    dtype_name = next(k for k, v in _DTYPES.items() if v == dtype)
    return ProbeReport(type(model).__name__, dtype_name, backend, tokens, float(loss.detach()), layers,
                       arithmetic, max_rows if arithmetic is not None else None)


# ---------------------------------------------------------------------------------------------------
# CLI: stable-attn probe


def tiny_model(name: str, seed: int = 0) -> nn.Module:
    """A small random-init model for a config name (no download): ``gpt2-tiny`` or ``llama-tiny``."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if name == "gpt2-tiny":
        cfg = GPT2Config(vocab_size=256, n_positions=512, n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.0,
                         resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)
    if name == "llama-tiny":
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return LlamaForCausalLM(cfg)
    raise ValueError(f"config={name!r} is not a tiny config name ({', '.join(TINY_CONFIGS)}) nor an existing path")


TINY_CONFIGS = ("gpt2-tiny", "llama-tiny")


def _load(config: str, seed: int):
    """``(model, tokenizer or None)`` for a tiny config name or a local model directory."""
    import os

    if config in TINY_CONFIGS:
        return tiny_model(config, seed), None
    if not os.path.isdir(config):
        raise ValueError(f"--config {config!r} is neither one of {TINY_CONFIGS} nor a local model directory")
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(config, local_files_only=True)
    except ValueError:
        model = AutoModel.from_pretrained(config, local_files_only=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(config, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None
    # A folder without tokenizer files still gets a tokenizer of its model type from transformers 5, with an
    # empty vocabulary (every text is zero tokens): the text's bytes are the ids then, as without one.
    if tokenizer is not None and len(tokenizer) < 2:
        tokenizer = None
    return model, tokenizer


def _batch(text: str | None, tokenizer, vocab: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """``[batch, seq_len]`` ids: consecutive windows of the text, or seeded random tokens without one.

    Without a tokenizer the text's UTF-8 bytes are the ids (modulo the vocabulary). A text shorter
    than ``batch * seq_len`` tokens is repeated.
    """
    need = batch * seq_len
    if text is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (batch, seq_len), generator=gen)
    ids = tokenizer(text)["input_ids"] if tokenizer is not None else list(text.encode("utf-8"))
    if not ids:
        raise ValueError("--text: the file is empty" if not text else "--text: the model's tokenizer gives no token "
                         "for this text; pass a text in its language, or a model folder whose tokenizer has a "
                         "vocabulary")
    ids = [i % vocab for i in ids]
    ids = (ids * (need // len(ids) + 1))[:need]
    return torch.tensor(ids, dtype=torch.int64).view(batch, seq_len)


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``stable-attn probe``."""
    parser.add_argument("--config", default="gpt2-tiny",
                        help=f"a tiny random-init config ({', '.join(TINY_CONFIGS)}) or a local model directory")
    parser.add_argument("--text", metavar="FILE", default=None,
                        help="text to run (default: seeded random tokens)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per batch (default 2)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="compute dtype (default bf16)")
    parser.add_argument("--fixes", default="off,ours,paper", help="comma-separated subset of off,ours,paper")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"),
                        help="stable_attn backend (default auto: Triton on CUDA, PyTorch on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arithmetic", choices=ARITHMETICS, default=None,
                        help="replay q.k^T and P-bar V on emulated tensor cores of this GPU (bit-level models of "
                        "stable_attn.numerics.tensor_core, run on the CPU; ieee: fp32 round-to-nearest-even in "
                        "order) instead of the backend's arithmetic")
    parser.add_argument("--rows", type=int, default=MAX_ROWS,
                        help=f"with --arithmetic: query rows per layer, sampled uniformly over batch, heads and "
                        f"positions (default {MAX_ROWS}; each costs about 2 x keys x head dim multiply-adds per fix)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the report as JSON to PATH (default: print the table only)")


def run_probe(args: argparse.Namespace) -> int:
    """Run ``stable-attn probe``: print the per-layer table, and write the JSON with ``--json PATH``; returns the
    exit status."""
    if args.batch < 1 or args.seq_len < 2:
        raise ValueError(f"--batch must be >= 1 and --seq-len >= 2, got {args.batch} and {args.seq_len}")
    if args.rows < 1:
        raise ValueError(f"--rows must be >= 1, got {args.rows}")
    fixes = [f for f in args.fixes.split(",") if f]
    text = None
    if args.text is not None:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    model, tokenizer = _load(args.config, args.seed)
    vocab = model.get_input_embeddings().num_embeddings
    ids = _batch(text, tokenizer, vocab, args.batch, args.seq_len, args.seed).to(args.device)
    model.to(args.device)
    report = probe(model, ids, fixes=fixes, dtype=_DTYPES[args.dtype], backend=args.backend, seed=args.seed,
                   arithmetic=args.arithmetic, max_rows=args.rows)
    print(report.table())
    if args.json is not None:
        report.write_json(args.json)
        print(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stable_attn.numerics.probe ...`` (the same as ``stable-attn probe ...``)."""
    parser = argparse.ArgumentParser(prog="stable-attn probe", description=__doc__.split("\n\n")[0])
    add_probe_arguments(parser)
    return run_probe(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

