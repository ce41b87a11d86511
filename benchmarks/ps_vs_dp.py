"""Parameter-server mode against plain data parallelism, in the same run: samples/s and bytes moved
per step.

Run: .venv/bin/python benchmarks/ps_vs_dp.py [--quick] [--json FILE]
For dlrm-tiny and dlrm-mid, each configuration trains examples/train_recsys.py under torchrun on
this machine: dp over 2 processes (DDP, the tables replicated), and ps with 1 server and 2 workers
at staleness 0 and 4. The configurations run in turns (dp, ps 0, ps 4, dp, ...) over --rounds
rounds, so that a drift of the machine's speed falls on all of them. Printed per configuration:
samples/s (all workers), bytes a worker moves per step (measured for ps: rows and dense weights
pulled, gradients pushed; for dp the all-reduce's 2 (n-1)/n x gradient bytes), and the planner's
prediction of the step next to it (hyparallel.planner.servers on the `cpu` cluster preset).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINE = re.compile(
    r"rank (\d+) \((ps|dp)\): (\d+) batches, .* (\d+) samples/s(?:, ([\d.]+) KiB moved per batch)?"
)
CONFIGS = (("dp", 0), ("ps", 0), ("ps", 4))
BATCH = 64


def run(model: str, mode: str, staleness: int, batches: int) -> dict:
    """One torchrun of the example; the workers' figures."""
    nproc = 3 if mode == "ps" else 2
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
    ]
    cmd += ["examples/train_recsys.py", "--mode", mode, "--model", model, "--batches", str(batches)]
    cmd += ["--batch", str(BATCH), "--staleness", str(staleness), "--servers", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    rows = [m.groups() for m in map(LINE.search, out.stdout.splitlines()) if m]
    if out.returncode or not rows:
        raise RuntimeError(
            f"{model} {mode} {staleness}: exit {out.returncode}\n{out.stderr[-2000:]}"
        )
    return {
        "samples_per_s": sum(float(r[3]) for r in rows),
        "kib_per_step": statistics.mean(float(r[4]) for r in rows) if rows[0][4] else None,
    }


def dp_kib_per_step(model_name: str, workers: int = 2) -> float:
    """A ring all-reduce moves 2 (n - 1) / n of the gradient bytes in and out of each worker (every
    weight: DDP)."""
    import hyparallel as hp

    model = hp.models.build(model_name)
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    return 2 * (workers - 1) / workers * grad_bytes / 2**10


def predicted(model_name: str, mode: str) -> float:
    """The planner's step time for this configuration: 2 workers on the `cpu` preset (ps: and 1
    server)."""
    import hyparallel as hp

    model = hp.models.build(model_name)
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=2)
    fixed = {"ps_servers": 1} if mode == "ps" else {"ps_servers": 0, "dp": 2}
    plan = hp.plan(
        model,
        cluster,
        global_batch=2 * BATCH,
        dtype="fp32",
        example_inputs=model.example_inputs(BATCH),
        **fixed,
    )
    assert (plan.ps is not None) == (mode == "ps"), (
        f"the planner did not plan {mode} for {model_name}"
    )
    return plan.predicted.step_time_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches, one round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    results = []
    for model, batches in (
        ("dlrm-tiny", 40 if args.quick else 200),
        ("dlrm-mid", 20 if args.quick else 80),
    ):
        measured: dict[tuple[str, int], list[dict]] = {c: [] for c in CONFIGS}
        for _ in range(rounds):
            for mode, staleness in CONFIGS:
                measured[(mode, staleness)].append(run(model, mode, staleness, batches))
        dp_rate = statistics.median(r["samples_per_s"] for r in measured[("dp", 0)])
        for (mode, staleness), runs in measured.items():
            rate = statistics.median(r["samples_per_s"] for r in runs)
            kib = runs[0]["kib_per_step"] if mode == "ps" else dp_kib_per_step(model)
            step = predicted(model, mode)
            results.append(
                {
                    "model": model,
                    "config": f"{mode}" + (f" staleness {staleness}" if mode == "ps" else " 2"),
                    "samples_per_s": rate,
                    "vs_dp": rate / dp_rate,
                    "kib_per_step": kib,
                    "predicted_samples_per_s": 2 * BATCH / step,
                }
            )
    print(
        "| model | configuration | samples/s | / dp | KiB per worker-step | predicted samples/s |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        pred = f"{r['predicted_samples_per_s']:.0f}"
        print(
            f"| {r['model']} | {r['config']} | {r['samples_per_s']:.0f} | {r['vs_dp']:.3f} | "
            f"{r['kib_per_step']:.1f} | {pred} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
