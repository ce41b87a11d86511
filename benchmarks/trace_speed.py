"""How long building on the meta device and tracing take, by model size.

Run: .venv/bin/python benchmarks/trace_speed.py [--seq-len 2048] [--json FILE]
Prints one row per model: build seconds, trace seconds, ops, and the checked parameter count.
Nothing here allocates real memory: every model lives on the meta device.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import hyparallel as hp

MODELS = [
    "gpt-125m",
    "gpt-1.3b",
    "gpt-13b",
    "gpt-175b",
    "gpt-1t",
    "llama-7b",
    "llama-70b",
    "hf:GPT2LMHeadModel",
    "hf:llama num_hidden_layers=32",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--json", help="write every row's figures here")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    print(
        f"{'model':32} {'params':>10} {'build s':>8} {'trace s':>8} {'method':>7} {'ops':>6}"
        f" {'blocks':>6}"
    )
    rows = []
    for spec in MODELS:
        start = time.perf_counter()
        loaded = hp.models.load(spec)
        built = time.perf_counter()
        seq_len = min(args.seq_len, getattr(loaded.module.config, "n_positions", args.seq_len))
        graph = hp.trace(
            loaded.module,
            hp.models.example_inputs(loaded.module, args.batch_size, seq_len),
            name=spec,
        )
        traced = time.perf_counter()
        assert graph.num_params == sum(p.numel() for p in loaded.module.parameters())
        print(
            f"{spec:32} {graph.num_params / 1e9:>9.2f}B {built - start:>8.2f}"
            f" {traced - built:>8.2f} {graph.method:>7} {len(graph.ops):>6} {len(graph.blocks):>6}"
        )
        rows.append(
            {
                "model": spec,
                "params": graph.num_params,
                "seq_len": seq_len,
                "build_s": built - start,
                "trace_s": traced - built,
                "method": graph.method,
                "ops": len(graph.ops),
                "blocks": len(graph.blocks),
            }
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"config": {"batch_size": args.batch_size}, "cases": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
