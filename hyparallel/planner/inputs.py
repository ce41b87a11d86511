"""What a planner's ``example_inputs`` say: one micro-batch (its rows and sequence length), or a
function making one.

Read as ``parallelize`` reads a batch: a tensor, a tuple of positional inputs or a dict of keyword
inputs, any of them holding non-tensor leaves too; the rows are dim 0 of the first tensor (pytree
order) that has dims, the sequence length dim 1 of the token ids (the first integer tensor of two or
more dims). Inputs without token ids (images, audio features, embeddings) have no length to check a
``seq_len`` against: dim 1 of pixels is their channels. Only when no ``seq_len`` is given is one
read from them: dim 1 of a (batch, length, width) float tensor (embeddings), else 1 (the plan's
figures per sample, as a recommendation model's).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from hyparallel.spec.errors import ConfigError
from hyparallel.spec.schema import Plan

# (batch_size, seq_len) -> one micro-batch, as a model's example_inputs
InputsFactory = Callable[[int, int], Any]
_SHAPE_HINT = (
    "a tensor, a tuple of positional inputs or a dict of keyword inputs, e.g. token ids (batch,"
    " seq_len)"
)


@dataclass(frozen=True)
class MicroBatch:
    """Example inputs of one micro-batch, with what the planner reads from them."""

    inputs: Any
    rows: int
    seq_len: int | None  # the token ids' length; None without token ids
    fallback_seq_len: int = 1  # when no seq_len is given and no token ids say it (the module doc)


def read(inputs: Any, what: str = "example_inputs") -> MicroBatch:
    """``inputs`` as one micro-batch; a ConfigError names ``what`` when they hold no batched
    tensor."""
    if not isinstance(inputs, (torch.Tensor, tuple, list, Mapping)):
        raise ConfigError(
            f"{what} is a {type(inputs).__name__}; give one micro-batch: {_SHAPE_HINT}"
        )
    tensors = [
        leaf for leaf in tree_leaves(inputs) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
    ]
    if not tensors:
        raise ConfigError(
            f"{what} hold no tensor with a batch dim; give one micro-batch: {_SHAPE_HINT}"
        )
    token_ids = [
        t
        for t in tensors
        if t.dim() >= 2 and not (t.is_floating_point() or t.is_complex()) and t.dtype != torch.bool
    ]
    embedded = [t for t in tensors if t.dim() == 3 and t.is_floating_point()]
    return MicroBatch(
        inputs,
        rows=tensors[0].size(0),
        seq_len=token_ids[0].size(1) if token_ids else None,
        fallback_seq_len=embedded[0].size(1) if embedded else 1,
    )


def default_seq_len(model: Any) -> int | None:
    """The default of ``seq_len`` in the model's own ``example_inputs(batch_size, seq_len=...,
    device)``, if it has one: a model whose inputs are not sequences (DLRM's samples) says so with
    ``seq_len=1``; None
    otherwise."""
    method = getattr(model, "example_inputs", None)
    try:
        parameter = (
            inspect.signature(method).parameters.get("seq_len") if callable(method) else None
        )
    except (TypeError, ValueError):  # no signature to read
        return None
    default = parameter.default if parameter is not None else None
    return (
        default
        if isinstance(default, int) and not isinstance(default, bool) and default > 0
        else None
    )


def make(factory: InputsFactory, batch_size: int, seq_len: int) -> MicroBatch:
    """``factory(batch_size, seq_len)`` read as one micro-batch, refused unless it has those rows
    and that length."""
    module = getattr(factory, "__module__", None) or "?"
    name = f"{module}:{getattr(factory, '__qualname__', type(factory).__name__)}"
    call = f"example inputs {name}({batch_size}, {seq_len})"
    try:
        inspect.signature(factory).bind(batch_size, seq_len)
    except TypeError:
        raise ConfigError(
            f"example inputs {name} must take (batch_size, seq_len), as a model's example_inputs"
            " method does"
        ) from None
    except ValueError:  # a builtin without a signature: call it and see
        pass
    batch = read(factory(batch_size, seq_len), what=call)
    if batch.rows != batch_size or batch.seq_len not in (None, seq_len):
        got = f"{batch.rows} rows" + (
            f" of {batch.seq_len} tokens" if batch.seq_len is not None else ""
        )
        raise ConfigError(
            f"{call} returned {got}; it must return batch_size rows of seq_len tokens"
        )
    return batch


def token_ids(plan: Plan) -> torch.Tensor:
    """One micro-batch of token ids of ``plan``'s ``micro_batch x seq_len`` on the meta device.

    What ``parallelize`` and ``hyparallel show --model`` trace a model with when given no example
    inputs.
    """
    return torch.zeros(
        plan.training.micro_batch, plan.training.seq_len, dtype=torch.long, device="meta"
    )
