"""Gradient compression worker: `torchrun --nproc_per_node 4 tests/distributed/compression_worker.py
OUT DIR CASE...`.

gpt-tiny (4 layers, no biases) in fp32 on the CPU cluster, every case a plan of the launch's 4
processes:

    first-<mode>-<layout>      bf16 / fp16: the first step's gradients against one device's, on DDP
                               (dp4), the bucketed all-reduce after a pipeline (dp2-pp2) and FSDP2
                               (dp4-zero1, dp4-zero3)
    gather-bf16-zero3          bf16 training under ZeRO 3: the weights arrive 16-bit (FSDP2
                               param_dtype) and the gradients match the uncompressed plan's
    powersgd-<layout>          PowerSGD (rank 4, from step 2): the losses of STEPS AdamW steps
                               against one device's
    resume-<layout>            PowerSGD saved after RESUME_AT steps and resumed into a fresh model:
                               the uninterrupted run's losses and weights; resumed without the
                               compression state, it differs
    error-feedback             fixed weights and batch: the mean of the applied gradients converges
                               to the true one with error feedback, and stays off without it
    cuda-present               a CPU bucket's PowerSGD with torch.cuda.is_available() true (a
                               machine with a GPU running gloo): hyparallel's hook reduces it,
                               torch's own raises

Rank 0 writes one JSON line per case (tests/distributed/harness.run_cases);
tests/test_grad_compression.py judges.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import harness  # tests/distributed/harness.py, beside this script
import torch
from parallel_worker import GLOBAL_BATCH, GPT, LR, SEED, SEQ, batch, full, reference

import hyparallel as hp
from hyparallel import checkpoint
from hyparallel.spec.schema import Plan
from hyparallel.tools.parity import expected_slice

STEPS, RESUME_AT, START, EF_STEPS, FIT_LR = 12, 6, 2, 20, 1e-2
LAYOUTS = {
    "dp4": dict(dp=4, tp=1, pp=1, micro_batch=2, zero=0),
    "dp2-pp2": dict(dp=2, tp=1, pp=2, schedule="1f1b", micro_batch=2, zero=0),
    "dp2-tp2": dict(dp=2, tp=2, pp=1, micro_batch=2, zero=0, sequence_parallel=False),
    "dp4-zero1": dict(dp=4, tp=1, pp=1, micro_batch=1, zero=1),
    "dp4-zero3": dict(dp=4, tp=1, pp=1, micro_batch=2, zero=3),
}
DIRECTORY: Path = Path(".")


def build(layout: str, mode: str, dtype: str = "fp32", seed: int = SEED, **compression):
    model = hp.models.load(GPT).module
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=4)
    plan = hp.plan(model, cluster, GLOBAL_BATCH, SEQ, dtype, **LAYOUTS[layout])
    data = plan.to_dict()
    data["parallel"].update(grad_compression=mode, **compression)
    plan = Plan.from_dict(data)
    return model, hp.parallelize(model, plan, seed=seed, device="cpu")


def worst_error(
    model, pmodel, expected: dict[str, torch.Tensor], grads: bool = True
) -> tuple[float, list[str]]:
    """The largest ||got - want|| / ||want|| over the tensors this rank holds, and their names."""
    modules, worst, checked = dict(model.named_modules()), 0.0, []
    for name, param in pmodel.named_parameters():
        owner, _, leaf = name.rpartition(".")
        want = expected_slice(modules[owner], leaf, expected[name])
        got = full(param.grad if grads else param)
        worst = max(worst, ((got - want).norm() / want.norm().clamp_min(1e-12)).item())
        checked.append(name)
    return worst, checked


def first_step(mode: str, layout: str) -> dict:
    ref = reference(GPT)
    model, pmodel = build(layout, mode)
    inputs, targets = batch(GPT, SEED)
    pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets))
    worst, checked = worst_error(model, pmodel, ref["grads"])
    return {
        "worst_rel": worst,
        "grads_checked": checked,
        "dp_rank": pmodel.dp_rank,
        "parameter_groups": harness.parameter_groups(hp.models.load(GPT).module),
        "ddp_hook": (
            pmodel.data_parallel.ddp is not None and pmodel.data_parallel.compressor is not None
        ),
        "bucketed": pmodel.data_parallel.after_step_all_reduce,
        "sharded": pmodel.data_parallel.sharded,
    }


def gather_bf16() -> dict:
    """bf16 training, ZeRO 3: the compressed plan's weights are bf16 inside forward; its gradients,
    the plain plan's."""
    inputs, targets = batch(GPT, SEED)
    grads, dtypes = {}, {}
    for mode in ("none", "bf16"):
        model, pmodel = build("dp4-zero3", mode, dtype="bf16")
        seen = []
        qkv = model.layers[0].attn.qkv
        qkv.register_forward_pre_hook(
            lambda module, _, seen=seen: seen.append(str(module.weight.dtype))
        )
        pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets))
        grads[mode] = {name: full(p.grad).clone() for name, p in pmodel.named_parameters()}
        dtypes[mode] = seen[0]
    worst = max(
        ((grads["bf16"][n] - g).norm() / g.norm().clamp_min(1e-12)).item()
        for n, g in grads["none"].items()
    )
    return {"worst_rel": worst, "weight_dtype": dtypes, "compared": sorted(grads["none"])}


def train(pmodel, optimizer, steps: range, same_batch: bool = False) -> list[float]:
    losses = []
    for step in steps:
        inputs, targets = batch(GPT, SEED if same_batch else SEED + step)
        losses.append(pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets)).item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


@functools.cache
def memorised_losses() -> list[float]:
    """One device learning one batch by heart (FIT_LR): the losses PowerSGD's training is held
    against."""
    from hyparallel.runtime.parallel import token_cross_entropy
    from hyparallel.tensor.init import materialize_

    model = materialize_(hp.models.load(GPT).module, "cpu", seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=FIT_LR)
    inputs, targets = batch(GPT, SEED)
    losses = []
    for _ in range(STEPS):
        loss = token_cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def powersgd(layout: str) -> dict:
    """PowerSGD learning one batch by heart, against one device doing the same (the loss falls far
    in STEPS)."""
    _, pmodel = build(layout, "powersgd", powersgd_rank=4, powersgd_start_step=START)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=FIT_LR)
    losses = train(pmodel, optimizer, range(STEPS), same_batch=True)
    state = pmodel.data_parallel.compressor.state
    residual = sum(e.norm().item() ** 2 for e in state.error_dict.values()) ** 0.5
    return {
        "losses": losses,
        "ref_losses": memorised_losses(),
        "iter": state.iter,
        "residual_norm": residual,
    }


def resume(layout: str) -> dict:
    def fresh(seed: int):
        model, pmodel = build(
            layout, "powersgd", seed=seed, powersgd_rank=4, powersgd_start_step=START
        )
        return model, pmodel, torch.optim.AdamW(pmodel.parameters(), lr=LR)

    def weights(pmodel) -> dict[str, torch.Tensor]:
        return {name: full(p).clone() for name, p in pmodel.named_parameters()}

    _, pmodel, optimizer = fresh(SEED)
    whole = train(pmodel, optimizer, range(STEPS))
    whole_weights = weights(pmodel)

    directory = DIRECTORY / f"resume-{layout}"
    _, pmodel, optimizer = fresh(SEED)
    first = train(pmodel, optimizer, range(RESUME_AT))
    checkpoint.save(pmodel, optimizer, directory, step=RESUME_AT)
    results = {}
    for kept in (True, False):
        # other initial weights: the checkpoint must bring them
        _, pmodel, optimizer = fresh(SEED + 1)
        info = checkpoint.load(pmodel, optimizer, directory)
        # the same resume, PowerSGD's residuals and factors dropped (its step count kept)
        if not kept:
            pmodel.data_parallel.load_compression_state(None, pmodel.data_parallel.compression_step)
        rest = train(pmodel, optimizer, range(RESUME_AT, STEPS))
        mine = weights(pmodel)
        worst = max(((mine[n] - w).norm() / w.norm()).item() for n, w in whole_weights.items())
        results["kept" if kept else "dropped"] = {"losses": first + rest, "worst_weight_rel": worst}
        results["step"] = info["step"]
    return {"whole": whole, **results, "compared": sorted(whole_weights)}


def error_feedback() -> dict:
    """Same weights and batch every step: with error feedback the mean applied gradient converges to
    the true one."""
    ref = reference(GPT)["grads"]
    inputs, targets = batch(GPT, SEED)
    result = {}
    for feedback in (True, False):
        model, pmodel = build("dp4", "powersgd", powersgd_rank=1, powersgd_start_step=START)
        pmodel.data_parallel.compressor.state.use_error_feedback = feedback
        total, errors = None, []
        for step in range(START + EF_STEPS):
            pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets))
            grads = {name: p.grad.clone() for name, p in pmodel.named_parameters()}
            for p in pmodel.parameters():
                p.grad = None
            if step < START:  # uncompressed warm-up steps
                continue
            total = grads if total is None else {n: total[n] + g for n, g in grads.items()}
            count = step - START + 1
            mean = {n: t / count for n, t in total.items()}
            errors.append(worst_error_of(mean, ref))
        result["with" if feedback else "without"] = errors
    return result


def worst_error_of(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """||got - want|| / ||want|| over every matrix (the tensors PowerSGD compresses) together."""
    names = [n for n, g in got.items() if g.dim() > 1]
    diff = sum((got[n] - want[n]).pow(2).sum() for n in names) ** 0.5
    return (diff / sum(want[n].pow(2).sum() for n in names) ** 0.5).item()


def cuda_present() -> dict:
    """Note [compression hooks on gloo], the last part: torch's hook synchronises CUDA for a CPU
    bucket."""
    from unittest import mock

    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from hyparallel.runtime import compression

    torch.manual_seed(0)
    # the matrix is compressed at rank 4
    grads = [("w", torch.randn(64, 32)), ("b", torch.randn(64))]
    outcome = {}
    for hook in ("hyparallel", "torch"):
        compressor = compression.Compressor("powersgd", None, {}, rank=4, start_step=2)
        compressor.state.iter = 2  # past the warm-up: compressed
        run = compression._CPU_POWERSGD if hook == "hyparallel" else powerSGD_hook.powerSGD_hook
        with mock.patch.object(torch.cuda, "is_available", lambda: True):
            with mock.patch.object(compression, "_CPU_POWERSGD", run):
                try:
                    compressor.reduce([(name, g.clone()) for name, g in grads])
                    outcome[hook] = "reduced"
                except Exception as error:  # noqa: BLE001 -- which one is what the case reports
                    outcome[hook] = f"{type(error).__name__}: {error}"[:200]
    return {"outcome": outcome}


def run_case(name: str) -> dict:
    kind, _, rest = name.partition("-")
    if kind == "first":
        mode, _, layout = rest.partition("-")
        return first_step(mode, layout)
    if name == "gather-bf16-zero3":
        return gather_bf16()
    if kind == "powersgd":
        return powersgd(rest)
    if kind == "resume":
        return resume(rest)
    if name == "error-feedback":
        return error_feedback()
    if name == "cuda-present":
        return cuda_present()
    raise ValueError(f"unknown case {name}")


def main() -> None:
    global DIRECTORY
    out, DIRECTORY, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    harness.init()
    harness.run_cases(out, [(name, functools.partial(run_case, name)) for name in names])


if __name__ == "__main__":
    main()
