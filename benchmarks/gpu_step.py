"""Training steps of a ~1B zoo model on one GPU against the planner's prediction for a cluster
preset.

Run: python benchmarks/gpu_step.py [--model gpt-1.3b] [--cluster h200] [--global-batch 16]
[--seq-len 2048] For the planner's own pick at tp = pp = dp = 1 and a few forced variants (larger
micro-batches, recomputation) it plans, runs `hp.parallelize` in a world of one on CUDA with AdamW
(fused), and prints per configuration: measured vs predicted step time (median after one warm-up
step; pmodel.metrics), MFU against the preset's bf16 peak, peak memory (torch's max allocated, and
max reserved) against the plan's prediction (which adds the preset's reserved_bytes for the CUDA
context and NCCL; the script exits 1 when a peak is above the prediction without the reserve: an
under-prediction), and the exact bytes of weights, gradients and optimizer state against the
planner's per-parameter figures. `--json FILE` writes the rows. Needs a CUDA device (exit 2 without
one).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import weakref

import torch
import torch.distributed as dist

import hyparallel as hp
from hyparallel.planner import costs

VARIANTS = {
    "planner's pick": {},
    "micro-batch 4": {"micro_batch": 4},
    "recompute full": {"recompute": "full"},
}


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def run(
    model_name: str, cluster: hp.ClusterSpec, args: argparse.Namespace, constraints: dict
) -> dict:
    model = hp.models.build(model_name)
    plan = hp.plan(
        model, cluster, args.global_batch, args.seq_len, "bf16", tp=1, pp=1, dp=1, **constraints
    )
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    pmodel = hp.parallelize(model, plan, seed=0, device="cuda:0" if cuda else "cpu")
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-4, fused=cuda)
    tokens = torch.randint(
        0,
        pmodel.module.config.vocab_size,
        (args.global_batch, args.seq_len + 1),
        device=args.device,
    )
    state = {}
    for step in range(args.steps):
        loss = pmodel.train_step(tokens[:, :-1], tokens[:, 1:])
        if step == args.steps - 1:
            state["grads"] = tensor_bytes(p.grad for p in pmodel.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    loss_value = loss.item()
    summary = pmodel.metrics.summary()
    params = list(pmodel.parameters())
    count = sum(p.numel() for p in params)
    state["weights"] = tensor_bytes(params)
    state["optimizer"] = tensor_bytes(
        t for s in optimizer.state.values() for t in s.values() if t.dim() > 0
    )
    predicted_state = count * costs.state_bytes_per_param("bf16", 0, 1)
    reserved = cluster.device.reserved_bytes
    row = {
        "config": (
            f"micro-batch {plan.training.micro_batch} x {plan.num_microbatches}, "
            f"recompute {plan.parallel.recompute}"
        ),
        "loss": loss_value,
        "parameters": count,
        "measured_step_s": summary.step_time_s,
        "predicted_step_s": summary.predicted_step_time_s,
        "measured_mfu": summary.mfu,
        "predicted_mfu": summary.predicted_mfu,
        "tokens_per_s": summary.tokens_per_s,
        "tflops_per_gpu": summary.tflops_per_gpu,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else float("nan"),
        "predicted_peak_gib": summary.predicted_memory_gib,
        "predicted_peak_without_reserved_gib": summary.predicted_memory_gib - reserved / 2**30,
        "state_bytes_measured": state,
        "state_bytes_measured_total": sum(state.values()),
        "state_bytes_predicted": predicted_state,
    }
    if args.profile:
        try:
            profile_step(pmodel, optimizer, tokens)
        except Exception as exc:  # noqa: BLE001 - the measurements above stand without the profile
            print(f"profile failed: {type(exc).__name__}: {exc}", flush=True)
    alive = weakref.ref(params[0])
    del pmodel, optimizer, params, model
    dist.destroy_process_group()
    # Note [the H200 rows] in tests/test_planner_memory.py: a ParallelModel holds reference cycles,
    # so without a collection its weights outlive this function and count in the next variant's
    # peak.
    gc.collect()
    if alive() is not None:
        raise RuntimeError(
            "the variant's weights are still referenced after it ended; the next peak would count"
            " them"
        )
    if cuda:
        torch.cuda.empty_cache()
    return row


def profile_step(pmodel, optimizer, tokens) -> None:
    """torch.profiler over one step: the kernels that take the device's time, and how many
    launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pmodel.train_step(tokens[:, :-1], tokens[:, 1:])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if str(getattr(e, "device_type", "")).endswith("CUDA"))
    print(f"profile: {kernels} kernel launches in the step", flush=True)
    print(
        events.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60), flush=True
    )


def print_row(name: str, row: dict) -> None:
    print(f"\n== {name}: {row['config']} (loss {row['loss']:.3f})", flush=True)
    print(
        f"step      measured {row['measured_step_s'] * 1e3:8.1f} ms   "
        f"predicted {row['predicted_step_s'] * 1e3:8.1f} ms   "
        f"measured/predicted {row['measured_step_s'] / row['predicted_step_s']:.2f}"
    )
    print(
        f"MFU       measured {row['measured_mfu']:8.1%}      predicted {row['predicted_mfu']:8.1%} "
        f"  ({row['tflops_per_gpu']:.0f} TFLOP/s, {row['tokens_per_s']:,.0f} tokens/s)"
    )
    print(
        f"memory    peak allocated {row['peak_allocated_gib']:.2f} GiB, reserved"
        f" {row['peak_reserved_gib']:.2f} GiB; predicted"
        f" {row['predicted_peak_without_reserved_gib']:.2f} GiB + preset reserve ="
        f" {row['predicted_peak_gib']:.2f} GiB"
    )
    measured = row["state_bytes_measured"]
    print(
        f"state     weights {measured['weights'] / 2**30:.2f} + grads"
        f" {measured['grads'] / 2**30:.2f} + optimizer {measured['optimizer'] / 2**30:.2f} ="
        f" {row['state_bytes_measured_total'] / 2**30:.2f} GiB; planner"
        f" {row['state_bytes_predicted'] / 2**30:.2f} GiB"
        f" ({costs.state_bytes_per_param('bf16', 0, 1):.0f} B/param)",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-1.3b")
    parser.add_argument(
        "--cluster",
        default="h200",
        help="preset or ClusterSpec YAML (e.g. from hyparallel calibrate)",
    )
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated names from: " + ", ".join(VARIANTS),
    )
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument(
        "--profile", action="store_true", help="also profile one step of each variant (top kernels)"
    )
    parser.add_argument(
        "--device", default="cuda", help="cuda (default), or cpu for a smoke test with a tiny model"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_step: no CUDA device", file=sys.stderr)
        return 2
    cluster = hp.ClusterSpec.resolve(args.cluster, num_nodes=1, gpus_per_node=1)
    print(
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'} torch"
        f" {torch.__version__}; {args.model}, global batch {args.global_batch} x {args.seq_len}"
        f" tokens, bf16, AdamW; predictions for '{cluster.name}'",
        flush=True,
    )
    rows = {}
    for name in args.variants.split(","):
        try:
            rows[name] = run(args.model, cluster, args, VARIANTS[name])
            print_row(name, rows[name])
        except Exception as exc:  # noqa: BLE001 - report and go on to the next variant: device time is scarce
            print(f"\n== {name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            if dist.is_initialized():
                dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    under = [
        name
        for name, row in rows.items()
        # NaN (CPU smoke test): False
        if row["peak_allocated_gib"] > row["predicted_peak_without_reserved_gib"]
    ]
    for name in under:
        row = rows[name]
        print(
            f"UNDER-PREDICTED: {name}: peak allocated {row['peak_allocated_gib']:.2f} GiB >"
            f" predicted {row['predicted_peak_without_reserved_gib']:.2f} GiB",
            flush=True,
        )
    return 0 if len(rows) == len(args.variants.split(",")) and not under else 1


if __name__ == "__main__":
    raise SystemExit(main())
