"""Pretrained weights worker: `torchrun --nproc_per_node 4 tests/distributed/pretrained_worker.py
OUT ROOT CASE...`.

ROOT holds Hugging Face folders of two small Llamas (``tied`` and ``untied``, written by
tests/test_pretrained.py with ``save_pretrained`` in small shards) and each case's plan
(``plan-CASE.yaml``, planned there: one trace in one process, not one in each). Each case builds its
model on the meta device, parallelizes it from another seed, loads the folder with
``hp.checkpoint.load_pretrained`` and records: this rank's resident-set growth while loading (peak
less the start, /proc/self/status), the bytes it read and the bytes of the pieces it holds, the eval
loss on batch 0, the training loss on batch 1 and, after that SGD step and a checkpoint of it in
ROOT/ckpt-CASE, the eval loss on batch 2. The test compares the losses with ``from_pretrained`` in
one process and exports the checkpoints. Rank 0 writes one JSON line per case.
"""

from __future__ import annotations

import gc
import logging
import re
import sys
from pathlib import Path

import harness  # tests/distributed/harness.py, beside this script
import torch

import hyparallel as hp
from hyparallel.runtime.checkpoint import state_entries

logging.getLogger("transformers").setLevel(logging.ERROR)
# 2 layers of width 384 (6 query heads, 2 key/value heads) and a 1,021-token vocabulary (odd: tp
# pads it): 15 MiB of fp32 weights, none of them more than a tenth, so a rank's memory while loading
# shows against the model's; small enough to trace and train in seconds.
LLAMA = (
    "hf:LlamaForCausalLM num_hidden_layers=2 hidden_size=384 num_attention_heads=6"
    " num_key_value_heads=2 intermediate_size=1024 vocab_size=1021 max_position_embeddings=64"
    " bos_token_id=0 eos_token_id=0"
)
SPECS = {"untied": LLAMA, "tied": LLAMA + " tie_word_embeddings=true"}
VOCAB, SEQ, GLOBAL_BATCH, SEED, LR = 1021, 16, 8, 23, 0.1
CASES = {  # name -> (folder, constraints for hp.plan)
    # the tie crosses the pipeline: the last stage's head reads the embedding's name in the file
    "tp2-pp2": (
        "tied",
        dict(dp=1, tp=2, pp=2, schedule="1f1b", micro_batch=2, zero=0, sequence_parallel=True),
    ),
    "dp2-tp2-zero1": (
        "untied",
        dict(dp=2, tp=2, pp=1, micro_batch=2, zero=1, sequence_parallel=True),
    ),
}


def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``index``: token ids and next-token targets, about 10% of them padding
    (-100)."""
    generator = torch.Generator().manual_seed(SEED + index)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
    targets = tokens[:, 1:].clone()
    targets[torch.rand(targets.shape, generator=generator) < 0.1] = -100
    return tokens[:, :-1], targets


def status_kib(field: str) -> int:
    """A figure of /proc/self/status in KiB (VmRSS: resident now, VmHWM: its peak)."""
    return int(
        re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)
    )


def run(name: str, root: Path) -> dict:
    folder, constraints = CASES[name]
    model = hp.models.load(SPECS[folder]).module  # meta: parameters take no memory
    plan = hp.Plan.load(root / f"plan-{name}.yaml")
    # other weights than the folder's
    pmodel = hp.parallelize(model, plan, seed=SEED + 1, device="cpu")
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    start = status_kib("VmRSS")
    loaded = hp.checkpoint.load_pretrained(pmodel, root / folder)
    growth = (status_kib("VmHWM") - start) * 1024
    held = sum(
        p.view.numel() * p.view.element_size()
        for e in state_entries(pmodel, None).values()
        for p in e.pieces
    )
    inputs, targets = batch(0)
    first = pmodel.eval_step(pmodel.shard(inputs), pmodel.shard(targets)).item()
    # The optimizer after an eval_step, and the save after another: under ZeRO 1 FSDP2 keeps a
    # forward's gathered weights for the backward, so an eval must hand them back
    # (ParallelModel._forward_only), else this optimizer would hold the gathered copies (its updates
    # lost: the eval after the step would not move) and the save below would write them (it crashed
    # in DCP's write)
    optimizer = torch.optim.SGD(pmodel.parameters(), lr=LR)
    inputs, targets = batch(1)
    trained = pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets)).item()
    optimizer.step()
    optimizer.zero_grad()
    inputs, targets = batch(2)
    after = pmodel.eval_step(pmodel.shard(inputs), pmodel.shard(targets)).item()
    pmodel(pmodel.shard(inputs))  # a call of the model too: weights handed back after it
    # and a forward of the user's module itself, past pmodel: the save hands them back
    if plan.parallel.pp == 1:
        with torch.no_grad():
            pmodel.module(pmodel.shard(inputs))
    hp.checkpoint.save(pmodel, optimizer, root / f"ckpt-{name}", step=1)
    return {
        "growth_bytes": growth,
        "bytes_read": loaded.bytes_read,
        "held_bytes": held,
        "tensors": loaded.tensors,
        "eval_loss": first,
        "train_loss": trained,
        "eval_after_step": after,
    }


if __name__ == "__main__":
    out_path, root, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    harness.init()
    harness.run_cases(out_path, [(name, lambda name=name: run(name, root)) for name in names])
