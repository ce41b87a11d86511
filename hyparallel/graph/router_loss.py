"""The router's auxiliary load-balancing loss a model computes in its forward: which function it
calls, and whether it is transformers' (Note [the router's auxiliary loss over dp] in
hyparallel/runtime/router_loss.py). Read from the model and the function's code, never run: the
planner prices what parallelize will do with it, the runtime does it."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

import torch
from torch import nn

NAME = "load_balancing_loss_func"


def gathers(model: nn.Module) -> bool:
    """Whether ``model``'s router loss, once parallelize made it the batch's, gathers
    every rank's router scores (False: it all-reduces 2 E + 1 sums, or the model has none)."""
    original = loss_function(model)
    return original is not None and not reduces(original)


def loss_function(model: nn.Module) -> Any:
    """transformers' load_balancing_loss_func the forward of ``model`` calls (None: none)."""
    forward = next(
        (cls.__dict__["forward"] for cls in type(model).__mro__ if "forward" in cls.__dict__), None
    )
    namespace = getattr(inspect.unwrap(forward), "__globals__", {}) if forward else {}
    original = namespace.get(NAME)
    if not callable(original):
        return None
    original = getattr(original, "__wrapped__", original)
    names = list(inspect.signature(original).parameters)
    return original if names and names[0] == "gate_logits" else None


@functools.cache
def reduces(original) -> bool:
    """Whether ``original`` is transformers' load_balancing_loss_func as
    ``transformers_load_balancing_loss`` copies it: then its three sums are all-reduced over dp
    instead of its inputs gathered."""
    return (
        getattr(original, "__globals__", {}).get("torch") is torch
        and _syntax(original) is not None
        and _syntax(original) == _syntax(transformers_load_balancing_loss)
    )


def _syntax(function) -> str | None:
    """``function``'s syntax tree without its name, decorators and docstring (None: no source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef):
        return None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    node.name, node.decorator_list, node.body = "_", [], body
    return ast.dump(node, include_attributes=False)


# A copy of transformers' load_balancing_loss_func (src/transformers/models/mixtral/
# modeling_mixtral.py, 5.25; Apache License 2.0, Copyright The HuggingFace Team), comments left out:
# never called, only compared with the function a model calls (reduces).
def transformers_load_balancing_loss(
    gate_logits: torch.Tensor | tuple[torch.Tensor] | None,
    num_experts: int | None = None,
    top_k=2,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor | int:
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0

    compute_device = gate_logits[0].device
    histc_dtype = torch.float32 if compute_device.type in ("cpu", "mps") else torch.int32
    tokens_per_expert_sum = torch.zeros(num_experts, dtype=torch.float32, device=compute_device)
    router_prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=compute_device)
    total_rows = 0.0

    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=compute_device, dtype=torch.float32)

    for layer_gate in gate_logits:
        routing_weights = torch.nn.functional.softmax(layer_gate.to(compute_device), dim=-1)
        _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
        if attention_mask is None:
            tokens_per_expert_sum = tokens_per_expert_sum + torch.histc(
                selected_experts.reshape(-1).to(histc_dtype),
                bins=num_experts,
                min=0,
                max=num_experts,
            )
            router_prob_sum = router_prob_sum + routing_weights.float().sum(dim=0)
            total_rows = total_rows + routing_weights.shape[0]
        else:
            tokens_per_expert_sum = tokens_per_expert_sum + torch.zeros(
                num_experts, dtype=torch.float32, device=compute_device
            ).scatter_add_(0, selected_experts.reshape(-1), flat_mask.repeat_interleave(top_k))
            router_prob_sum = router_prob_sum + (
                routing_weights.float() * flat_mask.unsqueeze(-1)
            ).sum(dim=0)
            total_rows = total_rows + flat_mask.sum()

    tokens_per_expert = tokens_per_expert_sum / total_rows
    router_prob_per_expert = router_prob_sum / total_rows

    overall_loss = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
    return overall_loss * num_experts
