"""The mixture-of-experts layers of a traced model: router, experts, shared experts, top-k.

Note [an MoE layer read from the trace]
    Expert parallelism (issue 38) places whole experts on ranks and moves each token to its top-k
    experts' ranks, so it must know, for every MoE layer, which parameters are experts (split by
    expert, never by rows), which module picks them, and how many it picks. That is read from the
    trace and the modules, as the tensor-parallel analysis reads column/row pairs, and never from
    class or attribute names:

    * the **router**: an op that picks top-k of E scores, a ``topk`` the trace shows as a function
      op (a hand-written MoE) or inside a leaf module call (transformers' ``...TopKRouter``). E is
      the scores' last dimension: the width of the linear map feeding them (a leaf router's own
      (E, hidden) weight, or the Linear the scores come from, through softmax, sigmoid, casts, a
      bias added). A top-k over anything else (DeepSeek-V3's top groups of experts, a sampler) has
      no such linear, or another width, and is no router.
    * the **experts**, found beside the router, in the nearest module holding both: E identical
      modules in one ModuleList (hand-written, Switch-style), or one module whose parameters are
      all stacked by expert, E first, weights 3-D (transformers' ``gate_up_proj``/``down_proj``
      and gpt-oss's biases beside them, torchtitan's ``w1``/``w2``/``w3``), ``grouped``. Their ops
      must be in the trace (they run). Each expert of a ModuleList profiled on fewer rows than the
      tokens is routed (Note [a size the data decides]); one that sees every token computes all
      experts for all tokens (a dense dispatch weighting unchosen ones by zero): ``dispatch`` says
      which.
    * the **shared experts**: the other modules with parameters in that module, run on every token
      (DeepSeek-V3's ``shared_experts``, Qwen2-MoE's ``shared_expert`` and its gate): replicated
      across expert-parallel ranks, split by tensor parallelism like any MLP.

    A top-k with no experts beside it is no router (a sampler's top-k of the vocabulary). Experts
    that never run, or stacked expert weights no router was found for (Phi-MoE's sparsemixer picks
    experts without a top-k), are reported with the reason (``refused``): the layer then stays out
    of expert parallelism, in one line naming the module, and the rest of the model plans as
    before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from hyparallel.graph.model_graph import ModelGraph, Op

# ops the router's scores may pass through between its linear map and the top-k
_SCORE_OPS = {
    "softmax",
    "_softmax",
    "sigmoid",
    "to",
    "float",
    "_to_copy",
    "type_as",
    "view",
    "reshape",
    "add",
    "div",
    "mul",
    "log_softmax",
}


@dataclass(frozen=True)
class MoELayer:
    """One mixture-of-experts layer (Note [an MoE layer read from the trace])."""

    path: str  # the module holding router and experts
    router: str  # the module whose linear map scores the experts
    experts: str  # the ModuleList of experts, or the module of stacked expert weights
    layout: Literal["list", "grouped"]
    num_experts: int
    top_k: int
    dispatch: Literal["routed", "dense"]
    expert_params: tuple[str, ...]  # every expert parameter, by name (what EP splits by expert)
    shared: tuple[str, ...] = ()  # modules run on every token beside the experts


@dataclass(frozen=True)
class MoEAnalysis:
    """Every MoE layer of a model, and the routers whose experts could not be read, path -> why."""

    layers: tuple[MoELayer, ...]
    refused: dict[str, str]

    @property
    def expert_params(self) -> set[str]:
        """Every expert parameter of every layer."""
        return {name for layer in self.layers for name in layer.expert_params}


def find_moe(graph: ModelGraph) -> MoEAnalysis:
    """The MoE layers of a traced model, read from its ``graph`` alone (Note [an MoE layer read
    from the trace]): a graph read from the cache plans as a fresh trace would."""
    params = _parameters(graph)
    layers: dict[str, MoELayer] = {}
    refused: dict[str, str] = {}
    for op in graph.ops:
        picked = _top_k(graph, op)
        if picked is None:
            continue
        router, count, top_k = picked
        if any(layer.router == router for layer in layers.values()) or router in refused:
            continue
        found = _experts(graph, params, router, count)
        if found is None:
            continue
        if isinstance(found, str):
            refused[router] = found
            continue
        path, experts, layout, names = found
        shared = sorted(
            {
                _child(path, name)
                for name in params
                if name.startswith(path + "." if path else "")
                and not _under(name, router)
                and not _under(name, experts)
            }
        )
        layers[path] = MoELayer(
            path=path,
            router=router,
            experts=experts,
            layout=layout,
            num_experts=count,
            top_k=top_k,
            dispatch=_dispatch(graph, experts, layout, op),
            expert_params=names,
            shared=tuple(shared),
        )
    claimed = {layer.experts for layer in layers.values()}
    for module in sorted({name.rpartition(".")[0] for name in params}):
        count = _stacked(params, module)
        if count and module not in claimed:
            refused[module] = (
                f"holds {count} experts' stacked weights, but no top-k router over {count} scores"
                " was found in the trace"
            )
    return MoEAnalysis(layers=tuple(layers.values()), refused=refused)


def expert_output_width(graph: ModelGraph, layer: MoELayer) -> int | None:
    """The last dimension of the output of expert 0 of a ModuleList of experts, from the trace (what
    expert parallelism sends back to a rank not holding it); None when it has not exactly one
    output width."""
    first = f"{layer.experts}.0"
    inside = [op for op in graph.ops if op.module == first or _under(op.module, first)]
    names = {op.name for op in inside}
    leaving = [
        op
        for op in inside
        if any(successor not in names for successor in graph.graph.successors(op.name))
    ]
    widths = {op.output_shapes[0][-1] for op in leaving if op.output_shapes and op.output_shapes[0]}
    return widths.pop() if len(widths) == 1 else None


def _parameters(graph: ModelGraph) -> dict[str, tuple[int, ...]]:
    """Every parameter the trace read, by name: its shape (from the op that owns it)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for op in graph.ops:
        if len(op.params) == len(op.param_shapes):
            shapes.update(zip(op.params, op.param_shapes))
    return shapes


def _under(name: str, module: str) -> bool:
    return name.startswith(module + ".")


def _child(path: str, name: str) -> str:
    """The child of ``path`` that parameter ``name`` lies under."""
    rest = name[len(path) + 1 :] if path else name
    return _join(path, rest.split(".")[0])


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _top_k(graph: ModelGraph, op: Op) -> tuple[str, int, int] | None:
    """(router module, E, k) when ``op`` picks the top k of E expert scores, else None."""
    if op.target == "topk" and op.input_shapes and op.output_shapes:
        experts, k = op.input_shapes[0][-1], op.output_shapes[0][-1]
        router = _scoring_linear(graph, op, experts)
    elif "topk" in op.inner and op.kind == "linear" and op.param_shapes:
        # a leaf router: its own (E, hidden) weight scores the experts
        experts = op.param_shapes[0][0]
        k = min((shape[-1] for shape in op.output_shapes if shape), default=0)
        router = op.module
    else:
        return None
    if router is None or not 0 < k < experts:
        return None
    return router, experts, k


def _scoring_linear(graph: ModelGraph, op: Op, experts: int) -> str | None:
    """The module of the linear map whose E-wide output reaches ``op``'s scores through score
    ops."""
    frontier, seen = list(graph.graph.predecessors(op.name)), set()
    while frontier:
        name = frontier.pop()
        if name in seen:
            continue
        seen.add(name)
        producer = graph.op(name)
        # a Linear, or F.linear of a weight cast first (Ernie 4.5's router computes in fp32)
        if producer.kind == "linear" or (producer.kind == "matmul" and producer.target == "linear"):
            widths = {shape[-1] for shape in producer.output_shapes if shape}
            return producer.module if experts in widths else None
        # a score op, or a leaf module keeping the scores' shape (Ernie 4.5's bias-adding
        # MoeStatics)
        keeps = producer.kind == "elementwise" and producer.output_shapes == op.input_shapes[:1]
        if producer.target.lower() in _SCORE_OPS or keeps:
            frontier.extend(graph.graph.predecessors(name))
    return None


def _experts(
    graph: ModelGraph, params: dict[str, tuple[int, ...]], router: str, count: int
) -> tuple[str, str, Literal["list", "grouped"], tuple[str, ...]] | str | None:
    """(the MoE module, its experts, their layout, their parameters) beside ``router``, why they
    cannot be used, or None when there are none (the top-k is no router: a sampler's, say)."""
    ran = {op.module for op in graph.ops}
    blocks = {block.path for block in graph.blocks}
    parts = router.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        path = ".".join(parts[:depth])
        inside = [m for m in graph.modules if path == "" or _under(m, path)]
        for module in inside:
            if module == router or _under(module, router) or _under(router, module):
                continue
            layout: Literal["list", "grouped"] = "list"
            names = _identical_list(graph, params, module, count)
            if not names:
                if _stacked(params, module) != count:
                    continue
                layout = "grouped"
                names = tuple(n for n in params if n.rpartition(".")[0] == module)
            if not any(m == module or _under(m, module) for m in ran):
                return f"its experts {module} never run in the trace"
            return path, module, layout, names
        if path in blocks:
            break  # not beyond the repeated block (a transformer layer) holding the router
    return None  # a top-k over a linear map's outputs with no experts beside it: no router


def _identical_list(
    graph: ModelGraph, params: dict[str, tuple[int, ...]], module: str, count: int
) -> tuple[str, ...]:
    """The parameters of ``module`` when it holds exactly children 0 .. count-1 (a ModuleList),
    each with the same parameter names and shapes; () otherwise."""
    children = {m[len(module) + 1 :].split(".")[0] for m in graph.modules if _under(m, module)}
    if count < 2 or children != {str(i) for i in range(count)}:
        return ()
    signatures = set()
    for i in range(count):
        prefix = f"{module}.{i}."
        signatures.add(
            tuple(sorted((n[len(prefix) :], s) for n, s in params.items() if n.startswith(prefix)))
        )
    if len(signatures) != 1 or not next(iter(signatures)):
        return ()
    return tuple(n for n in params if _under(n, module))


def _stacked(params: dict[str, tuple[int, ...]], module: str) -> int:
    """E when every parameter directly of ``module`` is stacked E experts first (at least two
    3-D weights) and no module under it holds one, else 0."""
    own = [s for n, s in params.items() if n.rpartition(".")[0] == module]
    deeper = any(_under(n.rpartition(".")[0], module) for n in params)
    if (
        not deeper
        and sum(len(s) == 3 for s in own) >= 2
        and len({s[0] for s in own}) == 1
        and all(len(s) >= 2 for s in own)
    ):
        return own[0][0]
    return 0


def _dispatch(
    graph: ModelGraph, experts: str, layout: str, router_op: Op
) -> Literal["routed", "dense"]:
    """``dense`` when a listed expert's first op sees as many rows as the router scores, else
    ``routed``."""
    if layout == "grouped":
        return "routed"
    tokens = math.prod(router_op.input_shapes[0][:-1]) if router_op.input_shapes else 1
    first = f"{experts}.0"
    for op in graph.ops:
        if (op.module == first or _under(op.module, first)) and op.input_shapes:
            return "dense" if math.prod(op.input_shapes[0][:-1]) >= tokens else "routed"
    return "routed"
