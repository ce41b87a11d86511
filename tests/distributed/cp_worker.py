"""Context-parallel training worker: `torchrun --nproc_per_node 4 tests/distributed/cp_worker.py
OUT CASE...`.

Each case plans the model for the launch's world / cp processes with the given degrees, sets
``parallel.cp`` (the planner does not price cp yet), parallelizes a meta-device copy, and trains 3
steps on parallel_worker's global batches (16 tokens, about 10% of the targets -100) as one device
materialised from the same seed: the first step's gradient of every parameter (by name), the losses,
the parameters after the last step, eval_step and a call of the model, with parallel_worker's
tolerances (Note [context parallelism], hyparallel/runtime/context.py). AdamW, but SGD with momentum
for Qwen2, whose key bias has a gradient that is exactly zero on one device (softmax ignores a shift
of every key) and rounding noise elsewhere, which AdamW would turn into +-lr updates
(parallel_worker says the same of GPT-2's). Rank 0 writes one JSON line per case.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import harness  # tests/distributed/harness.py, beside this script
import parallel_worker as pw  # its batches, single-device reference and comparisons
import torch
import torch.distributed as dist

import hyparallel as hp
from hyparallel.spec.errors import ConfigError
from hyparallel.tensor.init import materialize_

logging.getLogger("transformers").setLevel(logging.ERROR)

LLAMA = (
    "hf:LlamaForCausalLM vocab_size=128 hidden_size=64 intermediate_size=128 num_hidden_layers=2"
    " num_attention_heads=4 num_key_value_heads=2 max_position_embeddings=64 head_dim=16"
)
QWEN2 = (
    "hf:Qwen2ForCausalLM vocab_size=128 hidden_size=64 intermediate_size=128 num_hidden_layers=2"
    " num_attention_heads=4 num_key_value_heads=2 max_position_embeddings=64"
)
pw.KEY_BIAS.add(QWEN2)
OWN_LLAMA = "llama-tiny num_layers=2"
CASES = {  # name -> (model, degrees and constraints, cp, attention)
    # a hand-written GPT (learned positions, fused qkv): every rank a cp rank, keys gathered
    "gpt-cp4": (pw.GPT, dict(dp=1, tp=1, micro_batch=2), 4, "gather"),
    # passed round a ring of two beside dp 2, under ZeRO 1 (FSDP2 over dp x cp)
    "gpt-dp2-cp2-ring-zero1": (pw.GPT, dict(dp=2, tp=1, micro_batch=2, zero=1), 2, "ring"),
    # tp 2 splits the heads, sequence parallelism each rank's 8 tokens
    "gpt-cp2-tp2-sp": (pw.GPT, dict(dp=1, tp=2, micro_batch=2, sequence_parallel=True), 2, "ring"),
    # transformers' attention interface, grouped-query attention and rotary positions
    "llama-dp2-cp2": (LLAMA, dict(dp=2, tp=1, micro_batch=1), 2, "gather"),
    "qwen2-cp4-ring": (QWEN2, dict(dp=1, tp=1, micro_batch=2), 4, "ring"),
    # rotary tables indexed by position, each block recomputed in the backward
    "own-llama-dp2-cp2-recompute": (
        OWN_LLAMA,
        dict(dp=2, tp=1, micro_batch=2, recompute="full"),
        2,
        "gather",
    ),
}


def cp_plan(spec: str, constraints: dict, cp: int, kind: str) -> hp.Plan:
    """The planner's plan for world / cp processes with ``constraints``, run over cp more."""
    world = dist.get_world_size()
    planned = hp.plan(
        hp.models.load(spec).module,
        hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=world // cp),
        pw.GLOBAL_BATCH,
        pw.SEQ,
        "fp32",
        pp=1,
        zero=constraints.pop("zero", 0),
        **constraints,
    ).to_dict()
    planned.pop("predicted")
    planned["cluster"] = {**planned["cluster"], "gpus_per_node": world}
    planned["parallel"] = {**planned["parallel"], "cp": cp, "cp_attention": kind}
    return hp.Plan.from_dict(planned)


def run_case(name: str) -> dict:
    spec, constraints, cp, kind = CASES[name]
    ref = pw.reference(spec)
    plan = cp_plan(spec, dict(constraints), cp, kind)
    model = hp.models.load(spec).module
    groups = harness.parameter_groups(model)  # before parallelize swaps modules in
    pmodel = hp.parallelize(model, plan, seed=pw.SEED, device="cpu")
    optimizer = pw.optimizer_for(spec, pmodel.parameters())
    losses, result = [], {"plan": plan.parallel.model_dump(), "parameter_groups": groups}
    result["dp_rank"], result["cp_rank"] = pmodel.dp_rank, pmodel.context.rank
    for step, (inputs, targets) in enumerate(pw.batches(spec)):
        losses.append(pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets)).item())
        if step == 0:
            result["grads_checked"], result["grad_worst_rel"] = pw.compare(
                pmodel, model, ref["grads"], True
            )
        optimizer.step()
        optimizer.zero_grad()
    held_inputs, held_targets = pw.batch(spec, pw.SEED + 100)
    losses.append(pmodel.eval_step(pmodel.shard(held_inputs), pmodel.shard(held_targets)).item())
    result["checked"], result["worst_rel"] = pw.compare(pmodel, model, ref["params"], False)
    # a call of the model: every rank's chunks gathered into whole sequences
    logits = pw.logits_of(pmodel(pmodel.shard(held_inputs)))
    torch.testing.assert_close(
        logits, pmodel.shard(ref["held_logits"]), rtol=pw.PARAM_RTOL, atol=pw.PARAM_ATOL
    )
    result["called_logits"] = list(logits.shape)
    # 7 tokens do not cut into 2 cp chunks (generate's lengths grow one at a time): the whole
    # sequence on every rank, one device's logits (causal: the held batch's first 7 positions')
    held = pmodel.shard(held_inputs)
    odd = pw.logits_of(pmodel(held[:, :7]))
    torch.testing.assert_close(
        odd, pmodel.shard(ref["held_logits"])[:, :7], rtol=pw.PARAM_RTOL, atol=pw.PARAM_ATOL
    )
    result["odd_logits"] = list(odd.shape)
    # greedy decoding from 6 tokens: its first new token is one device's argmax wherever the top
    # two logits are 1e-3 apart, over twice the logits' tolerance above (rows closer are not
    # compared)
    generated = pmodel.generate(held[:, :6], 2)
    want = pmodel.shard(ref["held_logits"])[:, 5]
    top = want.topk(2, -1).values
    apart = (top[:, 0] - top[:, 1]) > 1e-3
    result["generated_shape"] = list(generated.shape)
    result["generated_compared"] = int(apart.sum())
    # token ids, exactly: a pick flips only where the logits moved by half the top-two gap, and the
    # logits are asserted within the tolerance above (measured ~1e-6 off), under half of 1e-3
    result["generated_equal"] = torch.equal(generated[apart, 6], want.argmax(-1)[apart])
    # a (total, count) loss of one's own is exact over the ranks' tokens; a mean is refused
    own = pmodel.eval_step(
        pmodel.shard(held_inputs),
        pmodel.shard(held_targets),
        lambda out, goal: (
            pw.token_cross_entropy(out, goal, reduction="sum"),
            (goal != -100).sum(),
        ),
    )
    result["own_eval_loss"] = own.item()
    try:
        pmodel.eval_step(
            pmodel.shard(held_inputs), pmodel.shard(held_targets), pw.token_cross_entropy
        )
    except ConfigError as error:
        result["mean_refused"] = str(error)
    for got, want in zip(losses, ref["losses"]):
        assert abs(got - want) <= pw.RTOL * abs(want), (losses, ref["losses"])
    return {**result, "losses": losses, "ref_losses": ref["losses"]}


def padded_case() -> dict:
    """transformers' Llama with padded rows (an attention_mask, the padding's targets -100)
    at dp 2 x cp 2, keys gathered and then passed round a ring: the first step's loss and every
    gradient, and a call's logits, against one process given the same mask."""
    spec = LLAMA
    inputs, targets = pw.batch(spec, pw.SEED)
    lengths = torch.tensor([16, 12, 9, 16, 5, 16, 14, 11])
    mask = (torch.arange(pw.SEQ)[None] < lengths[:, None]).long()
    # and rows padded on the left, whose real tokens would otherwise see the padding's keys
    mask[1], mask[6] = mask[1].flip(0), mask[6].flip(0)
    targets = targets.masked_fill(mask == 0, -100)
    batch = {"input_ids": inputs, "attention_mask": mask}
    one = materialize_(hp.models.load(spec).module, "cpu", seed=pw.SEED)
    output = one(**batch)
    loss = pw.token_cross_entropy(output, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in one.named_parameters()}
    result = {"parameter_groups": harness.parameter_groups(one)}
    for kind in ("gather", "ring"):
        model = hp.models.load(spec).module
        plan = cp_plan(spec, dict(dp=2, tp=1, micro_batch=2), 2, kind)
        pmodel = hp.parallelize(model, plan, seed=pw.SEED, device="cpu")
        got = pmodel.train_step(pmodel.shard(batch), pmodel.shard(targets)).item()
        assert abs(got - loss.item()) <= pw.RTOL * loss.item(), (kind, got, loss.item())
        checked, worst = pw.compare(pmodel, model, grads, True)
        logits = pw.logits_of(pmodel(pmodel.shard(batch)))
        torch.testing.assert_close(
            logits, pmodel.shard(pw.logits_of(output).detach()), rtol=pw.RTOL, atol=1e-5
        )
        # 7 tokens (no cut into 4 chunks): whole on every rank, the padding still masked
        prefix = {name: value[:, :7] for name, value in batch.items()}
        with torch.no_grad():
            want = pw.logits_of(one(**prefix))
        torch.testing.assert_close(
            pw.logits_of(pmodel(pmodel.shard(prefix))), pmodel.shard(want), rtol=pw.RTOL, atol=1e-5
        )
        result[kind] = {"loss": got, "ref_loss": loss.item(), "checked": checked, "worst": worst}
        result["dp_rank"], result["cp_rank"] = pmodel.dp_rank, pmodel.context.rank
    return result


def checkpoint_case(directory: Path) -> dict:
    """Two steps at dp 2 x cp 2 under ZeRO 1 (the shards over dp x cp), saved; loaded at dp 4 (cp
    1), where the third step's loss and the parameters after it are one device's."""
    spec = pw.GPT
    ref = pw.reference(spec)
    steps = pw.batches(spec)
    plans = {
        "cp": cp_plan(spec, dict(dp=2, tp=1, micro_batch=2, zero=1), 2, "ring"),
        "dp": cp_plan(spec, dict(dp=4, tp=1, micro_batch=2), 1, "gather"),
    }
    losses = []
    for which, plan in plans.items():
        model = hp.models.load(spec).module
        # the run that loads starts from other weights: the checkpoint's must replace them
        seed = pw.SEED if which == "cp" else pw.SEED + 1
        pmodel = hp.parallelize(model, plan, seed=seed, device="cpu")
        optimizer = pw.optimizer_for(spec, pmodel.parameters())
        if which == "dp":
            resumed = hp.checkpoint.load(pmodel, optimizer, directory)
        for step in range(2 if which == "cp" else 1):
            inputs, targets = steps[step if which == "cp" else 2]
            losses.append(pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets)).item())
            optimizer.step()
            optimizer.zero_grad()
        if which == "cp":
            hp.checkpoint.save(pmodel, optimizer, directory, step=1)
    checked, worst = pw.compare(pmodel, model, ref["params"], False)
    for got, want in zip(losses, ref["losses"]):
        assert abs(got - want) <= pw.RTOL * abs(want), (losses, ref["losses"])
    return {
        "losses": losses,
        "ref_losses": ref["losses"][:3],
        "resumed_step": resumed["step"],
        "checked": checked,
        "worst_rel": worst,
        "plans": [plan.parallel.model_dump() for plan in plans.values()],
    }


def main() -> None:
    harness.init()
    names = sys.argv[2:] or [*CASES, "checkpoint-cp2-to-dp4", "llama-padded-dp2-cp2"]
    directory = Path(sys.argv[1]).parent / "checkpoints"
    harness.run_cases(
        sys.argv[1],
        [
            (
                name,
                lambda name=name: (
                    checkpoint_case(directory)
                    if name.startswith("checkpoint")
                    else padded_case()
                    if name.endswith("padded-dp2-cp2")
                    else run_case(name)
                ),
            )
            for name in names
        ],
    )


if __name__ == "__main__":
    main()
