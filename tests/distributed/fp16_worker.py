"""fp16 loss scaling against underflow: `torchrun --nproc_per_node 4 fp16_worker.py OUT CASE...`.

Each case plans the layout in fp16 and takes a loss small enough (1e-5 x token cross-entropy) that
its gradients flush to zero in fp16's backward without scaling. It compares one train_step's
gradients with the same plan in fp32, with the scaler on and off (Note [fp16 loss scaling],
hyparallel/runtime/parallel.py); then makes one rank alone see an inf (a hook on a parameter of the
first pipeline stage): every rank must skip the optimizer step and halve the scale. Last, the
scaler's state must come back from a checkpoint into a new model. Rank 0 writes one JSON line per
case.
"""

from __future__ import annotations

import logging
import sys
import tempfile

import harness  # tests/distributed/harness.py, beside this script
import torch
import torch.distributed as dist

import hyparallel as hp
from hyparallel.runtime.parallel import token_cross_entropy

logging.getLogger("transformers").setLevel(logging.ERROR)
SEQ, GLOBAL_BATCH, SEED = 16, 8, 31
SPEC = "gpt-tiny num_layers=2 bias=false"
CASES = {
    "dp2-pp2": dict(dp=2, tp=1, pp=2, micro_batch=2, zero=0, schedule="1f1b"),
    "tp2-pp2": dict(
        dp=1, tp=2, pp=2, micro_batch=2, zero=0, schedule="1f1b", vocab_parallel_loss=False
    ),
}


def small_loss(output, targets):
    """A loss whose gradients fp16 cannot hold without scaling (about 1e-9 per logit)."""
    return token_cross_entropy(output, targets) * 1e-5


def build(dtype: str, constraints: dict):
    model = hp.models.load(SPEC).module
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=dist.get_world_size())
    plan = hp.plan(model, cluster, GLOBAL_BATCH, SEQ, dtype, **constraints)
    return hp.parallelize(model, plan, seed=SEED, device="cpu")


def grads_after_one_step(pmodel, inputs, targets) -> dict[str, torch.Tensor]:
    pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets), small_loss)
    return {name: param.grad.clone() for name, param in pmodel.named_parameters()}


def run_case(name: str) -> dict:
    constraints = CASES[name]
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    want = grads_after_one_step(build("fp32", constraints), inputs, targets)
    scaled = grads_after_one_step(build("fp16", constraints), inputs, targets)
    plain_model = build("fp16", constraints)
    plain_model.scaler = None  # what fp16 did before: autocast, no scaling
    plain = grads_after_one_step(plain_model, inputs, targets)

    def relative(got):
        return max(
            ((got[n] - w).norm() / w.norm().clamp_min(1e-30)).item() for n, w in want.items()
        )

    def zero_fraction(got):
        return sum(int((g == 0).sum()) for g in got.values()) / sum(g.numel() for g in got.values())

    result = {"scaled_rel": relative(scaled), "plain_rel": relative(plain)}
    result["zero_fraction"] = {
        "fp32": zero_fraction(want),
        "scaled": zero_fraction(scaled),
        "plain": zero_fraction(plain),
    }
    # One rank alone sees an inf: every rank skips the step and halves the scale.
    pmodel = build("fp16", constraints)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    first_stage = (
        pmodel.mesh["pp"].get_local_rank() == 0 and pmodel.mesh["tp"].get_local_rank() == 0
    )
    handle = None
    if first_stage and pmodel.dp_rank == 0:
        param = next(p for p in pmodel.parameters() if p.requires_grad)
        handle = param.register_hook(lambda grad: grad * float("inf"))
    before = [p.detach().clone() for p in pmodel.parameters()]
    scale = pmodel.scaler.scale
    pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets), small_loss)
    optimizer.step()
    optimizer.zero_grad()
    if handle is not None:
        handle.remove()
    # exact: a skipped step runs no kernel on the parameters, so they are the very same values
    result["inf_skipped"] = all(torch.equal(b, p) for b, p in zip(before, pmodel.parameters()))
    result["optimizer_state"] = len(optimizer.state)
    result["scale"] = (scale, pmodel.scaler.scale)
    # clean: trains, the tracker grows
    pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets), small_loss)
    optimizer.step()
    # loose by construction: any parameter moved at all (an AdamW step of lr 1e-3 moves each far
    # past rounding)
    result["clean_step_trained"] = not all(
        torch.equal(b, p) for b, p in zip(before, pmodel.parameters())
    )
    # The scaler's state survives a checkpoint into another model.
    folder = [tempfile.mkdtemp(prefix="fp16-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    hp.checkpoint.save(pmodel, optimizer, folder[0], step=2)
    resumed = build("fp16", constraints)
    hp.checkpoint.load(resumed, torch.optim.AdamW(resumed.parameters(), lr=1e-3), folder[0])
    result["saved_scaler"], result["resumed_scaler"] = (
        pmodel.scaler.state_dict(),
        resumed.scaler.state_dict(),
    )
    return result


if __name__ == "__main__":
    harness.main(run_case)
    sys.exit(0)
