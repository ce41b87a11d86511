"""One rank's sizes, run on meta: which tensor-parallel splits a model's own forward cannot run.

Shared by the planner (which replicates what fails before it writes a plan) and the runtime (which
refuses a plan whose splits fail, before the first collective); nothing here touches
torch.distributed.
"""

from __future__ import annotations

import copy
import copyreg
import functools
import math
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from hyparallel.graph.kinds import base_forward
from hyparallel.graph.model_graph import ModelGraph
from hyparallel.graph.structure import TPAnalysis, fused_parts, grouping, interleave
from hyparallel.graph.tracer import first_failure, trace
from hyparallel.spec.errors import ConfigError

# Integer attributes attention modules use for their head bookkeeping (transformers' conventions).
HEAD_ATTRIBUTES = (
    "num_heads",
    "n_head",
    "num_attention_heads",
    "split_size",
    "embed_dim",
    "hidden_size",
    "all_head_size",
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "num_key_value_groups",
)


# Note [one rank's sizes, run on meta]
#     The structure knows how each split weight is cut, not how a module's forward sizes what it
#     reads from it: code that slices a split output with the model's constants (Phi-3's qkv[...,
#     :config.num_attention_heads * head_dim], nanoGPT's qkv.split(self.n_embd, dim=2)) passes every
#     check and then fails inside torch on each rank. So, before the first collective, a meta copy
#     of the model runs one forward with the split Linears replaced by plain ones of one rank's
#     sizes and the head-count attributes divided as apply_tensor_parallel divides them; an error
#     there is refused in one line naming the module it happened in. Only shapes are checked (meta
#     tensors hold no values); a model whose unsplit forward does not run on meta is not judged.
# Note [the planner replicates what fails at one rank's sizes]
#     A split the runtime would refuse at one rank's sizes is not a plan. Before it searches, the
#     planner runs the dry run for each tensor-parallel degree it may pick (replicate_what_fails):
#     when a module fails, every split Linear inside the module that owns it (the attention of
#     Phi-3's qkv slice, nanoGPT's `split(self.n_embd)`) and inside the same module of every other
#     repeated block is kept replicated (ModelGraph.replicate: the structure is analysed again, row
#     partners follow their columns), and the dry run repeats until the rest runs. The MLPs stay
#     split; a model left with nothing split gets no tp > 1 at all. Replication is always correct,
#     so a module that fails only at a larger degree is replicated at every degree the planner
#     tries.


def replicate_what_fails(
    model: nn.Module, graph: ModelGraph, degrees: list[int], example_inputs: Any, rounds: int = 8
) -> list[str]:
    """Replicate (``graph.replicate``) the split modules that cannot run at one rank's sizes under
    any of ``degrees`` (Note [the planner replicates what fails at one rank's sizes]); returns the
    reasons."""
    reasons: list[str] = []
    # how the unsplit model runs: one answer for every degree and round
    unsplit: list[str | None] = []
    # a degree that does not divide the heads or widths is refused as such, not worked around
    runnable = [
        tp
        for tp in sorted(d for d in set(degrees) if d > 1)
        if not graph.structure.check(tp, graph)
    ]
    for tp in runnable:
        for _ in range(rounds):
            styles = {
                graph.op(n).module: s
                for n, s in graph.structure.styles.items()
                if graph.op(n).module
            }
            if not unsplit and any(style in ("column", "row") for style in styles.values()):
                unsplit.append(dry_run_method(model, graph, example_inputs))
            if unsplit == [None]:
                # the unsplit model runs on meta neither way: no split of it can be judged
                return reasons
            # heads regrouped at a smaller degree are at the largest too: checked once
            failure = local_shape_failure(
                model,
                graph,
                styles,
                tp,
                example_inputs,
                unsplit[0] if unsplit else None,
                groups=tp == runnable[-1],
            )
            if failure is None:
                break
            ops = _split_within(graph, failure[0])
            if not ops:
                # nothing left to replicate there: the runtime refuses such a plan in one line
                break
            graph.replicate(dict.fromkeys(ops, failure[1]))
            reasons.append(failure[1])
    return reasons


def _split_within(graph: ModelGraph, where: str) -> list[str]:
    """The split ops inside the module owning ``where`` (``where`` itself when it is not a split
    Linear), and inside the module at the same place in every repeated block. A module holding no
    split op itself (Nystromformer's depthwise convolution over the value heads, ``groups`` = the
    model's head count) is fed by a split one: the nearest enclosing module holding split ops (its
    attention) is replicated instead."""
    split = {
        n: graph.op(n).module for n, s in graph.structure.styles.items() if s in ("column", "row")
    }
    owner = where.rpartition(".")[0] if where in split.values() else where
    while True:
        places = {owner}
        for block in graph.blocks:
            if owner == block.path or owner.startswith(block.path + "."):
                places = {other.path + owner[len(block.path) :] for other in graph.blocks}
                break
        found = [
            n
            for n, m in split.items()
            if any(not p or m == p or m.startswith(p + ".") for p in places)
        ]
        if found or not owner:
            return found
        owner = owner.rpartition(".")[0]


def dry_run_method(model: nn.Module, graph: ModelGraph, example_inputs: Any) -> str | None:
    """How the unsplit ``model`` runs on meta at the shapes of ``example_inputs``: "fx" (eagerly),
    "export", or None when it runs neither way (then no split of it can be judged). It does not
    depend on the splits, so a caller judging several degrees or styles asks once (Note [one rank's
    sizes, run on meta])."""
    if graph.method == "fx" and first_failure(meta_copy(model), example_inputs, "fx") is not None:
        # Eager on meta the unsplit model fails (data-dependent checks, such as Hugging Face's
        # masks): judge both exported instead, which takes them; when even the unsplit export fails,
        # there is nothing to compare with.
        if first_failure(meta_copy(model), example_inputs, "export") is not None:
            return None
        return "export"
    return graph.method


def local_shape_failure(
    model: nn.Module,
    graph: ModelGraph,
    styles: dict[str, str],
    tp: int,
    example_inputs: Any,
    method: str | None = None,
    groups: bool = True,
) -> tuple[str, str] | None:
    """(module path, one-line reason) of the first split module that cannot run at one rank's sizes
    (Note [one rank's sizes, run on meta]); None when every split runs, or when the unsplit model
    does not run on meta.
    ``method``: :func:`dry_run_method`'s answer when the caller has it already (it is asked
    otherwise).
    ``groups``: also check that each split keeps its heads whole (a trace at one rank's sizes: Note
    [a split keeps each head whole]); the planner asks it at the largest degree it tries only."""
    if tp == 1 or not any(style in ("column", "row") for style in styles.values()):
        return None
    method = method or dry_run_method(model, graph, example_inputs)
    if method is None:
        return None
    local = local_shapes_copy(model, graph, styles, tp)
    failure = first_failure(local, example_inputs, method)
    if failure is None:
        return regrouped(local, graph, styles, tp, example_inputs) if groups else None
    where, exc = failure
    message = next(
        (line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__
    )
    return (
        where,
        (
            f"tensor_parallel: {where} does not run at one rank's sizes under tp = {tp}"
            f" ({type(exc).__name__}: {message[:160]}); it sizes its tensors with the model's full"
            " widths or head counts (constants or config values, not its inputs' shapes):"
            " replicate it"
        ),
    )


def regrouped(
    local: nn.Module, graph: ModelGraph, styles: dict[str, str], tp: int, example_inputs: Any
) -> tuple[str, str] | None:
    """Why a split column cut inside groups (Note [fused layouts read from the graph]) is viewed, at
    one rank's sizes, into other groups than a 1/tp share of the full model's (a module sizing its
    groups from its head-count attributes, CodeGen's ``embed_dim // mp_num``); None when every such
    column keeps its groups."""
    by_module = {graph.op(name).module: name for name in graph.structure.styles}
    columns = [path for path, style in styles.items() if style == "column" and path in by_module]
    grouped = {path: interleave(graph, by_module[path]) for path in columns}
    grouped = {path: groups for path, groups in grouped.items() if groups is not None}
    viewed = {path: grouping(graph, by_module[path]) for path in columns if path not in grouped}
    viewed = {path: dims for path, dims in viewed.items() if dims is not None}
    if not grouped and not viewed:
        return None
    local_graph = trace(local, example_inputs, method=graph.method)
    local_ops = {op.module: op.name for op in local_graph.compute_ops() if op.kind == "linear"}
    for path, (groups, inner) in grouped.items():
        found = interleave(local_graph, local_ops[path]) if path in local_ops else None
        if found != (groups // tp, inner):
            seen = f"{found[0]} groups of {tuple(found[1])}" if found else "no such groups"
            return (
                path,
                (
                    f"tensor_parallel: cannot split {path} (column; fused layout not recognised:"
                    f" its output is viewed as {groups} groups of {tuple(inner)}, but at one rank's"
                    f" sizes under tp = {tp} as {seen}, not {groups // tp}: its module sizes the"
                    " groups from the model's widths); replicate it and its row partner"
                ),
            )
    for path, dims in viewed.items():  # Note [a split keeps each head whole]
        rows = column_rows(by_module[path], graph, graph.structure, tp, 0)
        found = grouping(local_graph, local_ops[path]) if path in local_ops else None
        if found is None and math.prod(dims[1:]) == sum(b - a for a, b in rows):
            found = [1, *dims[1:]]  # one group per rank: (..., 1, D) reads as no grouping at all
        if found is None or not keeps_groups(rows, dims, found):
            seen = "x".join(map(str, found)) if found else "no such grouping"
            return (
                path,
                (
                    f"tensor_parallel: cannot split {path} (column: its output is viewed as"
                    f" {'x'.join(map(str, dims))} (heads x head size), but at one rank's sizes"
                    f" under tp = {tp} as {seen}, which mixes parts of different heads: its module"
                    " sizes its heads with a count tp does not divide, e.g. an attribute holding"
                    " the head count); replicate it and its row partner"
                ),
            )
    return None


# Note [a split keeps each head whole]
#     A column split hands each rank whole heads: the rows of a view (..., H, D) from heads r*H/tp
#     on. A module that computes its head size from the split width and its head count from an
#     attribute the analysis does not know (diffusers' ``attn.heads``: head_dim = key.shape[-1] //
#     attn.heads) views its share as (..., H, D/tp): every shape fits, the dry run passes, and each
#     rank runs H heads of the wrong width with the wrong softmax scale. So for every split column
#     whose output the full model views into groups (G, W...), the same view at one rank's sizes
#     must group the rank's rows as the full view groups them, level by level (keeps_groups): rows
#     in one group of the full view are in one local group and the other way round. The fused [gate
#     | up] of an MLP viewed as (2, I) keeps its two groups with I/tp rows each; a head split into
#     two local heads does not.


def keeps_groups(rows: list[tuple[int, int]], full: list[int], local: list[int]) -> bool:
    """Whether viewing a rank's ``rows`` of a column (full output rows, in order) as ``local``
    groups them as the full output's view ``full`` does, at every level of the grouping (Note [a
    split keeps each head whole])."""
    if len(full) != len(local):
        return False
    index = torch.cat([torch.arange(a, b) for a, b in rows])
    if index.numel() != math.prod(local):
        return False
    position = torch.arange(index.numel())
    for level in range(1, len(full)):
        outer, inner = index // math.prod(full[level:]), position // math.prod(local[level:])
        pairs = torch.unique(torch.stack([outer, inner]), dim=1).size(1)
        if not pairs == torch.unique(outer).numel() == torch.unique(inner).numel():
            return False
    return True


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device (no memory), its parameters and buffers shared tensors
    tied alike."""
    memo: dict[int, Any] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) not in memo:
            meta = tensor.detach().to("meta")
            memo[id(tensor)] = (
                nn.Parameter(meta, tensor.requires_grad)
                if isinstance(tensor, nn.Parameter)
                else meta
            )
    return _deepcopy(model, memo)


# Note [a module tree copied as deepcopy copies it]
#     copy.deepcopy takes every module, and each of the dozen OrderedDicts a module holds (its
#     parameters, buffers, children, hooks), through the generic __reduce_ex__ path; a dry run
#     copies the model once per tensor-parallel degree, and for GPT-3 175B's 967 modules each copy
#     took 0.15 s. _deepcopy does for those objects what deepcopy's own steps do (the same __new__,
#     __getstate__, __setstate__, one memo shared, so ties and cycles come out the same) without the
#     generic machinery, and hands anything else to copy.deepcopy with the same memo: a module class
#     that copies or reduces itself its own way, a dict subclass, an OrderedDict with attributes, a
#     tuple, any other object.
_ATOMIC = (type(None), bool, int, float, complex, str, bytes)
_OWN_COPY = ("__deepcopy__", "__getnewargs__", "__getnewargs_ex__")


def _deepcopy(value: Any, memo: dict[int, Any]) -> Any:
    cls = type(value)
    if cls in _ATOMIC:
        return value
    if id(value) in memo:
        return memo[id(value)]
    # Note [the memo keeps what it copied alive]: a module's __getstate__ is a new dict, freed once
    # copied; its id could then be another new dict's, and the memo would hand that one the first
    # one's copy (a module with another's attributes: "CausalSelfAttention has no attribute `qkv`",
    # now and then). deepcopy keeps every original it memoised alive in memo[id(memo)]; so does
    # this.
    memo.setdefault(id(memo), []).append(value)
    if cls is dict or (cls is OrderedDict and not vars(value)):
        result = memo[id(value)] = cls()
        for key, item in value.items():
            result[_deepcopy(key, memo)] = _deepcopy(item, memo)
        return result
    if cls is list:
        result = memo[id(value)] = []
        result.extend(_deepcopy(item, memo) for item in value)
        return result
    if isinstance(value, nn.Module) and _copied_generically(cls):
        result = memo[id(value)] = cls.__new__(cls)
        result.__setstate__(_deepcopy(value.__getstate__(), memo))
        return result
    return copy.deepcopy(value, memo)


@functools.cache
def _copied_generically(cls: type) -> bool:
    """Whether deepcopy copies instances of ``cls`` through object's __reduce_ex__ (protocol 4)."""
    return (
        cls not in copyreg.dispatch_table
        and cls.__reduce_ex__ is object.__reduce_ex__
        and cls.__reduce__ is object.__reduce__
        and not any(hasattr(cls, name) for name in _OWN_COPY)
    )


def local_shapes_copy(
    model: nn.Module, graph: ModelGraph, styles: dict[str, str], tp: int
) -> nn.Module:
    """A meta copy whose column and row Linears have rank 0's sizes, head-count attributes
    divided."""
    from hyparallel.models.meta import empty_init  # the models package imports this one's users

    local, analysis = meta_copy(model), graph.structure
    by_module = {graph.op(name).module: name for name in analysis.styles}
    for path, style in styles.items():
        if style not in ("column", "row"):
            continue
        old = local.get_submodule(path)
        weight, bias = linear_weight(old), getattr(old, "bias", None) is not None
        # on meta, no initialisation run (Note [no values written into meta parameters])
        with empty_init():
            if style == "column":
                out = sum(b - a for a, b in column_rows(by_module[path], graph, analysis, tp, 0))
                new = nn.Linear(weight.size(1), out, bias=bias)
            else:
                new = nn.Linear(weight.size(1) // tp, weight.size(0), bias=bias)
        set_submodule(local, path, new)
    patch_attention_attributes(local, graph, analysis, tp, styles)
    return local


def linear_weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    if isinstance(module, (nn.Linear, nn.Embedding)) or base_forward(module) in (
        "Linear",
        "Embedding",
    ):
        # Note [a layer that computes a standard one] (hyparallel.graph.kinds)
        return weight.detach()
    if type(module).__name__ == "Conv1D":  # transformers' Conv1D stores (in, out)
        return weight.detach().t()
    raise ConfigError(
        f"tensor_parallel: cannot split a {type(module).__name__}; only Linear-like layers and"
        " embeddings split"
    )


def column_rows(
    op_name: str, graph: ModelGraph, analysis: TPAnalysis, tp: int, rank: int
) -> list[tuple[int, int]]:
    """The output rows of a column weight this rank holds, part by part (fused [q | k | v] splits
    each part)."""
    op = graph.op(op_name)
    out = op.output_shapes[0][-1]
    groups = analysis.head_groups.get(op_name)
    head_dim = out // groups if groups else None
    query_heads = next(iter(analysis.attention_heads.values()), None)
    rows, offset = [], 0
    for size in analysis.parts.get(op_name) or fused_parts(graph, op_name):
        heads = size // head_dim if head_dim else None
        if heads is not None and heads % tp and query_heads:
            # Fewer key/value heads than ranks: hold the one this rank's query heads attend with.
            queries_per_rank, queries_per_head = query_heads // tp, query_heads // heads
            head = (rank * queries_per_rank) // queries_per_head
            rows.append((offset + head * head_dim, offset + (head + 1) * head_dim))
        else:
            share = size // tp
            rows.append((offset + rank * share, offset + (rank + 1) * share))
        offset += size
    return rows


def patch_attention_attributes(
    model: nn.Module, graph: ModelGraph, analysis: TPAnalysis, tp: int, styles: dict[str, str]
) -> None:
    """Divide head-count attributes of the modules that own split attention (Hugging Face keeps
    them); an attention whose projections ``styles`` (module path -> style) leaves replicated keeps
    its counts."""
    if tp == 1:
        return
    query_heads = next(iter(analysis.attention_heads.values()), None)
    if not query_heads:
        return
    # an attention with separate q, k, v Linears is one owner: divide its counts once
    patched: set[str] = set()
    for column, groups in analysis.head_groups.items():
        op = graph.op(column)
        if styles.get(op.module) != "column":
            continue
        head_dim = op.output_shapes[0][-1] // groups
        kv_heads = min(
            size // head_dim for size in analysis.parts.get(column) or fused_parts(graph, column)
        )
        local_q, local_kv = query_heads // tp, max(kv_heads // tp, 1)
        owner_path = op.module.rsplit(".", 1)[0] if "." in op.module else ""
        if owner_path in patched:
            continue
        patched.add(owner_path)
        owner = model.get_submodule(owner_path)
        for attribute in HEAD_ATTRIBUTES:
            value = getattr(owner, attribute, None)
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            if attribute == "num_key_value_groups" and value == query_heads // kv_heads:
                setattr(owner, attribute, local_q // local_kv)
            elif value == query_heads:
                setattr(owner, attribute, local_q)
            elif value == query_heads * head_dim:
                setattr(owner, attribute, local_q * head_dim)
            elif value == kv_heads and kv_heads != query_heads:
                setattr(owner, attribute, local_kv)


def set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attr, module)


def block_modules(model: nn.Module, path: str) -> list[nn.Module]:
    """The modules that run block ``path``: the block itself, or for a container without a forward
    of its own (a ModuleList of layers, as Funnel's blocks are) its children, in order. Hooks and
    wrappers go on these: a hook on a ModuleList never fires (sequence parallelism's scatter and
    gather did not run, silently wrong) and FSDP refuses to wrap one."""
    module = model.get_submodule(path)
    if type(module).forward is not nn.Module.forward:
        return [module]
    return [m for name, _ in module.named_children() for m in block_modules(module, name)]
