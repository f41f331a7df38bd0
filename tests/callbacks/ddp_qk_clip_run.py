"""A 2-process DDP run (gloo, CPU) of StableAttentionCallback(qk_clip=tau): each rank trains on its own batches,
so each sees its own per-head max logits; the clip must use the MAX over both ranks, or the replicas part.

Run by test_callback_qk_clip.py as ``python ddp_qk_clip_run.py OUT_DIR`` (Lightning's ``strategy="ddp"`` starts
the second process by running this script again). Each rank writes ``OUT_DIR/rank{r}.json``: the digest of its
query/key weights, its clip count, and per step its local and reduced layer-0 max logits and clipped heads.
"""

from __future__ import annotations

import hashlib
import sys

import lightning as L
import torch
from distributed_helpers import shutdown, write_results
from lightning.pytorch.loggers import CSVLogger
from qk_clip_lm import batches, group_max_logits, tiny_model
from test_callback_qk_clip import LM
from torch.utils.data import DataLoader

from stable_attn.callbacks import StableAttentionCallback

STEPS = 3


class RankLM(LM):
    def train_dataloader(self):
        return DataLoader(batches(STEPS, seed=10 + self.trainer.global_rank), batch_size=None)


def qk_digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for n, p in sorted(module.named_parameters()):
        if any(k in n for k in ("c_attn", "q_proj", "k_proj")):
            h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(out: str) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    # the same tau on both ranks: between the groups of layer 0 over both ranks' first batches
    first = [batches(1, seed=10 + r)[0] for r in (0, 1)]
    g = group_max_logits(tiny_model("llama"), first)["layer0"]
    tau = float(g.mean())
    cb = StableAttentionCallback(qk_clip=tau)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, logger=CSVLogger(out),
                        callbacks=[cb], use_distributed_sampler=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=2)
    module = RankLM("llama")
    qk = cb.engine._qk
    seen: list[dict] = []
    reduce, apply = qk.reduce, qk.apply

    def spy_reduce(stats, all_gather, device):
        seen.append({"local": stats["layer0"].max_logit.tolist()})
        return reduce(stats, all_gather, device)

    def spy_apply(max_logits):
        record = apply(max_logits)
        seen[-1].update(reduced=max_logits["layer0"].tolist(), heads=record.heads)
        return record

    qk.reduce, qk.apply = spy_reduce, spy_apply
    trainer.fit(module)
    result = {"rank": trainer.global_rank, "tau": tau, "global_step": trainer.global_step, "qk": qk_digest(module),
              "clip_steps": qk.clip_steps, "steps": seen}
    write_results(out, trainer.global_rank, result)
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
