"""Expert-parallel checkpoint worker: `torchrun --nproc_per_node 4
tests/distributed/experts_worker.py OUT DIR`.

For a grouped MoE (transformers' Mixtral: stacked expert weights) and a hand-written one (a
ModuleList of experts, torch.where dispatch): trains 2 SGD-with-momentum steps under dp 4 x ep 4,
saves, then loads into dp 4 x ep 2 with ZeRO 1 and into dp 4 (ep 1), and compares every parameter
and momentum buffer each rank holds with single-device training after 2 steps; each loaded plan
then takes step 3 and is compared again. Rank 0 writes one JSON line per case.
"""

from __future__ import annotations

import sys
from pathlib import Path

import harness  # tests/distributed/harness.py, beside this script
import torch
from checkpoint_worker import expected_slice, full
from parallel_worker import GLOBAL_BATCH, LR, SEED, SEQ, batch

import hyparallel as hp
from hyparallel import checkpoint
from hyparallel.runtime.parallel import token_cross_entropy
from hyparallel.tensor.init import materialize_
from hyparallel.tools.parity import small_spec

MODELS = {
    "mixtral": small_spec("hf:MixtralForCausalLM"),
    "where": "tests.tiny_lms:where_moe_lm vocab_size=256",  # parallel_worker.batch's vocabulary
}
PLANS = {
    "saved": dict(dp=4, ep=4, zero=0),
    "ep2-zero1": dict(dp=4, ep=2, zero=1),
    "ep1": dict(dp=4, ep=1, zero=0),
}


def optimizer_of(parameters):
    """SGD with momentum: its state is shaped like the parameters, as AdamW's, but it does not turn
    the rounding of a gradient that is exactly zero (a key bias's: softmax ignores a shift) into
    steps of the learning rate, as Adam's division by the root mean square does."""
    return torch.optim.SGD(parameters, lr=LR, momentum=0.9)


def reference(spec: str, steps: int):
    model = materialize_(hp.models.load(spec).module, "cpu", seed=SEED)
    optimizer = optimizer_of(model.parameters())
    for step in range(steps):
        inputs, targets = batch(spec, SEED + step)
        token_cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def build(spec: str, plan: str, seed: int):
    model = hp.models.load(spec).module
    planned = hp.plan(
        model,
        hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=4),
        GLOBAL_BATCH,
        SEQ,
        "fp32",
        tp=1,
        pp=1,
        micro_batch=2,
        **PLANS[plan],
    )
    pmodel = hp.parallelize(model, planned, seed=seed, device="cpu")
    return model, pmodel, optimizer_of(pmodel.parameters())


def worst_error(model, pmodel, optimizer, ref_model, ref_optimizer) -> tuple[float, list[str]]:
    """Largest relative (norm) difference over every parameter and momentum buffer this rank holds
    (checkpoint_worker's), and their names; the worst's name in ``worst_error.where``."""
    ref_params = dict(ref_model.named_parameters(remove_duplicate=False))
    modules, worst, checked = dict(model.named_modules()), (0.0, ""), []
    for name, param in pmodel.named_parameters():
        owner, _, leaf = name.rpartition(".")
        pairs = [("value", param, ref_params[name])]
        pairs += [
            (k, optimizer.state[param][k], ref_optimizer.state[ref_params[name]][k])
            for k in ("momentum_buffer",)
        ]
        for what, got, want in pairs:
            want = expected_slice(modules[owner], leaf, want)
            # relative, over a floor of 1e-3: a key bias's gradient is exactly zero in exact
            # arithmetic (softmax ignores a shift), so its buffer is rounding (norm ~1e-8) whose
            # relative difference means nothing; every other tensor's norm is far above the floor
            error = ((full(got) - want).norm() / want.norm().clamp_min(1e-3)).item()
            worst = max(worst, (error, f"{name} {what}"))
        checked.append(name)
    return worst, checked


def train(spec: str, pmodel, optimizer, steps: range) -> None:
    for step in steps:
        inputs, targets = batch(spec, SEED + step)
        pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets))
        optimizer.step()
        optimizer.zero_grad()


def run(spec: str, directory: Path) -> dict:
    """Train and save at ep 4, load at ep 2 and ep 1, train on; the errors against one device."""
    result = {"parameter_groups": harness.parameter_groups(hp.models.load(spec).module)}
    after = {steps: reference(spec, steps) for steps in (2, 3)}
    model, pmodel, optimizer = build(spec, "saved", SEED)
    train(spec, pmodel, optimizer, range(2))
    (result["saved_error"], result["saved_worst"]), result["saved_checked"] = worst_error(
        model, pmodel, optimizer, *after[2]
    )
    checkpoint.save(pmodel, optimizer, directory, step=2)
    for plan in ("ep2-zero1", "ep1"):
        model, pmodel, optimizer = build(spec, plan, SEED + 1)  # other initial weights
        checkpoint.load(pmodel, optimizer, directory)
        (result[f"{plan}_error"], result[f"{plan}_worst"]), result[f"{plan}_checked"] = worst_error(
            model, pmodel, optimizer, *after[2]
        )
        train(spec, pmodel, optimizer, range(2, 3))
        (result[f"{plan}_continued"], _), _ = worst_error(model, pmodel, optimizer, *after[3])
    return result


def main() -> None:
    out, directory = sys.argv[1], Path(sys.argv[2])
    harness.init()
    harness.run_cases(
        out,
        [
            (name, lambda spec=spec, name=name: run(spec, directory / name))
            for name, spec in MODELS.items()
        ],
    )


if __name__ == "__main__":
    main()
