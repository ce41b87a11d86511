"""Train a zoo GPT under any plan:
`torchrun --nproc_per_node 8 examples/train_gpt.py --plan configs/plans/cpu-dp2-tp2-pp2.yaml`.

Byte-level language modelling on examples/data/corpus.txt (hyparallel's own docs: 256 token ids,
gpt-tiny's vocabulary). Without --plan the planner plans for the launch it finds (WORLD_SIZE, the
`cpu` preset, the same global batch): under `torchrun --nnodes MIN:MAX --max-restarts N` or
`dlrover-run` a restarted group (with fewer workers: re-planned) loads the newest checkpoint of
--checkpoint-dir, resharded (--checkpoint-storage memory: from shared memory), and goes on. Every
rank draws the same global batches from a seeded generator (so a resumed run skips exactly the
batches already seen); `shard` gives each data-parallel rank its rows. Rank 0 logs loss, step time,
tokens/s, TFLOP/s and MFU (with peak memory) against the plan's predictions, and their medians at
the end; --log-json FILE adds every step's loss, unrounded. --metrics-out FILE is what `hyparallel
calibrate --from-run` reads; --calibrate-online FILE fits the cluster to the measured steps during
the run and says whether another plan would be faster (docs/cost-model.md).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import hyparallel as hp
from hyparallel.runtime import peak_memory

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def parse_args() -> argparse.Namespace:
    # The docstring's first paragraph (its summary, over two lines; argparse joins them into one).
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--plan", help="plan YAML (default: plan for this launch with the cpu preset)"
    )
    parser.add_argument(
        "--model", default="gpt-tiny", help="zoo name or model spec (default gpt-tiny)"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--global-batch", type=int, default=16, help="without --plan (default 16)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint-dir", help="save here, and resume from its newest complete checkpoint"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: never)"
    )
    parser.add_argument(
        "--checkpoint-storage",
        choices=("disk", "memory"),
        default="disk",
        help=(
            "memory: save to shared memory, persisted to --checkpoint-dir in the background"
            " (default disk)"
        ),
    )
    parser.add_argument(
        "--checkpoint-keep",
        type=int,
        default=0,
        help="keep only the newest N checkpoints on disk (default 0: all)",
    )
    parser.add_argument(
        "--metrics-out", help="rank 0 writes the measured step figures and the plan here as JSON"
    )
    parser.add_argument(
        "--calibrate-online", metavar="FILE", help="rank 0 writes the corrected cluster here"
    )
    parser.add_argument(
        "--calibrate-threshold", type=float, default=None, help="fit when off by more (default 0.1)"
    )
    parser.add_argument(
        "--memory-out", help="rank 0 writes every rank's peak tensor bytes and the prediction here"
    )
    parser.add_argument(
        "--memory-steps",
        type=int,
        default=0,
        help="count the peak over the first N steps only (0: all of them)",
    )
    parser.add_argument(
        "--log-json",
        help="rank 0 appends {step, loss, world_size, restart} here, a JSON line a step",
    )
    return parser.parse_args()


def load_plan(args: argparse.Namespace, model: torch.nn.Module) -> hp.Plan:
    if args.plan:
        return hp.Plan.load(args.plan)
    world = int(os.environ.get("WORLD_SIZE", 1))  # deterministic: every rank derives the same plan
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=world)
    return hp.plan(
        model, cluster, global_batch=args.global_batch, seq_len=64, dtype="fp32", name=args.model
    )


def batches(plan: hp.Plan, seed: int, skip: int):
    """Global batches of (inputs, targets): rows of seq_len + 1 bytes from random places in the
    corpus."""
    # widened per batch: 1 byte a token
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8)
    rows, length = plan.training.global_batch, plan.training.seq_len
    generator = torch.Generator().manual_seed(seed)
    for step in range(10**9):
        starts = torch.randint(0, data.numel() - length - 1, (rows,), generator=generator)
        if step >= skip:
            chunk = torch.stack([data[s : s + length + 1] for s in starts.tolist()]).long()
            yield chunk[:, :-1], chunk[:, 1:]


def main() -> None:
    args = parse_args()
    model = hp.models.load(args.model).module  # meta device: each rank materialises only its share
    plan = load_plan(args, model)
    # before the model is materialised
    peaks = peak_memory.for_plan(plan).start() if args.memory_out else None
    pmodel = hp.parallelize(model, plan, seed=args.seed)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=args.lr, weight_decay=0.0)
    if args.calibrate_online:  # Note [online calibration] in hyparallel/runtime/metrics.py
        pmodel.metrics.calibrate_online(
            args.calibrate_online, model=args.model, threshold=args.calibrate_threshold
        )
    if peaks:
        peaks.reset_peak()  # the steps' peak, not the materialisation's
    rank0, done, source = pmodel.env.rank == 0, 0, ""
    resumed = None
    if args.checkpoint_dir:
        resumed = hp.checkpoint.load(pmodel, optimizer, args.checkpoint_dir, missing_ok=True)
    if resumed:  # the newest checkpoint on disk or, from a restart on the same node, in memory
        done, source = resumed["step"], resumed["storage"]
    if rank0:
        par = plan.parallel
        print(
            f"{args.model}: dp {par.dp} x tp {par.tp} x pp {par.pp} ({par.schedule},"
            f" {plan.num_microbatches} micro-batches of {plan.training.micro_batch}), zero"
            f" {par.zero}, recompute {par.recompute}"
            + (f"; resumed after step {done} from {source}" if done else ""),
            flush=True,
        )
    data = batches(plan, args.seed, skip=done)
    first = last = None
    for step in range(done + 1, args.steps + 1):
        inputs, targets = next(data)
        # pmodel.metrics times each step
        loss = pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets))
        pmodel.clip_grad_norm_(1.0)  # the global norm, over every rank's slices and shards
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        last = loss.item()
        first = last if first is None else first
        # the rest run without the CPU's allocation profiler
        if peaks and step - done == args.memory_steps:
            peaks.stop()
        # steps closed so far: this one closes at the next train_step
        recent = pmodel.metrics.last(args.log_every)
        if rank0 and (step % args.log_every == 0 or step == done + 1):
            print(
                f"step {step:4d}  loss {last:.4f}" + (f"  {recent.line()}" if recent else ""),
                flush=True,
            )
        # appended: a restarted run adds the steps it redoes after the earlier ones
        if rank0 and args.log_json:
            with open(args.log_json, "a") as log:
                print(
                    json.dumps(
                        {
                            "step": step,
                            "loss": last,
                            "world_size": pmodel.env.world_size,
                            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                        }
                    ),
                    file=log,
                )
        if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
            hp.checkpoint.save(
                pmodel,
                optimizer,
                args.checkpoint_dir,
                step,
                extra={"sequences_seen": step * plan.training.global_batch},
                storage=args.checkpoint_storage,
                keep=args.checkpoint_keep or None,
            )
    if args.checkpoint_dir and args.checkpoint_storage == "memory":
        # the newest memory checkpoint on disk, memory freed
        hp.checkpoint.finish(pmodel, args.checkpoint_dir)
    summary = pmodel.metrics.summary()  # median over the steps after the first
    if rank0 and summary is not None:
        print(
            f"loss {first:.4f} -> {last:.4f} over steps {done + 1}..{args.steps}; median of"
            f" {summary.steps} steps: {summary.line()}",
            flush=True,
        )
        if args.metrics_out:
            Path(args.metrics_out).write_text(
                json.dumps(pmodel.metrics.record(args.model), indent=1)
            )
    if peaks and (rows := peak_memory.report(pmodel, peaks)):
        Path(args.memory_out).write_text(json.dumps(rows, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
