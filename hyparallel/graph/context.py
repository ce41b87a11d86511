"""What context parallelism can split, read from the trace (issue 39): the planner searches cp only
for a model this admits, and parallelize refuses the rest with the same line (Note [context
parallelism] in hyparallel/runtime/context.py)."""

from __future__ import annotations

from hyparallel.graph.model_graph import ModelGraph

# the attention kernel the split takes; every other attention op is refused
SPLIT_TARGETS = frozenset({"scaled_dot_product_attention"})
_SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "Softmax"})


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


def takes_positions(module) -> bool:
    """Whether ``module``'s forward takes ``position_ids`` (False without a module)."""
    import inspect

    forward = getattr(module, "forward", None)
    return forward is not None and "position_ids" in inspect.signature(forward).parameters
