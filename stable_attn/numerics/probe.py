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

CLI: ``stable-attn probe --config gpt2-tiny --text FILE`` (see :func:`add_probe_arguments`).
"""

from __future__ import annotations

import argparse
import json
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
from .bias import BF16_UNIT_ROUNDOFF, ErrorStats, error_stats, row_unit

PROBE_NAME = "stable_attn_probe"  # private AttentionInterface name used only while probing
FIXES = FIX_NAMES
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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

    def as_dict(self) -> dict[str, Any]:
        return {"o": self.o.as_dict(), "delta": self.delta.as_dict(), "fixed_rate": self.fixed_rate}


@dataclass
class LayerReport:
    name: str
    shape: tuple[int, ...]  # q: [B, Hq, Nq, D]
    saturation: float
    max_logit: float
    sink_mass: float
    fixes: dict[str, FixResult] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "saturation": self.saturation,
                "max_logit": self.max_logit, "sink_mass": self.sink_mass,
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

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "backend": self.backend, "tokens": self.tokens,
                "loss": self.loss, "unit_o": "2^-8 * rms(O_row)", "unit_delta": "2^-8 * sum|dO * O| per row",
                "bias_t": 3.0, "layers": [layer.as_dict() for layer in self.layers]}

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=1)

    def table(self) -> str:
        head = (f"{'layer':<8} {'sat':>6} {'maxlogit':>8} {'sink':>6} {'fix':<6} {'O mean':>8} {'O t':>7} "
                f"{'O rms':>6} {'d mean':>8} {'d t':>7} {'d rms':>6} {'fired':>6}")
        lines = [f"probe: {self.model}, {self.dtype} compute, backend {self.backend}, {self.tokens} tokens, "
                 f"loss {self.loss:.4f}",
                 "errors vs float64 oracle in units of one bf16 rounding; t = mean / s.e. over rows; "
                 "* = |t| >= 3", head, "-" * len(head)]
        for layer in self.layers:
            for i, (fix, r) in enumerate(layer.fixes.items()):
                lead = (f"{layer.name:<8} {layer.saturation:6.3f} {layer.max_logit:8.2f} {layer.sink_mass:6.3f}"
                        if i == 0 else " " * 31)
                o_flag = "*" if r.o.biased else " "
                d_flag = "*" if r.delta.biased else " "
                lines.append(f"{lead} {fix:<6} {r.o.mean:8.4f} {r.o.t:6.2f}{o_flag} {r.o.rms:6.3f} "
                             f"{r.delta.mean:8.4f} {r.delta.t:6.2f}{d_flag} {r.delta.rms:6.3f} {r.fixed_rate:6.3f}")
        return "\n".join(lines)


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


def _replay(call: _Call, name: str, dtype: torch.dtype, fixes: Sequence[str], backend: str) -> LayerReport:
    q, k, v = (t.to(dtype) for t in (call.q, call.k, call.v))
    kw = call.kwargs
    exact = naive.attention(q, k, v, **kw)
    do = call.do.to(dtype) if call.do is not None else torch.zeros_like(q)
    B, H, N, D = q.shape
    rows_o = exact.reshape(-1, D)
    do_rows = do.double().reshape(-1, D)
    delta_exact = (do_rows * rows_o).sum(dim=-1, keepdim=True)
    unit_o = row_unit(rows_o)
    unit_d = BF16_UNIT_ROUNDOFF * (do_rows * rows_o).abs().sum(dim=-1)
    keep_o, keep_d = unit_o > 0, unit_d > 0  # rows that see no key, or get no gradient, carry no error scale
    report = None
    for fix in fixes:
        stats = AttentionStats()
        out = attention(q, k, v, **kw, stabilize=FIXES[fix], stats=stats, backend=backend)
        o_rows = out.reshape(-1, D)
        # delta as the kernel's backward computes it: fp32 sum of dO * O, both in the compute dtype
        delta = (do.float().reshape(-1, D) * o_rows.float()).sum(dim=-1, keepdim=True)
        summary = stats.summary()
        if report is None:
            report = LayerReport(name, tuple(q.shape), summary["saturation"], summary["max_logit"],
                                 summary["sink_mass"])
        report.fixes[fix] = FixResult(
            o=error_stats(o_rows[keep_o], rows_o[keep_o], unit_o[keep_o]),
            delta=error_stats(delta[keep_d], delta_exact[keep_d], unit_d[keep_d]),
            fixed_rate=summary["fixed_rate"],
        )
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
        seed: seeds the random output projection used as loss for models without logits.
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
        layers.append(_replay(call, name, dtype, fixes, backend))
    tokens = int(attention_mask.sum()) if attention_mask is not None else input_ids.numel()
    dtype_name = next(k for k, v in _DTYPES.items() if v == dtype)
    return ProbeReport(type(model).__name__, dtype_name, backend, tokens, float(loss.detach()), layers)


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
        raise ValueError("--text: the file is empty")
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
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the report as JSON to PATH (default: print the table only)")


def run_probe(args: argparse.Namespace) -> int:
    """Run ``stable-attn probe``: print the per-layer table, and write the JSON with ``--json PATH``; returns the
    exit status."""
    if args.batch < 1 or args.seq_len < 2:
        raise ValueError(f"--batch must be >= 1 and --seq-len >= 2, got {args.batch} and {args.seq_len}")
    fixes = [f for f in args.fixes.split(",") if f]
    text = None
    if args.text is not None:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    model, tokenizer = _load(args.config, args.seed)
    vocab = model.get_input_embeddings().num_embeddings
    ids = _batch(text, tokenizer, vocab, args.batch, args.seq_len, args.seed).to(args.device)
    model.to(args.device)
    report = probe(model, ids, fixes=fixes, dtype=_DTYPES[args.dtype], backend=args.backend, seed=args.seed)
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

