"""hyparallel's data parallelism against plain PyTorch DDP, one training step each.

Run: torchrun --nproc_per_node 2 benchmarks/dp_vs_ddp.py [--model "gpt-tiny num_layers=4
hidden_size=256
     num_heads=8 vocab_size=1024 max_seq_len=128" --seq 128 --batch 16 --microbatches 1 --steps 10]
     [--json FILE]
(gloo on the CPU; torchrun sets OMP_NUM_THREADS=1.)

Both sides hold the same zoo model (built on meta, materialised from the same seed, so the same
weights), each its own copy. hyparallel runs ``hp.parallelize(model, plan)`` under a plan of dp =
world, tp = pp = 1, ZeRO 0, then ``pmodel.train_step(pmodel.shard(x), pmodel.shard(y))``; PyTorch
wraps its copy in
``DistributedDataParallel`` on the default group and runs forward, ``token_cross_entropy`` and
backward on the same rows (``no_sync`` on all but the last micro-batch, as hyparallel accumulates),
then AdamW steps and zeroes the gradients on both. ``--batch`` is global, split over the ranks, then
into
``--microbatches``. The sides first check they agree after one step (global mean loss, every
parameter), then alternate step by step after two warm-up steps each; rank 0 prints the median step
time (the slowest rank's) of each and their ratio (target <= 1.05). hyparallel also all-reduces the
scalar loss.
``--json FILE``: rank 0 also writes the figures there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from common import agreement, alternate, timed  # benchmarks/common.py, beside this script
from torch.nn.parallel import DistributedDataParallel

import hyparallel as hp
from hyparallel.runtime.parallel import token_cross_entropy
from hyparallel.tensor.init import materialize_

MODEL = "gpt-tiny num_layers=4 hidden_size=256 num_heads=8 vocab_size=1024 max_seq_len=128"
RTOL, ATOL = 1e-5, 1e-6  # fp32, same reductions on both sides: rounding only
WARMUP, SEED, LR = 2, 0, 1e-3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL)
    for name, default in (("seq", 128), ("batch", 16), ("microbatches", 1), ("steps", 10)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--json", help="rank 0 writes the figures here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")  # parallelize takes an initialised group as it is
    rank, world = dist.get_rank(), dist.get_world_size()
    m = args.microbatches

    model = hp.models.load(args.model).module
    plan = hp.plan(
        model,
        hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=world),
        args.batch,
        args.seq,
        "fp32",
        dp=world,
        tp=1,
        pp=1,
        zero=0,
        micro_batch=args.batch // world // m,
    )
    pmodel = hp.parallelize(model, plan, seed=SEED)
    ours_opt = torch.optim.AdamW(pmodel.parameters(), lr=LR)
    reference = materialize_(hp.models.load(args.model).module, "cpu", seed=SEED)
    ddp = DistributedDataParallel(reference)  # the default (world) group
    theirs_opt = torch.optim.AdamW(ddp.parameters(), lr=LR)

    torch.manual_seed(7)  # the same global batch on every rank; each side takes this rank's rows
    tokens = torch.randint(0, reference.config.vocab_size, (args.batch, args.seq + 1))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    ours_x, ours_y = pmodel.shard(inputs), pmodel.shard(targets)
    theirs_x, theirs_y = inputs.chunk(world)[rank].chunk(m), targets.chunk(world)[rank].chunk(m)

    def ours() -> torch.Tensor:
        loss = pmodel.train_step(ours_x, ours_y)
        ours_opt.step()
        ours_opt.zero_grad()
        return loss

    def theirs() -> torch.Tensor:
        total = torch.zeros(())
        for i, (x, y) in enumerate(zip(theirs_x, theirs_y)):
            with ddp.no_sync() if i < m - 1 else nullcontext():
                loss = token_cross_entropy(ddp(x), y)
                (loss / m).backward()
            total += loss.detach()
        theirs_opt.step()
        theirs_opt.zero_grad()
        return total / m

    # Agreement: one step each from the same weights, then the loss and every parameter under its
    # name.
    (_, ours_loss), (_, theirs_loss) = timed(ours), timed(theirs)
    dist.all_reduce(theirs_loss)  # hyparallel returns the global mean loss; DDP's is this rank's
    theirs_loss /= world
    summary = agreement(
        ((p, reference.get_parameter(name)) for name, p in pmodel.named_parameters()), RTOL, ATOL
    )
    loss_ok = torch.allclose(ours_loss, theirs_loss, rtol=RTOL, atol=ATOL)

    medians = alternate({"hyparallel": (ours, None), "DDP": (theirs, None)}, args.steps, WARMUP)
    ours_ms, theirs_ms = medians["hyparallel"], medians["DDP"]
    if rank == 0:
        print(
            f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs,"
            f" {torch.get_num_threads()} torch threads per rank; torch {torch.__version__};"
            f" dp={world} gloo CPU"
        )
        print(
            f"model: {args.model} ({sum(p.numel() for p in reference.parameters()):,} parameters),"
            f" fp32; global batch {args.batch} x seq {args.seq}, {m} micro-batch(es) per rank;"
            f" AdamW; median of {args.steps} steps after {WARMUP} warm-up"
        )
        ok = "OK" if loss_ok and summary[0] == 0 else "MISMATCH"
        print(
            f"check {ok}: loss hyparallel {ours_loss.item():.6f} DDP {theirs_loss.item():.6f}; "
            f"{int(summary[1] - summary[0])}/{int(summary[1])} parameters equal after one step "
            f"(rtol {RTOL:g}, atol {ATOL:g}), max abs diff {summary[2]:.1e}"
        )
        ratio = ours_ms / theirs_ms
        print(
            f"hyparallel / DDP step time ratio: {ratio:.3f} (hyparallel {ours_ms:.1f} ms, DDP"
            f" {theirs_ms:.1f} ms; target <= 1.05: {'met' if ratio <= 1.05 else 'MISSED'})"
        )
        if args.json:
            case = {
                "case": f"dp={world}",
                "hyparallel_ms": ours_ms,
                "torch_ms": theirs_ms,
                "ratio": ratio,
                "target": 1.05,
                "check": f"{ok}: max abs parameter diff {summary[2]:.1e} after one step",
            }
            Path(args.json).write_text(
                json.dumps(
                    {
                        "peer": "torch DistributedDataParallel",
                        "config": {**vars(args), "dp": world},
                        "cases": [case],
                    },
                    indent=1,
                )
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
