"""Importing stable_attn and stable_attn.callbacks leaves transformers' Trainer alone (checked in a fresh
interpreter); the Trainer callback imports it on first use."""

from __future__ import annotations

import subprocess
import sys


def test_trainer_module_is_imported_on_first_use_only():
    code = (
        "import sys, stable_attn, stable_attn.callbacks\n"
        "print('transformers.trainer' in sys.modules)\n"
        "from stable_attn.callbacks import StableAttentionTrainerCallback\n"
        "print('transformers.trainer' in sys.modules, StableAttentionTrainerCallback.__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "stable_attn.callbacks.trainer"]
