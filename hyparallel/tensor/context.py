"""Context parallelism's attention (issue 39): every sequence split over the cp ranks of a group,
attention exact across the split (Note [context-parallel attention]).

    local = shard_sequence(x, dim=1, cp=cp, rank=rank)        # this rank's two chunks
    out = context_parallel_attention(q, k, v, group, is_causal=True)   # keys and values gathered
    out = ring_attention(q, k, v, group, is_causal=True)               # or passed round a ring

Groundwork: the runtime does not yet split a model's sequences (parallel.cp is not a plan key).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode

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
    key_padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of this rank's queries over the whole sequence, whose
    keys and values are split over ``group`` as ``shard_sequence`` splits them along dim -2 ((batch,
    heads, tokens, head size); fewer key and value heads than query heads are grouped-query
    attention's, gathered before they are repeated); differentiable, the keys' and values'
    gradients summed on the ranks holding them (Note [context-parallel attention], Note [attention
    by chunk pairs]). ``key_padding``: (batch, whole sequence) booleans, False for keys no query
    may see (padding), in the sequence's own order."""
    cp = dist.get_world_size(group)
    repeat = q.size(-3) // k.size(-3)  # gathered as few, then each key head for its queries
    if cp == 1:
        k, v = (x.repeat_interleave(repeat, -3) for x in (k, v)) if repeat > 1 else (k, v)
        return _whole(q, k, v, is_causal, scale, key_padding)
    keys = all_gather_seq(k.contiguous(), k.dim() - 2, group)
    values = all_gather_seq(v.contiguous(), v.dim() - 2, group)
    if repeat > 1:
        keys, values = keys.repeat_interleave(repeat, -3), values.repeat_interleave(repeat, -3)
    scale = q.size(-1) ** -0.5 if scale is None else scale
    rank = dist.get_rank(group)
    return _Gathered.apply(q, keys, values, cp, rank, is_causal, scale, key_padding)


def _whole(q, k, v, is_causal: bool, scale, key_padding) -> torch.Tensor:
    """A group of one: scaled_dot_product_attention, the padding as a mask beside the causal one."""
    if key_padding is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    mask = key_padding[:, None, None, :]
    if is_causal:
        mask = mask & torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# Note [attention by chunk pairs]
#     Under the load-balanced split a rank's queries are two chunks of the sequence (i and 2 cp -
#     1 - i) and so is every rank's block of keys. Between one query chunk a and one key chunk b the
#     causal mask is all or nothing or the plain triangle: b < a sees every key, b = a is causal
#     within the chunk, b > a sees none. So attention is computed chunk pair by chunk pair, skipping
#     the invisible ones (each rank then computes its share of the (query, key) pairs and no more),
#     and no mask over the sequence is ever built (a (tokens x sequence) mask, which
#     scaled_dot_product_attention also turns into floats, is quadratic in the length). Each pair's
#     result is merged by log-sum-exp; the backward recomputes each pair's probabilities from the
#     final output and log-sum-exp (the flash-attention backward), query rows a tile at a time, so
#     that no more than a (tile x chunk) score matrix per head exists at once. Plain matrix
#     products: exact in fp32 on any device; a GPU would run a fused kernel per pair.

_TILE_ELEMENTS = 1 << 20  # scores per tile (batch x heads x query rows x chunk keys): 4 MiB in fp32


def _visible(a: int, b: int, causal: bool) -> str | None:
    """How query chunk ``a`` sees key chunk ``b``: "all", "causal" (the same chunk) or None."""
    if not causal:
        return "all"
    return "all" if b < a else "causal" if a == b else None


def _tiles(q: torch.Tensor, keys: int) -> list[slice]:
    rows = q.size(-2)
    per = max(1, _TILE_ELEMENTS // max(1, q[..., 0, 0].numel() * keys))
    return [slice(start, min(start + per, rows)) for start in range(0, rows, per)]


def _scores(q, k, scale, how: str, rows: slice, keep) -> torch.Tensor:
    scores = q[..., rows, :] @ k.transpose(-1, -2) * scale
    if how == "causal":  # query row r of the chunk sees keys 0..r
        index = torch.arange(k.size(-2), device=q.device)
        mine = torch.arange(rows.start, rows.stop, device=q.device)
        scores = scores.masked_fill(index[None, :] > mine[:, None], float("-inf"))
    if keep is not None:  # (batch, keys): padding no query sees
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with rows that see no key (-inf: every key padding) at 0, so their weights are 0."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def _pair_forward(q, k, v, scale, how: str, keep) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of query chunk ``q`` over key chunk ``k``, ``v`` (``keep``: its keys' padding)."""
    outs, lses = [], []
    for rows in _tiles(q, k.size(-2)):
        scores = _scores(q, k, scale, how, rows, keep)
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.exp(scores - _finite(lse)[..., None]) @ v)
        lses.append(lse)
    return torch.cat(outs, -2), torch.cat(lses, -1)


def _merge(out, lse, part_out, part_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmaxes over disjoint keys as one (rows without keys so far: -inf)."""
    merged = torch.logaddexp(lse, part_lse)
    keep = torch.where(torch.isfinite(merged), torch.exp(lse - merged), 0.0)
    take = torch.where(torch.isfinite(merged), torch.exp(part_lse - merged), 0.0)
    return out * keep[..., None] + part_out * take[..., None], merged


def _pair_backward(q, k, v, scale, how, keep, grad_out, lse, delta, grad_q, grad_k, grad_v) -> None:
    """Add query chunk ``q``'s pair with key chunk ``k``, ``v`` to the three gradients, from the
    final ``lse`` and ``delta`` (rowsum of grad_out x out)."""
    lse = _finite(lse)
    for rows in _tiles(q, k.size(-2)):
        weights = torch.exp(_scores(q, k, scale, how, rows, keep) - lse[..., rows, None])
        grad = grad_out[..., rows, :]
        grad_v.add_(weights.transpose(-1, -2) @ grad)
        grad_scores = weights * (grad @ v.transpose(-1, -2) - delta[..., rows, None])
        grad_q[..., rows, :].add_(grad_scores @ k * scale)
        grad_k.add_(grad_scores.transpose(-1, -2) @ q[..., rows, :] * scale)


def _keeps(padding, cp: int, source: int) -> list:
    """The key padding of rank ``source``'s two chunks (None, None without padding)."""
    if padding is None:
        return [None, None]
    return list(shard_sequence(padding, 1, cp, source).chunk(2, -1))


def _attend_block(q, k, v, cp, rank, source, causal, scale, out, lse, padding=None):
    """Merge this rank's queries' attention over rank ``source``'s block of keys into (out, lse),
    chunk pair by chunk pair (Note [attention by chunk pairs])."""
    mine, theirs = chunks_of(cp, rank), chunks_of(cp, source)
    keeps = _keeps(padding, cp, source)
    outs, lses = list(out.chunk(2, -2)), list(lse.chunk(2, -1))
    for x, (query, a) in enumerate(zip(q.chunk(2, -2), mine)):
        for key, value, b, keep in zip(k.chunk(2, -2), v.chunk(2, -2), theirs, keeps):
            if how := _visible(a, b, causal):
                part = _pair_forward(query, key, value, scale, how, keep)
                outs[x], lses[x] = _merge(outs[x], lses[x], *part)
    return torch.cat(outs, -2), torch.cat(lses, -1)


def _block_backward(q, k, v, cp, rank, source, causal, scale, grad_out, lse, delta, padding=None):
    """(dq, dk, dv) of this rank's queries' attention over rank ``source``'s block."""
    mine, theirs = chunks_of(cp, rank), chunks_of(cp, source)
    keeps = _keeps(padding, cp, source)
    grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    rows = zip(
        q.chunk(2, -2),
        grad_q.chunk(2, -2),
        grad_out.chunk(2, -2),
        lse.chunk(2, -1),
        delta.chunk(2, -1),
        mine,
    )
    for query, d_query, d_out, row_lse, row_delta, a in rows:
        columns = zip(k.chunk(2, -2), v.chunk(2, -2), grad_k.chunk(2, -2), grad_v.chunk(2, -2))
        for (key, value, d_key, d_value), b, keep in zip(columns, theirs, keeps):
            if how := _visible(a, b, causal):
                _pair_backward(
                    query, key, value, scale, how, keep, d_out, row_lse, row_delta, d_query,
                    d_key, d_value,
                )  # fmt: skip
    return grad_q, grad_k, grad_v


def _empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros_like(q), torch.full(
        q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device
    )


class _Gathered(torch.autograd.Function):
    """This rank's queries over every rank's keys and values (gathered, in rank order)."""

    @staticmethod
    def forward(ctx, q, keys, values, cp, rank, causal, scale, padding):
        out, lse = _empty_result(q)
        for source, (k, v) in enumerate(zip(keys.chunk(cp, -2), values.chunk(cp, -2))):
            out, lse = _attend_block(q, k, v, cp, rank, source, causal, scale, out, lse, padding)
        ctx.save_for_backward(q, keys, values, out, lse)
        ctx.cp, ctx.rank, ctx.causal, ctx.scale, ctx.padding = cp, rank, causal, scale, padding
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, keys, values, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1)
        grad_q, grad_keys, grad_values = torch.zeros_like(q), [], []
        for source, (k, v) in enumerate(zip(keys.chunk(ctx.cp, -2), values.chunk(ctx.cp, -2))):
            dq, dk, dv = _block_backward(
                q, k, v, ctx.cp, ctx.rank, source, ctx.causal, ctx.scale, grad_out, lse, delta,
                ctx.padding,
            )  # fmt: skip
            grad_q += dq
            grad_keys.append(dk)
            grad_values.append(dv)
        keys_grad, values_grad = torch.cat(grad_keys, -2), torch.cat(grad_values, -2)
        return grad_q, keys_grad, values_grad, None, None, None, None, None


# Note [ring attention]
#     The ring keeps one block of keys and values per rank at a time: at step s rank r holds the
#     block of rank r - s, attends its queries to it (chunk pair by chunk pair: Note [attention by
#     chunk pairs]) and passes it on to rank r + 1 while the next arrives. Each step's partial
#     result is merged into the running one by its log-sum-exp (lse = log(e^lse_a + e^lse_b), out =
#     out_a e^(lse_a - lse) + out_b e^(lse_b - lse)), which is exactly the softmax over every key
#     (Liu et al. 2023, Ring Attention; Megatron-Core's p2p context parallelism). The backward goes
#     round the ring again: with the final output and lse saved, each block's softmax is
#     recomputed, the queries' gradient accumulates in place, and the keys' and values' gradients
#     travel with their block, gathering every rank's share, one more hop bringing them home.
#     Grouped-query keys and values travel as few as they come (Note [grouped-query keys as they
#     travel], hyparallel/graph/context.py): each block's heads are repeated for their queries only
#     where the block is attended, and their gradients summed back onto them before they move on.


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    *,
    is_causal: bool,
    scale: float | None = None,
    key_padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """``context_parallel_attention`` by a ring of key/value blocks (Note [ring attention]): the
    same result, one other rank's keys and values held at a time."""
    cp = dist.get_world_size(group)
    repeat = q.size(-3) // k.size(-3)  # sent as few, each key head repeated for its queries here
    if cp == 1:
        k, v = (x.repeat_interleave(repeat, -3) for x in (k, v)) if repeat > 1 else (k, v)
        return _whole(q, k, v, is_causal, scale, key_padding)
    scale = q.size(-1) ** -0.5 if scale is None else scale
    return _Ring.apply(
        q, k.contiguous(), v.contiguous(), group, is_causal, scale, key_padding, repeat
    )


def _repeated(x: torch.Tensor, repeat: int) -> torch.Tensor:
    """Grouped-query keys or values with each head repeated for its ``repeat`` query heads."""
    return x.repeat_interleave(repeat, -3) if repeat > 1 else x


def _folded(grad: torch.Tensor, repeat: int) -> torch.Tensor:
    """The gradient of ``_repeated``'s output summed back onto its key or value heads."""
    if repeat == 1:
        return grad
    return grad.unflatten(-3, (grad.size(-3) // repeat, repeat)).sum(-3)


def _ring_step(x: list[torch.Tensor], group: ProcessGroup) -> list[torch.Tensor]:
    """Send each of ``x`` to the next rank of the ring, return what the previous one sent."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    after = dist.get_global_rank(group, (rank + 1) % cp)
    before = dist.get_global_rank(group, (rank - 1) % cp)
    received = [torch.empty_like(t) for t in x]
    ops = [dist.P2POp(dist.isend, t.contiguous(), after, group) for t in x]
    ops += [dist.P2POp(dist.irecv, t, before, group) for t in received]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, is_causal, scale, padding, repeat):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        out, lse = _empty_result(q)
        block = [k, v]  # grouped-query heads travel as few as they are
        for step in range(cp):
            source = (rank - step) % cp
            # the next block travels while this one is computed (on gloo: before)
            pending = _ring_step(block, group) if step < cp - 1 else None
            key, value = (_repeated(x, repeat) for x in block)
            out, lse = _attend_block(
                q, key, value, cp, rank, source, is_causal, scale, out, lse, padding
            )
            block = pending
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.is_causal, ctx.scale, ctx.padding = group, is_causal, scale, padding
        ctx.repeat = repeat
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1)
        grad_q = torch.zeros_like(q)
        # the block in hand and its keys' and values' gradients so far, travelling together
        block = [k, v, torch.zeros_like(k), torch.zeros_like(v)]
        for step in range(cp):
            source = (rank - step) % cp
            key, value, grad_k, grad_v = block
            dq, dk, dv = _block_backward(
                q, _repeated(key, ctx.repeat), _repeated(value, ctx.repeat), cp, rank, source,
                ctx.is_causal, scale, grad_out, lse, delta, ctx.padding,
            )  # fmt: skip
            grad_q += dq
            grad_k, grad_v = grad_k + _folded(dk, ctx.repeat), grad_v + _folded(dv, ctx.repeat)
            if step < cp - 1:
                block = _ring_step([key, value, grad_k, grad_v], group)
            else:
                block = [key, value, grad_k, grad_v]
        # one hop further than the blocks went: each rank's own keys' and values' gradients
        grad_k, grad_v = _ring_step(block[2:], group)
        return grad_q, grad_k, grad_v, None, None, None, None, None


# Note [context parallelism in a transformers model]
#     transformers' attention modules call the function its attention interface registers under
#     the config's _attn_implementation. TRANSFORMERS_ATTENTION is registered as one (no mask
#     function beside it, so transformers makes no mask: the split attention builds its own from
#     global positions): inside ``split_attention(group)`` it attends this rank's queries over the
#     whole sequence, keys and values gathered or passed round a ring, and a model given each
#     token's global position (position_ids) computes its rotary embeddings as on one device.
#     Any other model's ``F.scaled_dot_product_attention`` is split the same way:
#     ``split_attention`` holds a TorchFunctionMode that takes each call (a mode is thread-local
#     state, which autograd carries to the threads that run a backward, so a block recomputed
#     there splits too). What it cannot split is refused: a mask (padding, or a window the model's
#     mask function would add; transformers would drop a padding mask silently, so the runtime
#     refuses one before the forward), dropout in training, attention that is not causal, queries
#     over another sequence. Each call is counted: the runtime checks a forward made as many as
#     its trace has attention ops (an attention computed by hand would otherwise stay local,
#     silently).

TRANSFORMERS_ATTENTION = "hyparallel_context_parallel"


class _Split:
    """The split in force (module-level, not a context variable: autograd's threads read it)."""

    group: ProcessGroup | None = None
    kind: str = "gather"
    calls: int = 0  # split attentions computed since split_attention was entered
    # (batch, whole sequence) booleans of the micro-batch running, False for padding keys
    padding: torch.Tensor | None = None


def set_key_padding(padding: torch.Tensor | None) -> None:
    """The key padding of the forward about to run inside ``split_attention`` (a transformers
    model's attention_mask, whole; None: no padding)."""
    _Split.padding = padding


class _TakeAttention(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and _Split.kind == "whole":
            _Split.calls += 1  # the whole sequence here: the call as the model made it
            return func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return _split_sdpa(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def split_attention(group: ProcessGroup, kind: str = "gather") -> Iterator[_Split]:
    """Inside, ``TRANSFORMERS_ATTENTION`` and every ``F.scaled_dot_product_attention`` split
    attention over ``group`` by ``kind`` ("gather": ``context_parallel_attention``; "ring":
    ``ring_attention``; "whole": every rank holds the whole sequence and attends it alone, as one
    device). Yields the split in force; its ``calls`` counts them."""
    if kind not in ("gather", "ring", "whole"):
        raise ValueError(f"context-parallel attention '{kind}': 'gather' or 'ring'")
    if _Split.group is not None:
        raise RuntimeError("split_attention is already in force: it does not nest")
    _Split.group, _Split.kind, _Split.calls = group, kind, 0
    try:
        with _TakeAttention():
            yield _Split
    finally:
        _Split.group, _Split.padding = None, None


def recompute_contexts() -> tuple[Any, Any]:
    """``torch.utils.checkpoint``'s ``context_fn`` for a block checkpointed inside
    ``split_attention``: its recompute (in the backward, where the mode is not in force) splits
    attention over the same group again, never alone."""
    group, kind, padding = _Split.group, _Split.kind, _Split.padding
    if group is None:
        return contextlib.nullcontext(), contextlib.nullcontext()

    @contextlib.contextmanager
    def again() -> Iterator[None]:
        saved = _Split.group, _Split.kind, _Split.calls, _Split.padding
        _Split.group, _Split.kind, _Split.padding = group, kind, padding
        try:
            with _TakeAttention():
                yield
        finally:
            _Split.group, _Split.kind, _Split.calls, _Split.padding = saved

    return contextlib.nullcontext(), again()


def register_transformers_attention() -> str:
    """Register ``TRANSFORMERS_ATTENTION`` with transformers' attention interface (once); returns
    its name, for ``model.set_attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(TRANSFORMERS_ATTENTION, _transformers_attention)
    return TRANSFORMERS_ATTENTION


def _split(
    where: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: bool,
    dropout: float,
    causal: bool,
    scale: float | None,
    window: Any = None,
) -> torch.Tensor:
    """One split attention of (batch, heads, tokens, head size) tensors, or the refusal naming
    ``where``."""
    group = _Split.group
    if group is None:
        raise RuntimeError(f"{where}: context-parallel attention called outside split_attention")
    refusal = (
        "a mask beside the causal one (padding or a window)"
        if mask
        else f"dropout {dropout} in training"
        if dropout
        else "attention that is not causal"
        if not causal
        else f"a sliding window of {window}"
        if window
        else f"queries over another sequence ({query.size(-2)} queries, {key.size(-2)} keys)"
        if query.size(-2) != key.size(-2)
        else None
    )
    if refusal:
        raise ValueError(f"{where}: context parallelism cannot split {refusal}")
    # grouped-query keys and values go as they are: both attentions move them as few and repeat
    # each head for its queries where they attend
    attend = {"ring": ring_attention, "gather": context_parallel_attention, "whole": _alone}[
        _Split.kind
    ]
    _Split.calls += 1
    return attend(query, key, value, group, is_causal=True, scale=scale, key_padding=_Split.padding)


def _alone(q, k, v, group, *, is_causal: bool, scale=None, key_padding=None) -> torch.Tensor:
    """The whole sequence's attention on this rank alone (``split_attention``'s "whole")."""
    repeat = q.size(-3) // k.size(-3)
    k, v = (x.repeat_interleave(repeat, -3) for x in (k, v)) if repeat > 1 else (k, v)
    return _whole(q, k, v, is_causal, scale, key_padding)


def _split_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    with torch._C.DisableTorchFunction():  # the split's own attention runs as it is
        return _split(
            f"scaled_dot_product_attention call {_Split.calls + 1} of the forward",
            query,
            key,
            value,
            mask=attn_mask is not None,
            dropout=dropout_p,
            causal=is_causal,
            scale=scale,
        )


def _transformers_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    with torch._C.DisableTorchFunction():
        out = _split(
            type(module).__name__,
            query,
            key,
            value,
            mask=attention_mask is not None,
            dropout=dropout if module.training else 0.0,
            causal=causal,
            scale=scaling,
            window=kwargs.get("sliding_window"),
        )
    return out.transpose(1, 2).contiguous(), None
