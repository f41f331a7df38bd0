"""options.py: one Options object, one validator, one mode vocabulary, defaults written once, and the ops'
scalar arguments derived from the dataclass. Every entry point (attention(), attention_varlen(),
configure(), config.stable_attn, patch_sdpa()) must go through it."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

import stable_attn
from stable_attn import rules
from stable_attn.integrations import transformers as hf
from stable_attn.options import (
    BLOCK_N,
    DEFAULTS,
    FIX_NAMES,
    MODE_NAMES,
    MODEL_OPTIONS,
    STABILIZE_VALUES,
    Options,
    mode_of,
    model_options,
    op_schema,
    stabilize_of,
)

BAD_VALUES = [
    ("stabilize", "yes", ValueError, "stabilize='yes' is not supported; use True"),
    ("stabilize", 1, ValueError, "stabilize=1 is not supported"),
    ("stabilize", "exact", ValueError, "stabilize='exact' is not supported"),
    ("beta", 1.0, ValueError, "beta=1.0 must be a finite number > 1"),
    ("beta", math.inf, ValueError, "beta=inf"),
    ("beta", True, ValueError, "beta=True"),
    ("backend", "cuda", ValueError, "backend='cuda' is not supported; use one of ('auto', 'torch', 'triton')"),
    ("block_n", 24, ValueError, "block_n=24 must be a power of two >= 16 or None"),
    ("block_n", 8, ValueError, "block_n=8"),
    ("scale", 0.0, ValueError, "scale=0.0 must be a finite positive number or None"),
    ("scale", True, ValueError, "scale=True"),
    ("window", 0, ValueError, "window=0 must be a positive int"),
    ("window", 2.0, ValueError, "window=2.0"),
    ("softcap", -1.0, ValueError, "softcap=-1.0 must be a finite positive number or None"),
    ("dropout_p", 1.0, ValueError, "dropout_p=1.0 must be a number in [0, 1)"),
    ("dropout_p", math.nan, ValueError, "dropout_p=nan"),
    ("causal", "yes", TypeError, "causal='yes' must be True or False"),
]


@pytest.mark.parametrize("name,value,exc,needle", BAD_VALUES, ids=[f"{b[0]}={b[1]!r}" for b in BAD_VALUES])
def test_create_names_argument_value_and_what_is_accepted(name, value, exc, needle):
    with pytest.raises(exc) as info:
        Options.create(head_dim=16, **{name: value})
    assert needle in str(info.value), str(info.value)


def test_unknown_options_are_refused():
    with pytest.raises(ValueError, match=r"unknown keys \['betta'\]"):
        Options.create(head_dim=16, betta=2.0)


def test_create_resolves_the_public_arguments():
    opts = Options.create(head_dim=64, causal=True, window=8, softcap=30, stabilize="paper", beta=4, block_n=32)
    assert opts == Options(causal=True, scale=0.125, window=8, softcap=30.0, mode=rules.MODE_PAPER, beta=4.0,
                           block_n=32)
    assert isinstance(opts.softcap, float) and isinstance(opts.beta, float)
    assert opts.key_block == 32 and Options().key_block == BLOCK_N
    assert opts.key_block_given and not Options().key_block_given
    assert not Options.create(head_dim=64, block_n=None).key_block_given
    with pytest.raises(ValueError, match="scale=None needs the head dim"):
        Options.create()


def test_dataclass_defaults_are_the_public_defaults():
    """Options() is what Options.create gives for the defaults (scale aside, which needs the head dim)."""
    assert Options.create(head_dim=16, scale=1.0) == Options()
    assert Options().model_options() == {name: DEFAULTS[name] for name in MODEL_OPTIONS}


def test_one_mode_vocabulary():
    assert [stabilize_of(mode_of(s)) for s in STABILIZE_VALUES] == list(STABILIZE_VALUES)
    assert {mode_of(s) for s in STABILIZE_VALUES} == set(MODE_NAMES) == {rules.MODE_OFF, rules.MODE_EXACT,
                                                                         rules.MODE_PAPER}
    assert MODE_NAMES[rules.MODE_EXACT] == "exact" and MODE_NAMES[rules.MODE_OFF] == "off"
    with pytest.raises(ValueError, match="mode=7"):
        stabilize_of(7)
    from stable_attn.kernels.triton_aot import Variant

    assert [Variant("fwd", torch.bfloat16, 64, mode=m).mode_name for m in MODE_NAMES] == list(MODE_NAMES.values())
    # the numerics lab's names map to the same three values, through the one table
    from stable_attn.numerics import arithmetic, probe

    assert sorted(map(str, FIX_NAMES.values())) == sorted(map(str, STABILIZE_VALUES))
    assert arithmetic.FIXES == tuple(FIX_NAMES) and probe.FIXES is FIX_NAMES


def test_derived_kernel_scalars():
    plain = Options(scale=0.3)
    assert plain.qk_scale2 == 0.3 * rules.LOG2E
    assert plain.cap_scale == 1.0 and plain.cap_log2e == 1.0 and plain.keep_scale == 1.0
    capped = Options(scale=0.3, softcap=20.0, dropout_p=0.2)
    assert capped.cap_scale == 0.3 / 20.0 and capped.cap_log2e == 20.0 * rules.LOG2E
    assert capped.keep_scale == 1.0 / 0.8


ENTRY_POINTS = [(stable_attn.attention, DEFAULTS), (stable_attn.attention_varlen, DEFAULTS),
                (stable_attn.patch_sdpa, MODEL_OPTIONS), (hf.configure, MODEL_OPTIONS),
                # FlashAttention's own arguments keep FlashAttention's defaults (softcap=0.0 is "off" there)
                (stable_attn.flash_attn_func, ("stabilize", "beta", "backend")),
                (stable_attn.flash_attn_varlen_func, ("stabilize", "beta", "backend"))]


@pytest.mark.parametrize("fn,names", ENTRY_POINTS, ids=[f.__name__ for f, _ in ENTRY_POINTS])
def test_every_entry_points_defaults_agree_with_DEFAULTS(fn, names):
    params = inspect.signature(fn).parameters
    shared = [name for name in names if name in params]
    assert shared == list(names)
    for name in shared:
        assert params[name].default == DEFAULTS[name], name
    assert hf.OPTION_DEFAULTS == {name: DEFAULTS[name] for name in MODEL_OPTIONS}


def test_model_options_check_and_complete():
    assert model_options({"beta": 4.0}, where="x") == {"stabilize": True, "beta": 4.0, "backend": "auto",
                                                        "block_n": None, "pv_fp32": False}
    assert model_options(None) == model_options({})
    with pytest.raises(ValueError, match=r"^x: beta=0.5 must be a finite number > 1"):
        model_options({"beta": 0.5}, where="x")
    with pytest.raises(ValueError, match=r"^x has unknown keys \['causal'\]"):
        model_options({"causal": True}, where="x")  # per-call options are not per-model options
    with pytest.raises(TypeError, match="x must be a dict"):
        model_options([("beta", 4.0)], where="x")


class _Config:
    model_type = "toy"

    def __init__(self, stable_attn):
        self.stable_attn = stable_attn


class _Attention(torch.nn.Module):
    def __init__(self, stable_attn=None):
        super().__init__()
        self.config = _Config(stable_attn)


@pytest.mark.parametrize("bad,needle", [({"beta": 0.5}, "beta=0.5 must be a finite number > 1"),
                                        ({"stabilize": "ours"}, "stabilize='ours' is not supported"),
                                        ({"block_n": 24}, "block_n=24 must be a power of two")])
def test_configure_config_and_patch_sdpa_share_the_validator(bad, needle):
    with pytest.raises(ValueError, match="config.stable_attn") as from_config:
        hf.model_options_of(_Attention(bad))
    previous = F.scaled_dot_product_attention
    with pytest.raises(ValueError, match="patch_sdpa") as from_patch:
        stable_attn.patch_sdpa(**bad)
    assert F.scaled_dot_product_attention is previous  # nothing was patched
    with pytest.raises(ValueError, match="configure") as from_configure:
        hf.configure(torch.nn.Linear(1, 1), **bad)  # checked before the model is searched
    for info in (from_config, from_patch, from_configure):
        assert needle in str(info.value), str(info.value)


def test_options_from_config_are_completed_with_the_defaults():
    assert hf.model_options_of(_Attention({"beta": 3.0})) == {**hf.OPTION_DEFAULTS, "beta": 3.0}
    assert hf.model_options_of(_Attention(None)) == hf.OPTION_DEFAULTS
    with stable_attn.patch_sdpa(beta=3.0) as handle:
        assert handle.options == {**hf.OPTION_DEFAULTS, "beta": 3.0}


def test_ops_take_the_option_fields_by_name():
    """The ops' scalar arguments are the Options fields (seed aside: it is a tensor), named in the schema."""
    names = [f.name for f in dataclasses.fields(Options) if f.name != "seed"]
    assert [part.split()[-1] for part in op_schema().split(", ")] == names
    for op in (torch.ops.stable_attn.attention_fwd, torch.ops.stable_attn.attention_bwd,
               torch.ops.stable_attn.attention_varlen_fwd, torch.ops.stable_attn.attention_varlen_bwd):
        args = [a.name for a in op.default._schema.arguments]
        assert args[-len(names):] == names and "seed" in args, op
    opts = Options(causal=True, scale=0.5, window=3, softcap=2.5, dropout_p=0.1, seed=99, mode=rules.MODE_PAPER,
                   beta=3.0, block_n=32, backend="torch")
    assert Options.from_op_args(opts.op_args(), seed=99) == opts
    assert Options.from_op_args(Options().op_args()) == Options()


def test_the_op_runs_with_the_options_it_is_given():
    """The plumbing delivers each option: flipping one changes the result as the oracle says."""
    from stable_attn.kernels import naive

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g) for _ in range(3))
    for kw in ({"causal": True}, {"window": 3}, {"softcap": 2.0}, {"scale": 0.7}, {"causal": True, "window": 2}):
        got = stable_attn.attention(q, k, v, backend="torch", **kw)
        torch.testing.assert_close(got.double(), naive.attention(q, k, v, **kw), atol=2e-6, rtol=1e-5)
