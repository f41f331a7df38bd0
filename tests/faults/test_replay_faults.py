"""`stable-attn replay` on damaged, truncated, edited or swapped bundles: exit 1, one line naming the file and the
field or tensor, no traceback, control characters escaped; a good bundle still replays."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import stable_attn.integrations.transformers  # noqa: F401 - registers "stable_attn"
from stable_attn import cli
from stable_attn.monitor.actions import replay
from tests.integrations import tiny_models

VOCAB = 24
WEIGHTS = os.path.join(replay.BUNDLE_MODEL, "model.safetensors")


@pytest.fixture(scope="module")
def good_bundle(tmp_path_factory) -> str:
    model = tiny_models.build("llama", "stable_attn", VOCAB)
    ids = torch.arange(48).reshape(2, 24) % 8
    return replay.write_replay_bundle(str(tmp_path_factory.mktemp("bundle") / "b"), model, [ids], step=3,
                                      metric="loss", threshold=0.5)


def _edit_meta(path: str, **fields) -> None:
    meta_path = os.path.join(path, replay.BUNDLE_META)
    with open(meta_path) as f:
        meta = json.load(f)
    for k, v in fields.items():
        if v is KeyError:
            del meta[k]
        else:
            meta[k] = v
    with open(meta_path, "w") as f:
        json.dump(meta, f)


def _truncate(path: str, name: str) -> None:
    file = os.path.join(path, name)
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)


def _edit_weights(path: str, edit) -> None:
    file = os.path.join(path, WEIGHTS)
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _swap_model(path: str, family: str, **config) -> None:
    """The bundle's model folder replaced by another model of ``family`` (its config changed by ``config``)."""
    base = tiny_models.config(family, VOCAB)
    for k, v in config.items():
        setattr(base, k, v)
    other = type(tiny_models.build(family, "stable_attn", VOCAB))(base)
    shutil.rmtree(os.path.join(path, replay.BUNDLE_MODEL))
    other.save_pretrained(os.path.join(path, replay.BUNDLE_MODEL))


def _edit_config(path: str, **fields) -> None:
    file = os.path.join(path, replay.BUNDLE_MODEL, "config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(fields)
    with open(file, "w") as f:
        json.dump(config, f)


def _wrong_shape(t):
    t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(16, 32)


#: (case, damage, what the one error line must name). The damage runs on a fresh copy of a good bundle.
CASES = [
    ("meta truncated", lambda p: _truncate(p, replay.BUNDLE_META), "replay.json: not readable JSON"),
    ("meta a list", lambda p: open(os.path.join(p, replay.BUNDLE_META), "w").write("[1]"), "holds a list"),
    ("meta field missing", lambda p: _edit_meta(p, step=KeyError), "field 'step' is missing"),
    ("meta threshold a string", lambda p: _edit_meta(p, threshold="high"), "field 'threshold'"),
    ("meta metric unknown", lambda p: _edit_meta(p, metric="perplexity"), "field 'metric'"),
    ("meta dtype not a dtype", lambda p: _edit_meta(p, dtype="Tensor"), "field 'dtype'"),
    ("meta control characters", lambda p: _edit_meta(p, run_variant="\x1b[2J\x1b[31mours"), "field 'run_variant'"),
    ("meta older version", lambda p: _edit_meta(p, version=1), "bundle version 1"),
    ("meta no model identity", lambda p: _edit_meta(p, model=KeyError), "field 'model' is missing"),
    ("batches truncated", lambda p: _truncate(p, replay.BUNDLE_BATCHES), "batches.pt: not readable"),
    ("batches deleted", lambda p: os.remove(os.path.join(p, replay.BUNDLE_BATCHES)), "batches.pt"),
    ("batches empty", lambda p: torch.save([], os.path.join(p, replay.BUNDLE_BATCHES)), "non-empty list"),
    ("batches ids outside the vocabulary",
     lambda p: torch.save([torch.full((2, 8), VOCAB + 5)], os.path.join(p, replay.BUNDLE_BATCHES)),
     "tensor 'input_ids': ids in [29, 29]"),
    ("batches float ids", lambda p: torch.save([torch.rand(2, 8)], os.path.join(p, replay.BUNDLE_BATCHES)),
     "tensor 'input_ids': torch.float32"),
    ("batches dict without input_ids",
     lambda p: torch.save([{"x": torch.zeros(2, 8, dtype=torch.long)}], os.path.join(p, replay.BUNDLE_BATCHES)),
     "has no 'input_ids'"),
    ("weights truncated", lambda p: _truncate(p, WEIGHTS), "the model does not load"),
    ("weights tensor missing", lambda p: _edit_weights(p, lambda t: t.pop("model.norm.weight")), "model.norm.weight"),
    ("weights tensor wrong shape", lambda p: _edit_weights(p, _wrong_shape),
     "tensor 'model.layers.0.self_attn.q_proj.weight' is mismatched in the weights file (shape [16, 32], the model's "
     "[32, 32])"),
    ("another model class", lambda p: _swap_model(p, "qwen3"), "model class 'LlamaForCausalLM'"),
    ("another model, other shapes", lambda p: _swap_model(p, "llama", intermediate_size=48),
     "parameter 'model.layers.0.mlp.gate_proj.weight' has shape [48, 32]"),
    ("another model, same shapes", lambda p: _swap_model(p, "llama", rms_norm_eps=1e-3), "model.config_sha256"),
    ("config edited", lambda p: _edit_config(p, rms_norm_eps=0.1), "model.config_sha256"),
]


@pytest.mark.parametrize("case,damage,named", CASES, ids=[c[0] for c in CASES])
def test_a_damaged_bundle_is_refused_in_one_line(good_bundle, tmp_path, capsys, case, damage, named, row):
    path = str(tmp_path / "b")
    shutil.copytree(good_bundle, path)
    damage(path)
    capsys.readouterr()  # what the damage itself printed (save_pretrained's progress bar)
    rc = cli.main(["replay", path])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    row(f"exit 1, one line naming {named!r}",
        f"exit {rc}, {len(lines)} line(s): " + (lines[-1].replace(path, "BUNDLE") if lines else ""))
    assert rc == 1
    assert len(lines) == 1 and lines[0].startswith("stable-attn replay: error: "), captured.err
    assert named in lines[0], lines[0]
    assert "Traceback" not in captured.err and captured.out == ""
    assert all(c.isprintable() for c in lines[0]), lines[0]  # control characters escaped


def test_a_good_bundle_records_its_model_and_replays(good_bundle, capsys, row):
    with open(os.path.join(good_bundle, replay.BUNDLE_META)) as f:
        identity = json.load(f)["model"]
    assert identity["class"] == "LlamaForCausalLM"
    assert identity["parameters"]["model.layers.0.self_attn.q_proj.weight"] == [32, 32]
    rc = cli.main(["replay", good_bundle])
    out = capsys.readouterr().out
    row("exit 0, the table and its verdict", f"exit {rc}: " + out.strip().splitlines()[-1] if out.strip() else "")
    assert rc == 0
    assert "replay of step 3" in out and out.count("\n") == 6
