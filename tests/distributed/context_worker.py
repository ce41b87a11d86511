"""Context-parallel attention worker: `torchrun --nproc_per_node 4
tests/distributed/context_worker.py OUT`.

Keys and values all-gathered, and passed round a ring; for cp 4 (every rank) and cp 2 (ranks 0-1 and
2-3), causal and not: each rank's output and the
gradients of its queries, keys and values against one process's scaled_dot_product_attention of the
whole sequence, and the (query, key) pairs its causal attention computes (Note [context-parallel
attention], hyparallel/tensor/context.py).
"""

from __future__ import annotations

import harness  # tests/distributed/harness.py, beside this script
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyparallel.tensor.context import (
    context_parallel_attention,
    positions,
    ring_attention,
    shard_sequence,
)

KINDS = {"gather": context_parallel_attention, "ring": ring_attention}


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def attention(kind: str, cp: int, causal: bool, groups: dict) -> dict:
    group = groups[cp][dist.get_rank() // cp]
    rank = dist.get_rank(group)
    torch.manual_seed(0)  # the same sequence on every rank
    q, k, v = (torch.randn(2, 3, 32, 8, requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    grad = torch.randn_like(out)
    out.backward(grad)
    mine = [shard_sequence(x.detach(), 2, cp, rank).requires_grad_() for x in (q, k, v)]
    got = KINDS[kind](*mine, group, is_causal=causal)
    got.backward(shard_sequence(grad, 2, cp, rank))
    result = {"out": error(got, shard_sequence(out.detach(), 2, cp, rank))}
    for name, local, whole in zip("qkv", mine, (q, k, v)):
        result[name] = error(local.grad, shard_sequence(whole.grad, 2, cp, rank))
    # the (query, key) pairs a causal mask leaves this rank: its queries' positions + 1, summed
    result["pairs"] = int((positions(32, cp, rank) + 1).sum()) if causal else 32 // cp * 32
    return result


def llama(kind: str, cp: int, groups: dict) -> dict:
    """A tiny Llama (grouped-query attention, rotary embeddings) whose attention is split over cp
    ranks (Note [context parallelism in a transformers model]): each rank runs its two chunks of
    the tokens at their global positions; its logits, and every weight gradient summed over the cp
    ranks, against one process running the whole sequence."""
    import copy

    import hyparallel as hp
    from hyparallel.tensor.context import register_transformers_attention, split_attention
    from hyparallel.tensor.init import materialize_
    from hyparallel.tools.parity import small_spec

    group = groups[cp][dist.get_rank() // cp]
    rank = dist.get_rank(group)
    one = materialize_(hp.models.load(small_spec("hf:LlamaForCausalLM")).module, "cpu", seed=0)
    split = copy.deepcopy(one)
    split.set_attn_implementation(register_transformers_attention())
    torch.manual_seed(1)
    vocab = one.config.vocab_size
    ids = torch.randint(0, vocab, (2, 32))
    weights = torch.randn(2, 32, vocab)  # a loss reading every logit
    logits = one(input_ids=ids).logits
    (logits * weights).sum().backward()
    where = positions(32, cp, rank)[None].expand(2, -1)
    with split_attention(group, kind):
        mine = split(input_ids=shard_sequence(ids, 1, cp, rank), position_ids=where).logits
    (mine * shard_sequence(weights, 1, cp, rank)).sum().backward()
    result = {"logits": error(mine, shard_sequence(logits.detach(), 1, cp, rank))}
    reference = dict(one.named_parameters())
    worst, checked = 0.0, []
    for name, param in split.named_parameters():
        dist.all_reduce(param.grad, group=group)  # the cp ranks' shares of the whole sequence's
        worst = max(worst, error(param.grad, reference[name].grad))
        checked.append(name)
    return {**result, "grads": worst, "checked": checked, "names": sorted(reference)}


def main() -> None:
    import sys

    harness.init()
    world = dist.group.WORLD
    # every rank makes every group, in the same order
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {4: [world], 2: halves}
    harness.run_cases(
        sys.argv[1],
        [
            (
                f"{kind}-cp{cp}-{'causal' if causal else 'full'}",
                lambda kind=kind, cp=cp, causal=causal: attention(kind, cp, causal, groups),
            )
            for kind in KINDS
            for cp in (2, 4)
            for causal in (True, False)
        ]
        + [
            (f"llama-{kind}-cp{cp}", lambda kind=kind, cp=cp: llama(kind, cp, groups))
            for kind, cp in (("gather", 2), ("ring", 4))
        ],
    )


if __name__ == "__main__":
    main()
