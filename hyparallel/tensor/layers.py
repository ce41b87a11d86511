"""Tensor-parallel modules: column- and row-split Linears, the vocab-parallel embedding, and the
vocab-parallel cross-entropy (Shoeybi et al. 2019; sequence parallelism: Korthikanti et al. 2022).

Activations are (batch, seq, hidden); under sequence parallelism the seq dim (1) is split between
blocks. Weights are stored in nn.Linear layout (out, in) whatever the source module was.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from hyparallel.kernels import linear_act
from hyparallel.tensor.collectives import (
    all_gather_seq,
    all_reduce_,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_seq,
)
from hyparallel.tensor.init import ShardLayout

SEQ_DIM = 1

# Note [whole sequences for a forward]
#     Sequence parallelism splits the hidden state's sequence over the tp ranks between blocks, so
#     it needs lengths that divide by tp; a forward, an evaluation or a generation step may have any
#     length. Inside ``whole_sequences()`` every sequence-parallel split (the parallel Linears'
#     gathers and reduce-scatters, the entry hooks, the scatter before the first block and the
#     gather after the last: hyparallel.tensor.apply) is off, and the blocks run as plain tensor
#     parallelism on the whole sequence: the same numbers, rounding aside. A trace made inside bakes
#     that in; an eager forward reads it at each call. Training never runs inside it.
_WHOLE_SEQUENCES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "whole_sequences", default=False
)


@contextlib.contextmanager
def whole_sequences() -> Iterator[None]:
    """Sequence parallelism off inside (Note [whole sequences for a forward])."""
    token = _WHOLE_SEQUENCES.set(True)
    try:
        yield
    finally:
        _WHOLE_SEQUENCES.reset(token)


def splits_sequence(sequence_parallel: bool) -> bool:
    """Whether a module asked for sequence parallelism splits the sequence now (not inside
    ``whole_sequences``)."""
    return sequence_parallel and not _WHOLE_SEQUENCES.get()


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local.T + b_local: this rank holds some output rows (features) of W.

    ``rows`` lists the (start, stop) ranges of the full weight's output rows held here: one range
    for a plain split, one per part for fused projections ([q | k | v]), repeated rows for key/value
    heads replicated across ranks. Under sequence parallelism the input is all-gathered along the
    sequence.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rows: list[tuple[int, int]],
        bias: bool,
        group: ProcessGroup,
        *,
        sequence_parallel: bool = False,
        gather_output: bool = False,
        enter_region: bool = True,
        activation: str = "none",
        transposed_source: bool = False,
        every_rank_rows: list[list[tuple[int, int]]] | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        # Every tp rank's ``rows``, in rank order: key/value heads several ranks hold show up in
        # more than one (TensorParallelInfo.reduce_grads sums their gradients). None: not known (a
        # layer built on its own).
        self.every_rank_rows = every_rank_rows
        # split from a weight stored (in, out): see ShardLayout.transposed
        self.transposed_source = transposed_source
        # An activation that followed this Linear in the model, applied in the matmul's epilogue
        # (Triton on CUDA, torch otherwise): see hyparallel.kernels.linear_act.
        self.activation = activation
        self.in_features, self.out_features, self.rows = in_features, out_features, rows
        self.group, self.sequence_parallel, self.gather_output = (
            group,
            sequence_parallel,
            gather_output,
        )
        # False when the module owning several column Linears (an attention, an MLP) enters the
        # tensor-parallel region once for all of them: see enter_tp_region.
        self.enter_region = enter_region
        local = sum(stop - start for start, stop in rows)
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter_region:
            x = enter_tp_region(x, self.group, self.sequence_parallel)
        y = (
            F.linear(x, self.weight, self.bias)
            if self.activation == "none"
            else linear_act(x, self.weight, self.bias, self.activation)
        )
        return gather_from_tp(y, -1, self.group) if self.gather_output else y

    def shard_layout(self, leaf: str) -> ShardLayout:
        """Where this rank's weight/bias rows sit in the full parameter."""
        if leaf != "weight":
            return ShardLayout(full_shape=(self.out_features,), rows=tuple(self.rows))
        return ShardLayout(
            full_shape=(self.out_features, self.in_features),
            rows=tuple(self.rows),
            transposed=self.transposed_source,
        )

    def extra_repr(self) -> str:
        fused = f", activation={self.activation}" if self.activation != "none" else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features},"
            f" rows={self.rows}{fused}"
        )


def enter_tp_region(x: torch.Tensor, group: ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
    """Where replicated activations enter split compute.

    All-gather the sequence (SP) or copy (gradients all-reduced).
    """
    return (
        all_gather_seq(x, SEQ_DIM, group)
        if splits_sequence(sequence_parallel)
        else copy_to_tp(x, group)
    )


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_local @ W_local.T, then + b: this rank holds ``cols`` of the input
    features.

    The input is already split (it comes from column-split compute). The partial products are
    all-reduced, or reduce-scattered along the sequence under sequence parallelism; the bias is
    added once, after the reduction.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        cols: tuple[int, int],
        bias: bool,
        group: ProcessGroup,
        *,
        sequence_parallel: bool = False,
        transposed_source: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        # split from a weight stored (in, out): see ShardLayout.transposed
        self.transposed_source = transposed_source
        self.in_features, self.out_features, self.cols = in_features, out_features, cols
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(
            torch.empty(out_features, cols[1] - cols[0], device=device, dtype=dtype)
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if splits_sequence(self.sequence_parallel):
            y = reduce_scatter_seq(y, SEQ_DIM, self.group)
        else:
            y = reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y

    def shard_layout(self, leaf: str) -> ShardLayout | None:
        """Where this rank's weight columns sit in the full weight (the bias is whole)."""
        if leaf != "weight":
            return None
        return ShardLayout(
            full_shape=(self.out_features, self.in_features),
            cols=self.cols,
            transposed=self.transposed_source,
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, cols={self.cols}"


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary, padded to a multiple of tp) are split across ranks.

    Ids outside this rank's rows look up row 0 and are zeroed; the partial embeddings are
    all-reduced.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        rows: tuple[int, int],
        group: ProcessGroup,
        *,
        padding_idx: int | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.rows, self.group = (
            num_embeddings,
            embedding_dim,
            rows,
            group,
        )
        self.padding_idx = padding_idx
        # The padding row gets no gradient (nn.Embedding's padding_idx), on the rank that holds it.
        self._local_padding = (
            padding_idx - rows[0]
            if padding_idx is not None and rows[0] <= padding_idx < rows[1]
            else None
        )
        self.weight = nn.Parameter(
            torch.empty(rows[1] - rows[0], embedding_dim, device=device, dtype=dtype)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.rows[0]
        outside = (local < 0) | (local >= self.weight.size(0))
        out = F.embedding(
            local.masked_fill(outside, 0), self.weight, padding_idx=self._local_padding
        )
        return reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)

    def shard_layout(self, leaf: str) -> ShardLayout:
        """This rank's vocabulary rows; rows past the real vocabulary are padding."""
        return ShardLayout(full_shape=(self.num_embeddings, self.embedding_dim), rows=(self.rows,))

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim},"
            f" rows={self.rows}"
        )


class VocabParallelHead(ColumnParallelLinear):
    """The output projection to vocab-parallel logits (this rank's vocabulary rows, padding
    included).

    With ``gather_output`` the full logits (padding dropped) are returned, so any loss works;
    without, pass the local logits to :func:`vocab_parallel_cross_entropy`, which never forms the
    full logits.
    """

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        rows: tuple[int, int],
        bias: bool,
        group: ProcessGroup,
        **kwargs,
    ):
        super().__init__(in_features, vocab_size, [rows], bias, group, **kwargs)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y[..., : self.vocab_size] if self.gather_output else y

    def shard_layout(self, leaf: str) -> ShardLayout:
        """This rank's vocabulary rows of the head; rows past the real vocabulary are padding."""
        full = (self.vocab_size, self.in_features) if leaf == "weight" else (self.vocab_size,)
        return ShardLayout(full_shape=full, rows=tuple(self.rows))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron-LM's vocab-parallel cross-entropy: max, sum of exponentials and target logit are
    all-reduced.

    Note [the vocab-parallel loss's memory]: one fp32 tensor of the local logits' size, made once
    and worked on in place (masked, shifted, exponentiated in the forward and saved; turned into the
    gradient in the backward, as Megatron-LM's does): 4 bytes per local logit beside the logits
    themselves, where out-of-place steps held
    16. The backward consumes what it saved, so it runs once (a second backward, retain_graph, is
        refused).
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group, ignore_index):
        work = logits.to(torch.float32, copy=True)
        columns = torch.arange(work.size(-1), device=work.device) + vocab_start
        work.masked_fill_(columns >= vocab_size, float("-inf"))  # vocabulary padding
        maximum = all_reduce_(work.amax(dim=-1), group, torch.distributed.ReduceOp.MAX)
        work.sub_(maximum.unsqueeze(-1))
        local_target = targets - vocab_start
        here = (local_target >= 0) & (local_target < work.size(-1))
        picked = work.gather(-1, local_target.clamp(0, work.size(-1) - 1).unsqueeze(-1)).squeeze(-1)
        target_logit = all_reduce_(torch.where(here, picked, torch.zeros_like(picked)), group)
        exp = work.exp_()
        sum_exp = all_reduce_(exp.sum(dim=-1), group)
        valid = targets != ignore_index
        count = valid.sum().clamp(min=1)
        loss = (
            torch.where(valid, sum_exp.log() - target_logit, torch.zeros_like(target_logit)).sum()
            / count
        )
        ctx.save_for_backward(exp, sum_exp, local_target, here & valid, valid)
        ctx.count, ctx.consumed, ctx.dtype = count, False, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        if ctx.consumed:
            raise RuntimeError(
                "vocab_parallel_cross_entropy's backward ran twice: it turns its saved tensor into"
                " the gradient in place; backward through it once (no retain_graph)"
            )
        ctx.consumed = True
        exp, sum_exp, local_target, hit, valid = ctx.saved_tensors
        # the softmax, ignored targets zero
        gradient = exp.div_(sum_exp.unsqueeze(-1)).mul_(valid.unsqueeze(-1))
        index = local_target.clamp(0, gradient.size(-1) - 1).unsqueeze(-1)
        gradient.scatter_add_(-1, index, -hit.unsqueeze(-1).to(gradient.dtype))
        return gradient.mul_(grad / ctx.count).to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    targets: torch.Tensor,
    group: ProcessGroup,
    vocab_start: int,
    vocab_size: int,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy over tokens from this rank's slice of the logits; equals F.cross_entropy
    on the full ones."""
    if torch.distributed.get_world_size(group) == 1:
        full = local_logits[..., :vocab_size]
        return F.cross_entropy(
            full.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index
        )
    return _VocabParallelCrossEntropy.apply(
        local_logits, targets, vocab_start, vocab_size, group, ignore_index
    )
