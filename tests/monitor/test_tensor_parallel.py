"""Tensor parallelism (torch's parallelize_module: q/k/v column-wise, o row-wise; 2 CPU processes, gloo) with
"stable_attn" serving each rank's own heads: the loss, per-head statistics, gradient norm and QK-Clip against
one unsharded copy of the model; and QK-Clip on FSDP2's row shards of q_proj / k_proj
(tests/monitor/tp_run.py)."""

from __future__ import annotations

import os

from distributed_helpers import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


def test_tensor_parallel_heads_statistics_and_qk_clip(tmp_path):
    from tp_run import BIG, HEADS, KV_HEADS

    results = run_ranks(os.path.join(HERE, "tp_run.py"), [str(tmp_path)], tmp_path, 180)
    group = HEADS // KV_HEADS
    for res in results:
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
