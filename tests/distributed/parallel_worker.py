"""parallelize parity worker: `torchrun --nproc_per_node N tests/distributed/parallel_worker.py OUT
CASE...`.

Each case plans a model for the launch with the given degrees fixed, parallelizes a meta-device
copy, and trains 3 AdamW steps on the same global batches (about 10% of targets padding, -100) as a
single-device model materialised from the same seed. After the first step every gradient slice this
rank holds is compared with the single device's; after the last, every parameter slice (gathered
over dp where FSDP shards it); then eval_step on a held-out batch. "accumulate" cases call
train_step twice before the first optimizer
step: gradients must be twice the single device's. Recompute cases (run_recompute_case) compare bf16
training under recompute full and selective with recompute none instead. Rank 0 writes one JSON line
per case.

Tolerances, fp32: gradients rtol 1e-5 / atol 1e-6 elementwise (sums over micro-batches, ranks and
tensor-parallel partial products in another order: rounding only). Parameters after 3 steps: each
tensor within 1e-5 of the single device's in norm, and elementwise rtol 1e-5 / atol 1e-4: AdamW's m
/ (sqrt(v) + eps) turns a rounding difference in a small gradient entry into a larger one in the
update (up to lr = 1e-3 a step for an entry whose gradient is all rounding). Measured: below 1e-5
with this CPU's AVX-512 kernels, 1.25e-5 on one qkv entry with AVX2 kernels
(ATEN_CPU_CAPABILITY=avx2, what a CPU without AVX-512 runs), so atol 1e-4; the norm bound keeps the
whole tensor honest. Hugging Face GPT-2 has a key bias, whose gradient is exactly zero (softmax
ignores a shift of every key): its computed gradient is rounding noise that AdamW would turn into
+-lr updates, different on every layout. Its cases train with SGD (momentum 0.9) instead, which
keeps a zero gradient zero; the first-step gradient check is the same for both.
"""

from __future__ import annotations

import functools
import logging
import sys

import harness  # tests/distributed/harness.py, beside this script
import torch
import torch.distributed as dist

import hyparallel as hp
from hyparallel.runtime.parallel import _logits as logits_of  # output.logits, or the output itself
from hyparallel.runtime.parallel import token_cross_entropy
from hyparallel.spec.errors import ConfigError
from hyparallel.tensor.init import materialize_

# the slice of a full tensor a tensor-parallel module holds
from hyparallel.tools.parity import expected_slice

logging.getLogger("transformers").setLevel(logging.ERROR)
RTOL, GRAD_ATOL, PARAM_ATOL, STEPS, LR = 1e-5, 1e-6, 1e-4, 3, 1e-3
# Parameters after STEPS AdamW steps: Adam divides each gradient by its running root mean square, so
# an element whose gradient is near zero moves by lr whatever its rounding, and tp's partial sums
# (the vocab-parallel loss's split softmax among them) round differently. Measured ||parallel -
# single|| / ||single|| with the first step's gradients within 7e-7: 8.0-8.9e-6 with the logits
# gathered, 0.99-1.08e-5 with the vocab-parallel loss, 3.3e-6 without tp; bounded at 2e-5.
PARAM_RTOL = 2e-5
SEQ, GLOBAL_BATCH, SEED = 16, 8, 17
# no biases: a key bias's gradient is exactly zero, all rounding (see test)
GPT = "gpt-tiny num_layers=4 bias=false"
GPT2 = (
    "hf:GPT2LMHeadModel n_layer=4 n_embd=64 n_head=4 vocab_size=128 n_positions=64 bos_token_id=0"
    " eos_token_id=0 resid_pdrop=0 embd_pdrop=0 attn_pdrop=0"
)
CASES = {  # name -> (model, plan constraints, train_step calls before the first optimizer step)
    # tp cases ask for sequence parallelism: on gloo the planner prices it above plain tp and would
    # leave it off
    "dp2-tp2-pp2-1f1b": (
        GPT,
        dict(dp=2, tp=2, pp=2, schedule="1f1b", micro_batch=2, zero=0, sequence_parallel=True),
        1,
    ),
    "dp4": (GPT, dict(dp=4, tp=1, pp=1, micro_batch=1, zero=0), 1),
    "tp2-pp2": (
        GPT,
        dict(dp=1, tp=2, pp=2, schedule="1f1b", micro_batch=2, zero=0, sequence_parallel=True),
        1,
    ),
    "dp2-tp2-nosp": (
        GPT,
        dict(dp=2, tp=2, pp=1, micro_batch=2, zero=0, sequence_parallel=False),
        1,
    ),
    "dp2-tp2-zero1": (
        GPT,
        dict(dp=2, tp=2, pp=1, micro_batch=2, zero=1, sequence_parallel=True),
        1,
    ),
    "dp2-tp2-zero2": (
        GPT,
        dict(dp=2, tp=2, pp=1, micro_batch=1, zero=2, sequence_parallel=True),
        1,
    ),
    "dp2-tp2-zero3": (
        GPT,
        dict(dp=2, tp=2, pp=1, micro_batch=2, zero=3, sequence_parallel=True),
        1,
    ),
    "dp2-pp2-zero1-gpipe": (
        GPT,
        dict(dp=2, tp=1, pp=2, schedule="gpipe", micro_batch=1, zero=1),
        1,
    ),
    "dp2-pp2-interleaved": (
        GPT,
        dict(
            dp=2, tp=1, pp=2, schedule="interleaved-1f1b", virtual_stages=2, micro_batch=1, zero=0
        ),
        1,
    ),
    "dp2-tp2-recompute": (
        GPT,
        dict(dp=2, tp=2, pp=1, micro_batch=2, zero=0, recompute="full", sequence_parallel=True),
        1,
    ),
    "tp2-pp2-recompute": (
        GPT,
        dict(
            dp=1,
            tp=2,
            pp=2,
            schedule="1f1b",
            micro_batch=2,
            zero=0,
            recompute="full",
            sequence_parallel=True,
        ),
        1,
    ),
    "dp2-tp2-sp-accumulate": (
        GPT,
        dict(dp=2, tp=2, pp=1, micro_batch=2, zero=0, sequence_parallel=True),
        2,
    ),
    # the logits gathered for the loss (parallel.vocab_parallel_loss false; every other tp case
    # computes it vocab-parallel, the planner's default)
    "dp2-tp2-gathered": (
        GPT,
        dict(
            dp=2,
            tp=2,
            pp=1,
            micro_batch=2,
            zero=0,
            sequence_parallel=True,
            vocab_parallel_loss=False,
        ),
        1,
    ),
    "hf-gpt2-tp2-pp2": (
        GPT2,
        dict(dp=1, tp=2, pp=2, schedule="1f1b", micro_batch=2, zero=0, sequence_parallel=True),
        1,
    ),
    "hf-gpt2-dp2-pp2-zero1-selective": (
        GPT2,
        dict(dp=2, tp=1, pp=2, schedule="1f1b", micro_batch=1, zero=1, recompute="selective"),
        1,
    ),
}
# GPT-2 with eager attention and its default dropout (0.1): bf16, one train_step under recompute
# none, full and selective from the same weights, batch and RNG state; the gradients must agree
# (run_recompute_case).
GPT2_EAGER_DROPOUT = (
    "hf:GPT2LMHeadModel n_layer=4 n_embd=64 n_head=4 vocab_size=128 n_positions=64 bos_token_id=0 "
    "eos_token_id=0 attn_implementation=eager"
)
# name -> (model, plan constraints); two blocks per pipeline stage, each stage one region
RECOMPUTE_CASES = {
    "hf-gpt2-dp2-pp2-bf16-recompute": (
        GPT2_EAGER_DROPOUT,
        dict(dp=2, tp=1, pp=2, schedule="1f1b", micro_batch=1, zero=0),
    ),
}


# models with a key bias (see the module docstring): trained with SGD; other workers add theirs
KEY_BIAS = {GPT2}


def optimizer_for(spec: str, params) -> torch.optim.Optimizer:
    """AdamW, or SGD with momentum for models with a key bias (see the module docstring)."""
    return (
        torch.optim.SGD(params, lr=0.1, momentum=0.9)
        if spec in KEY_BIAS
        else torch.optim.AdamW(params, lr=LR)
    )


def vocab(spec: str) -> int:
    return 128 if spec.startswith("hf:") else 256


def batch(spec: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab(spec), (GLOBAL_BATCH, SEQ + 1), generator=generator)
    targets = tokens[:, 1:].clone()
    # padding: not counted in the mean
    targets[torch.rand(targets.shape, generator=generator) < 0.1] = -100
    return tokens[:, :-1], targets


def batches(spec: str):
    return [batch(spec, SEED + step) for step in range(STEPS)]


@functools.cache
def reference(spec: str) -> dict:
    """Single-device training: first-step gradients, parameters after the last step, losses,
    held-out loss."""
    model = materialize_(hp.models.load(spec).module, "cpu", seed=SEED)
    optimizer = optimizer_for(spec, model.parameters())
    losses, first_grads = [], None
    for inputs, targets in batches(spec):
        loss = token_cross_entropy(model(inputs), targets)
        loss.backward()
        if first_grads is None:
            first_grads = {
                n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)
            }
            first_norm = (
                torch.stack([p.grad.double().pow(2).sum() for p in model.parameters()])
                .sum()
                .sqrt()
                .item()
            )
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        held_inputs, held_targets = batch(spec, SEED + 100)
        held_logits = logits_of(model(held_inputs))
        losses.append(token_cross_entropy(held_logits, held_targets).item())
    return {
        "held_logits": held_logits,
        "grads": first_grads,
        "grad_norm": first_norm,
        "params": {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)},
        "losses": losses,
    }


def full(tensor: torch.Tensor) -> torch.Tensor:
    # FSDP: gather over dp
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def compare(
    pmodel, model, expected: dict[str, torch.Tensor], of_grads: bool, factor: float = 1.0
) -> tuple[list[str], float]:
    """The names of the parameters this rank holds, each compared with ``expected``, and the worst
    relative error."""
    modules, checked, worst = dict(model.named_modules()), [], 0.0
    for pname, param in pmodel.named_parameters():
        owner, _, leaf = pname.rpartition(".")
        want = expected_slice(modules[owner], leaf, expected[pname]) * factor
        got = full(param.grad if of_grads else param)
        relative = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
        worst = max(worst, relative)
        what = "gradient of " if of_grads else ""
        bound = RTOL if of_grads else PARAM_RTOL
        assert of_grads or relative <= bound, (
            f"{what}{pname}: relative error {relative:.2e} > {bound}"
        )
        torch.testing.assert_close(
            got,
            want,
            rtol=bound,
            atol=GRAD_ATOL if of_grads else PARAM_ATOL,
            msg=lambda m, what=what, pname=pname: f"{what}{pname}: {m}",
        )
        checked.append(pname)
    return checked, worst


def run_case(name: str) -> dict:
    spec, constraints, calls_first = CASES[name]
    ref = reference(spec)
    model = hp.models.load(spec).module
    world = dist.get_world_size()
    plan = hp.plan(
        model,
        hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=world),
        GLOBAL_BATCH,
        SEQ,
        "fp32",
        **constraints,
    )
    groups = harness.parameter_groups(model)  # before parallelize swaps modules in
    # gloo on the CPU, a GPU present or not
    pmodel = hp.parallelize(model, plan, seed=SEED, device="cpu")
    first_block = "layers.0.attn.qkv" if spec == GPT else "transformer.h.0.attn.c_attn"
    # forward calls of the first block's qkv: twice per micro-batch when the block is recomputed
    calls = []
    model.get_submodule(first_block).register_forward_hook(lambda *_: calls.append(1))
    optimizer = optimizer_for(spec, pmodel.parameters())
    losses = []
    result = {
        "plan": plan.parallel.model_dump(),
        "dp_rank": pmodel.dp_rank,
        "parameter_groups": groups,
    }
    for step, (inputs, targets) in enumerate(batches(spec)):
        for _ in range(calls_first if step == 0 else 1):
            loss = pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets))
        losses.append(loss.item())
        if step == 0:
            result["grads_checked"], result["grad_worst_rel"] = compare(
                pmodel, model, ref["grads"], True, calls_first
            )
            # The global norm as one device computes it, then clipping to half of it scales every
            # gradient alike.
            norm = pmodel.clip_grad_norm_(float("inf")).item()
            result["grad_norm"], result["ref_grad_norm"] = norm, ref["grad_norm"] * calls_first
            unclipped = [p.grad.clone() for p in pmodel.parameters()]
            pmodel.clip_grad_norm_(norm / 2)
            compare(pmodel, model, ref["grads"], True, calls_first * (norm / 2) / (norm + 1e-6))
            # the optimizer steps on the unclipped ones
            for param, grad in zip(pmodel.parameters(), unclipped):
                param.grad.copy_(grad)
            if calls_first > 1:  # accumulated: the rest would train on doubled gradients
                return {
                    **result,
                    "losses": losses,
                    "ref_losses": ref["losses"][:1],
                    "accumulated": calls_first,
                }
        optimizer.step()
        optimizer.zero_grad()
    train_calls = len(calls)
    held_inputs, held_targets = batch(spec, SEED + 100)
    losses.append(pmodel.eval_step(pmodel.shard(held_inputs), pmodel.shard(held_targets)).item())
    assert all(p.grad is None for p in pmodel.parameters())  # forward only
    result["checked"], result["worst_rel"] = compare(pmodel, model, ref["params"], False)
    # calling the model gives the whole logits under any plan, the vocab-parallel loss or not, a
    # pipeline or not
    logits = logits_of(pmodel(pmodel.shard(held_inputs)))
    torch.testing.assert_close(
        logits, pmodel.shard(ref["held_logits"]), rtol=PARAM_RTOL, atol=PARAM_ATOL
    )
    result["called_logits"] = list(logits.shape)

    # a loss_fn of one's own evaluates on the whole logits (gathered for it under a vocab-parallel
    # head); as (total, count) its mean is the single device's over the padded targets (Note [the
    # loss a user reads])
    def own_loss(output, goal):
        return token_cross_entropy(output, goal, reduction="sum"), (goal != -100).sum()

    own = pmodel.eval_step(pmodel.shard(held_inputs), pmodel.shard(held_targets), own_loss).item()
    result["own_eval_loss"] = own
    # in training it would see a slice: refused before any compute
    if plan.parallel.vocab_parallel_loss:
        try:
            pmodel.train_step(
                pmodel.shard(held_inputs), pmodel.shard(held_targets), token_cross_entropy
            )
        except ConfigError as error:
            result["own_loss_refused"] = str(error)
    for got, want in zip(losses, ref["losses"]):
        assert abs(got - want) <= RTOL * abs(want), (losses, ref["losses"])
    return {
        **result,
        "losses": losses,
        "ref_losses": ref["losses"],
        "pipeline": pmodel.pipeline is not None,
        "tp": pmodel.tp_info is not None,
        "qkv_calls_per_microbatch": train_calls / (STEPS * plan.num_microbatches),
    }


def run_recompute_case(name: str) -> dict:
    """bf16 gradients of one train_step under recompute full and selective against recompute none,
    by name.

    Tolerance: rtol 1e-5 / atol 1e-6, as tests/test_parallel.py's single-process check says:
    recomputation replays the same ops on the same inputs, dropout masks included (checkpointing
    restores the RNG state per region).
    """
    spec, constraints = RECOMPUTE_CASES[name]
    inputs, targets = batch(spec, SEED)
    world = dist.get_world_size()
    losses, grads, worst = {}, {}, {}
    planned = hp.plan(
        hp.models.load(spec).module,
        hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=world),
        GLOBAL_BATCH,
        SEQ,
        "bf16",
        recompute="none",
        **constraints,
    ).to_dict()
    for recompute in ("none", "full", "selective"):
        # the same plan, stages included, under each mode (the planner may balance the stages
        # otherwise per mode)
        model = hp.models.load(spec).module
        data = {**planned, "parallel": {**planned["parallel"], "recompute": recompute}}
        data.pop("predicted")
        plan = hp.Plan.from_dict(data)
        groups = harness.parameter_groups(model)  # before parallelize swaps modules in
        # gloo on the CPU, a GPU present or not
        pmodel = hp.parallelize(model, plan, seed=SEED, device="cpu")
        # the same dropout draws under each mode; other ones on each rank
        torch.manual_seed(SEED + dist.get_rank())
        losses[recompute] = pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets)).item()
        grads[recompute] = {pname: full(param.grad) for pname, param in pmodel.named_parameters()}
    for recompute in ("full", "selective"):
        assert grads[recompute].keys() == grads["none"].keys(), recompute
        assert abs(losses[recompute] - losses["none"]) <= RTOL * abs(losses["none"]), (
            recompute,
            losses,
        )
        for pname, grad in grads[recompute].items():
            torch.testing.assert_close(
                grad,
                grads["none"][pname],
                rtol=RTOL,
                atol=GRAD_ATOL,
                msg=lambda m, recompute=recompute, pname=pname: f"{recompute}: {pname}: {m}",
            )
        worst[recompute] = max(
            ((g - grads["none"][n]).norm() / grads["none"][n].norm().clamp_min(1e-12)).item()
            for n, g in grads[recompute].items()
        )
    return {
        "losses": losses,
        "grad_worst_rel": worst,
        "grads_checked": sorted(grads["none"]),
        "dp_rank": pmodel.dp_rank,
        "parameter_groups": groups,
    }


def main() -> None:
    out_path, names = sys.argv[1], sys.argv[2:]
    harness.init()
    harness.run_cases(
        out_path,
        [
            (
                name,
                functools.partial(
                    run_recompute_case if name in RECOMPUTE_CASES else run_case, name
                ),
            )
            for name in names
        ],
    )


if __name__ == "__main__":
    main()
