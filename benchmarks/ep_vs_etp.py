"""Expert parallelism against expert tensor parallelism for a mixture of experts, one training step
each, in one run.

Run: torchrun --nproc_per_node 2 benchmarks/ep_vs_etp.py [--hidden 256 --experts 8 --top-k 2
--layers 2 --seq 128 --batch 8 --steps 6] [--json FILE] (gloo on the CPU; torchrun sets
OMP_NUM_THREADS=1.)

The model is tests.tiny_lms:where_moe_lm (a hand-written top-k MoE: torch.where dispatch over a
ModuleList of MLP experts) at the given size. Both sides train the same global batch on the same 2
processes from the same weights (same seed): ep, dp 2 x ep 2 (each rank half the batch, half the
experts, tokens exchanged with all-to-all; Note [expert parallelism] in
hyparallel/runtime/experts.py); etp, tp 2 (each rank the whole batch, every expert split column /
row by tensor parallelism, the planner's own split). The sides alternate step by step; rank 0
checks that each side's loss is the single device's (fp32, rtol 1e-5: the two sum in other orders)
and prints the median step times and their ratio (``--json FILE``: also written there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hyparallel as hp
from hyparallel.runtime.parallel import token_cross_entropy
from hyparallel.tensor.init import materialize_

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.tiny_lms

LOSS_RTOL = 1e-5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    spec = (
        f"tests.tiny_lms:where_moe_lm hidden={args.hidden} experts={args.experts}"
        f" top_k={args.top_k} layers={args.layers} vocab_size=256"
    )
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    reference = materialize_(hp.models.load(spec).module, "cpu", seed=0)
    want = token_cross_entropy(reference(inputs), targets).item()
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=2)
    sides = {}
    for name, fixed in (("ep", dict(dp=2, tp=1, ep=2)), ("etp", dict(dp=1, tp=2))):
        model = hp.models.load(spec).module
        plan = hp.plan(
            model,
            cluster,
            args.batch,
            args.seq,
            "fp32",
            pp=1,
            micro_batch=args.batch // fixed["dp"],
            **fixed,
        )
        sides[name] = hp.parallelize(model, plan, seed=0, device="cpu")
    times: dict[str, list[float]] = {name: [] for name in sides}
    losses = {}
    for _ in range(args.steps):
        for name, pmodel in sides.items():
            dist.barrier()
            start = time.perf_counter()
            loss = pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets))
            dist.barrier()
            times[name].append(time.perf_counter() - start)
            losses.setdefault(name, loss.item())
            for param in pmodel.parameters():
                param.grad = None
    if dist.get_rank() == 0:
        for name, loss in losses.items():
            assert abs(loss - want) <= LOSS_RTOL * abs(want), (name, loss, want)
        median = {name: statistics.median(t[1:]) for name, t in times.items()}  # the first warms up
        figures = {
            "median_step_s": median,
            "ep_over_etp": median["ep"] / median["etp"],
            "loss": losses,
            "single_device_loss": want,
            "args": vars(args),
        }
        print(
            f"ep (dp 2 x ep 2): {median['ep'] * 1e3:.1f} ms/step, etp (tp 2, experts split):"
            f" {median['etp'] * 1e3:.1f} ms/step; ep / etp = {figures['ep_over_etp']:.2f}"
            f" (losses equal to one device's within rtol {LOSS_RTOL})"
        )
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
