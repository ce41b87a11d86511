"""The numbers a user's own loop reads, against one device: `torchrun --nproc_per_node 4
loop_worker.py OUT CASE...`.

Each case plans a layout (dp, tp, pp, mixes; one and several micro-batches), parallelizes a meta
copy of the model, and compares with one device materialised from the same seed, without an
optimizer step in between (so every comparison is against the same weights):

- ``train_step``'s returned loss (on every rank) and every gradient, for the default loss, a
  ``(total, count)`` loss with label smoothing over padded targets (-100), and a scalar mean loss
  over targets without padding (the case where a mean of micro-batch means is the global mean); the
  pair loss accumulated over two calls with ``accumulate=2`` gives the gradient of the mean of the
  two batches;
- ``eval_step`` with each loss on a batch of another size than training's;
- the forward's outputs (``pmodel(x)``: whole logits on every rank) and, where asked, greedy
  generation and a Hugging Face forward with an attention mask and an eval with ``labels=`` (inputs
  the pipeline was not traced with);
- a backward through train_step's loss is refused with a line saying train_step ran it;
- under ZeRO (FSDP2), an optimizer made after the eval and the call updates the weights as one
  device's SGD step (the weights compared with PARAM_RTOL, parallel_worker's).

Tolerances, fp32: losses rtol 1e-5 (sums over micro-batches and ranks in another order), logits rtol
1e-5 / atol 1e-5, gradients rtol 1e-5 / atol 1e-6 elementwise as
tests/distributed/parallel_worker.py (its ``compare``).
"""

from __future__ import annotations

import functools
import logging

import harness  # tests/distributed/harness.py, beside this script
import torch
import torch.distributed as dist
import torch.nn.functional as F

# every gradient slice this rank holds against the single device's
from parallel_worker import compare

import hyparallel as hp
from hyparallel.runtime.parallel import _logits as logits_of
from hyparallel.runtime.parallel import token_cross_entropy
from hyparallel.tensor.init import materialize_

logging.getLogger("transformers").setLevel(logging.ERROR)
SEQ, GLOBAL_BATCH, EVAL_BATCH, SEED = 16, 8, 4, 23
LOSS_RTOL, LOGITS_TOL = 1e-5, 1e-5
LR = 0.1  # "after_eval": one SGD step
GPT = "gpt-tiny num_layers=4 bias=false"  # torch.fx stages
LLAMA = (  # torch.export stages; grouped-query attention
    "hf:LlamaForCausalLM hidden_size=64 intermediate_size=128 num_hidden_layers=4"
    " num_attention_heads=4 num_key_value_heads=2 vocab_size=128 max_position_embeddings=64"
)
# torch's nn.TransformerEncoder: torch.export stages, its fused eval path (hidden 48: no greedy pick
# near a tie)
ENCODER = "tests.tiny_lms:torch_encoder_lm hidden=48 layers=2 vocab_size=256"
# name -> (model, plan constraints, extras: "custom" trains the user's losses, "hf" the HF inputs)
CASES = {
    "dp4-m2": (GPT, dict(dp=4, tp=1, pp=1, micro_batch=1, zero=0), {"custom", "metrics"}),
    "dp2-tp2-m1": (
        GPT,
        dict(dp=2, tp=2, pp=1, micro_batch=4, zero=0, sequence_parallel=True),
        set(),
    ),
    "dp2-tp2-gathered-m2": (
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
        {"custom"},
    ),
    "dp2-pp2-gpipe-m4": (
        GPT,
        dict(dp=2, tp=1, pp=2, schedule="gpipe", micro_batch=1, zero=0),
        {"custom", "generate"},
    ),
    "dp2-pp2-interleaved-m2": (
        GPT,
        dict(
            dp=2, tp=1, pp=2, schedule="interleaved-1f1b", virtual_stages=2, micro_batch=2, zero=0
        ),
        {"custom"},
    ),
    "tp2-pp2-1f1b-m4": (
        GPT,
        dict(dp=1, tp=2, pp=2, schedule="1f1b", micro_batch=2, zero=0, sequence_parallel=True),
        {"generate"},
    ),
    # ZeRO: FSDP2 units, whose gathered weights an eval and a call hand back ("after_eval": an
    # optimizer made then)
    "dp2-tp2-zero1-m2": (
        GPT,
        dict(
            dp=2,
            tp=2,
            pp=1,
            micro_batch=2,
            zero=1,
            sequence_parallel=True,
            vocab_parallel_loss=False,
        ),
        {"custom", "after_eval"},
    ),
    "dp2-pp2-zero1-m2": (
        GPT,
        dict(dp=2, tp=1, pp=2, schedule="1f1b", micro_batch=2, zero=1),
        {"after_eval"},
    ),
    # Note [torch's fused encoder path]: eval under no_grad would take torch's fused kernel on the
    # split weights
    "encoder-tp2-pp2-m4": (
        ENCODER,
        dict(dp=1, tp=2, pp=2, schedule="1f1b", micro_batch=2, zero=0, sequence_parallel=False),
        {"generate"},
    ),
    "hf-llama-tp2-pp2": (
        LLAMA,
        dict(dp=1, tp=2, pp=2, schedule="1f1b", micro_batch=4, zero=0, sequence_parallel=True),
        {"hf", "generate"},
    ),
}


def vocab(spec: str) -> int:
    return 128 if spec.startswith("hf:") else 256


def batch(spec: str, rows: int, seed: int, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab(spec), (rows, SEQ + 1), generator=generator)
    targets = tokens[:, 1:].clone()
    # about a fifth padding, unevenly over rows: a mean of means would differ from the global mean
    if padded:
        targets[torch.rand(targets.shape, generator=generator) < 0.2] = -100
    return tokens[:, :-1], targets


def smoothed_sum(output, targets):
    """The user's own loss as (total, count): label-smoothed cross-entropy summed over the counted
    targets."""
    logits = logits_of(output).flatten(0, -2).float()
    total = F.cross_entropy(
        logits, targets.flatten(), ignore_index=-100, label_smoothing=0.1, reduction="sum"
    )
    return total, (targets != -100).sum()


def smoothed_mean(output, targets):
    """The user's own loss as a mean (the usual mean-reduced call)."""
    logits = logits_of(output).flatten(0, -2).float()
    return F.cross_entropy(logits, targets.flatten(), ignore_index=-100, label_smoothing=0.1)


@functools.cache
def reference(spec: str) -> dict:
    """One device: each loss's value and gradients on the training batches, eval losses, logits,
    greedy tokens."""
    model = materialize_(hp.models.load(spec).module, "cpu", seed=SEED)
    (x, y), (x2, y2), (xc, yc) = (
        batch(spec, GLOBAL_BATCH, SEED, True),
        batch(spec, GLOBAL_BATCH, SEED + 1, True),
        batch(spec, GLOBAL_BATCH, SEED + 2, False),
    )
    out: dict = {}

    def run(name, loss_of):
        model.zero_grad()
        loss = loss_of()
        loss.backward()
        out[name] = (
            loss.item(),
            {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)},
        )

    run("default", lambda: token_cross_entropy(model(x), y))
    grads = out["default"][1]
    out["after_sgd"] = {
        n: p.detach() - LR * grads[n] for n, p in model.named_parameters(remove_duplicate=False)
    }
    run("pair", lambda: (lambda t, c: t / c)(*smoothed_sum(model(x), y)))
    run("pair2", lambda: (lambda t, c: t / c)(*smoothed_sum(model(x2), y2)))
    run("mean", lambda: smoothed_mean(model(xc), yc))
    model.zero_grad()
    ex, ey = batch(spec, EVAL_BATCH, SEED + 3, True)
    with torch.no_grad():
        logits = logits_of(model(ex))
        out["eval"] = {
            "default": token_cross_entropy(logits, ey).item(),
            "pair": (lambda t, c: (t / c).item())(*smoothed_sum(logits, ey)),
        }
        out["logits"] = logits_of(model(x))
        tokens, margins = x[:, :6], []
        for _ in range(3):
            last = logits_of(model(tokens))[:, -1]
            top = last.topk(2, dim=-1).values
            # how far each greedy pick is from a tie
            margins.append((top[:, 0] - top[:, 1]).min().item())
            tokens = torch.cat([tokens, last.argmax(-1, keepdim=True)], 1)
        out["generated"], out["generation_margin"] = tokens, min(margins)
        if spec.startswith("hf:"):
            mask = torch.ones_like(x)
            mask[::2, -5:] = 0  # right padding on every other row
            out["masked_logits"] = model(input_ids=x, attention_mask=mask).logits
            out["mask"] = mask
            out["labels_loss"] = model(input_ids=ex, labels=ex).loss.item()
    return out


def close(got: float, want: float) -> bool:
    return abs(got - want) <= LOSS_RTOL * abs(want)


def run_case(name: str) -> dict:
    spec, constraints, extras = CASES[name]
    ref = reference(spec)
    model = hp.models.load(spec).module
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=dist.get_world_size())
    plan = hp.plan(model, cluster, GLOBAL_BATCH, SEQ, "fp32", **constraints)
    groups = harness.parameter_groups(model)
    pmodel = hp.parallelize(model, plan, seed=SEED, device="cpu")
    shard = pmodel.shard
    (x, y), (x2, y2), (xc, yc) = (
        batch(spec, GLOBAL_BATCH, SEED, True),
        batch(spec, GLOBAL_BATCH, SEED + 1, True),
        batch(spec, GLOBAL_BATCH, SEED + 2, False),
    )
    result = {
        "dp_rank": pmodel.dp_rank,
        "parameter_groups": groups,
        "microbatches": plan.num_microbatches,
    }
    losses, compared = {}, set()

    def train(label, loss_fn, inputs, targets, want_grads, **options):
        loss = pmodel.train_step(shard(inputs), shard(targets), loss_fn, **options)
        names, worst = compare(pmodel, model, want_grads, True)
        compared.update(names)
        result[f"grad_worst_{label}"] = worst
        for param in pmodel.parameters():
            param.grad = None
        return loss

    loss = train("default", None, x, y, ref["default"][1])
    losses["train_default"] = (loss.item(), ref["default"][0])
    try:
        loss.backward()
    except RuntimeError as error:
        result["backward_refused"] = str(error)
    if "custom" in extras:
        losses["train_pair"] = (
            train("pair", smoothed_sum, x, y, ref["pair"][1]).item(),
            ref["pair"][0],
        )
        losses["train_mean"] = (
            train("mean", smoothed_mean, xc, yc, ref["mean"][1]).item(),
            ref["mean"][0],
        )
        # two calls accumulate: the gradient of the mean of the two batches' losses (the second call
        # adds to the first)
        pmodel.train_step(shard(x), shard(y), smoothed_sum, accumulate=2)
        want = {n: (g + ref["pair2"][1][n]) / 2 for n, g in ref["pair"][1].items()}
        train("accumulated", smoothed_sum, x2, y2, want, accumulate=2)
    ex, ey = batch(spec, EVAL_BATCH, SEED + 3, True)
    losses["eval_default"] = (pmodel.eval_step(shard(ex), shard(ey)).item(), ref["eval"]["default"])
    losses["eval_pair"] = (
        pmodel.eval_step(shard(ex), shard(ey), smoothed_sum).item(),
        ref["eval"]["pair"],
    )
    logits = logits_of(pmodel(shard(x)))
    torch.testing.assert_close(logits, shard(ref["logits"]), rtol=LOGITS_TOL, atol=LOGITS_TOL)
    result["logits_shape"] = list(logits.shape)
    if "generate" in extras:
        traced = len(pmodel._forwards._cache) if pmodel._forwards is not None else 0
        generated = pmodel.generate(shard(x)[:, :6], 3)
        # pipelines traced for the three lengths: one, its sequence size symbolic, where the
        # model allows (Note [one export for every length])
        result["generate_pipelines"] = (
            len(pmodel._forwards._cache) - traced if pmodel._forwards is not None else 0
        )
        # Token ids, compared exactly: each pick's top-2 logit gap on one device (generation_margin,
        # asserted in the test to be 100x LOGITS_TOL) is far above the logits' difference between
        # layouts, so no kernel's rounding on any machine can flip an argmax here
        result["generated_equal"] = torch.equal(generated, shard(ref["generated"]))
        result["generation_margin"] = ref["generation_margin"]
    if "hf" in extras:  # inputs the pipeline was not traced with: traced again for them
        masked = pmodel(input_ids=shard(x), attention_mask=shard(ref["mask"])).logits
        torch.testing.assert_close(
            masked, shard(ref["masked_logits"]), rtol=LOGITS_TOL, atol=LOGITS_TOL
        )
        labels_loss = pmodel.eval_step(
            {"input_ids": shard(ex), "labels": shard(ex)}, None, lambda out, _: out.loss
        )
        losses["eval_labels"] = (labels_loss.item(), ref["labels_loss"])
    if "metrics" in extras:  # a measured step spans the calls between two optimizer steps
        optimizer = torch.optim.SGD(pmodel.parameters(), lr=0.0)
        # the first optimizer step seen: from now on steps run between optimizer steps
        optimizer.step()
        for _ in range(2):
            pmodel.train_step(shard(x), shard(y), accumulate=2)
        optimizer.step()
        optimizer.zero_grad()
        pmodel.train_step(shard(x), shard(y))  # opens the next step: the two calls' step is closed
        result["metrics_last_tokens"] = pmodel.metrics.steps()[-1][1]
    # last: an optimizer made after the eval and the call above, then one step
    if "after_eval" in extras:
        optimizer = torch.optim.SGD(pmodel.parameters(), lr=LR)
        pmodel.train_step(shard(x), shard(y))
        optimizer.step()
        names, _ = compare(pmodel, model, ref["after_sgd"], False)
        result["stepped_after_eval"] = sorted(names)
    bad = {key: pair for key, pair in losses.items() if not close(*pair)}
    assert not bad, f"losses off the single device's (got, want): {bad}"
    return {**result, "losses": losses, "compared": sorted(compared)}


if __name__ == "__main__":
    harness.main(run_case)
