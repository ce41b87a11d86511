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


def attention(kind: str, cp: int, causal: bool, groups: dict, kv_heads: int = 3) -> dict:
    """``kv_heads`` fewer than the 3 (or 4, then) query heads: grouped-query attention, against
    scaled_dot_product_attention's enable_gqa."""
    group = groups[cp][dist.get_rank() // cp]
    rank = dist.get_rank(group)
    torch.manual_seed(0)  # the same sequence on every rank
    heads = 3 if kv_heads == 3 else 4
    q = torch.randn(2, heads, 32, 8, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 32, 8, requires_grad=True) for _ in range(2))
    gqa = {"enable_gqa": True} if kv_heads != heads else {}
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
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
    from hyparallel.tensor import context
    from hyparallel.tensor.context import register_transformers_attention, split_attention
    from hyparallel.tensor.init import materialize_
    from hyparallel.tools.parity import small_spec

    group = groups[cp][dist.get_rank() // cp]
    rank = dist.get_rank(group)
    spec = small_spec("hf:LlamaForCausalLM num_key_value_heads=2")  # 4 query heads
    one = materialize_(hp.models.load(spec).module, "cpu", seed=0)
    split = copy.deepcopy(one)
    split.set_attn_implementation(register_transformers_attention())
    torch.manual_seed(1)
    vocab = one.config.vocab_size
    ids = torch.randint(0, vocab, (2, 32))
    weights = torch.randn(2, 32, vocab)  # a loss reading every logit
    logits = one(input_ids=ids).logits
    (logits * weights).sum().backward()
    where = positions(32, cp, rank)[None].expand(2, -1)
    # the heads of every key, value (and, on the ring, gradient) block that leaves this rank
    sent: set[int] = set()
    ring_step, all_gather_seq = context._ring_step, context.all_gather_seq

    def counted_ring_step(x, group):
        sent.update(t.size(-3) for t in x)
        return ring_step(x, group)

    def counted_all_gather_seq(x, dim, group):
        sent.add(x.size(-3))
        return all_gather_seq(x, dim, group)

    context._ring_step, context.all_gather_seq = counted_ring_step, counted_all_gather_seq
    try:
        with split_attention(group, kind):
            mine = split(input_ids=shard_sequence(ids, 1, cp, rank), position_ids=where).logits
        (mine * shard_sequence(weights, 1, cp, rank)).sum().backward()
    finally:
        context._ring_step, context.all_gather_seq = ring_step, all_gather_seq
    result = {
        "logits": error(mine, shard_sequence(logits.detach(), 1, cp, rank)),
        "sent_heads": sorted(sent),
        "heads": [one.config.num_attention_heads, one.config.num_key_value_heads],
    }
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
            # 4 query heads over 2 key/value heads, which travel as 2
            (f"{kind}-cp2-gqa", lambda kind=kind: attention(kind, 2, True, groups, kv_heads=2))
            for kind in KINDS
        ]
        + [
            (f"llama-{kind}-cp{cp}", lambda kind=kind, cp=cp: llama(kind, cp, groups))
            for kind, cp in (("gather", 2), ("ring", 4))
        ],
    )


if __name__ == "__main__":
    main()
