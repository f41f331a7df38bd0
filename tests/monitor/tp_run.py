"""Two-process tensor parallelism (torch's ``parallelize_module``, CPU, gloo) over a tiny Llama served by
``"stable_attn"``: q/k/v column-wise, o row-wise, so each rank computes its own query heads (4 of 8) and key
heads (2 of 4). Compared with one unsharded copy of the same model on the same batch.

Run by test_tensor_parallel.py as ``python tp_run.py RANK WORLD PORT OUT``; each rank writes
``OUT/rank{r}.json``.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from distributed_helpers import all_gather, full, shutdown, write_results

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 4
BIG = (1, 6)  # query heads of large logits: key-value groups 0 (rank 0's shard) and 3 (rank 1's)


def model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from stable_attn.integrations.transformers import register

    register()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=HEADS * HEAD_DIM, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=64, attn_implementation="stable_attn")
    m = LlamaForCausalLM(config)
    gain = torch.ones(HEADS)
    gain[list(BIG)] = 12.0
    with torch.no_grad():  # two heads of large logits: a tau between them and the rest clips their groups only
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(gain.repeat_interleave(HEAD_DIM)[:, None])
    return m


def main(out: str) -> None:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: distributed_helpers.run_ranks
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from stable_attn.integrations.transformers import attach_stats
    from stable_attn.monitor.actions.qk_clip import QKClip, head_layout
    from stable_attn.monitor.grad_norm import total_grad_norm

    reference = model()
    sharded = copy.deepcopy(reference)
    fsdp = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (world,))
    for layer in sharded.model.layers:
        parallelize_module(layer.self_attn, mesh, {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                                   "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))  # the same batch on each rank
    ref_stats, tp_stats = attach_stats(reference), attach_stats(sharded)
    ref_loss = reference(input_ids=ids, labels=ids).loss
    tp_loss = sharded(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    tp_loss.backward()

    result: dict = {"loss": [tp_loss.item(), ref_loss.item()]}
    result["local_q_heads"] = [int(s.max_logit.numel()) for s in tp_stats.values()]
    # this rank's heads are global heads [first, first + n): its statistics against the unsharded model's
    first = rank * HEADS // world
    result["head_max_logit_equal"] = [
        torch.allclose(tp_stats[k].max_logit, ref_stats[k].max_logit[first:first + tp_stats[k].max_logit.numel()],
                       rtol=1e-5, atol=1e-6) for k in ref_stats]
    result["rows"] = [[int(tp_stats[k].rows.sum()), int(ref_stats[k].rows.sum())] for k in ref_stats]
    try:
        result["grad_norm"] = [float(total_grad_norm(sharded.parameters())),
                               float(total_grad_norm(reference.parameters()))]
    except Exception as e:  # noqa: BLE001 - the test reports what happened
        result["grad_norm_error"] = f"{type(e).__name__}: {e}"[:300]

    # QK-Clip: the global per-head maxima from each rank's local heads, and the edits on each rank's own rows
    attn = lambda m: {f"layer{i}": layer.self_attn for i, layer in enumerate(m.model.layers)}  # noqa: E731
    maxima = torch.stack([s.max_logit for s in ref_stats.values()])
    big = torch.zeros(HEADS, dtype=torch.bool)
    big[list(BIG)] = True
    tau = float(maxima[:, ~big].max() + maxima[:, big].min()) / 2
    result["tau_between"] = bool(maxima[:, ~big].max() < tau < maxima[:, big].min())
    ref_clip, tp_clip = QKClip(tau=tau), QKClip(tau=tau)
    ref_clip.setup(attn(reference))
    tp_clip.setup(attn(sharded))
    result["layout_heads"] = [head_layout(m).heads for m in attn(sharded).values()]
    ref_max = ref_clip.reduce(ref_stats, None, torch.device("cpu"))
    tp_max = tp_clip.reduce(tp_stats, all_gather, torch.device("cpu"))
    result["reduced_equal"] = all(torch.allclose(tp_max[k], ref_max[k], rtol=1e-5, atol=1e-6) for k in ref_max)
    before = {n: full(p.detach()).clone() for n, p in sharded.named_parameters()}
    ref_rec, tp_rec = ref_clip.apply(ref_max), tp_clip.apply(tp_max)
    result["clipped"] = [ref_rec.heads, tp_rec.heads]
    weights = lambda m: {n: full(p.detach()) for n, p in m.named_parameters()}  # noqa: E731
    got, want = weights(sharded), weights(reference)
    # eta from the sharded forward's maxima, which differ from the unsharded one's in the last bits
    result["weights_equal"] = {n: torch.allclose(got[n], want[n], rtol=1e-5, atol=0) for n in want
                               if "q_proj" in n or "k_proj" in n}
    # the rows (query, key) each edit changed, by head, on the gathered weights
    changed = lambda n: (got[n] != before[n]).any(dim=1).nonzero().flatten().tolist()  # noqa: E731
    result["changed_heads"] = {n: sorted({i // HEAD_DIM for i in changed(n)}) for n in want
                               if "q_proj" in n or "k_proj" in n}

    # FSDP2 (each rank computes every head; q_proj / k_proj sharded by rows): the same clip edits the rows
    # through each rank's shard, and the next forward's all-gather sees them
    from torch.distributed.fsdp import fully_shard

    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp_stats = attach_stats(fsdp)
    fsdp(input_ids=ids, labels=ids).loss.backward()
    fsdp_clip = QKClip(tau=tau)
    fsdp_clip.setup(attn(fsdp))
    result["fsdp_clipped"] = fsdp_clip.apply(fsdp_clip.reduce(fsdp_stats, all_gather, torch.device("cpu"))).heads
    edited = weights(fsdp)
    result["fsdp_weights_equal"] = {n: torch.allclose(edited[n], want[n], rtol=1e-5, atol=0) for n in want
                                    if "q_proj" in n or "k_proj" in n}
    for st in (*fsdp_stats.values(), *ref_stats.values()):
        st.reset()
    with torch.no_grad():  # the next forward (FSDP2 gathers the edited shards) sees the clipped logits
        fsdp(input_ids=ids)
        reference(input_ids=ids)
    result["fsdp_max_logit_after"] = [
        [float(fsdp_stats[k].max_logit.max()), float(ref_stats[k].max_logit.max())] for k in ref_stats]
    write_results(out, rank, result)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
