"""A pipeline stage follows the model's mode: `torchrun --nproc_per_node 2 eval_mode_worker.py OUT
CASE...`.

Each case builds a model with dropout, plans pp = 2, and runs eval_step twice with the model in eval
mode (the single device's eval loss, the same both times) and twice in training mode (dropout on:
two draws differ). Note [a stage follows the model's mode] (hyparallel/pipeline/split.py). Rank 0
writes one JSON line per case.
"""

from __future__ import annotations

import logging

import harness  # tests/distributed/harness.py, beside this script
import torch
import torch.distributed as dist

import hyparallel as hp
from hyparallel.runtime.parallel import token_cross_entropy
from hyparallel.tensor.init import materialize_

logging.getLogger("transformers").setLevel(logging.ERROR)
SEQ, BATCH, SEED, VOCAB = 16, 4, 5, 64
CASES = {
    "hf-gpt2": (  # export: aten.dropout and the attention's dropout_p baked in at trace time
        "hf:GPT2LMHeadModel n_layer=2 n_embd=32 n_head=4 vocab_size=64 n_positions=32"
        " resid_pdrop=0.3 embd_pdrop=0.3 attn_pdrop=0.3 bos_token_id=0 eos_token_id=0"
    ),
    # torch.fx: self.training read once, at trace
    "gpt-tiny": "gpt-tiny num_layers=2 vocab_size=64 dropout=0.3",
}


def run_case(name: str) -> dict:
    spec = CASES[name]
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    reference = materialize_(hp.models.load(spec).module, "cpu", seed=SEED).eval()
    with torch.no_grad():
        want = token_cross_entropy(reference(inputs), targets).item()
    model = hp.models.load(spec).module
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=dist.get_world_size())
    plan = hp.plan(model, cluster, BATCH, SEQ, "fp32", dp=1, tp=1, pp=2, micro_batch=2, zero=0)
    pmodel = hp.parallelize(model, plan, seed=SEED, device="cpu")
    model.eval()
    evals = [pmodel.eval_step(pmodel.shard(inputs), pmodel.shard(targets)).item() for _ in range(2)]
    model.train()
    trains = [
        pmodel.eval_step(pmodel.shard(inputs), pmodel.shard(targets)).item() for _ in range(2)
    ]
    return {"want": want, "eval": evals, "train": trains}


if __name__ == "__main__":
    harness.main(run_case)
