"""Context parallelism 2 against one process on a long sequence, in one run: time and memory.

Run: torchrun --nproc_per_node 2 benchmarks/cp_vs_one.py [--seq 8192 --hidden 128 --layers 2
--heads 4 --batch 1 --steps 3] [--json FILE] (gloo on the CPU; torchrun sets OMP_NUM_THREADS=1.)

A GPT (hyparallel's own: learned positions, fused qkv, F.scaled_dot_product_attention) of the given
size trains the same batch from the same weights: first in one process (rank 0 alone, the other
waiting at a barrier), then under cp 2 over the two processes, keys and values gathered and then
passed round the ring (Note [context parallelism] in hyparallel/runtime/context.py). Each side's
peak is the tensor bytes allocated during its steps, on each rank
(hyparallel.runtime.peak_memory.PeakMemory: the weights, made before, are not in it); the step is
the median of all but the first. Rank 0 checks every side's first loss against the one process's
(fp32, rtol 1e-5) and prints time and peak per rank, and their ratios to one process's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hyparallel as hp
from hyparallel.runtime.parallel import token_cross_entropy
from hyparallel.runtime.peak_memory import PeakMemory
from hyparallel.tensor.init import materialize_

LOSS_RTOL = 1e-5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def timed_steps(step, steps: int, together: bool = True) -> tuple[list[float], list[float], int]:
    """``steps`` calls of ``step()`` (returning the loss): seconds each, losses, peak bytes;
    ``together``: each step timed from and to a barrier of every rank (False: this rank alone)."""
    barrier = dist.barrier if together else lambda: None
    tracker = PeakMemory("cpu").start()
    seconds, losses = [], []
    for _ in range(steps):
        barrier()
        start = time.perf_counter()
        losses.append(step())
        barrier()
        seconds.append(time.perf_counter() - start)
    return seconds, losses, tracker.stop()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = (
        f"gpt-tiny num_layers={args.layers} hidden_size={args.hidden} num_heads={args.heads}"
        f" max_seq_len={args.seq}"
    )
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    sides: dict[str, dict] = {}

    # one process: rank 0 alone
    if rank == 0:
        model = materialize_(hp.models.load(spec).module, "cpu", seed=0)

        def one_step(model=model) -> float:
            loss = token_cross_entropy(model(inputs), targets)
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss.item()

        seconds, losses, peak = timed_steps(one_step, args.steps, together=False)
        sides["one process"] = {"seconds": seconds, "losses": losses, "peaks": [peak]}
        del model
    dist.barrier()

    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=2)
    for kind in ("gather", "ring"):
        model = hp.models.load(spec).module
        plan = hp.plan(
            model,
            cluster,
            args.batch,
            args.seq,
            "fp32",
            dp=1,
            tp=1,
            pp=1,
            cp=2,
            cp_attention=kind,
            zero=0,
            micro_batch=args.batch,
            recompute="none",
        )
        pmodel = hp.parallelize(model, plan, seed=0, device="cpu")

        def cp_step(pmodel=pmodel) -> float:
            loss = pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets))
            for param in pmodel.parameters():
                param.grad = None
            return loss.item()

        seconds, losses, peak = timed_steps(cp_step, args.steps)
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
        sides[f"cp 2 ({kind})"] = {"seconds": seconds, "losses": losses, "peaks": peaks}
        del pmodel, model
    if rank == 0:
        want = sides["one process"]["losses"][0]
        for name, side in sides.items():
            got = side["losses"][0]
            assert abs(got - want) <= LOSS_RTOL * abs(want), (name, got, want)
        figures = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "sides": {}}
        one = sides["one process"]
        one_step_s, one_peak = statistics.median(one["seconds"][1:]), one["peaks"][0]
        for name, side in sides.items():
            step_s = statistics.median(side["seconds"][1:])
            figures["sides"][name] = {
                "step_s": step_s,
                "peak_gib_per_rank": [p / 2**30 for p in side["peaks"]],
                "time_ratio": step_s / one_step_s,
                "peak_ratio": max(side["peaks"]) / one_peak,
                "loss": side["losses"][0],
            }
            print(
                f"{name:14s} {step_s * 1e3:8.1f} ms/step (x{step_s / one_step_s:.2f}), peak"
                f" {', '.join(f'{p / 2**20:.1f}' for p in side['peaks'])} MiB per rank"
                f" (x{max(side['peaks']) / one_peak:.2f}), loss {side['losses'][0]:.6f}"
            )
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
