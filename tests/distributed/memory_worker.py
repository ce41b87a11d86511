"""A real training step's peak memory against the planner's: `torchrun --nproc_per_node 2
memory_worker.py OUT CASE...`.

Each case plans gpt-tiny for two processes with the cpu preset, counts this rank's tensor bytes from
before the model is materialised (hyparallel.runtime.peak_memory, Note [measuring a CPU peak]), and
runs two steps as examples/train_gpt.py does (train_step, clip_grad_norm_, AdamW, zero_grad). Each
rank reports its peak over the steps, the plan's prediction for its stage (without the preset's
reserve) and the bytes of its weights, gradients and optimizer state. Rank 0 writes one JSON line
per case.
"""

from __future__ import annotations

import harness  # tests/distributed/harness.py, beside this script
import torch
import torch.distributed as dist

import hyparallel as hp
from hyparallel.runtime.peak_memory import PeakMemory

SEQ, BATCH = 64, 8
CASES = {
    "pp2-1f1b-bf16": {
        "dp": 1,
        "tp": 1,
        "pp": 2,
        "schedule": "1f1b",
        "micro_batch": 2,
        "dtype": "bf16",
    },
    "pp2-1f1b-fp32": {
        "dp": 1,
        "tp": 1,
        "pp": 2,
        "schedule": "1f1b",
        "micro_batch": 2,
        "dtype": "fp32",
    },
    "dp2-bf16": {"dp": 2, "tp": 1, "pp": 1, "micro_batch": 2, "dtype": "bf16"},
    "tp2-fp32": {
        "dp": 1,
        "tp": 2,
        "pp": 1,
        "micro_batch": 4,
        "dtype": "fp32",
        "sequence_parallel": False,
    },
    "tp2-sp-bf16": {
        "dp": 1,
        "tp": 2,
        "pp": 1,
        "micro_batch": 4,
        "dtype": "bf16",
        "sequence_parallel": True,
    },
    # the logits gathered for the loss: the tp cases above compute it vocab-parallel
    "tp2-gathered-fp32": {
        **{
            "dp": 1,
            "tp": 2,
            "pp": 1,
            "micro_batch": 4,
            "dtype": "fp32",
            "sequence_parallel": False,
        },
        "vocab_parallel_loss": False,
    },
}


def run_case(name: str) -> dict:
    constraints = dict(CASES[name])
    dtype = constraints.pop("dtype")
    model = hp.models.load("gpt-tiny").module
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=dist.get_world_size())
    plan = hp.plan(model, cluster, BATCH, SEQ, dtype, zero=0, recompute="none", **constraints)
    peaks = PeakMemory("cpu").start()
    pmodel = hp.parallelize(model, plan, seed=0, device="cpu")
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-3, weight_decay=0.0)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    peaks.reset_peak()
    for _ in range(2):
        pmodel.train_step(pmodel.shard(tokens[:, :-1]), pmodel.shard(tokens[:, 1:]))
        pmodel.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    # weights, grads (fp32), m and v
    state = sum(p.numel() * p.element_size() for p in pmodel.parameters()) * 4
    stage = plan.coords(dist.get_rank())["pp"]
    predicted = plan.predicted.memory_gib[stage] * 2**30 - cluster.device.reserved_bytes
    return {
        "peak_bytes": peaks.stop(),
        "predicted_bytes": predicted,
        "state_bytes": state,
        "plan": plan.to_dict(),
    }


if __name__ == "__main__":
    harness.main(run_case)
