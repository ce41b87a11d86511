"""`hyparallel demo`: the embedded default run, on any machine, in about a minute.

1. Plans at scale without memory: builds GPT-3 175B on the meta device, traces it, and loads the
   hand-written 1,024-GPU A100 plan shipped in configs/plans, completed and checked.
2. Trains a tiny GPT on the CPU and shows the loss falling.

Parallel training under torchrun joins step 2 when `hyparallel.parallelize` lands (the parallelize
issue); the automatic planner joins step 1 with the Planner issue.
"""

from __future__ import annotations

import time
from importlib import resources

import torch
import torch.nn.functional as F

from hyparallel import models
from hyparallel.graph import trace
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


def run(log=print) -> None:
    """The demo: trace and plan-check GPT-3 175B on meta, then train gpt-tiny on the CPU."""
    log("1. GPT-3 175B on the meta device: no weights are allocated")
    start = time.perf_counter()
    model = models.build("gpt-175b")
    graph = trace(model, model.example_inputs(1, 2048), name="gpt-175b")
    log(f"   built and traced in {time.perf_counter() - start:.1f}s")
    log("   " + graph.summary().replace("\n", "\n   "))
    plan_file = resources.files("hyparallel.configs") / "plans" / "gpt-175b-a100-1024.yaml"
    plan = Plan.load(plan_file)
    par = plan.parallel
    log(f"   hand-written plan {plan_file.name}: dp {par.dp} x tp {par.tp} x pp {par.pp} = {plan.world_size} GPUs "
        f"on {plan.cluster.num_nodes} x {plan.cluster.gpus_per_node} {plan.cluster.device.name}, "
        f"{plan.num_microbatches} micro-batches of {plan.training.micro_batch} per replica, schedule {par.schedule}")
    log("   " + plan.to_yaml().replace("\n", "\n   ").rstrip())
    per_stage = -(-graph.num_layers // (par.pp * par.virtual_stages))
    log(f"   {graph.num_layers} layers over {par.pp * par.virtual_stages} (virtual) stages: about {per_stage} layers each; "
        f"{len(graph.cut_points)} places the graph may be cut")
    log("2. gpt-tiny trained on this CPU (one process)")
    losses = train_tiny(log=log)
    log(f"   loss {losses[0]:.3f} -> {losses[-1]:.3f}")
