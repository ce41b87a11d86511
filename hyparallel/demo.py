"""`hyparallel demo`: the embedded default run, on any machine, in well under a minute.

1. Plans GPT-3 175B for 128 DGX A100 nodes (1,024 GPUs) on the meta device: no weights are allocated.
2. Trains a tiny GPT on the CPU and shows the loss falling.

Parallel training under torchrun joins step 2 when `hyparallel.parallelize` lands (the parallelize issue).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hyparallel import models
from hyparallel.cluster import ClusterSpec
from hyparallel.graph import trace
from hyparallel.planner import search
from hyparallel.schema import Plan


def counting_batches(vocab_size: int, batch_size: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """Token sequences that count up with a random start and stride: easy to learn, nothing to download."""
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 4, (batch_size, 1), generator=generator)
    return (start + stride * torch.arange(seq_len + 1)) % vocab_size  # (B, T + 1)


def train_tiny(steps: int = 40, batch_size: int = 8, seq_len: int = 64, seed: int = 0, log=print) -> list[float]:
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


def plan_gpt175b(log=print) -> Plan:
    """Trace GPT-3 175B on the meta device and plan it for 128 DGX A100 nodes (global batch 1536, 2048 tokens)."""
    start = time.perf_counter()
    model = models.build("gpt-175b")
    graph = trace(model, model.example_inputs(1, 2048), name="gpt-175b")
    log(f"   built and traced in {time.perf_counter() - start:.1f}s")
    log("   " + graph.summary().replace("\n", "\n   "))
    result = search(graph, ClusterSpec.preset("a100-80g", num_nodes=128), global_batch=1536, seq_len=2048, dtype="bf16")
    log(f"   searched {result.considered:,} configurations ({result.evaluated} costed exactly) in {result.search_s:.2f}s")
    return result.plan()


def run(log: Callable[[str], None] = print, show_plan: Callable[[Plan], None] | None = None) -> None:
    """The demo: plan GPT-3 175B on 1,024 A100s, then train gpt-tiny on the CPU."""
    log("1. GPT-3 175B planned for 128 DGX A100 nodes (1,024 GPUs), on the meta device: no weights allocated")
    plan = plan_gpt175b(log)
    if show_plan is not None:
        show_plan(plan)
    log("   the plan file (hyparallel plan ... -o plan.yaml writes it):")
    text = plan.to_yaml()
    head, _, rest = text.partition("\nstages:")
    log("   " + head.replace("\n", "\n   ") + "\n   stages: ... (one per virtual stage)")
    log("2. gpt-tiny trained on this CPU (one process)")
    losses = train_tiny(log=log)
    log(f"   loss {losses[0]:.3f} -> {losses[-1]:.3f}")
