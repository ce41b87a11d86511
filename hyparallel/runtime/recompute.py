"""Activation recomputation as a plan asks for it: ``apply_recompute(modules, recompute, seq_len)``.

``full`` recomputes each wrapped module's forward in its backward; ``selective`` only its seq x seq
ops (attention scores, softmax, dropout), what the planner costs. ``parallelize`` wraps each
repeated block when pp = 1 and each pipeline stage's graph when pp > 1. The module's forward is
wrapped, not its ``__call__``, so hooks on it (sequence-parallel scatter, FSDP's gathers) run once,
outside the recomputed region, and the parameter names do not change.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial

import torch
from torch import nn

from hyparallel.spec.schema import Recompute


def apply_recompute(
    modules: Iterable[nn.Module], recompute: Recompute, seq_len: int, split_attention: bool = False
) -> None:
    """Recompute each of ``modules`` in its backward (``full``) or only its seq x seq ops
    (``selective``); ``split_attention``: under context parallelism, the recompute splits its
    attention as the forward did (hyparallel.tensor.context.recompute_contexts)."""
    if recompute == "none":
        return
    context = selective_context(seq_len) if recompute == "selective" else None
    if split_attention:
        from hyparallel.tensor.context import recompute_contexts

        context = _both(context, recompute_contexts) if context else recompute_contexts
    for module in modules:
        module.forward = partial(
            torch.utils.checkpoint.checkpoint,
            module.forward,
            use_reentrant=False,
            **({"context_fn": context} if context else {}),
        )


# Note [what selective recomputation saves]
#     The policy below is asked about every op of a recomputed region as the forward runs it; what
#     it saves, the recompute takes back from a cache instead of running the op again. It
#     recomputes:
#       1. ops whose output is seq x seq (attention scores, their scale, mask, softmax and dropout):
#          what the planner costs as selective recomputation;
#       2. ops that write into a tensor (in-place ops, e.g. CPU dropout's
#          `empty_like(x).bernoulli_(1 - p)` then `div_(1 - p)`, or `masked_fill_`), and the
#          allocations they fill (`empty_like`, `new_*`, factories without tensor inputs). A saved
#          result is handed back as the tensor it was when saved: torch refuses one written to since
#          ("Tensor cached during selective activation checkpoint has been mutated": what dropout
#          did to the saved `empty_like` before this rule), and replaying the write on a saved
#          tensor would apply it twice;
#       3. every random op (dropout's draw). Checkpointing restores the RNG state at the start of
#          the region's recompute, so the recompute draws the forward's numbers only if it makes
#          every draw the forward made, in the same order; one saved (skipped) draw would shift the
#          ones after it, and the backward would use other dropout masks than the forward did.
#     Everything else is saved. In transformer blocks rules 2 and 3 add elementwise work only
#     (dropout's draws, masks built in place), which the planner does not count. A model that writes
#     in place into the result of some other op (say `relu_` on a matmul's output) still stops with
#     torch's error in its first backward: loud, never wrong.


def selective_context(seq_len: int):
    """Selective recomputation as the planner costs it; see Note [what selective recomputation
    saves]."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, func, *args, **kwargs):
        redo = _writes_or_draws(func, args) or _is_seq_by_seq(func, args, seq_len)
        return CheckpointPolicy.PREFER_RECOMPUTE if redo else CheckpointPolicy.MUST_SAVE

    return partial(create_selective_checkpoint_contexts, policy)


def _writes_or_draws(func, args) -> bool:
    """Rules 2 and 3 of Note [what selective recomputation saves]: writes into a tensor, allocates
    one, or draws."""
    schema = getattr(func, "_schema", None)
    if schema is None:  # not an ATen op (a higher-order op): leave it to the shape rule
        return False
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in func.tags:
        return True
    name = schema.name.split("::")[-1]
    return (
        name.endswith("_like")
        or name.startswith("new_")
        or not any(isinstance(a, torch.Tensor) for a in args)
    )


def _is_seq_by_seq(func, args, seq_len: int) -> bool:
    """Rule 1: the op's result ends in (seq_len, seq_len) (a matmul's from its operands, others'
    from the first)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return False
    name = str(func)
    if any(k in name for k in ("bmm", "matmul", ".mm", "baddbmm")) and len(tensors) >= 2:
        shape = (*tensors[-2].shape[:-1], tensors[-1].shape[-1])
    else:
        shape = tuple(tensors[0].shape)
    return len(shape) >= 2 and shape[-1] == shape[-2] == seq_len


def _both(first, second):
    """A ``context_fn`` entering the (forward, recompute) contexts of ``first`` and ``second``."""

    def contexts():
        (forward_a, recompute_a), (forward_b, recompute_b) = first(), second()
        return _entered(forward_a, forward_b), _entered(recompute_a, recompute_b)

    return contexts


@contextmanager
def _entered(*managers) -> Iterator[None]:
    with ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield
