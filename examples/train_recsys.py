"""Train a DLRM on a synthetic click log, in parameter-server mode or plain data parallelism, from
the same flags: `torchrun --nproc_per_node 3 examples/train_recsys.py --mode ps --servers 1` (1
server, 2 workers).

--mode ps: ranks 0 .. servers-1 hold the embedding tables (and dense weights) as Ray actors and
apply the updates; the other ranks pull rows, push gradients and take the batches the dispatcher
gives out (a worker that dies leaves its unfinished batches to the others; a server that dies comes
back from the newest checkpoint of --checkpoint-dir). --mode dp: every rank holds the whole model,
DDP all-reduces the gradients, and step s trains batches s*dp .. s*dp + dp - 1 of the same log. Both
print the loss, samples/s and the bytes each worker moved.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import hyparallel as hp
from hyparallel.models.dlrm import batch_for, bce_loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("ps", "dp"), default="ps")
    parser.add_argument(
        "--model", default="dlrm-tiny", help="a DLRM of the zoo (default dlrm-tiny)"
    )
    parser.add_argument(
        "--plan", help="plan YAML (default: built from the flags below and WORLD_SIZE)"
    )
    parser.add_argument(
        "--servers", type=int, default=1, help="--mode ps: server ranks (default 1)"
    )
    parser.add_argument(
        "--staleness", type=int, default=0, help="--mode ps: 0 is synchronous SGD (default 0)"
    )
    parser.add_argument(
        "--optimizer", choices=("sgd", "adagrad", "rowwise-adam"), default="adagrad"
    )
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--batch", type=int, default=64, help="samples per worker and step (default 64)"
    )
    parser.add_argument("--batches", type=int, default=200, help="batches in the log (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint-dir", help="save here every --checkpoint-every batches, and resume from it"
    )
    parser.add_argument("--checkpoint-every", type=int, default=0)
    return parser.parse_args()


def make_plan(args: argparse.Namespace) -> hp.Plan:
    if args.plan:
        return hp.Plan.load(args.plan)
    world = int(os.environ.get("WORLD_SIZE", 1))
    workers = world - args.servers if args.mode == "ps" else world
    plan = {
        "training": {
            "global_batch": args.batch * workers,
            "micro_batch": args.batch,
            "seq_len": 1,
            "dtype": "fp32",
        },
        "parallel": {"dp": workers},
    }
    if args.mode == "ps":
        plan["ps"] = {
            "servers": args.servers,
            "staleness": args.staleness,
            "optimizer": args.optimizer,
            "lr": args.lr,
        }
    return hp.Plan.from_dict(plan)


def main() -> None:
    args = parse_args()
    plan = make_plan(args)
    # as a --plan says
    args.batch, args.mode = plan.training.micro_batch, "ps" if plan.ps is not None else "dp"
    torch.manual_seed(args.seed)  # the same weights on every rank
    model = hp.models.build(args.model, device="cpu")
    pmodel = hp.parallelize(
        model, plan, example_inputs=model.example_inputs(args.batch, device="cpu")
    )
    # a server rank serves here until the log is consumed
    if plan.ps is not None and pmodel.serve():
        return
    if plan.ps is None:
        optimizer = torch.optim.Adagrad(pmodel.parameters(), lr=args.lr)
        rank, dp = pmodel.env.rank, plan.parallel.dp
        steps = ((s, s * dp + rank) for s in range(args.batches // dp))
    else:  # the servers apply the updates: no optimizer here
        resumed = args.checkpoint_dir and hp.checkpoint.load(
            pmodel, None, args.checkpoint_dir, missing_ok=True
        )
        # steps go on from it
        rank, first = int(os.environ.get("RANK", 0)), resumed["step"] if resumed else 0
        steps = enumerate(pmodel.batches(args.batches), start=first)
    cfg, losses, ends, done = model.config, [], [], 0
    for step, index in steps:
        dense, sparse, clicks = batch_for(cfg, args.batch, index, seed=args.seed)
        loss = pmodel.train_step((dense, sparse), clicks, bce_loss)
        if plan.ps is None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        ends.append(time.perf_counter())
        done += 1
        if (
            plan.ps is not None
            and args.checkpoint_every
            and (step + 1) % args.checkpoint_every == 0
        ):
            hp.checkpoint.save(pmodel, None, args.checkpoint_dir, step=step + 1)
    # Steady state: from the end of the first batch (start-up, the first pull of every row) to the
    # end of the last.
    rate = (done - 1) * args.batch / (ends[-1] - ends[0]) if done > 1 else float("nan")
    moved = getattr(pmodel, "bytes_moved", None)
    recent = losses[-10:]
    print(
        f"rank {rank} ({args.mode}): {done} batches, loss {losses[0]:.4f} ->"
        f" {sum(recent) / len(recent):.4f} (last 10), {rate:.0f} samples/s"
        + (
            f", {moved / max(done, 1) / 2**10:.1f} KiB moved per batch" if moved is not None else ""
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
