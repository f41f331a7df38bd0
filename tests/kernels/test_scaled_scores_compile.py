"""The kernels' scaled-first score form (``rules.SCORES_SCALED``, huge softmax scales) compiles for Hopper and
Ampere: the launchers pick it only above ``rules.FUSED_SCALE_MAX``, so no other compile test builds it. The
variants are the launchers' own constants with ``SOFTCAP`` set to it, compiled on the CPU in a subprocess without
the interpreter, as test_triton_compile.py's are."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import json, torch
from stable_attn import rules
from stable_attn.kernels import triton_aot
from stable_attn.kernels.triton_aot import SHARED_LIMIT, Variant
constants = triton_aot._constants
def scaled(variant):
    consts, opts = constants(variant)
    consts["SOFTCAP"] = rules.SCORES_SCALED
    return consts, opts
triton_aot._constants = scaled
out = []
for v in [Variant("fwd", torch.bfloat16, 128, True, rules.MODE_EXACT, True, 90),
          Variant("bwd_dq", torch.bfloat16, 128, True, cc=90),
          Variant("bwd_dkdv", torch.float16, 64, False, cc=80),
          Variant("decode", torch.bfloat16, 128, False, rules.MODE_EXACT, False, 90)]:
    k = triton_aot.compile_variant(v)
    out.append({"variant": v.name, "cubin": len(k.asm["cubin"]), "shared": k.metadata.shared,
                "limit": SHARED_LIMIT[v.cc]})
print(json.dumps(out))
"""


def test_scaled_scores_compile():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 4
    for r in results:
        assert r["cubin"] > 0 and r["shared"] <= r["limit"], r
