"""monitor/actions/qk_clip.py: QK-Clip on tiny transformers models, the kernel's per-head max logit as S_h.

Each case runs a forward through attn_implementation="stable_attn" (PyTorch path) with statistics, takes a
real AdamW step, clips at a tau below some heads' max logit and above others', and runs the same batch
again: every head's max logit is then <= tau (1 + 1e-3), the heads (key-value groups) that were below tau
and every other parameter are bitwise what they were, and the optimizer's state is untouched.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import stable_attn
import stable_attn.integrations.transformers as st
from stable_attn.monitor.actions.qk_clip import QKClip, head_layout

st.register()
VOCAB, SEQ = 64, 24
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(7)
    if name == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, attn_pdrop=0.0,
                         resid_pdrop=0.0, embd_pdrop=0.0)
        model = GPT2LMHeadModel._from_config(cfg, attn_implementation="stable_attn")
    elif name == "llama-gqa":
        model = LlamaForCausalLM._from_config(LlamaConfig(**SMALL, num_key_value_heads=2),
                                              attn_implementation="stable_attn")
    else:  # qwen2: q and k biases
        model = Qwen2ForCausalLM._from_config(Qwen2Config(**SMALL, num_key_value_heads=2),
                                              attn_implementation="stable_attn")
    st.configure(model, backend="torch")
    with torch.no_grad():  # sharper attention than the init gives: logits of a few units
        for _, m in st.attention_modules(model):
            for p in m.parameters():
                p.mul_(4.0)
    return model


def _max_logits(model, batch) -> dict[str, torch.Tensor]:
    stats = st.attach_stats(model)
    for s in stats.values():
        s.reset()
        s.enabled = True
    with torch.no_grad():
        model(input_ids=batch)
    return {name: s.max_logit.clone() for name, s in stats.items()}


@pytest.mark.parametrize("family", ["gpt2", "llama-gqa", "qwen2"])
def test_clip_bounds_the_max_logit_and_touches_nothing_else(family):
    model = _model(family)
    batch = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    before = _max_logits(model, batch)
    clip = QKClip(tau=1.0)  # placeholder tau, set below from the logits
    clip.setup(dict(zip(before, (m for _, m in st.attention_modules(model)), strict=True)))
    layer0 = clip.layouts["layer0"]
    group_max = before["layer0"].view(layer0.kv_heads, layer0.group).amax(1)
    assert group_max.min() > 0
    clip.tau = float(group_max.sort().values[len(group_max) // 2 - 1: len(group_max) // 2 + 1].mean())
    tau = clip.tau
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = copy.deepcopy(opt.state_dict())

    record = clip.apply(before)

    assert record.clipped_heads > 0 and clip.clip_steps == 1 and clip.alert_due()
    after = _max_logits(model, batch)
    # layer 0 sees the same inputs again: its clipped groups' max logit is tau (to rounding), the others'
    # the same bits. Later layers see layer 0's changed outputs, so only the edit itself is exact there.
    layout = clip.layouts["layer0"]
    s0 = before["layer0"].view(layout.kv_heads, layout.group)
    s1 = after["layer0"].view(layout.kv_heads, layout.group)
    over0 = s0.amax(1) > tau
    assert over0.any() and not over0.all()
    assert (s1.amax(1) <= tau * (1 + 1e-3)).all(), s1
    assert (s1[over0].amax(1) >= tau * (1 - 1e-3)).all(), s1  # clipped to tau, not below
    assert torch.equal(s1[~over0], s0[~over0])  # groups below tau: the same logits, bit for bit
    for name, layout in clip.layouts.items():
        s0 = before[name].view(layout.kv_heads, layout.group)
        over = s0.amax(1) > tau
        assert record.max_logit[name] == pytest.approx(s0.max().item())
        clipped = set(record.heads.get(name, []))
        assert clipped == {h for g in over.nonzero().flatten().tolist()
                           for h in range(g * layout.group, (g + 1) * layout.group)}
    # only the query and key blocks of clipped heads changed
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, params[n])}
    allowed = ("c_attn", "q_proj", "k_proj")
    assert changed and all(any(a in n for a in allowed) for n in changed), changed
    _unclipped_blocks_are_bitwise_unchanged(model, clip, record, params)
    new_state = opt.state_dict()
    for k, v in state["state"].items():
        for key, t in v.items():
            assert torch.equal(t, new_state["state"][k][key]), (k, key)


def _unclipped_blocks_are_bitwise_unchanged(model, clip, record, params):
    names = {id(p): n for n, p in model.named_parameters()}
    for layer, layout in clip.layouts.items():
        clipped_q = set(record.heads.get(layer, []))
        clipped_k = {h // layout.group for h in clipped_q}
        for block, heads, clipped in ((layout.query, layout.heads, clipped_q), (layout.key, layout.kv_heads,
                                                                               clipped_k)):
            for h in range(heads):
                lo = block.offset + h * layout.head_dim
                now = block.weight.detach().narrow(block.dim, lo, layout.head_dim)
                was = params[names[id(block.weight)]].narrow(block.dim, lo, layout.head_dim)
                assert torch.equal(now, was) != (h in clipped), (layer, h)
                if block.bias is not None:
                    assert torch.equal(block.bias.detach().narrow(0, lo, layout.head_dim),
                                       params[names[id(block.bias)]].narrow(0, lo, layout.head_dim)) != (h in clipped)


def test_non_positive_unseen_and_nan_logits_never_clip():
    model = _model("llama-gqa")
    clip = QKClip(tau=0.5)
    clip.setup({f"layer{i}": m for i, (_, m) in enumerate(st.attention_modules(model))})
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    record = clip.apply({"layer0": torch.tensor([-3.0, 0.0, -math.inf, math.nan]),
                         "layer1": torch.full((4,), -math.inf)})
    assert record.clipped_heads == 0 and clip.clip_steps == 0 and not clip.alert_due()
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_statistics_of_neither_every_head_nor_this_ranks_shard_are_refused_naming_the_layer():
    """Heads computed by a rank are every head, or under tensor parallelism those of its shard of q_proj
    (tests/monitor/test_tensor_parallel.py); any other count cannot be placed among the global heads."""
    model = _model("llama-gqa")
    clip = QKClip(tau=0.5)
    clip.setup({f"layer{i}": m for i, (_, m) in enumerate(st.attention_modules(model))})
    stats = {"layer0": stable_attn.AttentionStats(), "layer1": stable_attn.AttentionStats()}
    for s in stats.values():
        s.max_logit = torch.ones(3)
    with pytest.raises(ValueError, match=r"layer 'layer0' \(LlamaAttention\) computed 3 query heads.*qk_clip=None"):
        clip.reduce(stats, None, torch.device("cpu"))


def test_alerts_on_the_first_clip_and_every_100th_and_the_count_survives_a_resume():
    model = _model("gpt2")
    modules = {f"layer{i}": m for i, (_, m) in enumerate(st.attention_modules(model))}
    clip = QKClip(tau=1e-3)
    clip.setup(modules)
    due = []
    for _ in range(3):
        clip.apply({"layer0": torch.full((4,), 2.0)})
        due.append(clip.alert_due())
    assert due == [True, False, False]
    resumed = QKClip(tau=1e-3)
    resumed.setup(modules)
    resumed.load_state_dict(clip.state_dict())
    for _ in range(98):
        resumed.apply({"layer0": torch.full((4,), 2.0)})
    assert resumed.clip_steps == 101 and resumed.alert_due()


def test_bf16_weights_are_scaled_in_fp32_and_rounded_once():
    model = _model("llama-gqa").to(torch.bfloat16)
    clip = QKClip(tau=1.0, alpha=0.25)
    clip.setup({"layer0": st.attention_modules(model)[0][1]})
    q = clip.layouts["layer0"].query.weight
    was = q.detach().clone()
    clip.apply({"layer0": torch.tensor([4.0, 1.0, 0.5, 0.5])})  # group 0 (heads 0, 1): eta = 1/4
    hd = clip.layouts["layer0"].head_dim
    want = (was[: 2 * hd].float() * 0.25**0.25).to(torch.bfloat16)
    assert q.dtype == torch.bfloat16 and torch.equal(q[: 2 * hd], want) and torch.equal(q[2 * hd:], was[2 * hd:])


def test_layouts_it_cannot_edit_raise_at_setup_naming_the_class():
    qwen3 = Qwen3ForCausalLM._from_config(Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=8),
                                          attn_implementation="stable_attn")
    with pytest.raises(ValueError, match="Qwen3Attention.*q_norm"):
        QKClip(100.0).setup({"layer0": st.attention_modules(qwen3)[0][1]})
    with pytest.raises(ValueError, match="Linear: no known query/key layout"):
        head_layout(torch.nn.Linear(4, 4))
    for bad in (0.0, -1.0, math.inf, math.nan, True, "100"):
        with pytest.raises(ValueError, match="qk_clip="):
            QKClip(bad)
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="qk_clip_alpha="):
            QKClip(100.0, alpha=bad)


# ------------------------------------------------------------------------------- in the engine's loop


def test_engine_clips_applied_steps_only_alerts_and_resumes(tmp_path):
    """MonitorEngine(qk_clip=tau) in test_engine's plain loop (two micro-batches, AdamW, a skipped spike):
    every applied step whose max logit passes tau is clipped and logged, the skipped step is not (its weights
    and moments stay bit for bit), the first clip raises a qk_clip alert, the count survives a resume."""
    from test_engine import BAD, STEPS, Loop, assert_equal

    from stable_attn.monitor import names
    from stable_attn.monitor.engine import MonitorEngine

    alerts = []
    tau = 1e-3  # below every head's max logit: each applied step clips every head of both layers
    engine = MonitorEngine(on_spike="skip", qk_clip=tau, on_alert=alerts.append)
    loop = Loop(engine, str(tmp_path))
    seen = []
    original = engine._qk.apply

    def spy(max_logits):
        seen.append({k: v.clone() for k, v in max_logits.items()})
        return original(max_logits)

    engine._qk.apply = spy
    loop.run(scale={BAD: 20.0})

    assert engine.skipped_steps == [BAD]
    assert len(seen) == STEPS - 1  # every applied step is offered to QK-Clip, the skipped one is not
    assert_equal(loop.states[BAD][0], loop.states[BAD + 1][0])  # the skipped step: no update, no clip
    applied = [s for s in range(STEPS) if s != BAD]
    over = {step: sum(int((m > tau).sum()) for m in s.values()) for step, s in zip(applied, seen, strict=True)}
    assert over[0] == 4 and engine._qk.clip_steps == sum(n > 0 for n in over.values())
    ends = {e.step: e for e in loop.ends if e.metrics is not None and names.QK_CLIP_HEADS in e.metrics}
    assert sorted(ends) == [step for step, n in over.items() if n > 0]
    assert all(ends[step].metrics[names.QK_CLIP_HEADS] == over[step] for step in ends)
    # after a clip the next step starts from S_h = tau: what it shows is one AdamW step's growth
    assert all(max(m.max().item() for m in s.values()) < 5 * tau for s in seen[1:])
    clip_alerts = [a for a in alerts if a.kind == "qk_clip"]
    assert [a.step for a in clip_alerts] == [0] and "layer0 heads [0, 1]" in clip_alerts[0].message
    # the statistics ran on every training step (both micro-batches); the entropy only on monitored ones
    assert all(torch.isfinite(s["layer0"]).all() for s in seen)
    assert not any(s.enabled for s in engine.layers.stats.values())  # off between steps: eval is not seen
    state = engine.state_dict()
    assert state["qk_clip"]["clip_steps"] == engine._qk.clip_steps
    resumed = MonitorEngine(on_spike="skip", qk_clip=tau)
    resumed.load_state_dict(state)
    assert resumed._qk.clip_steps == engine._qk.clip_steps


def test_qk_clip_options_are_checked_and_off_by_default():
    from stable_attn.monitor.config import MonitorConfig
    from stable_attn.monitor.engine import MonitorEngine

    assert MonitorConfig().qk_clip is None and MonitorConfig().qk_clip_alpha == 0.5
    assert MonitorEngine()._qk is None
    with pytest.raises(ValueError, match=r"qk_clip=-1\.0 is not supported"):
        MonitorEngine(qk_clip=-1.0)
    with pytest.raises(ValueError, match=r"qk_clip_alpha=2 is not supported"):
        MonitorEngine(qk_clip=100.0, qk_clip_alpha=2)
    with pytest.raises(ValueError, match="attention_stats=False"):
        MonitorEngine(qk_clip=100.0, attention_stats=False)


def test_packed_documents_clip_from_the_varlen_statistics():
    """DataCollatorWithFlattening packs documents into one row; the model runs attention_varlen, whose
    per-head max logit feeds QK-Clip the same way: layer 0 then stays at tau on the same packed batch."""
    from transformers import DataCollatorWithFlattening

    model = _model("llama-gqa")
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (9, 14, 6)]
    batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in docs])
    assert batch["input_ids"].shape == (1, 29) and "attention_mask" not in batch

    def max_logits():
        stats = st.attach_stats(model)
        for s in stats.values():
            s.reset()
        with torch.no_grad():
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        return {name: s.max_logit.clone() for name, s in stats.items()}

    before = max_logits()
    clip = QKClip(tau=float(before["layer0"].median()))
    clip.setup({f"layer{i}": m for i, (_, m) in enumerate(st.attention_modules(model))})
    record = clip.apply(before)
    after = max_logits()
    layout = clip.layouts["layer0"]
    over = before["layer0"].view(layout.kv_heads, layout.group).amax(1) > clip.tau
    assert record.clipped_heads > 0 and over.any()
    s1 = after["layer0"].view(layout.kv_heads, layout.group)
    assert (s1.amax(1) <= clip.tau * (1 + 1e-3)).all()
    assert torch.equal(s1[~over], before["layer0"].view(layout.kv_heads, layout.group)[~over])


def test_ranks_clip_from_the_same_max_reduced_logits(tmp_path):
    """Two ranks (threads with test_engine's all_gather) see different batches: each clips from the MAX over
    both ranks' per-head max logits, so both make the same edit (same heads, same eta) every step."""
    import threading

    from test_engine import Loop, ThreadGather

    from stable_attn.monitor.engine import MonitorEngine, World

    gather = ThreadGather(2)
    engines = {r: MonitorEngine(qk_clip=0.02) for r in (0, 1)}
    local, used, errors = {0: [], 1: []}, {0: [], 1: []}, []

    def rank(r: int) -> None:
        try:
            loop = Loop(engines[r], str(tmp_path), World(rank=r, size=2, all_gather=gather.for_rank(r)), seed=r)
            qk = engines[r]._qk
            reduce, apply = qk.reduce, qk.apply

            def spy_reduce(stats, all_gather, device):
                local[r].append({n: s.max_logit.clone() for n, s in stats.items()})
                return reduce(stats, all_gather, device)

            def spy_apply(max_logits):
                record = apply(max_logits)
                used[r].append(({k: v.clone() for k, v in max_logits.items()}, record.heads, record.eta))
                return record

            qk.reduce, qk.apply = spy_reduce, spy_apply
            loop.run(steps=6)
        except BaseException as exc:
            errors.append(exc)
            gather.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(used[0]) == len(used[1]) == 6
    for step in range(6):
        (s0, heads0, eta0), (s1, heads1, eta1) = used[0][step], used[1][step]
        assert heads0 == heads1 and eta0 == eta1
        for name in s0:
            assert torch.equal(s0[name], s1[name])
            assert torch.equal(s0[name], torch.maximum(local[0][step][name], local[1][step][name]))
    assert any(used[0][step][1] for step in range(6))  # it clipped


def test_a_second_setup_reads_the_layouts_of_parameters_replaced_since():
    """Sharding after the first setup (Lightning's configure_model on a model built in __init__: fully_shard or
    parallelize_module put new parameters on q_proj / k_proj) must not leave QK-Clip editing the old tensors: the
    engine's next setup (the callback's on_fit_start) reads the layouts again, and a clip edits the new ones."""
    from stable_attn.monitor.engine import MonitorEngine, World

    model = _model("llama-gqa")
    engine = MonitorEngine(qk_clip=1e-3)
    engine.setup(model, World())
    modules = dict(st.attention_modules(model))
    for m in modules.values():
        m.q_proj.weight = torch.nn.Parameter(m.q_proj.weight.detach().clone())
        m.k_proj.weight = torch.nn.Parameter(m.k_proj.weight.detach().clone())
    engine.setup(model, World())
    layouts = list(engine._qk.layouts.values())  # by layer, in module order
    assert len(layouts) == len(modules) == 2
    assert all(lay.query.weight is m.q_proj.weight and lay.key.weight is m.k_proj.weight
               for lay, m in zip(layouts, modules.values(), strict=True))
    before = {name: m.q_proj.weight.detach().clone() for name, m in modules.items()}
    batch = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    record = engine._qk.apply(_max_logits(model, batch))
    assert record.heads and all(not torch.equal(before[name], m.q_proj.weight) for name, m in modules.items())
