"""The router's auxiliary load-balancing loss over the whole data-parallel batch (Note [the router's
auxiliary loss over dp]).

    global_router_loss(model, dp_group)   # once, in parallelize, when dp > 1
    with traced_with(model):              # around a trace of the model for pipeline stages
        split = split_model(model, ...)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hyparallel.graph.router_loss import NAME, loss_function, reduces
from hyparallel.tensor.collectives import all_gather_seq, all_reduce_sum

# Note [the router's auxiliary loss over dp]
#     A mixture of experts' load-balancing loss (Switch Transformer's: E sum_e f_e P_e, f_e the
#     share of the (token, choice) pairs routed to expert e, P_e the mean router probability of e)
#     is a product of two means over the tokens, so the mean over dp ranks of each rank's loss on
#     its own tokens is not the loss of the batch, which one device computes. transformers' MoEs
#     compute it in their forward with their modeling file's load_balancing_loss_func(gate_logits,
#     num_experts, top_k, attention_mask), from every layer's router logits (when the config's
#     output_router_logits is on). Inside a ParallelModel's forward (dp > 1) that function gets
#     every dp rank's router logits (and attention mask), all-gathered with a differentiable
#     all-gather whose backward is a reduce-scatter, so it computes the batch's loss itself,
#     the same number on every dp rank. Its backward sums each rank's gradient of that (identical)
#     loss into the rows that rank routed, dp times its share, and the data-parallel mean of the
#     gradients leaves the batch's gradient: one device's, within fp32 rounding. Each micro-batch's
#     loss is the one of that micro-batch of every dp rank (as Megatron-Core's global auxiliary
#     loss), so under gradient accumulation it equals one device running the same micro-batches.
#     The function is found by name in the globals the model's forward runs in (a subclass that
#     keeps transformers' forward included), wrapped once, and changed only inside a ParallelModel's
#     forward: any other model in the process calls the original.
#     Gathering moves and holds tokens x E scores per layer from every dp rank (gigabytes for 128
#     experts over 94 layers at dp 128). transformers' function (5.25's: counts and probability
#     sums accumulated layer by layer, normalised at the end) needs only its three
#     sums of the batch, as Megatron-Core's global auxiliary loss does: a function whose code is
#     that one's (its syntax tree, docstring aside, equal to hyparallel.graph.router_loss's copy
#     of it) is replaced by _global_load_balancing_loss, which all-reduces the per-expert
#     counts, the per-expert probability sums (with their gradient: all_reduce_sum) and the row
#     count, 2 E + 1 numbers, before normalising. Any other function (an older transformers',
#     a model's own) is gathered as above: exact, priced at its bytes (Note [expert parallelism's
#     costs] in hyparallel/planner/costs.py). A pipeline (pp > 1) runs stage
#     graphs traced from the model, not its forward: the trace is made inside ``traced_with``, so
#     the all-gather is in the last stage's graph as an op (Note [collectives in traced graphs],
#     hyparallel/tensor/collectives.py) over the dp group of the ranks running that stage. An MoE
#     computing its auxiliary loss in code of its own keeps the per-rank one
#     (docs/expert-parallel.md, Limits).

_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("hyparallel_router_loss_group")


def global_router_loss(model: nn.Module, group: Any) -> bool:
    """Make ``model``'s forward compute transformers' router auxiliary loss over ``group``'s tokens
    (Note [the router's auxiliary loss over dp]); False when its forward has no such function."""
    original = loss_function(model)
    if original is None:  # none, or another by the name (Switch Transformers' takes probabilities)
        return False
    forward = next(
        cls.__dict__["forward"] for cls in type(model).__mro__ if "forward" in cls.__dict__
    )
    # the module the forward was written in, under its decorators (transformers' can_return_tuple)
    namespace = inspect.unwrap(forward).__globals__
    namespace[NAME] = _wrapped(original)
    model.__dict__["_router_loss_group"] = group
    model.register_forward_pre_hook(lambda *_: _enter(model, group))
    model.register_forward_hook(lambda *_: _leave(model), always_call=True)
    return True


@contextlib.contextmanager
def traced_with(model: nn.Module) -> Iterator[None]:
    """Inside, a trace of ``model`` records its router loss over the group ``global_router_loss``
    gave it (nothing changes for a model without one): torch.fx calls no forward hook."""
    group = model.__dict__.get("_router_loss_group")
    token = _GROUP.set(group) if group is not None else None
    try:
        yield
    finally:
        if token is not None:
            _GROUP.reset(token)


def _enter(model: nn.Module, group: Any) -> None:
    model._router_loss_token = _GROUP.set(group)


def _leave(model: nn.Module) -> None:
    token = model.__dict__.pop("_router_loss_token", None)
    if token is not None:
        _GROUP.reset(token)


@functools.cache
def _wrapped(original):
    signature = inspect.signature(original)
    reduces_sums = reduces(original)

    @functools.wraps(original)
    def load_balancing_loss_func(*args: Any, **kwargs: Any) -> Any:
        group = _GROUP.get(None)
        bound = signature.bind(*args, **kwargs)
        logits = bound.arguments.get("gate_logits")
        if group is None or not isinstance(logits, tuple) or not logits:
            return original(*args, **kwargs)
        if reduces_sums:
            bound.apply_defaults()
            return _global_load_balancing_loss(group=group, **bound.arguments)
        bound.arguments["gate_logits"] = tuple(_gathered(x, group) for x in logits)
        mask = bound.arguments.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            bound.arguments["attention_mask"] = _gathered(mask, group)
        return original(*bound.args, **bound.kwargs)

    return load_balancing_loss_func


def _gathered(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``x`` along dim 0, differentiable: each rank's rows get the sum over the ranks
    of their gradient (a reduce-scatter); one op in a traced graph."""
    return all_gather_seq(x, 0, group)


def _global_load_balancing_loss(
    gate_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None,
    group: Any,
) -> torch.Tensor:
    """transformers' load_balancing_loss_func (hyparallel.graph.router_loss's copy) of the rows of
    every rank of ``group``: each rank's three sums, all-reduced (the probabilities' with their
    gradient) before they are normalised (Note [the router's auxiliary loss over dp])."""
    device = gate_logits[0].device
    histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probabilities = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros(1, dtype=torch.float32, device=device)
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer_gate in gate_logits:
        weights = torch.nn.functional.softmax(layer_gate.to(device), dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        if attention_mask is None:
            counts = counts + torch.histc(
                selected.reshape(-1).to(histc_dtype), bins=num_experts, min=0, max=num_experts
            )
            probabilities = probabilities + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            counts = counts + torch.zeros(
                num_experts, dtype=torch.float32, device=device
            ).scatter_add_(0, selected.reshape(-1), flat_mask.repeat_interleave(top_k))
            probabilities = probabilities + (weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + flat_mask.sum()
    sums = all_reduce_sum(torch.cat([counts.float(), probabilities, rows]), group)
    counts, probabilities, rows = sums[:num_experts], sums[num_experts:-1], sums[-1]
    return torch.sum(counts / rows * (probabilities / rows).unsqueeze(0)) * num_experts
