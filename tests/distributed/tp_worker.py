"""Tensor-parallel parity worker: run under `torchrun --nproc_per_node 4` (gloo); one process group
for all cases.

Every case builds the single-device reference model with a fixed seed on every rank, copies it,
applies tensor parallelism over a tp group (tp=2: ranks {0,1} and {2,3}; tp=4: all four), runs the
same batch, and compares the logits, the loss and every parameter's gradient (split gradients
gathered back to full shape). Rank 0 writes one JSON line per case (every rank's result) to the file
given as argv[1].

Tolerance: fp32, rtol 1e-5 with atol 1e-6: the all-reduces sum partial products in another order
than the single-device matmul, so results differ by float rounding only; atol covers entries near
zero, where a relative bound means nothing.
"""

from __future__ import annotations

import functools
import logging
import os
import sys

import harness  # tests/distributed/harness.py, beside this script
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hyparallel as hp
from hyparallel.kernels import kernels_enabled
from hyparallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy
from hyparallel.tensor.init import materialize_
from hyparallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)

logging.getLogger("transformers").setLevel(logging.ERROR)
RTOL, ATOL = 1e-5, 1e-6
NO_DROPOUT = "resid_pdrop=0 embd_pdrop=0 attn_pdrop=0"
MODELS = {
    "gpt": "gpt-tiny",
    "llama": "llama-tiny",  # 4 query heads, 2 key/value heads: replicated at tp=4
    "hf-gpt2": (
        "hf:GPT2LMHeadModel n_layer=2 n_embd=64 n_head=4 vocab_size=128 n_positions=64"
        f" bos_token_id=0 eos_token_id=0 {NO_DROPOUT}"
    ),
    "hf-llama": (  # padded vocab at tp=4
        "hf:LlamaForCausalLM num_hidden_layers=2 hidden_size=64 num_attention_heads=4"
        " num_key_value_heads=2 intermediate_size=128 vocab_size=122 max_position_embeddings=64"
        " bos_token_id=0 eos_token_id=0"
    ),
}


def build(spec: str):
    torch.manual_seed(1234)
    return hp.models.load(spec, device="cpu").module


def logits_of(output):
    return output.logits if hasattr(output, "logits") else output


def expected_local(module, param_name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the single-device gradient ``full`` (nn.Linear layout), padding rows
    zero.

    Compared rank by rank: a key/value head held by several ranks must carry the whole gradient on
    each.
    """
    if isinstance(module, (ColumnParallelLinear, VocabParallelHead)) or isinstance(
        module, VocabParallelEmbedding
    ):
        rows = [module.rows] if isinstance(module, VocabParallelEmbedding) else module.rows
        pieces = []
        for start, stop in rows:
            kept = full[start : min(stop, full.size(0))]
            padding = full.new_zeros(max(0, stop - max(start, full.size(0))), *full.shape[1:])
            pieces += [kept, padding]
        return torch.cat(pieces)
    if isinstance(module, RowParallelLinear) and param_name == "weight":
        return full[:, module.cols[0] : module.cols[1]]
    return full


def run_case(
    name: str,
    spec: str,
    tp_group,
    sequence_parallel: bool,
    vocab_loss: bool,
    from_meta: bool = False,
) -> dict:
    if from_meta:  # planned on the meta device: each rank materialises only its slices
        reference = materialize_(hp.models.load(spec, device="meta").module, "cpu", seed=11)
        model = hp.models.load(spec, device="meta").module
    else:
        reference, model = build(spec), build(spec)
    batch, seq = 2, 16
    torch.manual_seed(7)
    vocab = reference.config.vocab_size if hasattr(reference.config, "vocab_size") else 256
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    ref_logits = logits_of(reference(inputs))
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    ref_loss.backward()

    graph = hp.trace(model, hp.models.example_inputs(model, 1, seq))
    plan = hp.plan(
        graph,
        hp.ClusterSpec.preset("cpu", gpus_per_node=dist.get_world_size(tp_group)),
        global_batch=2,
        seq_len=seq,
        dtype="fp32",
        tp=dist.get_world_size(tp_group),
        pp=1,
    )
    info = apply_tensor_parallel(
        model,
        plan.tensor_parallel,
        tp_group,
        graph,
        sequence_parallel=sequence_parallel,
        gather_logits=not vocab_loss,
    )
    if from_meta:
        assert all(p.is_meta for p in model.parameters())  # nothing allocated until materialised
        materialize_(model, "cpu", seed=11)
    logits = logits_of(model(inputs))
    if vocab_loss:
        loss = vocab_parallel_cross_entropy(
            logits, targets, tp_group, info.vocab_start, info.vocab_size
        )
    else:
        torch.testing.assert_close(logits, ref_logits, rtol=RTOL, atol=ATOL)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    loss.backward()
    info.reduce_grads(model)
    reference_params = dict(reference.named_parameters())
    checked, split_bytes, full_bytes = [], 0, 0
    for param_name, param in model.named_parameters():
        owner_path, _, leaf = param_name.rpartition(".")
        owner = model.get_submodule(owner_path)
        expected = reference_params[param_name].grad
        if type(reference.get_submodule(owner_path)).__name__ == "Conv1D":
            expected = expected.t()  # compared in nn.Linear layout
        local = expected_local(owner, leaf, expected)
        torch.testing.assert_close(
            param.grad,
            local,
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m, param_name=param_name: f"{param_name}: {m}",
        )
        if isinstance(owner, (ColumnParallelLinear, RowParallelLinear)) and leaf == "weight":
            split_bytes += param.numel() * param.element_size()
            full_bytes += expected.numel() * expected.element_size()
        checked.append(param_name)
    tp = dist.get_world_size(tp_group)
    # Memory: split weights hold 1/tp of the full bytes (more only where key/value heads are
    # replicated).
    fused = sum(
        1 for m in model.modules() if isinstance(m, ColumnParallelLinear) and m.activation != "none"
    )
    return {
        "checked_params": checked,
        "parameter_groups": harness.parameter_groups(reference),
        "split_fraction": split_bytes / full_bytes,
        "tp": tp,
        "synced": len(info.synced_params),
        "fused": fused,
        "shared": len(info.shared_rows),
    }


def triton_cases() -> list[tuple[str, object]]:
    """The fused column Linears through the Triton kernels, run by Triton's interpreter on the CPU.

    Launched on its own with TRITON_INTERPRET=1 in the environment: Triton reads it when first
    imported.
    """
    assert os.environ.get("TRITON_INTERPRET") == "1"

    def case(model_name: str) -> dict:
        result = run_case(
            f"{model_name}-tp2-triton", MODELS[model_name], dist.group.WORLD, False, False
        )
        return {**result, "triton": kernels_enabled(torch.zeros(1))}

    return [
        (f"{model_name}-tp2-triton", functools.partial(case, model_name))
        for model_name in ("gpt", "hf-llama")
    ]


def cases(rank: int) -> list[tuple[str, object]]:
    """Every (name, case) of the main launch: tp 2 on ranks {0, 1} and {2, 3} at once, then tp 4 on
    all four."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    everyone = dist.new_group([0, 1, 2, 3])
    listed = []
    for tp in (2, 4):
        group = pairs[rank // 2] if tp == 2 else everyone
        for model_name, spec in MODELS.items():
            for sequence_parallel in (False, True):
                for vocab_loss in (False, True) if not sequence_parallel and tp == 2 else (False,):
                    sp, vocab = (
                        "-sp" if sequence_parallel else "",
                        "-vocab-loss" if vocab_loss else "",
                    )
                    name = f"{model_name}-tp{tp}{sp}{vocab}"
                    listed.append(
                        (
                            name,
                            functools.partial(
                                run_case, name, spec, group, sequence_parallel, vocab_loss
                            ),
                        )
                    )
        # hf-gpt2: Conv1D stores (in, out); its slices must take those values
        for model_name, spec in MODELS.items():
            name = f"{model_name}-tp{tp}-meta"
            listed.append(
                (name, functools.partial(run_case, name, spec, group, False, False, from_meta=True))
            )
    return listed


def main() -> None:
    harness.init()
    triton = len(sys.argv) > 2 and sys.argv[2] == "triton"
    harness.run_cases(sys.argv[1], triton_cases() if triton else cases(dist.get_rank()))


if __name__ == "__main__":
    main()
