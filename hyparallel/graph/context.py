"""What context parallelism can split, read from the trace (issue 39): the planner searches cp only
for a model this admits, and parallelize refuses the rest with the same line (Note [context
parallelism] in hyparallel/runtime/context.py)."""

from __future__ import annotations

import math

from hyparallel.graph.model_graph import ModelGraph

# the attention kernel the split takes; every other attention op is refused
SPLIT_TARGETS = frozenset({"scaled_dot_product_attention"})
_SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "Softmax"})


def at_degree(reason: str, cp: int) -> str:
    """``context_refusal``'s line said of context parallelism ``cp`` (what the runtime and the
    planner print)."""
    return reason.replace("context parallelism", f"context parallelism {cp}", 1)


def attention_sites(graph: ModelGraph) -> list[str]:
    """The module of each attention op the forward makes, in call order."""
    return [op.module or graph.name for op in graph.ops if op.kind == "attention"]


def context_refusal(
    graph: ModelGraph, takes_positions: bool, name: str | None = None
) -> str | None:
    """Why context parallelism cannot split ``graph``'s model, in one line naming the module (None:
    it can). ``takes_positions``: whether the model's forward takes ``position_ids``."""
    name = name or graph.name
    if not takes_positions:
        return (
            f"{name}.forward takes no position_ids: context parallelism gives each rank's tokens"
            " their global positions through it; add a position_ids argument used where the"
            " positions are computed, or set cp: 1"
        )
    for op in graph.ops:
        where = op.module or name
        if op.kind == "attention" and op.target not in SPLIT_TARGETS:
            return (
                f"{where}: context parallelism splits scaled_dot_product_attention, not"
                f" {op.target}; call F.scaled_dot_product_attention there, or set cp: 1"
            )
        shape = op.output_shapes[0] if op.output_shapes else ()
        if op.target in _SOFTMAX and len(shape) >= 2 and shape[-1] == shape[-2] > 1:
            return (
                f"{where}: attention computed by hand ({op.target} over {shape[-2]} x"
                f" {shape[-1]} scores) cannot be split by context parallelism; call"
                " F.scaled_dot_product_attention there, or set cp: 1"
            )
    if not attention_sites(graph):
        return (
            f"{name} makes no scaled_dot_product_attention call: context parallelism has no"
            " attention to split (a model without one needs no cp); set cp: 1"
        )
    return None


# Note [grouped-query keys as they travel]
#     Context parallelism moves each attention's keys and values between ranks; with grouped-query
#     attention there are fewer key and value heads than query heads, and how many travel depends
#     on where the split receives them. A transformers model's attention function (the attention
#     interface the split registers) gets them before the model repeats them (repeat_kv happens
#     inside transformers' own sdpa function), and both attentions move them as few (the gather
#     repeats each head for its queries after gathering, the ring on each block it holds). A model
#     that calls F.scaled_dot_product_attention hands it what it made: repeated already if it
#     repeated them (enable_gqa=True passes them as few). So the trace's sdpa inputs are what
#     travels, except for a transformers model, whose keys and values are read back through the
#     views and repeats that made them (expand, reshape, repeat_interleave) to the tensor they
#     repeat.
_REPEATS = frozenset({"expand", "expand_as", "repeat", "repeat_interleave"})


def attention_interface(module) -> bool:
    """Whether context parallelism receives ``module``'s attention through transformers' attention
    interface (a model with ``set_attn_implementation``) rather than F.scaled_dot_product_attention
    calls."""
    return hasattr(module, "set_attn_implementation")


def kv_elements(graph: ModelGraph, op, as_made: bool) -> int:
    """The key and value elements attention ``op`` (traced rows) moves under context parallelism
    (Note [grouped-query keys as they travel]); ``as_made``: read before the model repeats
    them."""
    shapes = op.input_shapes[1:3]
    whole = sum(math.prod(shape) for shape in shapes)
    if not as_made:
        return whole
    g, fraction = graph.graph, 1.0
    for name in g.predecessors(op.name):
        made = graph.op(name)
        if not made.output_shapes or made.output_shapes[0] not in shapes:
            continue
        size = smallest = math.prod(made.output_shapes[0])
        while made.kind == "view" or made.target in _REPEATS:
            sources = [
                graph.op(p)
                for p in g.predecessors(made.name)
                if graph.op(p).output_shapes and math.prod(graph.op(p).output_shapes[0]) > 1
            ]
            if len(sources) != 1:
                break
            made = sources[0]
            smallest = min(smallest, math.prod(made.output_shapes[0]))
        fraction = min(fraction, smallest / size)
    return round(whole * fraction)


def takes_positions(module) -> bool:
    """Whether ``module``'s forward takes ``position_ids`` (False without a module)."""
    import inspect

    forward = getattr(module, "forward", None)
    return forward is not None and "position_ids" in inspect.signature(forward).parameters
