"""Train a zoo GPT under any plan: `torchrun --nproc_per_node 8 examples/train_gpt.py --plan configs/plans/cpu-dp2-tp2-pp2.yaml`.

Byte-level language modelling on examples/data/corpus.txt (hyparallel's own docs: 256 token ids, the
vocabulary of gpt-tiny). Without --plan the planner picks one for this launch on the `cpu` cluster preset.
Every rank draws the same global batch from a seeded generator; `shard` gives each data-parallel rank
its rows. Rank 0 logs loss, step time and tokens/s.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import hyparallel as hp

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", help="plan YAML (default: plan for this launch with the cpu preset)")
    parser.add_argument("--model", default="gpt-tiny", help="zoo name or model spec (default gpt-tiny)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def load_plan(args: argparse.Namespace, model: torch.nn.Module) -> hp.Plan:
    if args.plan:
        return hp.Plan.load(args.plan)
    world = int(os.environ.get("WORLD_SIZE", 1))
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=world)
    return hp.plan(model, cluster, global_batch=8 * world, seq_len=64, dtype="fp32")


def batches(plan: hp.Plan, seed: int):
    """Global batches of (inputs, targets): rows of seq_len + 1 bytes from random places in the corpus."""
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    rows, length = plan.training.global_batch, plan.training.seq_len
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - length - 1, (rows,), generator=generator)
        chunk = torch.stack([data[s: s + length + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


def main() -> None:
    args = parse_args()
    model = hp.models.load(args.model).module  # meta device: each rank materialises only its share
    plan = load_plan(args, model)
    pmodel = hp.parallelize(model, plan, seed=args.seed)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=args.lr, weight_decay=0.0)
    rank0 = pmodel.env.rank == 0
    if rank0:
        par = plan.parallel
        print(f"{args.model}: dp {par.dp} x tp {par.tp} x pp {par.pp} ({par.schedule}, {plan.num_microbatches} "
              f"micro-batches of {plan.training.micro_batch}), zero {par.zero}, recompute {par.recompute}", flush=True)
    tokens_per_step = plan.training.global_batch * plan.training.seq_len
    data = batches(plan, args.seed)
    first = last = None
    for step in range(1, args.steps + 1):
        inputs, targets = next(data)
        start = time.perf_counter()
        loss = pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets))
        pmodel.clip_grad_norm_(1.0)  # the global norm, over every rank's slices and shards
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        last = loss.item()  # waits for the step (on a GPU too) before the clock stops
        elapsed = time.perf_counter() - start
        first = last if first is None else first
        if rank0 and (step % args.log_every == 0 or step == 1):
            print(f"step {step:4d}  loss {last:.4f}  {elapsed * 1e3:7.1f} ms  {tokens_per_step / elapsed:9.0f} tokens/s",
                  flush=True)
    if rank0:
        print(f"loss {first:.4f} -> {last:.4f} over {args.steps} steps", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
