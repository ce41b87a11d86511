"""hyparallel's tensor parallelism against PyTorch's DTensor tensor parallelism, one training step
each.

Run: torchrun --nproc_per_node 2 benchmarks/tp_vs_dtensor.py [--layers 4 --hidden 256 --seq 128
--batch 4] [--json FILE] (gloo on the CPU; torchrun sets OMP_NUM_THREADS=1.)

Both sides start from the same zoo GPT (same seed, so the same weights) and split exactly the same
modules: per block, qkv and mlp.fc column-wise, attn.proj and mlp.proj row-wise (Megatron's plan).
Embeddings and the output head stay replicated on both sides. hyparallel uses
``apply_tensor_parallel``; DTensor uses ``parallelize_module`` with ``ColwiseParallel`` and
``RowwiseParallel`` on a 1-D DeviceMesh. One step is forward, cross-entropy and backward (gradients
zeroed between steps); the two sides alternate step by step on the same batch, and rank 0 prints the
median step times and their ratio, after checking that each side's loss matches the single-device
loss (``--json FILE``: rank 0 also writes the figures there).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import hyparallel as hp
from hyparallel.tensor import apply_tensor_parallel

STYLES = {
    "layers.*.attn.qkv": "column",
    "layers.*.attn.proj": "row",
    "layers.*.mlp.fc": "column",
    "layers.*.mlp.proj": "row",
}
LOGITS_RTOL = 1e-5  # see the check in main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--json", help="rank 0 writes the figures here")
    return parser.parse_args()


def interleave_qkv_for_dtensor(model: torch.nn.Module, tp: int) -> None:
    """Reorder each fused qkv's rows from [q | k | v] to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], in
    place.

    ColwiseParallel gives rank r the r-th contiguous block of output rows. On the [q | k | v] layout
    rank 0 would hold all of q's first half and part of k, and the model's ``chunk(3)`` would then
    read them as q, k and v: the forward runs (the shapes fit) but computes something else. With the
    rows interleaved per rank, as Megatron-LM stores its fused QKV, each rank's block is its own
    heads' [q_r | k_r | v_r], so DTensor computes the single-device function with the same FLOPs.
    """
    with torch.no_grad():
        for layer in model.layers:
            qkv = layer.attn.qkv
            hidden = qkv.in_features
            qkv.weight.copy_(
                qkv.weight.view(3, tp, -1, hidden).transpose(0, 1).reshape(3 * hidden, hidden)
            )
            if qkv.bias is not None:
                qkv.bias.copy_(qkv.bias.view(3, tp, -1).transpose(0, 1).reshape(-1))


def step(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor
) -> tuple[float, float]:
    """One forward + cross-entropy + backward; returns (seconds, loss). Ranks start together."""
    model.zero_grad(set_to_none=True)
    dist.barrier()
    start = time.perf_counter()
    logits = model(inputs)  # (B, T, vocab), full on every rank on both sides
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return time.perf_counter() - start, loss.item()


@torch.no_grad()
def logits_error(
    model: torch.nn.Module, inputs: torch.Tensor, reference_logits: torch.Tensor
) -> float:
    """max |logits - reference| / max |reference|. Near initialisation the loss is about log(vocab)
    whatever the attention computes, so the loss alone barely shows a wrong head layout; logits
    do."""
    return ((model(inputs) - reference_logits).abs().max() / reference_logits.abs().max()).item()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    reference = hp.models.build(
        "gpt-mini",
        device="cpu",
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        max_seq_len=max(256, args.seq),
    )
    ours, theirs = copy.deepcopy(reference), copy.deepcopy(reference)

    graph = hp.trace(ours, ours.example_inputs(1, args.seq))
    apply_tensor_parallel(
        ours, STYLES, dist.group.WORLD, graph, sequence_parallel=False, gather_logits=True
    )

    mesh = init_device_mesh("cpu", (tp,))
    interleave_qkv_for_dtensor(theirs, tp)
    parallelize_module(
        theirs,
        mesh,
        {
            path: ColwiseParallel() if style == "column" else RowwiseParallel()
            for path, style in STYLES.items()
        },
    )

    torch.manual_seed(7)  # same batch on every rank: tensor parallelism replicates the data
    tokens = torch.randint(0, reference.config.vocab_size, (args.batch, args.seq + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        ref_logits = reference(inputs)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten()).item()
    errors = {
        "hyparallel": logits_error(ours, inputs, ref_logits),
        "DTensor": logits_error(theirs, inputs, ref_logits),
    }
    # fp32: the all-reduces sum partial products in another order than one matmul, so the sides
    # differ from the single-device model by float rounding only (about 1e-6); anything larger is a
    # wrong split.
    if wrong := {name: error for name, error in errors.items() if error > LOGITS_RTOL}:
        raise RuntimeError(
            f"logits differ from the single-device model beyond rounding ({LOGITS_RTOL:g}): {wrong}"
        )

    times: dict[str, list[float]] = {"hyparallel": [], "DTensor": []}
    losses: dict[str, float] = {}
    for i in range(args.warmup + args.iterations):
        for name, model in (("hyparallel", ours), ("DTensor", theirs)):
            seconds, loss = step(model, inputs, targets)
            # the first step's loss: no optimizer, so every step's is the same
            losses.setdefault(name, loss)
            if i >= args.warmup:
                times[name].append(seconds)

    # A step ends when the slowest rank finishes: take the max over ranks of each step's time.
    per_rank = torch.tensor([times["hyparallel"], times["DTensor"]], dtype=torch.float64)
    dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)
    ours_ms, theirs_ms = (statistics.median(row.tolist()) * 1e3 for row in per_rank)
    if rank == 0:
        print(
            f"model: gpt {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
            f"vocab {reference.config.vocab_size}, "
            f"batch {args.batch} x seq {args.seq}, fp32"
        )
        for name, loss in losses.items():
            print(
                f"{name:10} loss {loss:.6f}  single-device {ref_loss:.6f}  "
                f"rel diff {abs(loss - ref_loss) / abs(ref_loss):.1e}"
                f"  logits rel diff {errors[name]:.1e}"
            )
        print(
            f"hyparallel / DTensor step time ratio: {ours_ms / theirs_ms:.2f} (hyparallel"
            f" {ours_ms:.1f} ms, DTensor {theirs_ms:.1f} ms, median of {args.iterations}, tp={tp}"
            " gloo CPU)"
        )
        if args.json:
            check = (
                f"logits rel diff vs single-device: hyparallel {errors['hyparallel']:.1e}, "
                f"DTensor {errors['DTensor']:.1e}"
            )
            case = {
                "case": f"tp={tp}",
                "hyparallel_ms": ours_ms,
                "torch_ms": theirs_ms,
                "ratio": ours_ms / theirs_ms,
                "check": check,
            }
            Path(args.json).write_text(
                json.dumps(
                    {
                        "peer": "torch DTensor parallelize_module (Colwise/RowwiseParallel)",
                        "config": {**vars(args), "tp": tp},
                        "cases": [case],
                    },
                    indent=1,
                )
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
