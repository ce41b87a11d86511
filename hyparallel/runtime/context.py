"""Context parallelism in the runtime (issue 39): ``parallel.cp`` ranks each run two chunks of
every sequence of their data-parallel rank's rows, attention exact across them
(hyparallel/tensor/context.py), the loss over every token of the global batch, the weight gradients
shared over dp x cp.

Note [context parallelism]
    A cp group is the cp ranks of one data-parallel rank (the mesh's cp axis, right inside dp: Note
    [rank order] in hyparallel/spec/schema.py). They take the same rows (``pmodel.shard``, the
    sampler: dp shares, as without cp), and train_step, eval_step and a call of the model cut every
    sequence there: each input and target tensor whose dim 1 is the token ids' length keeps this
    rank's two chunks (i and 2 cp - 1 - i, Note [context-parallel attention]), and the model is
    given each token's global position as ``position_ids`` (the user's own are cut like the rest).
    So the user's loop is unchanged. Every attention of the forward is split over the group
    (Note [context parallelism in a transformers model]), and a call of the model gathers its
    outputs' sequences back. A call whose length does not cut into 2 cp chunks (generate's, a
    token longer each time) runs the whole sequence on every rank, each attending alone
    (split_attention's "whole"), as one device: never refused, never split unevenly.

    Each rank's loss covers its tokens: the default loss (token sum, token count) and a (total,
    count) loss sum over dp x cp exactly as over dp (Note [the loss a user reads]), so the runtime
    treats dp x cp as its data-parallel group for the loss and the gradients (DDP or FSDP2 over the
    flattened mesh, torchtitan's dp_shard_cp). A loss_fn returning a mean is refused: a mean over
    each rank's tokens, averaged, is one device's only when every rank counts as many.

    A transformers model's padding ``attention_mask`` (2-D, either side) is taken off the call whole
    (transformers drops a mask for an attention function it makes none for) and handed to the
    split attention by a pre-hook of the model's, masking every rank's keys.

    Refused before the first collective, naming the module: a model whose forward takes no
    ``position_ids`` (its positions would be local), attention computed by hand (a softmax over a
    (tokens x tokens) product) or by another kernel (flex attention, nn.MultiheadAttention), no
    attention at all. At a call: Hugging Face ``labels`` (the model's own shift would pair tokens
    across the cut), a padding mask of any other model, and a forward that made fewer split
    attentions than its trace has.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from hyparallel.graph import ModelGraph
from hyparallel.graph.context import (
    at_degree,
    attention_interface,
    attention_sites,
    context_refusal,
    takes_positions,
)
from hyparallel.graph.tracer import split_inputs
from hyparallel.spec.errors import ConfigError
from hyparallel.spec.schema import Plan
from hyparallel.tensor.context import (
    TRANSFORMERS_ATTENTION,
    positions,
    register_transformers_attention,
    set_key_padding,
    shard_sequence,
    split_attention,
    unshard_sequence,
)


def check_context_parallel(model: nn.Module, plan: Plan, graph: ModelGraph) -> list[str]:
    """The refusals of Note [context parallelism] that the model and its trace show
    (hyparallel.graph.context); returns the module of each attention the forward makes, in call
    order."""
    cp = plan.parallel.cp
    reason = context_refusal(graph, takes_positions(model), type(model).__name__)
    if reason:
        raise ConfigError(at_degree(reason, cp))
    par, seq_len = plan.parallel, plan.training.seq_len
    if par.recompute == "selective":
        raise ConfigError(
            f"recompute selective beside context parallelism {cp}: the split attention makes no"
            " (sequence x sequence) tensor for it to recompute, so it would keep what none keeps;"
            " use recompute none or full"
        )
    if par.sequence_parallel and (seq_len // cp) % par.tp:
        raise ConfigError(
            f"sequence parallelism splits each rank's {seq_len // cp} tokens (seq_len {seq_len} /"
            f" cp {cp}) over tp {par.tp}, which does not divide them; change seq_len, or set"
            " sequence_parallel: false"
        )
    return attention_sites(graph)


# the keyword a cut call carries a transformers model's whole padding mask under, to its pre-hook
KEY_PADDING = "_hyparallel_key_padding"


def _take_key_padding(module, args, kwargs):
    set_key_padding(kwargs.pop(KEY_PADDING, None))
    return args, kwargs


@dataclass
class SequenceCut:
    """How cp rank ``rank`` of ``cp`` cuts a call's inputs and targets (Note [context
    parallelism]); ``params``: the model's forward parameters, in order; ``hf``: its attention is
    transformers' interface (which would drop a padding mask)."""

    cp: int
    rank: int
    params: list[str]
    hf: bool = False

    def splits(self, inputs: Any) -> bool:
        """Whether ``inputs``' sequences cut into 2 cp equal chunks (a call of the model whose
        length does not runs whole on every rank)."""
        args, kwargs = split_inputs(inputs)
        return (
            self._length(dict(zip(self.params, args)) | kwargs, refuse=False) % (2 * self.cp) == 0
        )

    def cut(self, inputs: Any, targets: Any = None, whole: bool = False) -> tuple[dict, Any, int]:
        """``(inputs as keyword arguments, targets)`` with this rank's chunks of every sequence and
        the tokens' global ``position_ids``; and the whole length. ``whole``: nothing cut (every
        rank runs the whole sequence), a transformers model's padding taken off the call as
        under the cut."""
        args, kwargs = split_inputs(inputs)
        bound = dict(zip(self.params, args)) | kwargs
        length = self._length(bound, refuse=not whole)
        if "labels" in bound:
            raise ConfigError(
                "context parallelism cannot split Hugging Face labels: the model shifts them by one"
                " token inside its forward, across the cut; pass the shifted targets to"
                " train_step or eval_step instead (the default loss reads them)"
            )
        padding = None
        if self.hf:  # transformers would drop it for the split attention: given to it whole
            mask = bound.pop("attention_mask", None)
            if isinstance(mask, torch.Tensor) and not bool(mask.all()):
                if mask.dim() != 2 or mask.size(1) != length:
                    raise ConfigError(
                        f"context parallelism takes a (batch, {length}) attention_mask of padding,"
                        f" not one of shape {tuple(mask.shape)}; pass the 2-D padding mask, or"
                        " set cp: 1"
                    )
                padding = mask.bool()
        elif whole:
            pass  # the model's own mask, on the whole sequence: as on one device
        elif isinstance(bound.get("attention_mask"), torch.Tensor):
            if not bool(bound["attention_mask"].all()):
                raise ConfigError(
                    "context parallelism splits a padding attention_mask of a transformers model"
                    " only (any other model builds its own mask, which the split attention"
                    " refuses); pad with -100 targets instead of masked tokens, or set cp: 1"
                )
        if whole:
            if padding is not None:
                bound[KEY_PADDING] = padding
            return bound, targets, length
        if "position_ids" not in bound:
            first = next(t for t in bound.values() if isinstance(t, torch.Tensor))
            where = positions(length, self.cp, self.rank, first.device)
            bound["position_ids"] = where[None].expand(first.size(0), -1)
        cut = self._cut_tree(bound, length)
        if padding is not None:  # whole: every rank's keys are masked by it
            cut[KEY_PADDING] = padding
        return cut, self._cut_tree(targets, length), length

    def _cut_tree(self, tree: Any, length: int) -> Any:
        def cut(value):
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(1) == length:
                return shard_sequence(value, 1, self.cp, self.rank)
            return value

        return tree_map(cut, tree)

    def _length(self, bound: dict, refuse: bool = True) -> int:
        """The sequences' length (their token ids'); ``refuse``: one that does not cut into 2 cp
        chunks is refused."""
        ids = next(
            (
                t
                for t in bound.values()
                if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point()
            ),
            None,
        )
        if ids is None:
            raise ConfigError(
                "context parallelism cuts sequences of token ids, a (batch, tokens) integer"
                " tensor, and these inputs have none; pass token ids, or set cp: 1"
            )
        length = ids.size(1)
        if length % (2 * self.cp) and refuse:
            raise ConfigError(
                f"a sequence of {length} tokens does not split into {2 * self.cp} equal chunks for"
                f" context parallelism {self.cp}; pad it to a multiple of {2 * self.cp} (-100"
                " targets)"
            )
        return length


class ContextParallel:
    """This rank's share of a cp group: cuts sequences, splits attention, gathers outputs."""

    def __init__(self, model: nn.Module, group, kind: str, sites: list[str]):
        self.group, self.kind, self.sites = group, kind, sites
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # transformers' attention modules call the function their config names (Note [context
        # parallelism in a transformers model])
        if attention_interface(model):
            model.set_attn_implementation(register_transformers_attention())
        hf = getattr(getattr(model, "config", None), "_attn_implementation", None) == (
            TRANSFORMERS_ATTENTION
        )
        params = list(inspect.signature(model.forward).parameters)
        self.cutter = SequenceCut(self.cp, self.rank, params, hf)
        if hf:  # the whole padding mask, taken off the call before the model sees it
            model.register_forward_pre_hook(_take_key_padding, with_kwargs=True)

    def cut(self, inputs: Any, targets: Any = None, whole: bool = False) -> tuple[dict, Any, int]:
        """``SequenceCut.cut`` for this rank."""
        return self.cutter.cut(inputs, targets, whole)

    @staticmethod
    def pair_loss(loss_fn):
        """``loss_fn``, refusing a mean: under cp only a (total, count) pair sums exactly over the
        ranks' tokens (Note [context parallelism])."""

        def paired(output: Any, targets: Any):
            value = loss_fn(output, targets)
            if not isinstance(value, (tuple, list)):
                raise ConfigError(
                    "under context parallelism a loss_fn must return (total, count), the sum of"
                    " the loss over what it counts and that count: each rank holds part of every"
                    " sequence, and a mean over its part averaged over the ranks is not one"
                    " device's"
                )
            return value

        return paired

    @contextmanager
    def attending(self, whole: bool = False) -> Iterator[Any]:
        """Around a forward (and its backward, which may recompute it): attention split over the
        group (``whole``: each rank attends the whole sequence alone); ``checked()`` on what it
        yields after the forward."""
        with split_attention(self.group, "whole" if whole else self.kind) as split:
            yield _Counted(split, self.sites)

    def gather(self, output: Any, length: int) -> Any:
        """A call's outputs with their sequences whole again (every cp rank's chunks, in order)."""
        local = length // self.cp

        def whole(value):
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(1) == local:
                shards = [torch.empty_like(value) for _ in range(self.cp)]
                dist.all_gather(shards, value.contiguous(), group=self.group)
                return unshard_sequence(shards, 1)
            return value

        return tree_map(whole, output)


class _Counted:
    def __init__(self, split, sites: list[str]):
        self.split, self.sites = split, sites

    def checked(self) -> None:
        """After a forward: it split as many attentions as its trace has, else the refusal."""
        if self.split.calls != len(self.sites):
            raise RuntimeError(
                f"context parallelism split {self.split.calls} attention call(s) in a forward whose"
                f" trace has {len(self.sites)} ({', '.join(dict.fromkeys(self.sites))}): an"
                " attention this rank computed alone would be wrong; call"
                " F.scaled_dot_product_attention there, or set cp: 1"
            )
        self.split.calls = 0
