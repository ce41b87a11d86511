"""Compile and data worker: `torchrun --nproc_per_node 4 tests/distributed/compile_data_worker.py
OUT DIR CASE...`.

compile cases: a plan with ``parallel.compile`` (backend aot_eager, the CPU's) takes one train_step;
its loss and every gradient slice this rank holds are compared with a single device's (uncompiled)
from the same seed, elementwise at rtol 1e-5 / atol 1e-6 (tests/distributed/parallel_worker.py's
gradient bound: sums over ranks and tensor-parallel partial products in another order; aot_eager
runs the ATen ops eager mode runs). The dp 2 case also checks ``pmodel._warn_if_same_rows``
(train_step calls it on its first step).

data case: gpt-tiny under dp 2 x tp 2 trains 3 steps from ``pmodel.sampler`` + DataLoader, saves
(the position with it), takes a 4th step; a fresh dp 4 model loads the checkpoint, makes its sampler
after the load, and takes the 4th step: the same global rows (gathered over dp) and the same loss.
Rank 0 writes one JSON line per case.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import harness  # tests/distributed/harness.py, beside this script
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import hyparallel as hp
from hyparallel import checkpoint
from hyparallel.runtime.parallel import token_cross_entropy
from hyparallel.tensor.init import materialize_

# the slice of a full tensor a tensor-parallel module holds
from hyparallel.tools.parity import expected_slice

GPT = "gpt-tiny num_layers=2 bias=false"
SEQ, GLOBAL_BATCH, SEED, LR = 16, 8, 23, 1e-3
RTOL, ATOL = 1e-5, 1e-6
COMPILE_CASES = {
    "dp2-tp2-compile": dict(dp=2, tp=2, pp=1, micro_batch=2, zero=0, sequence_parallel=True),
    "tp2-pp2-compile": dict(
        dp=1, tp=2, pp=2, schedule="1f1b", micro_batch=2, zero=0, sequence_parallel=True
    ),
}
DATA_PLANS = {
    "saved": dict(dp=2, tp=2, pp=1, micro_batch=2, zero=0, sequence_parallel=True),
    "loaded": dict(dp=4, tp=1, pp=1, micro_batch=1, zero=0),
}
DATASET_ROWS = 44  # 5 global batches of 8 and 4 rows left over: the epoch drops them


def build(constraints: dict, compile: bool = False, seed: int = SEED):
    model = hp.models.load(GPT).module
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=dist.get_world_size())
    plan = hp.plan(model, cluster, GLOBAL_BATCH, SEQ, "fp32", **constraints)
    if compile:
        data = plan.to_dict()
        plan = hp.Plan.from_dict({**data, "parallel": {**data["parallel"], "compile": True}})
    groups = harness.parameter_groups(model)  # before parallelize swaps modules in
    return (
        model,
        hp.parallelize(model, plan, seed=seed, device="cpu", compile_backend="aot_eager"),
        groups,
    )


def tokens(seed: int, rows: int = GLOBAL_BATCH) -> torch.Tensor:
    return torch.randint(0, 256, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def run_compile_case(name: str) -> dict:
    batch = tokens(SEED)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    reference = materialize_(hp.models.load(GPT).module, "cpu", seed=SEED)
    ref_loss = token_cross_entropy(reference(inputs), targets)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}
    model, pmodel, groups = build(COMPILE_CASES[name], compile=True)
    loss = pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets)).item()
    modules, worst, checked = dict(model.named_modules()), 0.0, []
    for pname, param in pmodel.named_parameters():
        owner, _, leaf = pname.rpartition(".")
        # this rank's slice of the full gradient
        want = expected_slice(modules[owner], leaf, ref_grads[pname])
        torch.testing.assert_close(
            param.grad, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=pname: f"{n}: {m}"
        )
        worst = max(worst, ((param.grad - want).norm() / want.norm().clamp_min(1e-12)).item())
        checked.append(pname)
    result = {
        "loss": loss,
        "ref_loss": ref_loss.item(),
        "grad_worst_rel": worst,
        "grads_checked": checked,
        "dp_rank": pmodel.dp_rank,
        "parameter_groups": groups,
        "compiled": pmodel.plan.parallel.compile,
        "compiled_regions": (
            sum(_compiled(m) for m in model.modules())
            + sum(_compiled(m) for m in pmodel.local_modules())
        ),
    }
    if pmodel.dp_size > 1:
        result.update(same_rows(pmodel, inputs))
    return result


def _compiled(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward was replaced by torch.compile's wrapper
    (hyparallel.runtime.compile)."""
    return "forward" in vars(module) and hasattr(
        vars(module)["forward"], "_torchdynamo_orig_callable"
    )


def same_rows(pmodel, inputs: torch.Tensor) -> dict:
    """``_warn_if_same_rows`` on the whole batch (every rank the same rows), again (once only), then
    on shards."""
    # train_step checked its first batch (each rank's own rows): as a fresh model
    pmodel._rows_checked = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = pmodel._warn_if_same_rows(inputs)
        # checked once: no collective, False
        again = pmodel._warn_if_same_rows(pmodel.shard(inputs))
    pmodel._rows_checked = False
    sharded = pmodel._warn_if_same_rows(pmodel.shard(inputs))
    return {
        "same_rows": [same, again, sharded],
        "same_rows_warnings": [str(w.message) for w in caught],
    }


def train(pmodel, optimizer, loader_iter) -> tuple[float, list[int]]:
    """One step on the loader's next batch: train_step counts it consumed
    (DataSampler.step_consumed)."""
    indices, batch = next(loader_iter)
    consumed = pmodel.data_sampler.consumed
    loss = pmodel.train_step(batch[:, :-1], batch[:, 1:])
    assert pmodel.data_sampler.consumed == consumed + GLOBAL_BATCH, (
        "train_step did not count its batch"
    )
    optimizer.step()
    optimizer.zero_grad()
    return loss.item(), global_rows(pmodel, indices)


def global_rows(pmodel, indices: torch.Tensor) -> list[int]:
    """The dataset rows of this global batch, dp rank after dp rank (a replica's tp and pp ranks
    hold the same)."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (pmodel.dp_rank, indices.tolist()))
    by_replica = dict(every)
    # one replica, one set of rows
    assert all(by_replica[dp_rank] == rows for dp_rank, rows in every), every
    return [row for dp_rank in sorted(by_replica) for row in by_replica[dp_rank]]


def run_data_case(directory: Path) -> dict:
    dataset = TensorDataset(torch.arange(DATASET_ROWS), tokens(SEED + 1, DATASET_ROWS))
    _, pmodel, _ = build(DATA_PLANS["saved"])
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=LR)
    sampler = pmodel.sampler(dataset, seed=5)
    loader = iter(DataLoader(dataset, batch_size=sampler.share, sampler=sampler))
    saved_rows, saved_losses = [], []
    for _ in range(3):
        loss, rows = train(pmodel, optimizer, loader)
        saved_losses.append(loss)
        saved_rows.append(rows)
    checkpoint.save(pmodel, optimizer, directory, step=3)
    loss, rows = train(pmodel, optimizer, loader)  # step 4 under dp 2, after the save
    saved_losses.append(loss)
    saved_rows.append(rows)
    position = pmodel.data_sampler.position().to_dict()

    # other weights: the checkpoint's must win
    _, pmodel, _ = build(DATA_PLANS["loaded"], seed=SEED + 1)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=LR)
    checkpoint.load(pmodel, optimizer, directory)
    # made after the load: the saved position (and seed) resumes
    sampler = pmodel.sampler(dataset, seed=0)
    resumed = sampler.position().to_dict()
    loader = iter(DataLoader(dataset, batch_size=sampler.share, sampler=sampler))
    loss, rows = train(pmodel, optimizer, loader)
    return {
        "saved_rows": saved_rows,
        "saved_losses": saved_losses,
        "position_after_4": position,
        "resumed_position": resumed,
        "loaded_rows": rows,
        "loaded_loss": loss,
        "loaded_share": sampler.share,
    }


def main() -> None:
    out, directory, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    harness.init()
    cases = [
        (
            name,
            (
                (lambda name=name: run_compile_case(name))
                if name in COMPILE_CASES
                else (lambda: run_data_case(directory))
            ),
        )
        for name in names
    ]
    harness.run_cases(out, cases)


if __name__ == "__main__":
    main()
