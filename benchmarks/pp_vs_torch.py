"""hyparallel's pipeline runtime against PyTorch's torch.distributed.pipelining, one training step
each.

Run: torchrun --nproc_per_node 2 benchmarks/pp_vs_torch.py [--layers 8 --hidden 256 --seq 128
--batch 16
     --microbatches 8 --steps 10 --schedules gpipe,1f1b] [--json FILE]
(gloo on the CPU, one stage per rank; torchrun sets OMP_NUM_THREADS=1.)

Both sides run the same zoo GPT (same seed, so the same weights) cut into the same stages, one per
rank: the blocks split evenly, the embeddings with the first, the final norm and head with the last.
Each side holds its own copy, materialised from its own meta model, so the two never share a
parameter or a gradient buffer. The embedding and head are untied: torch.distributed.pipelining does
not sum a tied weight's gradient over the ranks holding it, which hyparallel does. hyparallel runs
``PipelineRuntime.train_step``; PyTorch runs ``PipelineStage`` around the same hyparallel stage
module (a thin adapter for its call convention) under ``ScheduleGPipe`` or ``Schedule1F1B``. One
step is forward and backward over all micro-batches with a mean cross-entropy loss, no optimizer,
gradients zeroed between steps. Per schedule the sides first check they agree (mean loss and this
rank's gradients), then alternate step by step after two warm-up steps each; rank 0 prints the
median step time (the slowest rank's) of each and their ratio (``--json FILE``: rank 0 also writes
the figures there).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import agreement, alternate, timed  # benchmarks/common.py, beside this script
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import hyparallel as hp
from hyparallel.pipeline import split_model
from hyparallel.pipeline.executor import PipelineRuntime
from hyparallel.tensor.init import materialize_

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# fp32: torch divides the summed gradients by m, hyparallel each loss: rounding only
RTOL, ATOL = 1e-5, 1e-6
WARMUP, SEED = 2, 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (
        ("layers", 8),
        ("hidden", 256),
        ("heads", 8),
        ("vocab", 1024),
        ("seq", 128),
        ("batch", 16),
        ("microbatches", 8),
        ("steps", 10),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--json", help="rank 0 writes the figures here")
    return parser.parse_args()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # a micro-batch's mean, as both sides expect
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def stage_paths(layers: int, pp: int) -> list[list[str]]:
    """Blocks split evenly; embeddings go with the first stage, final norm and head with the
    last."""
    per = layers // pp
    stages = [
        [f"layers.{i}" for i in range(k * per, (k + 1) * per if k < pp - 1 else layers)]
        for k in range(pp)
    ]
    stages[0] = ["tok_embeddings", "pos_embeddings", "dropout", *stages[0]]
    stages[-1] += ["norm", "output"]
    return stages


def build_stage(args: argparse.Namespace, pp: int, rank: int):
    """A fresh meta model, split and with only this rank's stage materialised: (split, stage
    module)."""
    spec = (
        f"gpt-tiny num_layers={args.layers} hidden_size={args.hidden} num_heads={args.heads} "
        f"vocab_size={args.vocab} max_seq_len={args.seq} tie_embeddings=false"
    )
    model = hp.models.load(spec).module
    example = torch.zeros(
        args.batch // args.microbatches, args.seq, dtype=torch.long, device="meta"
    )
    split = split_model(model, stage_paths(args.layers, pp), example)
    if len(split.input_names) != 1:
        raise RuntimeError(
            f"expected the token ids as the only user input, got {split.input_names}"
        )
    materialize_(model, "cpu", seed=SEED, only=split.state_names(rank))
    return split, split.stage_module(rank)


class TorchAdapter(nn.Module):
    """torch's call convention over a hyparallel stage: stage 0 takes the tokens, later ones what
    was sent."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, *args: torch.Tensor):
        return self.stage([args[0]], ()) if self.stage.index == 0 else self.stage([None], args)


def clear_grads(params: list[nn.Parameter]) -> None:
    for p in params:
        p.grad = None


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    last = pp - 1  # the rank of the last stage
    # separate p2p channels for each side
    ours_group, theirs_group = dist.new_group(), dist.new_group()
    (split, ours_stage), (_, theirs_stage) = (
        build_stage(args, pp, rank),
        build_stage(args, pp, rank),
    )
    adapter = TorchAdapter(theirs_stage)
    ours_params, theirs_params = list(ours_stage.parameters()), list(adapter.parameters())

    torch.manual_seed(7)  # the same batch on every rank
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if rank == 0:
        print(
            f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs,"
            f" {torch.get_num_threads()} torch threads per rank; torch {torch.__version__}; pp={pp}"
            " gloo CPU"
        )
        print(
            f"model: gpt {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab"
            f" {args.vocab}, fp32; batch {args.batch} x seq {args.seq} in {args.microbatches}"
            f" micro-batches; median of {args.steps} steps after {WARMUP} warm-up"
        )

    cases = []
    for kind in args.schedules.split(","):
        runtime = PipelineRuntime(
            split,
            {rank: ours_stage},
            ours_group,
            schedule_kind=kind,
            num_microbatches=args.microbatches,
        )
        torch_stage = PipelineStage(adapter, rank, pp, torch.device("cpu"), group=theirs_group)
        torch_schedule = TORCH_SCHEDULES[kind](torch_stage, args.microbatches, loss_fn=loss_fn)

        # This iteration's runtime and schedule, bound when defined (the functions are only called
        # in it).
        def ours(runtime: PipelineRuntime = runtime) -> torch.Tensor:
            return runtime.train_step(inputs, targets, loss_fn)

        def theirs(torch_schedule: ScheduleGPipe | Schedule1F1B = torch_schedule) -> torch.Tensor:
            losses: list[torch.Tensor] = []
            torch_schedule.step(
                *([inputs] if rank == 0 else []),
                target=targets if rank == last else None,
                losses=losses,
                return_outputs=False,
            )
            loss = torch.stack(losses).mean().detach() if rank == last else torch.zeros(())
            # hyparallel hands every rank the loss too
            dist.broadcast(loss, src=last, group=theirs_group)
            return loss

        # Agreement: a step each from zeroed gradients, compared parameter by parameter under the
        # model's names.
        zero_ours, zero_theirs = (
            partial(clear_grads, ours_params),
            partial(clear_grads, theirs_params),
        )
        (_, ours_loss), (_, theirs_loss) = timed(ours, zero_ours), timed(theirs, zero_theirs)
        summary = agreement(
            (
                (p.grad, adapter.stage.body.get_parameter(name).grad)
                for name, p in ours_stage.body.named_parameters()
            ),
            RTOL,
            ATOL,
        )
        loss_ok = torch.allclose(ours_loss, theirs_loss, rtol=RTOL, atol=0)

        medians = alternate(
            {"hyparallel": (ours, zero_ours), "torch": (theirs, zero_theirs)}, args.steps, WARMUP
        )
        ours_ms, theirs_ms = medians["hyparallel"], medians["torch"]
        if rank == 0:
            ok = "OK" if loss_ok and summary[0] == 0 else "MISMATCH"
            print(
                f"[{kind}] check {ok}: loss hyparallel {ours_loss.item():.6f} torch"
                f" {theirs_loss.item():.6f}; {int(summary[1] - summary[0])}/{int(summary[1])}"
                f" gradients equal (rtol {RTOL:g}, atol {ATOL:g}), max abs diff {summary[2]:.1e}"
            )
            print(
                f"[{kind}] hyparallel / torch step time ratio: {ours_ms / theirs_ms:.2f} "
                f"(hyparallel {ours_ms:.1f} ms, torch {theirs_ms:.1f} ms)"
            )
            cases.append(
                {
                    "case": kind,
                    "hyparallel_ms": ours_ms,
                    "torch_ms": theirs_ms,
                    "ratio": ours_ms / theirs_ms,
                    "check": f"{ok}: max abs gradient diff {summary[2]:.1e}",
                }
            )
    if rank == 0 and args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "peer": "torch.distributed.pipelining (PipelineStage + ScheduleGPipe/1F1B)",
                    "config": {**vars(args), "pp": pp},
                    "cases": cases,
                },
                indent=1,
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
