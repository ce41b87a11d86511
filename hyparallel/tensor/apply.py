"""Apply a plan's ``tensor_parallel`` map to a model: swap modules in place, keeping this rank's
slices.

The styles come from the plan (module path or glob -> column | row | vocab | replicate). How a
column weight is laid out (one range, or fused parts such as [q | k | v]) and how many heads an
attention has are facts of the model's dataflow, read from its traced graph with the same analysis
the planner used. Attention modules that keep head counts as attributes (Hugging Face's) get their
per-rank counts.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from hyparallel.graph import ModelGraph
from hyparallel.graph.checks import check_blocks, check_styles, check_tensor_parallel_degree
from hyparallel.graph.kinds import base_forward
from hyparallel.graph.local_shapes import (
    block_modules,
    column_rows,
    linear_weight,
    local_shape_failure,
    patch_attention_attributes,
    set_submodule,
)
from hyparallel.graph.structure import TPAnalysis, split_region
from hyparallel.graph.tracer import tied_names
from hyparallel.spec.errors import ConfigError
from hyparallel.tensor.collectives import all_reduce_, gather_from_tp, scatter_to_tp
from hyparallel.tensor.init import retie
from hyparallel.tensor.layers import (
    SEQ_DIM,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    enter_tp_region,
    splits_sequence,
)


@dataclass
class TensorParallelInfo:
    """What ``apply_tensor_parallel`` did: the styles per module and what training must know."""

    group: ProcessGroup
    tp: int
    rank: int
    sequence_parallel: bool
    styles: dict[str, str] = field(default_factory=dict)
    vocab_start: int = 0
    vocab_size: int | None = None
    # replicated inside the SP region: partial gradients
    synced_params: list[str] = field(default_factory=list)
    # param -> every rank's rows
    shared_rows: dict[str, list[list[tuple[int, int]]]] = field(default_factory=dict)

    def partial_grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        """Copies of the gradients ``reduce_grads`` completes, as they are now: pass them back to it
        as ``since``."""
        find = _parameter_or_none(model)
        held = {name: find(name) for name in (*self.synced_params, *self.shared_rows)}
        return {
            name: None if p.grad is None else _local(p.grad).clone()
            for name, p in held.items()
            if p is not None
        }

    def reduce_grads(
        self, model: nn.Module, since: dict[str, torch.Tensor | None] | None = None
    ) -> None:
        """Complete the gradients tensor parallelism leaves partial; call once per step, after the
        last backward.

        Under sequence parallelism each rank's norm weights and row biases saw part of the sequence;
        key/value heads held by several ranks got gradient only from each holder's own query heads.
        Megatron-LM does the same once per step (finalize_model_grads), after gradient accumulation.
        ``since`` (from ``partial_grads`` before the step) limits the sums to what this step added,
        so gradients accumulated over several steps without zero_grad are not summed twice.
        """
        since = since or {}
        find = _parameter_or_none(model)

        def step_part(name: str, grad: torch.Tensor) -> torch.Tensor:
            before = since.get(name)
            return grad - before if before is not None else grad.clone()

        held = [
            (name, p)
            for name in self.synced_params
            if (p := find(name)) is not None and p.grad is not None
        ]
        if held and self.tp > 1:
            parts = [step_part(name, _local(p.grad)) for name, p in held]
            flat = torch.cat([part.flatten() for part in parts])  # one collective for all of them
            all_reduce_(flat, self.group)
            offset = 0
            for (name, p), part in zip(held, parts):
                total = flat[offset : offset + part.numel()].view_as(part)
                _local(p.grad).copy_(total + since[name] if since.get(name) is not None else total)
                offset += part.numel()
        for name, every_rank in self.shared_rows.items():
            param = find(name)
            if param is not None and param.grad is not None:
                summed = _sum_replicated_rows(
                    step_part(name, param.grad), every_rank, self.rank, self.group
                )
                param.grad.copy_(summed + since[name] if since.get(name) is not None else summed)


def _parameter_or_none(model: nn.Module):
    def find(name: str) -> nn.Parameter | None:
        try:
            return model.get_parameter(name)
        except AttributeError:
            return None

    return find


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a gradient FSDP sharded over data parallelism), else the tensor
    itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def apply_tensor_parallel(
    model: nn.Module,
    tensor_parallel: dict[str, str],
    group: ProcessGroup,
    graph: ModelGraph,
    *,
    sequence_parallel: bool = False,
    gather_logits: bool = False,
    fused_kernels: bool = True,
) -> TensorParallelInfo:
    """Swap the modules ``tensor_parallel`` names for their tensor-parallel versions on ``group``,
    in place.

    ``graph`` is the model traced by ``hyparallel.trace``. Each rank keeps only its slices of the
    split weights. The vocab-parallel head returns this rank's vocabulary slice of the logits, for
    ``vocab_parallel_cross_entropy`` (what the planner costs); with ``gather_logits`` it all-gathers
    the full logits instead, so any loss works, at the price of full logits on every rank. With
    ``fused_kernels`` an activation module right after a column Linear runs in that Linear's matmul
    epilogue (a Triton kernel on CUDA; the environment variable HYPARALLEL_TRITON=0 turns it off
    too).
    """
    tp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    analysis = graph.structure
    check_tensor_parallel_degree(graph, tp)
    styles = check_styles(graph, tensor_parallel)
    info = TensorParallelInfo(
        group=group, tp=tp, rank=rank, sequence_parallel=sequence_parallel, styles=styles
    )
    ties = tied_names(model)
    by_module = {graph.op(name).module: name for name in analysis.styles}
    blocks = tuple(block.path + "." for block in graph.blocks)
    called = {
        path
        for path, module in model.named_modules()
        if type(module).forward is not nn.Module.forward
    }
    entries = _region_entries(graph, analysis, styles, blocks, by_module, called)
    fused = _fusable_activations(model, graph, styles, by_module) if fused_kernels else {}
    for path, style in styles.items():
        old = model.get_submodule(path)
        op = graph.op(by_module.get(path, path))
        in_blocks = path.startswith(blocks)
        new = _parallel_module(
            old,
            style,
            op.name,
            graph,
            analysis,
            group,
            tp,
            rank,
            sequence_parallel and in_blocks,
            gather_logits,
            enter_region=path not in entries,
            activation=fused[path][1] if path in fused else "none",
        )
        if style == "vocab":
            info.vocab_size = analysis.vocab_size
            info.vocab_start = rank * math.ceil(analysis.vocab_size / tp)
        set_submodule(model, path, new)
    retie(model, ties)
    for path in styles:
        module = model.get_submodule(path)
        every_rank = getattr(module, "every_rank_rows", None)
        if every_rank and any(
            sum(r in other for other in every_rank) > 1 for r in every_rank[rank]
        ):
            for leaf in ("weight", "bias"):
                if getattr(module, leaf, None) is not None:
                    info.shared_rows[f"{path}.{leaf}"] = every_rank
    for act_path, _ in fused.values():  # now applied in its Linear's epilogue
        set_submodule(model, act_path, nn.Identity())
    for owner in sorted(set(entries.values())):
        module = model.get_submodule(owner)
        module.register_forward_pre_hook(
            _entry_hook(module, group, sequence_parallel), with_kwargs=True
        )
    patch_attention_attributes(model, graph, analysis, tp, styles)
    _off_fused_encoder_paths(model, styles)
    if sequence_parallel and tp > 1:
        info.synced_params = _enter_sequence_parallel(model, graph, styles, group)
    # Note [replicated parameters inside a split region]
    info.synced_params = sorted(
        set(info.synced_params) | _region_parameters(graph, analysis, styles)
    )
    return info


# Note [torch's fused encoder path]
#     nn.TransformerEncoderLayer in eval under no_grad runs one fused kernel
#     (torch._transformer_encoder_layer_fwd) on its children's weights as whole tensors instead of
#     calling them, and nn.TransformerEncoder first packs a padded batch into nested tensors for it.
#     With linear1 / linear2 split, that kernel reads one rank's slices as the whole weights: eval
#     logits 0.57 off under tp 2, no error. torch skips both paths when a forward hook is attached
#     anywhere in the layer, and packs nothing when the encoder's use_nested_tensor is off: a layer
#     holding a split module gets a no-op pre-hook, and its encoder that flag off. Training never
#     took them.
def _no_op(module: nn.Module, args: tuple) -> None:
    return None


def _off_fused_encoder_paths(model: nn.Module, styles: dict[str, str]) -> None:
    """Turn off torch's fused encoder paths above every split module (Note [torch's fused encoder
    path])."""
    split = [path for path, style in styles.items() if style != "replicate"]
    for path, module in model.named_modules():
        if path and not any(_inside(s, path) for s in split):
            continue
        if isinstance(module, nn.TransformerEncoderLayer):
            module.register_forward_pre_hook(_no_op)
        elif isinstance(module, nn.TransformerEncoder):
            module.use_nested_tensor = False


# Note [replicated parameters inside a split region]
#     A parameter read between a split column and its row (a per-head norm's weight, shared by every
#     head: Qwen3's and Kolibri's q_norm / k_norm) gets from each rank the gradient of that rank's
#     heads only. Summed over the tensor-parallel group once per step
#     (TensorParallelInfo.reduce_grads), as the sequence-parallel norms are; before, only sequence
#     parallelism summed them, and without it they trained on one rank's share (0.74 relative,
#     measured on Kolibri at tp 2). Only regions of columns this plan splits count: a replicated
#     column's region computes every head on every rank, its gradients already whole.
def _region_parameters(graph: ModelGraph, analysis: TPAnalysis, styles: dict[str, str]) -> set[str]:
    """Parameter names read by ops inside the split regions of the columns ``styles`` splits (not
    the Linears')."""
    linears = {name for name in analysis.styles}
    names: set[str] = set()
    for column, style in analysis.styles.items():
        if style != "column" or styles.get(graph.op(column).module) != "column":
            continue
        for name in split_region(graph, column):
            if name not in linears:
                names.update(graph.op(name).params)
    return names


# Activation modules a column Linear can apply in its epilogue (torch's and transformers' names).
_FUSABLE = {
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "GELUActivation": "gelu",
    "NewGELUActivation": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "GELUTanhActivation": "gelu_tanh",
}


def _fusable_activation(module: nn.Module) -> str | None:
    if isinstance(module, nn.GELU):
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    return _FUSABLE.get(type(module).__name__)


def _fusable_activations(
    model: nn.Module, graph: ModelGraph, styles: dict[str, str], by_module: dict[str, str]
) -> dict[str, tuple[str, str]]:
    """Column Linear path -> (activation module path, its epilogue name) for each activation module
    that alone consumes a column Linear's output and is called nowhere else: the Linear applies it
    instead."""
    fused: dict[str, tuple[str, str]] = {}
    g = graph.graph
    calls: dict[str, int] = {}
    for op in graph.compute_ops():
        calls[op.module] = calls.get(op.module, 0) + 1
    for path, style in styles.items():
        if style != "column":
            continue
        successors = list(g.successors(by_module.get(path, path)))
        if len(successors) != 1 or graph.op(successors[0]).kind != "activation":
            continue
        act_path = graph.op(successors[0]).module
        activation = _fusable_activation(model.get_submodule(act_path)) if act_path else None
        if activation is None or calls.get(act_path) != 1:  # a module called elsewhere too stays
            continue
        fused[path] = (act_path, activation)
    return fused


def _region_entries(
    graph: ModelGraph,
    analysis: TPAnalysis,
    styles: dict[str, str],
    blocks: tuple[str, ...],
    by_module: dict[str, str],
    called: set[str] | None = None,
) -> dict[str, str]:
    """Column Linear path -> the module that enters the tensor-parallel region for it.

    Inside a block, the column Linears of one module (q/k/v of an attention, up/gate of an MLP) read
    the same input: that module's first input. Entering there once costs one collective for all of
    them (the planner's assumption), and lets modules that reshape by their input's shape (Hugging
    Face attention) see the gathered sequence under sequence parallelism. Only where nothing else in
    the module reads that input: Funnel's FFN adds its input back (``layer_norm(x + down(up(x)))``),
    and the residual read through the entered tensor had its gradient summed over the ranks too (tp
    times the single device's, no error); such columns enter on their own. The module entered is one
    whose forward runs (``called``): a ModuleList of experts all reading one input qualifies but is
    never called, and its hook never fired (an MoE layer's experts then summed no gradient over the
    ranks, no error).
    """
    g, entries = graph.graph, {}
    columns = [
        p for p, style in styles.items() if style == "column" and p.startswith(blocks) and "." in p
    ]
    source = {
        c: next(iter(g.predecessors(by_module[c])), None)
        for c in columns
        if g.in_degree(by_module[c]) == 1
    }
    for column, read in source.items():
        block = next(b for b in blocks if column.startswith(b))
        owner, scope = None, column.rsplit(".", 1)[0]
        while (scope + ".").startswith(block):  # from the column's parent up to its block:
            # the widest module whose first input is the column's, read inside it by columns of that
            # input only (a wrapped projection, Moshi's q_proj.linear, enters at the attention that
            # reshapes by its input)
            if _owner_input(graph, scope) != read:
                break
            inside = [n for n in g.successors(read) if _inside(graph.op(n).module, scope)]
            if not all(
                graph.op(n).module in source
                and source[graph.op(n).module] == read
                or not graph.op(n).output_shapes
                for n in inside
            ):
                break
            if called is None or scope in called:
                owner = scope
            scope = scope.rsplit(".", 1)[0]
        if owner is not None:
            entries[column] = owner
    return entries


def _inside(module: str, owner: str) -> bool:
    return module == owner or module.startswith(owner + ".")


def _owner_input(graph: ModelGraph, owner: str) -> str | None:
    """The op producing the first tensor a module receives (the input its first op reads from
    outside it)."""
    inside = [op for op in graph.compute_ops() if _inside(op.module, owner)]
    if not inside:
        return None
    names = {op.name for op in inside}
    for op in inside:
        outside = [p for p in graph.graph.predecessors(op.name) if p not in names]
        if outside:
            return outside[0]
    return None


def _entry_hook(module: nn.Module, group: ProcessGroup, sequence_parallel: bool):
    """Pre-hook entering the tensor-parallel region on a module's first input (positional or
    keyword).

    Every argument that is that same tensor enters with it: CTRL calls its attention as ``attn(x, x,
    x)`` (value, key, query), and entering only the first would leave the key and query paths'
    gradients unsummed over the ranks (the norm before it then trains on one rank's share) and,
    under sequence parallelism, ungathered.
    """
    first = next(iter(inspect.signature(module.forward).parameters))

    def hook(module, args, kwargs):
        given = args[0] if args else kwargs[first]
        entered = enter_tp_region(given, group, sequence_parallel)
        args = tuple(entered if value is given else value for value in args)
        return args, {key: entered if value is given else value for key, value in kwargs.items()}

    return hook


def _parallel_module(
    old: nn.Module,
    style: str,
    op_name: str,
    graph: ModelGraph,
    analysis: TPAnalysis,
    group: ProcessGroup,
    tp: int,
    rank: int,
    sp: bool,
    gather_logits: bool,
    enter_region: bool = True,
    activation: str = "none",
) -> nn.Module:
    weight = linear_weight(old)  # (out, in), nn.Linear layout
    bias = getattr(old, "bias", None)
    kwargs = {"device": weight.device, "dtype": weight.dtype}
    linear_kwargs = {**kwargs, "transposed_source": type(old).__name__ == "Conv1D"}
    if style == "column":
        every_rank = [column_rows(op_name, graph, analysis, tp, r) for r in range(tp)]
        rows = every_rank[rank]
        new = ColumnParallelLinear(
            weight.size(1),
            weight.size(0),
            rows,
            bias is not None,
            group,
            sequence_parallel=sp,
            enter_region=enter_region,
            activation=activation,
            every_rank_rows=every_rank,
            **linear_kwargs,
        )
        _copy(new.weight, torch.cat([weight[a:b] for a, b in rows]))
        if bias is not None:
            _copy(new.bias, torch.cat([bias[a:b] for a, b in rows]))
        return new
    if style == "row":
        width = weight.size(1) // tp
        cols = (rank * width, (rank + 1) * width)
        new = RowParallelLinear(
            weight.size(1),
            weight.size(0),
            cols,
            bias is not None,
            group,
            sequence_parallel=sp,
            **linear_kwargs,
        )
        _copy(new.weight, weight[:, cols[0] : cols[1]])
        if bias is not None:
            _copy(new.bias, bias)
        return new
    if style == "vocab":
        vocab = analysis.vocab_size or weight.size(0)
        per_rank = math.ceil(vocab / tp)
        rows = (rank * per_rank, (rank + 1) * per_rank)
        padded = (
            torch.zeros(per_rank, weight.size(1), **kwargs)
            if not weight.is_meta
            else weight.new_empty(per_rank, weight.size(1))
        )
        if not weight.is_meta:
            kept = weight[rows[0] : min(rows[1], vocab)]
            padded[: kept.size(0)] = kept
        # a layer computing one, too
        if isinstance(old, nn.Embedding) or base_forward(old) == "Embedding":
            padding = getattr(old, "padding_idx", None)
            new = VocabParallelEmbedding(
                vocab, weight.size(1), rows, group, padding_idx=padding, **kwargs
            )
        else:
            new = VocabParallelHead(
                weight.size(1),
                vocab,
                rows,
                bias is not None,
                group,
                sequence_parallel=sp,
                gather_output=gather_logits,
                **kwargs,
            )
            if bias is not None:
                _copy(
                    new.bias,
                    torch.cat(
                        [
                            bias[rows[0] : min(rows[1], vocab)],
                            bias.new_zeros(max(0, rows[1] - vocab)),
                        ]
                    ),
                )
        _copy(new.weight, padded)
        return new
    raise ConfigError(
        f"tensor_parallel: unknown style '{style}' for {op_name}; use column, row, vocab or"
        " replicate"
    )


def _sum_replicated_rows(
    grad: torch.Tensor, every_rank: list[list[tuple[int, int]]], rank: int, group: ProcessGroup
) -> torch.Tensor:
    """Each rank's gradient covers only its own query heads: add the other holders' part of a shared
    key/value head."""
    parts = [torch.empty_like(grad) for _ in every_rank]
    torch.distributed.all_gather(parts, grad.contiguous(), group=group)
    total = grad.clone()
    offset = 0
    for start, stop in every_rank[rank]:
        for other, other_rows in enumerate(every_rank):
            other_offset = 0
            for other_start, other_stop in other_rows:
                if other != rank and (other_start, other_stop) == (start, stop):
                    total[offset : offset + stop - start] += parts[other][
                        other_offset : other_offset + stop - start
                    ]
                other_offset += other_stop - other_start
        offset += stop - start
    return total


def _copy(target: nn.Parameter, source: torch.Tensor) -> None:
    if not target.is_meta and not source.is_meta:
        with torch.no_grad():
            target.copy_(source)


def _enter_sequence_parallel(
    model: nn.Module, graph: ModelGraph, styles: dict[str, str], group: ProcessGroup
) -> list[str]:
    """Split the hidden state along the sequence between the first block's input and the last
    block's output.

    Replicated parameters inside the blocks (norms, row biases) then see only part of the sequence,
    so their gradients are all-reduced over the tensor-parallel group as they are produced.
    """
    check_blocks(graph, "sequence_parallel", "to shard between")
    first, last = (
        block_modules(model, graph.blocks[0].path)[0],
        block_modules(model, graph.blocks[-1].path)[-1],
    )
    size = torch.distributed.get_world_size(group)

    def scatter(module, args, kwargs):
        # Note [whole sequences for a forward] (hyparallel.tensor.layers)
        if not splits_sequence(True):
            return None
        hidden = args[0] if args else kwargs["hidden_states"]
        length = hidden.size(SEQ_DIM)  # a Proxy under torch.fx: checked when the traced graph runs
        if isinstance(length, int) and length % size:
            raise ConfigError(
                f"sequence_parallel: sequence length {length} is not divisible by tp {size}"
            )
        hidden = scatter_to_tp(hidden, SEQ_DIM, group)
        return (
            ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
        )

    def gather(module, args, output):
        if not splits_sequence(True):
            return None
        # (hidden, attention weights...): OpenAI GPT's block returns a list
        if isinstance(output, (tuple, list)):
            items = [gather_from_tp(output[0], SEQ_DIM, group), *output[1:]]
            # a namedtuple too
            return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
        return gather_from_tp(output, SEQ_DIM, group)

    first.register_forward_pre_hook(scatter, with_kwargs=True)
    last.register_forward_hook(gather)
    synced = []
    for block in graph.blocks:
        for path, module in model.get_submodule(block.path).named_modules(prefix=block.path):
            for name, _ in module.named_parameters(recurse=False):
                split = isinstance(module, ColumnParallelLinear) or (
                    isinstance(module, RowParallelLinear) and name == "weight"
                )
                if not split:
                    # summed over tp by TensorParallelInfo.reduce_grads
                    synced.append(f"{path}.{name}")
    return synced


def check_local_shapes(
    model: nn.Module, graph: ModelGraph, styles: dict[str, str], tp: int, example_inputs: Any
) -> None:
    """Refuse, in one line, a split whose modules cannot run at one rank's sizes (Note [one rank's
    sizes, run on meta], hyparallel.graph.local_shapes); ``styles`` are the checked ones,
    ``example_inputs`` one micro-batch."""
    if failure := local_shape_failure(model, graph, styles, tp, example_inputs):
        raise ConfigError(failure[1])
