"""The serving check of the transformers integration (what ``explain()`` reports) against the path that serves.

Both come from one rule (``_ops.backend_rule``). To see what a CUDA device would run without one, the ops'
device check is handed tensors that answer ``is_cuda`` as CUDA tensors would; the call itself then runs on
the PyTorch path of the CPU whatever was picked, and the pick is recorded.
"""

from __future__ import annotations

import importlib

import pytest
import tiny_models
import torch
import torch.nn.functional as F

import stable_attn
import stable_attn.integrations.transformers as st
from stable_attn import _ops, call_cache
from stable_attn.integrations.transformers import dispatch

VOCAB = 128
attention_module = importlib.import_module("stable_attn.attention")


class _OnCuda(torch.Tensor):
    """A CPU tensor that answers the device check as a CUDA tensor does."""

    @property
    def is_cuda(self) -> bool:
        return True


@pytest.fixture
def served(monkeypatch) -> list[str]:
    """The implementation ``attention()`` picks for each call as if its tensors were on a CUDA device."""
    picks: list[str] = []

    def resolve(backend, q, has_attn_mask, k=None, pv_fp32=False, v=None, key_block=_ops.BLOCK_N):
        cuda = [None if t is None else t.as_subclass(_OnCuda) for t in (k, v)]
        picks.append(_ops.resolve_backend(backend, q.as_subclass(_OnCuda), has_attn_mask, cuda[0], pv_fp32, cuda[1],
                                          key_block))
        return "torch"  # the CPU runs it either way

    monkeypatch.setattr(attention_module, "resolve_backend", resolve)
    monkeypatch.setattr(call_cache, "ENABLED", False)  # every call asks (a repeated call reuses the first's answer)
    return picks


def test_explain_names_the_path_that_serves_pv_fp32_on_cuda(served, capsys):
    model = tiny_models.build("llama", "stable_attn", VOCAB)
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    st.configure(model, pv_fp32=True)
    rows = stable_attn.explain(model, {"input_ids": ids})
    assert served == ["torch", "torch"]
    assert [r["path"] for r in rows] == [dispatch.PYTORCH] * 2
    assert all("pv_fp32=True" in r["reason"] for r in rows)
    assert "pv_fp32=True" in capsys.readouterr().out
    served.clear()
    st.configure(model, pv_fp32=False)
    rows = stable_attn.explain(model, {"input_ids": ids})
    assert served == ["triton", "triton"]
    assert [r["path"] for r in rows] == [dispatch.TRITON_DENSE] * 2 and all(r["reason"] is None for r in rows)


def test_explain_and_the_ops_agree_on_backend_torch_and_a_4d_mask(served):
    model = tiny_models.build("llama", "stable_attn", VOCAB)
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    st.configure(model, backend="torch")
    rows = stable_attn.explain(model, {"input_ids": ids})
    assert served == ["torch", "torch"] and [r["path"] for r in rows] == [dispatch.PYTORCH] * 2
    assert all("backend='torch'" in r["reason"] for r in rows)
    served.clear()
    st.configure(model)
    four_d = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    rows = stable_attn.explain(model, {"input_ids": ids, "attention_mask": four_d, "use_cache": False})
    assert served == ["torch", "torch"] and [r["path"] for r in rows] == [dispatch.PYTORCH] * 2
    assert all("4D" in r["reason"] for r in rows)


def test_batch_size_zero_is_served_as_sdpa_serves_it(served):
    """F.scaled_dot_product_attention returns the empty output for a batch of 0; so does the attention function
    (on the PyTorch path: nothing to launch), and the serving check says so instead of indexing the batch."""
    module = st.attention_modules(tiny_models.build("llama", "stable_attn", VOCAB))[0][1]
    q, k, v = torch.randn(0, 4, 12, 8), torch.randn(0, 2, 12, 8), torch.randn(0, 2, 12, 8)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    with dispatch.recording() as calls:
        out, weights = st.stable_attn_attention_forward(module, q, k, v, None, scaling=8 ** -0.5)
    assert out.shape == want.transpose(1, 2).shape == (0, 12, 4, 8) and weights is None
    assert served == ["torch"]
    assert calls[0]["path"] == dispatch.PYTORCH and "batch size 0" in calls[0]["reason"]


def test_explain_takes_a_tensor_of_input_ids_and_says_in_one_line_what_it_wants(capsys):
    model = tiny_models.build("llama", "stable_attn", VOCAB)
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    rows = stable_attn.explain(model, ids)
    assert [r["attention"] for r in rows] == ["stable_attn"] * 2 and all(r["path"] for r in rows)
    assert "its attention layers: all 2 run 'stable_attn'" in capsys.readouterr().out
    for bad, got in ((ids.float(), "a torch.float32 tensor"), ([ids], "list")):
        with pytest.raises(TypeError) as info:
            stable_attn.explain(model, bad)
        message = str(info.value)
        assert "\n" not in message and len(message) < 250, message
        assert "a dict of the model's inputs" in message and "integer tensor of input ids" in message
        assert message.endswith(f"got {got}")


def test_explain_says_which_attention_each_layer_runs_after_a_shared_config_switched_it(capsys):
    """transformers' from_config keeps the config it is given: an sdpa twin built from it switches the model."""
    model = tiny_models.build("llama", "stable_attn", VOCAB)
    twin = type(model)._from_config(model.config, attn_implementation="sdpa")
    assert twin.config is model.config
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    rows = stable_attn.explain(model, {"input_ids": ids})
    assert [(r["attention"], r["path"]) for r in rows] == [("sdpa", None)] * 2
    out = capsys.readouterr().out
    assert "its attention layers: all 2 run 'sdpa'" in out and "model.layers.0.self_attn: 'sdpa' -- runs 'sdpa'" in out
    assert "copy.deepcopy(config)" in out


def test_a_transformers_model_runs_under_the_strict_layout_check():
    """transformers hands the attention function [B, H, N, D]: the integration says so, so the strict mode (which
    refuses a direct call whose shapes fit both layouts without layout=) never refuses a model."""
    model = tiny_models.build("llama", "stable_attn", VOCAB)
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    previous = stable_attn.set_layout_check("error")
    try:
        assert model(input_ids=ids).logits.shape == (2, 12, VOCAB)
    finally:
        stable_attn.set_layout_check(previous)
