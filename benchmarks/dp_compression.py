"""Gradient compression on the dp axis: each parallel.grad_compression mode against uncompressed
torch DDP.

Run: python benchmarks/dp_compression.py [--worlds 2,4 --model "gpt-tiny num_layers=4
hidden_size=256
     num_heads=8 vocab_size=1024 max_seq_len=128" --seq 128 --batch 16 --steps 10 --rank 4] [--json
     FILE]
It launches itself under torchrun (gloo on the CPU, OMP_NUM_THREADS=1) once per world size in
--worlds (dp = world); ``torchrun --nproc_per_node N benchmarks/dp_compression.py ...`` runs one
world directly.

Every side holds the same zoo model materialised from the same seed. The peer is torch's
DistributedDataParallel without a hook (fp32 all-reduce); hyparallel runs ``hp.parallelize`` under a
plan of dp = world, ZeRO 0, for each mode: none, bf16, fp16, powersgd (rank --rank, compressing from
step 2). A further DDP runs every step under ``no_sync`` (no gradient reduction at all): the step
time without dp communication, so each side's measured dp seconds are its step time minus that one.
The sides alternate step by step after warm-up (PowerSGD past its uncompressed warm-up steps); rank
0 prints the median step (the slowest rank's) of each, its ratio to DDP, the bytes each rank handed
to all-reduce in one step (counted by wrapping torch.distributed.all_reduce, which the compression
hooks call; DDP's own reducer, which mode none is too, is counted through torch's allreduce_hook,
which sends what the reducer sends), and the planner's predicted comm_s.dp for the same plan (less
its AdamW step) next to the measured dp seconds. Plans are made for a cluster calibrated here for
each world size (`hyparallel calibrate --quick --nproc N`: a CPU "device" is one process, and its
share of the cores depends on how many run), or for --cluster. Finally the planner chooses among
every mode (grad_compression="any"): its choice should be the mode measured fastest, or one within
the measurement's noise.
``--json FILE``: the figures of every world (under torchrun: rank 0's of its world).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from common import alternate  # benchmarks/common.py, beside this script
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import hyparallel as hp
from hyparallel.planner import costs
from hyparallel.runtime.parallel import token_cross_entropy
from hyparallel.spec.schema import Plan
from hyparallel.tensor.init import materialize_

MODEL = "gpt-tiny num_layers=4 hidden_size=256 num_heads=8 vocab_size=1024 max_seq_len=128"
MODES = ("none", "bf16", "fp16", "powersgd")
SEED, LR, START = 0, 1e-3, 2
# a judgement: step-time medians closer than 2% are a tie (the pick must not be measured slower)
NOISE = 0.02


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL)
    for name, default in (("seq", 128), ("batch", 16), ("steps", 10), ("rank", 4)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--worlds", default="2,4", help="dp sizes to launch (without torchrun)")
    parser.add_argument(
        "--cluster", help="cluster YAML to plan with (default: `hyparallel calibrate --quick` here)"
    )
    parser.add_argument("--json", help="rank 0 writes the figures here")
    return parser.parse_args()


def launch_each_world(args: argparse.Namespace) -> None:
    """Run this script under torchrun once per world size; print each, merge their figures into
    --json."""
    worlds, merged = [int(w) for w in args.worlds.split(",")], {"cases": [], "worlds": []}
    forwarded = [
        f"--{k}={v}" for k, v in vars(args).items() if k not in ("json", "worlds", "cluster") and v
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for world in worlds:
        with tempfile.TemporaryDirectory() as folder:
            out, cluster = (
                Path(folder) / "figures.json",
                args.cluster or str(Path(folder) / "cluster.yaml"),
            )
            # this machine's figures for `world` processes (a CPU "device" is a process)
            if not args.cluster:
                calibrate = [
                    sys.executable,
                    "-m",
                    "hyparallel",
                    "calibrate",
                    "--quick",
                    "--nproc",
                    str(world),
                ]
                done = subprocess.run(
                    [*calibrate, "--out", cluster], env=env, text=True, capture_output=True
                )
                if done.returncode != 0:
                    sys.exit(f"calibrate --nproc {world} failed:\n{done.stderr[-3000:]}")
            forwarded_here = [*forwarded, f"--cluster={cluster}"]
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                str(world),
            ]
            proc = subprocess.run(
                [*command, __file__, *forwarded_here, "--json", str(out)],
                env=env,
                text=True,
                capture_output=True,
            )
            print(proc.stdout, end="", flush=True)
            if proc.returncode != 0 and not out.exists():
                sys.exit(f"dp={world} failed:\n{proc.stderr[-3000:]}")
            figures = json.loads(out.read_text())
        merged["cases"] += figures["cases"]
        merged["worlds"].append({k: v for k, v in figures.items() if k != "cases"})
        merged["peer"] = figures["peer"]
    if args.json:
        Path(args.json).write_text(json.dumps(merged, indent=1))


@contextmanager
def counted() -> Iterator[list[int]]:
    """Bytes handed to torch.distributed.all_reduce inside the block, by this rank."""
    sent, original = [0], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield sent
    finally:
        dist.all_reduce = original


def plan_for(model, args, world: int, mode: str) -> Plan:
    if args.cluster:
        cluster = hp.ClusterSpec.load(args.cluster).resized(num_nodes=1, gpus_per_node=world)
    else:
        cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=world)
    extra = dict(powersgd_rank=args.rank, powersgd_start_step=START) if mode == "powersgd" else {}
    return hp.plan(
        model,
        cluster,
        args.batch,
        args.seq,
        "fp32",
        dp=world,
        tp=1,
        pp=1,
        zero=0,
        micro_batch=args.batch // world,
        grad_compression=mode,
        **extra,
    )


def predicted_dp_s(plan: Plan) -> float:
    """The plan's predicted dp seconds without the optimizer step: ``comm_s.dp`` ends the step with
    AdamW's update, which the measured side (step time minus the no_sync step's, which updates too)
    leaves out."""
    device = plan.cluster.device
    adam_s = (
        plan.model.num_params
        * costs.adam_step_bytes_per_param(plan.training.dtype)
        / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)
    )
    return plan.predicted.comm_s.dp - adam_s


def main() -> None:
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:
        launch_each_world(args)
        return
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)  # the same global batch on every rank; each side takes this rank's rows
    vocab = hp.models.load(args.model).module.config.vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    mine = inputs.chunk(world)[rank], targets.chunk(world)[rank]

    runs, sent, plans = {}, {}, {}
    for mode in MODES:
        model = hp.models.load(args.model).module
        plans[mode] = plan_for(model, args, world, mode)
        pmodel = hp.parallelize(model, plans[mode], seed=SEED, device="cpu")
        optimizer = torch.optim.AdamW(pmodel.parameters(), lr=LR)

        def step(pmodel=pmodel, optimizer=optimizer) -> torch.Tensor:
            loss = pmodel.train_step(*mine)
            optimizer.step()
            optimizer.zero_grad()
            return loss

        # PowerSGD's uncompressed warm-up (and DDP's bucket rebuild) out of the way
        for _ in range(START):
            step()
        with counted() as count:
            step()
        sent[mode] = count[0]
        runs[mode] = (step, None)

    def ddp_side(no_sync: bool, hook=None):
        model = materialize_(hp.models.load(args.model).module, "cpu", seed=SEED)
        ddp = DistributedDataParallel(model)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR)

        def step() -> torch.Tensor:
            with ddp.no_sync() if no_sync else nullcontext():
                loss = token_cross_entropy(ddp(mine[0]), mine[1])
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        return step

    counting_ddp = ddp_side(False, default_hooks.allreduce_hook)
    counting_ddp()  # DDP's first step: its buckets rebuilt after it
    with counted() as count:
        counting_ddp()
    sent["DDP"] = count[0]
    # hyparallel's none is DDP without a hook: its reducer sends what the peer's does
    sent["none"] = sent["DDP"]
    runs["DDP"] = (ddp_side(False), None)
    runs["no dp communication"] = (ddp_side(True), None)
    medians = alternate(runs, args.steps, warmup=2)
    chosen = plan_for(
        hp.models.load(args.model).module, args, world, "any"
    ).parallel.grad_compression

    if rank == 0:
        params = sum(p.numel() for p in hp.models.load(args.model).module.parameters())
        ddp_ms, bare_ms = medians["DDP"], medians["no dp communication"]
        print(
            f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs,"
            f" {torch.get_num_threads()} torch threads per rank; torch {torch.__version__};"
            f" dp={world} gloo CPU"
        )
        print(
            f"model: {args.model} ({params:,} parameters), fp32; global batch {args.batch} x seq"
            f" {args.seq}; AdamW; median of {args.steps} steps; PowerSGD rank {args.rank}; a step"
            f" without dp communication: {bare_ms:.1f} ms"
        )
        cases = []
        for name in (*MODES, "DDP"):
            ms = medians[name]
            measured_dp_s = max(ms - bare_ms, 0.0) / 1e3
            predicted = predicted_dp_s(plans[name]) if name in plans else None
            case = {
                "case": f"dp={world} {name}",
                "ms": ms,
                "ratio_to_ddp": ms / ddp_ms,
                "all_reduce_bytes": sent[name],
                "bytes_ratio_to_ddp": sent[name] / sent["DDP"],
                "measured_dp_s": measured_dp_s,
                "predicted_dp_s": predicted,
            }
            cases.append(case)
            print(
                f"{name:>9}: {ms:7.1f} ms/step, x{ms / ddp_ms:.3f} of DDP; {sent[name] / 1e6:6.2f}"
                f" MB to all-reduce per rank (x{sent[name] / sent['DDP']:.3f}); dp seconds measured"
                f" {measured_dp_s:.4f}"
                + (f", predicted {predicted:.4f}" if predicted is not None else "")
            )
        fastest = min(MODES, key=medians.__getitem__)
        agrees = medians[chosen] <= medians[fastest] * (1 + NOISE)
        print(
            f"planner (grad_compression any) chose {chosen}; measured fastest {fastest}: "
            f"{'agrees' if agrees else 'DISAGREES'} (within {NOISE:.0%})"
        )
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "peer": "torch DistributedDataParallel (fp32, no hook)",
                        "config": {**vars(args), "dp": world},
                        "cases": cases,
                        "bare_ms": bare_ms,
                        "planner_choice": chosen,
                        "fastest": fastest,
                        "agrees": agrees,
                    },
                    indent=1,
                )
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
