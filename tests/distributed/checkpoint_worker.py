"""Checkpoint worker: `torchrun --nproc_per_node 4 tests/distributed/checkpoint_worker.py OUT DIR`.

Trains gpt-tiny 2 AdamW steps under dp 2 x tp 2 with ZeRO 1 (FSDP shards over dp, tensor-parallel
slices), saves asynchronously while it trains a third step, then loads into a fresh model and
optimizer under tp 2 x pp 2 (1F1B) and compares every parameter and every AdamW moment with
single-device training after 2 steps; then both plans take step 3 and are compared again. Rank 0
writes one JSON line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import harness  # tests/distributed/harness.py, beside this script
import torch
from parallel_worker import GLOBAL_BATCH, GPT, LR, SEED, SEQ, batch, expected_slice, full

import hyparallel as hp
from hyparallel import checkpoint
from hyparallel.runtime.parallel import token_cross_entropy
from hyparallel.tensor.init import materialize_

PLANS = {
    "saved": dict(dp=2, tp=2, pp=1, micro_batch=2, zero=1, sequence_parallel=True),
    "loaded": dict(
        dp=1, tp=2, pp=2, schedule="1f1b", micro_batch=2, zero=0, sequence_parallel=True
    ),
}


def reference(steps: int):
    model = materialize_(hp.models.load(GPT).module, "cpu", seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        inputs, targets = batch(GPT, SEED + step)
        token_cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def build(name: str):
    model = hp.models.load(GPT).module
    plan = hp.plan(
        model,
        hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=4),
        GLOBAL_BATCH,
        SEQ,
        "fp32",
        **PLANS[name],
    )
    # loaded: other initial weights; gloo on the CPU, a GPU present or not
    pmodel = hp.parallelize(model, plan, seed=SEED + 1 if name == "loaded" else SEED, device="cpu")
    return model, pmodel, torch.optim.AdamW(pmodel.parameters(), lr=LR)


def train(pmodel, optimizer, steps: range) -> None:
    for step in steps:
        inputs, targets = batch(GPT, SEED + step)
        pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets))
        optimizer.step()
        optimizer.zero_grad()


def worst_error(model, pmodel, optimizer, ref_model, ref_optimizer) -> tuple[float, list[str]]:
    """Largest relative (norm) difference over every parameter and AdamW moment this rank holds, and
    their names."""
    ref_params = dict(ref_model.named_parameters(remove_duplicate=False))
    modules, worst, checked = dict(model.named_modules()), 0.0, []
    for name, param in pmodel.named_parameters():
        owner, _, leaf = name.rpartition(".")
        pairs = [(param, ref_params[name])]
        pairs += [
            (optimizer.state[param][k], ref_optimizer.state[ref_params[name]][k])
            for k in ("exp_avg", "exp_avg_sq")
        ]
        for got, want in pairs:
            want = expected_slice(modules[owner], leaf, want)
            got = full(got)
            worst = max(worst, ((got - want).norm() / want.norm().clamp_min(1e-12)).item())
        checked.append(name)  # its value and both moments
    return worst, checked


def run(directory: Path) -> dict:
    """Train and save under one plan, load under the other, train on; the errors against one device
    at each point."""
    result = {"parameter_groups": harness.parameter_groups(hp.models.load(GPT).module)}
    model, pmodel, optimizer = build("saved")
    train(pmodel, optimizer, range(2))
    result["saved_error"], _ = worst_error(model, pmodel, optimizer, *reference(2))
    pending = checkpoint.save(
        pmodel,
        optimizer,
        directory,
        step=2,
        extra={"samples_seen": 2 * GLOBAL_BATCH},
        asynchronous=True,
    )
    # training goes on while the checkpoint is written: it keeps step 2
    train(pmodel, optimizer, range(2, 3))
    path = pending.wait()

    model, pmodel, optimizer = build("loaded")
    info = checkpoint.load(pmodel, optimizer, directory)
    result.update(step=info["step"], extra=info["extra"], path=str(path), dp_rank=pmodel.dp_rank)
    result["loaded_error"], result["loaded_checked"] = worst_error(
        model, pmodel, optimizer, *reference(2)
    )
    train(pmodel, optimizer, range(2, 3))  # and training goes on where it left off
    result["continued_error"], _ = worst_error(model, pmodel, optimizer, *reference(3))
    return result


def main() -> None:
    out, directory = sys.argv[1], Path(sys.argv[2])
    harness.init()
    harness.run_cases(out, [("save-dp2-tp2-zero1-load-tp2-pp2", lambda: run(directory))])


if __name__ == "__main__":
    main()
