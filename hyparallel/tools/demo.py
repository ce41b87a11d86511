"""`hyparallel demo`: the embedded default run, on any machine, in well under a minute.

1. Plans GPT-3 175B for 128 DGX A100 nodes (1,024 GPUs) on the meta device: no weights are
   allocated.
2. Trains gpt-tiny with data x tensor x pipeline parallelism (dp 2 x tp 2 x pp 2, 1F1B) in 8 CPU
   processes: `torchrun --nproc_per_node 8 examples/train_gpt.py --plan
   configs/plans/cpu-dp2-tp2-pp2.yaml`, and shows the loss falling. Outside a repository checkout
   (no examples/), one process trains it instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from hyparallel import models
from hyparallel.graph import trace
from hyparallel.planner import search
from hyparallel.spec.cluster import ClusterSpec
from hyparallel.spec.schema import Plan


def counting_batches(
    vocab_size: int, batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """Token sequences that count up with a random start and stride: easy to learn, nothing to
    download."""
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 4, (batch_size, 1), generator=generator)
    return (start + stride * torch.arange(seq_len + 1)) % vocab_size  # (B, T + 1)


def train_tiny(
    steps: int = 40, batch_size: int = 8, seq_len: int = 64, seed: int = 0, log=print
) -> list[float]:
    """Train the zoo's gpt-tiny on one CPU process; returns the loss of every step."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = models.build("gpt-tiny", device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        batch = counting_batches(model.config.vocab_size, batch_size, seq_len, generator)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            log(f"  step {step:3d}  loss {loss.item():.3f}")
    return losses


REPO = Path(__file__).resolve().parents[2]
PARALLEL_RUN = [
    "examples/train_gpt.py",
    "--plan",
    "configs/plans/cpu-dp2-tp2-pp2.yaml",
    "--steps",
    "30",
]


def train_parallel(log=print) -> list[float] | None:
    """Run examples/train_gpt.py under torchrun with 8 processes; the first and last loss, or None
    without examples/."""
    if not (REPO / PARALLEL_RUN[0]).exists():
        return None
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "8",
        *PARALLEL_RUN,
    ]
    log("   $ torchrun --nproc_per_node 8 " + " ".join(PARALLEL_RUN))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    losses = None
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith(("step", "gpt", "loss")):
            log("   " + line.rstrip())
        if match := re.match(r"loss ([\d.]+) -> ([\d.]+)", line):
            losses = [float(match[1]), float(match[2])]
    if proc.wait() != 0 or losses is None:
        raise RuntimeError(
            f"the parallel training run failed (exit {proc.returncode}); run the command above to"
            " see why"
        )
    return losses


def plan_gpt175b(log=print) -> Plan:
    """Trace GPT-3 175B on the meta device and plan it for 128 DGX A100 nodes (global batch 1536,
    2048 tokens)."""
    start = time.perf_counter()
    model = models.build("gpt-175b")
    graph = trace(model, model.example_inputs(1, 2048), name="gpt-175b")
    log(f"   built and traced in {time.perf_counter() - start:.1f}s")
    log("   " + graph.summary().replace("\n", "\n   "))
    result = search(
        graph,
        ClusterSpec.preset("a100-80g", num_nodes=128),
        global_batch=1536,
        seq_len=2048,
        dtype="bf16",
    )
    log(
        f"   searched {result.considered:,} configurations ({result.evaluated} costed exactly) "
        f"in {result.search_s:.2f}s"
    )
    return result.plan()


def run(
    log: Callable[[str], None] = print, show_plan: Callable[[Plan], None] | None = None
) -> None:
    """The demo: plan GPT-3 175B on 1,024 A100s, then train gpt-tiny on the CPU."""
    log(
        "1. GPT-3 175B planned for 128 DGX A100 nodes (1,024 GPUs), on the meta device: no weights"
        " allocated"
    )
    plan = plan_gpt175b(log)
    if show_plan is not None:
        show_plan(plan)
    log("   the plan file (hyparallel plan ... -o plan.yaml writes it):")
    text = plan.to_yaml()
    head, _, rest = text.partition("\nstages:")
    log("   " + head.replace("\n", "\n   ") + "\n   stages: ... (one per virtual stage)")
    log("2. gpt-tiny trained with dp 2 x tp 2 x pp 2 (1F1B) in 8 CPU processes")
    losses = train_parallel(log)
    if losses is None:
        log("   (no examples/ here: one process instead)")
        losses = train_tiny(log=log)
    log(f"   loss {losses[0]:.3f} -> {losses[-1]:.3f}")
