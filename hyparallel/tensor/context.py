"""Context parallelism's attention (issue 39): every sequence split over the cp ranks of a group,
attention exact across the split (Note [context-parallel attention]).

    local = shard_sequence(x, dim=1, cp=cp, rank=rank)        # this rank's two chunks
    out = context_parallel_attention(q, k, v, group, is_causal=True)

Groundwork: the runtime does not yet split a model's sequences (parallel.cp is not a plan key).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from hyparallel.tensor.collectives import all_gather_seq

# Note [context-parallel attention]
#     Each of cp ranks holds two of the sequence's 2 cp equal chunks, i and 2 cp - 1 - i (Megatron-
#     Core's and torchtitan's load balancing): under a causal mask a query attends to the keys
#     before it, so early chunks cost little and late ones much, and the pair gives every rank the
#     same number of (query, key) pairs. Attention is exact across the split the way Llama 3 trained
#     its long contexts: every rank all-gathers the keys and values of the others (all_gather_seq,
#     whose backward reduce-scatters their gradients back to the ranks holding them) and attends
#     its own queries to the whole sequence, under a mask built from each token's global position.
#     Queries never move; the keys and values of the whole sequence are held once per layer during
#     its attention (grouped-query attention keeps them small). A ring passing key/value blocks and
#     merging partial results by their log-sum-exp holds less, and overlaps its sends with compute;
#     it is the other choice the planner is to price.


def chunks_of(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks of a sequence cut in 2 ``cp`` that cp rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This cp rank's two chunks of ``x`` along the sequence dimension ``dim``, in order."""
    length = x.size(dim)
    if length % (2 * cp):
        raise ValueError(
            f"a sequence of {length} tokens does not split into {2 * cp} equal chunks for"
            f" context parallelism {cp}; pad it to a multiple of {2 * cp}"
        )
    parts = x.chunk(2 * cp, dim=dim)
    first, second = chunks_of(cp, rank)
    return torch.cat([parts[first], parts[second]], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every cp rank's ``shard_sequence``, in rank order."""
    cp = len(shards)
    parts: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        first, second = chunks_of(cp, rank)
        parts[first], parts[second] = shard.chunk(2, dim=dim)
    return torch.cat(parts, dim=dim)


def positions(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions of the tokens cp rank ``rank`` holds of a ``length``-token sequence."""
    return shard_sequence(torch.arange(length, device=device), 0, cp, rank)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    *,
    is_causal: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of this rank's queries over the whole sequence, whose
    keys and values are split over ``group`` as ``shard_sequence`` splits them along dim -2 ((batch,
    heads, tokens, head size), the same heads for keys and values as for queries); differentiable,
    the keys' and values' gradients summed on the ranks holding them (Note [context-parallel
    attention])."""
    cp = dist.get_world_size(group)
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    rank = dist.get_rank(group)
    local = q.size(-2)
    keys = all_gather_seq(k.contiguous(), k.dim() - 2, group)
    values = all_gather_seq(v.contiguous(), v.dim() - 2, group)
    mask = None
    if is_causal:
        length = local * cp
        mine = positions(length, cp, rank, q.device)
        every = torch.cat([positions(length, cp, r, q.device) for r in range(cp)])
        mask = mine[:, None] >= every[None, :]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
