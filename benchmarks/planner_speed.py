"""How long the planner's search takes, and how it grows with layers and GPUs.

Run: .venv/bin/python benchmarks/planner_speed.py [--quick] [--json FILE]
Targets (the Planner issue): GPT-3 175B on 1,024 A100s in at most 1 s, a 1T GPT on 3,072 in at most
5 s, on one core. Tracing is timed separately: it is shared by every plan of a model.
``--quick`` times the two target cases only; ``--json FILE`` writes every row's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import hyparallel as hp
from hyparallel.planner import search


def time_search(name: str, gpus: int, global_batch: int, layers: int | None = None) -> dict:
    """Trace and search one case; prints its row and returns its figures."""
    overrides = {"num_layers": layers} if layers else {}
    model = hp.models.build(name, **overrides)
    start = time.perf_counter()
    graph = hp.trace(model, model.example_inputs(1, 2048), name=name)
    traced = time.perf_counter()
    result = search(graph, hp.ClusterSpec.preset("a100-80g", num_nodes=gpus // 8), global_batch, 2048, "bf16")
    done = time.perf_counter()
    par, pred = result.plan().parallel, result.plan().predicted
    best = (
        f"tp {par.tp} pp {par.pp} dp {par.dp} mb {par.num_microbatches}x{result.best[0].config.micro_batch}"
        f" {par.schedule} v{par.virtual_stages} ZeRO {par.zero}"
    )  # mb: micro-batches x size
    print(
        f"{name:9} {len(graph.blocks):>6} {gpus:>6} {traced - start:>8.2f} {done - traced:>9.2f} "
        f"{result.considered:>8,} "
        f"{result.evaluated:>6}   {best}, MFU {pred.mfu:.1%}"
    )
    return {
        "model": name,
        "layers": len(graph.blocks),
        "gpus": gpus,
        "global_batch": global_batch,
        "trace_s": traced - start,
        "search_s": done - traced,
        "configs": result.considered,
        "costed": result.evaluated,
        "plan": best,
        "mfu": pred.mfu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the two target cases only")
    parser.add_argument("--json", help="write every row's figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(
        f"{'model':9} {'layers':>6} {'GPUs':>6} {'trace s':>8} {'search s':>9} {'configs':>8} {'costed':>6}   best plan"
    )
    rows = [
        {**time_search("gpt-175b", 1024, 1536), "group": "target", "target_s": 1.0},
        {**time_search("gpt-1t", 3072, 3072), "group": "target", "target_s": 5.0},
    ]
    if not args.quick:
        print("growth with GPUs (gpt-175b):")
        for gpus in (64, 256, 1024, 2048, 4096):
            rows.append({**time_search("gpt-175b", gpus, 1536 if gpus <= 1536 else 3072), "group": "growth with GPUs"})
        print("growth with layers (gpt-175b widths, 1,024 GPUs):")
        for layers in (24, 48, 96, 192):
            rows.append({**time_search("gpt-175b", 1024, 1536, layers), "group": "growth with layers"})
    if args.json:
        Path(args.json).write_text(json.dumps({"cases": rows}, indent=1))


if __name__ == "__main__":
    main()
