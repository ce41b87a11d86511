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
        ],
    )


if __name__ == "__main__":
    main()
