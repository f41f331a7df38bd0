"""An ``alerts_file`` name the file system cannot hold is refused when the callback is built, not at every write."""

from __future__ import annotations

import os

import pytest

from stable_attn.callbacks import StableAttentionCallback, StableAttentionTrainerCallback
from stable_attn.monitor.alerts import channels as alerting
from tests.faults.conftest import outcome

CALLBACKS = [StableAttentionCallback, StableAttentionTrainerCallback]
LIMIT = alerting._name_max(os.getcwd())


@pytest.mark.parametrize("callback", CALLBACKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name,size", [("a" * (LIMIT - 5) + "x.jsonl", LIMIT + 2),
                                       ("\u00e9" * (LIMIT // 2 + 1), 2 * (LIMIT // 2 + 1))],  # 2 bytes per char
                         ids=["ascii", "multibyte"])
def test_a_name_over_the_limit_is_refused(callback, name, size, row):
    row(f"ValueError at construction: {size} bytes > {LIMIT}", outcome(callback, alerts_file=name))
    assert len(os.fsencode(name)) == size > LIMIT
    with pytest.raises(ValueError, match=rf"alerts_file=.* is {size} bytes long; file names hold at most {LIMIT}"):
        callback(alerts_file=name)


@pytest.mark.parametrize("callback", CALLBACKS, ids=lambda c: c.__name__)
def test_an_unencodable_name_is_refused(callback, row):
    row("ValueError at construction: cannot encode", outcome(callback, alerts_file="alerts-\udc00.jsonl"))
    with pytest.raises(ValueError, match="alerts_file=.*cannot encode"):
        callback(alerts_file="alerts-\udc00.jsonl")


def test_a_name_at_the_limit_is_taken_and_writable(tmp_path, row):
    name = "a" * (LIMIT - 6) + ".jsonl"
    row(f"a {LIMIT}-byte name accepted", outcome(StableAttentionCallback, alerts_file=name))
    StableAttentionCallback(alerts_file=name)
    with open(tmp_path / name, "w") as f:  # the limit is the file system's: a longer name fails here
        f.write("{}\n")
    with pytest.raises(OSError):
        open(tmp_path / ("a" + name), "w")
