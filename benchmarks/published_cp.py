"""The planner's context-parallel cost model against torchtitan's published long-context table.

Run: .venv/bin/python benchmarks/published_cp.py [--json FILE]
As benchmarks/published_moe.py does for an MoE: Llama 3.1 8B (the zoo's llama3-8b) is built on the
meta device and traced, and each published configuration (FSDP = dp under ZeRO 3, CP, local batch
1, full recomputation, bf16) costed on the stock h100-sxm preset with the run's 96 GB of memory; it
prints measured and predicted tokens per second per GPU, the signed error (predicted / measured - 1:
positive is optimistic) and the predicted peak memory against the measured one, for gather and
ring; then, for each length, the planner's own pick on the same 8 GPUs. A benchmark, not a test:
it exits 0 whatever the error.

Note [the published context-parallel rows]
    torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (commit 31a17bf), Table 2: Llama 3.1
    8B on 8 H100s (Grand Teton: 96 GB HBM2e, 500 W, NVLink), FSDP + CP + torch.compile + Float8,
    local batch 1, full activation checkpointing: FSDP 8 / CP 1 at 32,768 tokens 3,890 TPS/GPU and
    83.9 GiB; FSDP 4 / CP 2 at 65,536: 2,540 and 84.2; FSDP 2 / CP 4 at 131,072: 1,071 and 84.0;
    FSDP 1 / CP 8 at 262,144: 548 and 84.5. Their CP is torch's context_parallel (ring attention
    over SDPA's flash or cuDNN kernels).

    What hyparallel costs differently, each a source of error: Float8 Linears (about 1.3x faster
    matmuls by the same table's Table 1: 6,667 to 8,532 TPS/GPU) and torch.compile's fusions are not
    modelled (hyparallel prices bf16 kernels, so it should be pessimistic by as much on the matmul
    share); the preset is the 700 W SXM part, faster than the 500 W HBM2e one; the attention FLOPs
    the graph counts are the whole T x T product (causal masking not discounted, as Megatron-LM's
    formula), which at 262k tokens is most of the step, while flash attention skips the masked
    half; and the memory the run reports is the allocator's reserved peak, which PyTorch keeps near
    the device's limit, not what the model needs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import hyparallel as hp

HERE = Path(__file__).resolve().parent
GPUS = 8
ROWS = [  # (fsdp, cp, sequence, measured TPS/GPU, measured GiB)
    (8, 1, 32768, 3890, 83.9),
    (4, 2, 65536, 2540, 84.2),
    (2, 4, 131072, 1071, 84.0),
    (1, 8, 262144, 548, 84.5),
]
SOURCE = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (31a17bf), Table 2"


def _published():
    """benchmarks/published.py (its preset file and unbounded-memory cluster), imported by path."""
    spec = importlib.util.spec_from_file_location("benchmarks_published", HERE / "published.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(HERE))
    spec.loader.exec_module(module)
    return module


def cluster() -> hp.ClusterSpec:
    """One node of the h100-sxm preset with the run's 96 GB of memory."""
    published = _published()
    node = hp.ClusterSpec.load(published.preset_file("h100-sxm")).resized(1, GPUS)
    device = node.device.model_copy(update={"memory_bytes": 96 * 10**9})
    return node.model_copy(update={"device": device})


def predict(model, fsdp: int, cp: int, seq_len: int, attention: str, node) -> dict:
    """The row's exact configuration costed, whatever its memory (published._unbounded)."""
    fixed = dict(dp=fsdp, tp=1, pp=1, zero=3 if fsdp * cp > 1 else 0, micro_batch=1)
    fixed |= dict(recompute="full", cp=cp) | ({"cp_attention": attention} if cp > 1 else {})
    result = hp.search(model, _published()._unbounded(node), fsdp, seq_len, "bf16", **fixed)
    evaluation = result.best[0]
    return {
        "config": str(evaluation.config),
        "tps_per_gpu": fsdp * seq_len / evaluation.step_time_s / GPUS,
        "memory_gib": (evaluation.peak_memory_bytes + node.device.reserved_bytes) / 2**30,
        "comm_s": {k: float(v) for k, v in evaluation.comm_s.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    started = time.perf_counter()
    node = cluster()
    # the table's longest sequence is twice Llama 3.1's context: its rotary tables made that long
    model = hp.models.load("llama3-8b max_seq_len=262144").module
    rows = []
    for fsdp, cp, seq_len, tps, gib in ROWS:
        kinds = ("gather", "ring") if cp > 1 else ("gather",)
        costed = {kind: predict(model, fsdp, cp, seq_len, kind, node) for kind in kinds}
        pick = hp.plan(model, node, fsdp, seq_len, "bf16", micro_batch=1)
        row = {
            "id": f"llama3-8b-fsdp{fsdp}-cp{cp}-{seq_len}",
            "source": SOURCE,
            "seq_len": seq_len,
            "measured_tps_per_gpu": tps,
            "measured_gib": gib,
            "predicted": {
                kind: {**p, "error": p["tps_per_gpu"] / tps - 1} for kind, p in costed.items()
            },
            "pick": {
                "parallel": (
                    f"dp {pick.parallel.dp} x cp {pick.parallel.cp} ({pick.parallel.cp_attention})"
                    f" x tp {pick.parallel.tp} x pp {pick.parallel.pp}, ZeRO {pick.parallel.zero},"
                    f" recompute {pick.parallel.recompute}"
                ),
                "tps_per_gpu": pick.predicted.tokens_per_s / GPUS,
                "memory_gib": max(pick.predicted.memory_gib),
            },
        }
        rows.append(row)
        print(f"{row['id']}: measured {tps:,} TPS/GPU, {gib} GiB")
        for kind, p in row["predicted"].items():
            print(
                f"  {kind:6s} predicted {p['tps_per_gpu']:,.0f} TPS/GPU ({p['error']:+.1%}),"
                f" {p['memory_gib']:.1f} GiB; cp traffic exposed {p['comm_s'].get('cp', 0.0):.2f} s"
            )
        print(
            f"  the planner's pick: {row['pick']['parallel']}:"
            f" {row['pick']['tps_per_gpu']:,.0f} TPS/GPU, {row['pick']['memory_gib']:.1f} GiB"
        )
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
