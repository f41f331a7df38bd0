"""Tensor parallelism (torch's parallelize_module: q/k/v column-wise, o row-wise; 2 CPU processes, gloo) with
"stable_attn" serving each rank's own heads: the loss, per-head statistics, gradient norm and QK-Clip against
one unsharded copy of the model; and QK-Clip on FSDP2's row shards of q_proj / k_proj
(tests/monitor/tp_run.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_tensor_parallel_heads_statistics_and_qk_clip(tmp_path):
    from tp_run import BIG, HEADS, KV_HEADS

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    script = os.path.join(HERE, "tp_run.py")
    procs = [subprocess.Popen([sys.executable, script, str(r), "2", port, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    group = HEADS // KV_HEADS
    for r in (0, 1):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        tp_loss, ref_loss = res["loss"]
        assert abs(tp_loss - ref_loss) <= 1e-5 * ref_loss  # the op served the local heads
        assert res["local_q_heads"] == [HEADS // 2] * 2  # each rank computed its own half of the heads
        assert all(res["head_max_logit_equal"])  # rank r's heads are global heads [r * H/2, (r + 1) * H/2)
        assert all(2 * tp == ref for tp, ref in res["rows"])  # the rows of the two ranks' heads add up
        tp_norm, ref_norm = res["grad_norm"]  # DTensor (attention) and plain (the rest) gradients together
        assert abs(tp_norm - ref_norm) <= 1e-5 * ref_norm
        assert res["layout_heads"] == [HEADS] * 2 and res["reduced_equal"] and res["tau_between"]
        clipped = sorted(h for g in {b // group for b in BIG} for h in range(g * group, (g + 1) * group))
        assert res["clipped"][0] == res["clipped"][1] == {"layer0": clipped, "layer1": clipped}
        assert all(res["weights_equal"].values())
        for name, heads in res["changed_heads"].items():  # the right rows, on whichever rank holds them
            assert heads == (clipped if "q_proj" in name else sorted({b // group for b in BIG})), name
        # FSDP2 shards q_proj / k_proj by rows too (each rank computes every head): the edit reaches the shards
        assert res["fsdp_clipped"] == res["clipped"][0] and all(res["fsdp_weights_equal"].values())
        for after, ref_after in res["fsdp_max_logit_after"]:
            assert abs(after - ref_after) <= 1e-5 * abs(ref_after)
