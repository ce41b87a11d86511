"""Split a model into pipeline stages at the plan's module boundaries.

    stages = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    split = split_model(model, stages, example)
    # meta model: only what this rank runs
    materialize_(model, device, only=split.state_names(stages_of_this_rank))
    # an nn.Module: (inputs, boundary values) -> next boundary
    stage = split.stage_module(1)

The model is traced once more, with the same tracers as ``hyparallel.trace`` (torch.fx first,
torch.export for models only it can trace, e.g. Hugging Face transformers). The stage map is a
policy this module does not choose: every graph node goes to the stage that lists its module (or
its nearest listed ancestor), see Note [which stage runs a node]; each stage is then copied out of
the graph as its own ``fx.GraphModule`` (Note [why not split_module]). A stage module holds
references to the model's own parameters and buffers, under the model's names, so a tied weight
(embedding and head) is one tensor in a single process; the runtime keeps its copies on different
ranks in sync.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from hyparallel.graph.checks import assign_stages, listed_stages
from hyparallel.graph.model_graph import ModelGraph
from hyparallel.graph.opaque import restore_module_calls
from hyparallel.graph.tracer import Method, first_program, module_of, split_inputs, to_meta
from hyparallel.kernels import bias_dropout_residual
from hyparallel.spec.errors import ConfigError

# Note [which stage runs a node]
# A node whose module (the innermost module it ran in) is listed in a stage, or has a listed
# ancestor (the longest listed prefix wins), runs in that stage. Other nodes are glue code of
# unlisted parents (Hugging Face's `transformer` computing position ids and masks, a final reshape
# at the root): each runs in the stage of the closest node before it in execution order, the first
# ones in stage 0. Stages must follow execution order: a node of stage k may not come after a node
# of stage k + 1, or the pipeline would have to run a stage twice; that is refused with the two
# modules named. Values a stage reads from any earlier stage travel stage to stage (a value made in
# stage 0 and read in stage 2 passes through stage 1), because a pipeline rank talks only to its
# neighbours. User inputs (token ids, masks) are not sent: every rank of a pipeline is handed the
# same batch, as in Megatron-LM.


@dataclass(frozen=True)
class StageIO:
    """What one stage reads and hands on: names of the split graph's values, in a fixed order."""

    index: int
    inputs: tuple[str, ...]  # boundary values received from the previous stage (none for stage 0)
    # boundary values sent to the next stage (none for the last: it returns the model output)
    outputs: tuple[str, ...]
    modules: tuple[str, ...]  # the plan's module paths for this stage


@dataclass
class PipelineSplit:
    """A model cut into stages; see the module docstring. Build it with :func:`split_model`."""

    model: nn.Module
    graph: fx.Graph  # the traced graph, model state read with get_attr under the model's own names
    stage_of: dict[str, int]  # graph node name -> stage
    io: tuple[StageIO, ...]
    method: str
    input_names: tuple[str, ...]  # user-input placeholders, in flattening order
    input_spec: TreeSpec | None  # export: how (args, kwargs) flatten; fx: None (bound by signature)
    output_spec: TreeSpec | None  # export: how the flat outputs rebuild the model's output
    signature: inspect.Signature
    # flat example inputs' micro-batch shapes, as the export fixed them: each dim its size, or the
    # name of a size it kept symbolic (Note [one export for every length], hyparallel.graph.tracer)
    example_shapes: tuple[tuple[int | str, ...] | None, ...]
    # non-tensor keyword arguments the trace added (use_cache=False), added again
    fixed_kwargs: dict[str, Any]
    # Subgraphs torch.export keeps beside the graph (submod_1 of a wrap_with_set_grad_enabled
    # region): not the model's attributes, so a stage reads them from here.
    subgraphs: dict[str, nn.Module] = field(default_factory=dict)
    # each symbolic size of example_shapes -> (least, most or None): the sizes the export admits
    size_ranges: dict[str, tuple[int, int | None]] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        """Number of (virtual) stages."""
        return len(self.io)

    def state_names(self, stages: Sequence[int] | int) -> set[str]:
        """Names of the parameters and buffers the given stages read (what a rank must
        materialise)."""
        wanted = {stages} if isinstance(stages, int) else set(stages)
        names: set[str] = set()
        modules = dict(self.model.named_modules())
        for node in self.graph.nodes:
            if self.stage_of.get(node.name) not in wanted:
                continue
            names.update(
                str(source.target) for source in node.all_input_nodes if source.op == "get_attr"
            )
            if node.op == "call_module":
                prefix = f"{node.target}."
                module = modules[str(node.target)]
                names.update(prefix + n for n, _ in module.named_parameters(remove_duplicate=False))
                names.update(prefix + n for n, _ in module.named_buffers(remove_duplicate=False))
        return names

    def shared_state(self) -> dict[str, tuple[int, ...]]:
        """Parameters read by more than one stage (a tied embedding and head), under their first
        name: -> stages."""
        first: dict[int, str] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            first.setdefault(id(param), name)
        alias = {
            name: first[id(p)] for name, p in self.model.named_parameters(remove_duplicate=False)
        }
        readers: dict[str, set[int]] = {}
        for stage in range(self.num_stages):
            for name in self.state_names(stage):
                if name in alias:
                    readers.setdefault(alias[name], set()).add(stage)
        return {name: tuple(sorted(stages)) for name, stages in readers.items() if len(stages) > 1}

    def flatten_inputs(self, inputs: Any) -> list[Any]:
        """The user's inputs (a tensor, a tuple of args or a dict of kwargs) in the order the stages
        read them."""
        args, kwargs = split_inputs(inputs)
        kwargs = {**self.fixed_kwargs, **kwargs}
        if self.input_spec is None:
            bound = self.signature.bind_partial(*args, **kwargs).arguments
            missing = [name for name in self.input_names if name not in bound]
            extra = [name for name in bound if name not in self.input_names]
            if missing or extra:
                parts = ([f"passes {extra}, not traced"] if extra else []) + (
                    [f"lacks {missing}"] if missing else []
                )
                what = " and ".join(parts)
                raise ConfigError(
                    f"the pipeline's stages were traced with inputs {list(self.input_names)}: this"
                    f" call {what}; train with the traced inputs, or pass a micro-batch of these as"
                    " parallelize's example_inputs"
                )
            return [bound[name] for name in self.input_names]
        keys = _children(self.input_spec)[1].context  # the traced keyword order
        if set(kwargs) == set(keys):
            kwargs = {key: kwargs[key] for key in keys}
        flat, spec = tree_flatten((args, kwargs))
        if spec != self.input_spec:
            raise ConfigError(
                f"the pipeline's stages were traced with inputs {list(keys) or 'given by position'}"
                f" but this call passes {list(kwargs) or 'positional arguments'}; train with the"
                " traced inputs, or pass a micro-batch of these as parallelize's example_inputs"
            )
        return flat

    def mismatch(self, flat: Sequence[Any], m: int = 1) -> tuple[int, tuple, str] | None:
        """The first of the flat inputs ``flat`` (``m`` micro-batches stacked on dim 0) that this
        split's torch.export trace cannot run, as (position, its micro-batch shape, the traced
        shape); None when every one fits (always for torch.fx, which fixes no shape).

        A size the export kept symbolic fits within its range, the same in every input that shares
        it (Note [one export for every length], hyparallel.graph.tracer).
        """
        if self.method != "export":
            return None
        seen: dict[str, int] = {}
        for position, (value, shape) in enumerate(zip(flat, self.example_shapes)):
            if not isinstance(value, torch.Tensor) or shape is None:
                continue
            got = tuple(value.shape)
            if got and m > 1:
                if got[0] % m:
                    return position, got, self.describe_shape(shape)
                got = (got[0] // m, *got[1:])
            if not self._admits(got, shape, seen):
                return position, got, self.describe_shape(shape)
        return None

    def _admits(self, got: tuple, shape: tuple, seen: dict[str, int]) -> bool:
        if len(got) != len(shape):
            return False
        for size, traced in zip(got, shape):
            if isinstance(traced, int):
                if size != traced:
                    return False
                continue
            least, most = self.size_ranges[traced]
            if not isinstance(size, int) or size < least or (most is not None and size > most):
                return False
            if seen.setdefault(traced, size) != size:
                return False
        return True

    def describe_shape(self, shape: tuple) -> str:
        """A traced shape as a person reads it: a symbolic size as its range."""

        def size(traced: int | str) -> str:
            if isinstance(traced, int):
                return str(traced)
            least, most = self.size_ranges[traced]
            return f"{least}..{most if most is not None else ''}"

        return f"({', '.join(size(d) for d in shape)})"

    def check_microbatch(self, flat: Sequence[Any]) -> None:
        """Refuse a micro-batch whose shapes a torch.export trace (which fixes every shape it did
        not keep symbolic) cannot run."""
        if (found := self.mismatch(flat)) is not None:
            position, got, traced = found
            raise ConfigError(
                f"micro-batch input {position} has shape {got} but the model was traced by"
                f" torch.export with {traced}, which fixes every shape; pass batches of"
                " num_microbatches x the traced micro-batch (the plan's micro_batch x seq_len)"
            )

    def output(self, flat: Any) -> Any:
        """The model's output rebuilt from the last stage's graph output (export flattens it)."""
        return (
            tree_unflatten(list(flat), self.output_spec) if self.output_spec is not None else flat
        )

    def stage_module(self, index: int, device: torch.device | str | None = None) -> Stage:
        """Stage ``index`` as a module over the model's current tensors: materialise those first.

        ``device`` replaces the meta device a meta-model trace baked into factory calls
        (``arange``); by default the device of the stage's first parameter.
        """
        graph = _stage_graph(self, index)
        module = fx.GraphModule(_Root(self.model, self.subgraphs), graph, f"Stage{index}")
        if device is None:
            device = next((t.device for t in module.parameters()), torch.device("cpu"))
        device = torch.device(device)
        # and the bodies of
        for gm in (module, *(m for sub in self.subgraphs.values() for m in sub.modules())):
            # higher-order ops (a no_grad region), which a stage calls
            if isinstance(gm, fx.GraphModule):
                for node in gm.graph.nodes:
                    node.args, node.kwargs = fx.node.map_aggregate(
                        (node.args, node.kwargs),
                        lambda v: device if isinstance(v, torch.device) and v.type == "meta" else v,
                    )
                    # Note [a view the run device's strides allow]
                    if node.target == torch.ops.aten.view.default:
                        node.target = torch.ops.aten.reshape.default
                    # Note [a stage follows the model's mode]
                    node.target = _AS_MODE.get(node.target, node.target)
                gm.recompile()
        return Stage(self, index, module)


class Stage(nn.Module):
    """One pipeline stage: ``forward(flat_inputs, received) -> tuple to send`` (the last: the
    model's output).

    ``flat_inputs`` is the micro-batch as :meth:`PipelineSplit.flatten_inputs` gives it;
    ``received`` the tuple the previous stage returned. Parameters keep the model's names
    (``layers.3.mlp.fc.weight``).
    """

    def __init__(self, split: PipelineSplit, index: int, body: fx.GraphModule):
        super().__init__()
        self.index = index
        self.io = split.io[index]
        self.is_last = index == split.num_stages - 1
        self.body = body
        self._num_inputs = len(split.input_names)
        self._output_spec = split.output_spec if self.is_last else None
        # not a child: its parameters are the body's already
        object.__setattr__(self, "_model", split.model)
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"][self._num_inputs :]
        self._written = {i for i, node in enumerate(placeholders) if _written_in_place(node)}

    def forward(self, flat_inputs: Sequence[Any], received: Sequence[Any] = ()) -> Any:
        if len(flat_inputs) != self._num_inputs or len(received) != len(self.io.inputs):
            raise ValueError(
                f"stage {self.index} takes {self._num_inputs} inputs and {len(self.io.inputs)}"
                f" received values, got {len(flat_inputs)} and {len(received)}"
            )
        # A received value is a leaf that needs its gradient (sent back to the previous stage); one
        # the stage writes in place (RoCBert's `embedding_in += token_type_embeddings` right after a
        # stage boundary) is written on a copy, as the single device writes on a non-leaf. Other
        # received values are used as they are.
        received = [r.clone() if i in self._written else r for i, r in enumerate(received)]
        _STAGE_MODE["training"] = self._model.training  # Note [a stage follows the model's mode]
        result = self.body(*flat_inputs, *received)
        if self.is_last and self._output_spec is not None:
            return tree_unflatten(list(result), self._output_spec)
        return result


# Note [a stage follows the model's mode]
#     A traced program keeps the mode it was traced in: torch.export writes `aten.dropout(x, p,
#     train=True)` and `aten.batch_norm(..., training=True, ...)` into the graph, and torch.fx
#     evaluates `self.training` in `F.dropout(x, p, self.training)` once. A pipeline stage runs such
#     a graph, so `model.eval()` did not turn its dropout off: eval_step of GPT-2 at pp 2 drew new
#     dropout masks on every call (4.1738, then 4.1756, against 4.1787 on one device in eval mode;
#     no error). The stage graphs call these ops through wrappers that ask the model's mode at each
#     call (the model's `training` flag, as a single device's modules do). Other branches on
#     `self.training` that a trace bakes in (sampling, a cache) keep the traced mode: the parity
#     check compares a model that draws in training in eval mode, traced so (Note [a parity check]).
# The mode of the last stage forward on this process: kept after it (not a context), so that a
# recomputation in backward (Note [what selective recomputation saves]) draws as that forward did.
_STAGE_MODE = {"training": True}


def _dropout_in_mode(x: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
    return torch.ops.aten.dropout.default(x, p, bool(train) and _STAGE_MODE["training"])


def _feature_dropout_in_mode(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    return torch.ops.aten.feature_dropout.default(x, p, bool(train) and _STAGE_MODE["training"])


# aten.batch_norm's arguments
def _batch_norm_in_mode(x, weight, bias, mean, var, training, momentum, eps, cudnn):
    training = bool(training) and _STAGE_MODE["training"]
    return torch.ops.aten.batch_norm.default(
        x, weight, bias, mean, var, training, momentum, eps, cudnn
    )


def _attention_in_mode(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    # HF passes its attention dropout only in training
    dropout_p = dropout_p if _STAGE_MODE["training"] else 0.0
    return torch.ops.aten.scaled_dot_product_attention.default(
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


def _fused_dropout_in_mode(x, bias, residual, p: float, training: bool, seed: int | None = None):
    return bias_dropout_residual(
        x, bias, residual, p, bool(training) and _STAGE_MODE["training"], seed
    )


def _functional_dropout_in_mode(
    x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
):
    return torch.nn.functional.dropout(x, p, training and _STAGE_MODE["training"], inplace)


_AS_MODE = {
    torch.ops.aten.dropout.default: _dropout_in_mode,
    torch.ops.aten.feature_dropout.default: _feature_dropout_in_mode,
    torch.ops.aten.batch_norm.default: _batch_norm_in_mode,
    torch.nn.functional.dropout: _functional_dropout_in_mode,
    torch.ops.aten.scaled_dot_product_attention.default: _attention_in_mode,
    torch.nn.functional.scaled_dot_product_attention: _attention_in_mode,  # torch.fx: the zoo GPT's
    # the zoo GPT's residual (torch.fx.wrap'ed: one node)
    bias_dropout_residual: _fused_dropout_in_mode,
}


_ALIASES = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "transpose",
        "permute",
        "unsqueeze",
        "squeeze",
        "expand",
        "slice",
        "select",
        "t",
        "alias",
        "as_strided",
        "unflatten",
        "flatten",
        "narrow",
        "view_as",
        "movedim",
        "split",
        "chunk",
        "getitem",
    }
)


_IN_PLACE_OPERATORS = frozenset(
    {
        operator.iadd,
        operator.isub,
        operator.imul,
        operator.itruediv,
        operator.ipow,
        operator.iand,
        operator.ior,
    }
)


def _written_in_place(node: fx.Node) -> bool:
    """Whether an in-place op writes ``node``'s value or a view of it (read from the ops' schemas
    and names)."""
    stack, seen = [node], set()
    while stack:
        value = stack.pop()
        for user in value.users:
            if user in seen:
                continue
            seen.add(user)
            schema = getattr(user.target, "_schema", None)
            name = (
                schema.name.split("::")[-1]
                if schema is not None
                else getattr(user.target, "__name__", "")
            )
            writes = schema is not None and schema.is_mutable
            if user.op == "call_method":  # torch.fx: x.add_(y)
                name, writes = (
                    str(user.target),
                    str(user.target).endswith("_") and not str(user.target).startswith("_"),
                )
            writes = writes or user.target in _IN_PLACE_OPERATORS  # torch.fx: x += y
            if writes and user.args and user.args[0] is value:
                return True
            if name in _ALIASES or name.removesuffix("_copy") in _ALIASES:
                stack.append(user)
    return False


def split_model(
    model: nn.Module,
    stages: Sequence[Sequence[str]],
    example_inputs: Any,
    *,
    method: Method = "auto",
    traced: ModelGraph | None = None,
    dynamic: bool = False,
) -> PipelineSplit:
    """Cut ``model`` into ``len(stages)`` stages, stage k running the modules ``stages[k]`` lists.

    ``example_inputs`` is one micro-batch (a tensor, a tuple of args, or a dict of kwargs); only its
    shapes and dtypes are used, on the meta device. See Note [which stage runs a node]. ``traced``
    is ``hyparallel.trace(model, example_inputs)`` when the caller has it: the split cuts a copy of
    that trace instead of tracing again (only valid while the model is the one traced: no module
    swapped since). ``dynamic``: a torch.export trace keeps the batch and sequence sizes symbolic
    where the model allows, so the stages run other sizes too (Note [one export for every length],
    hyparallel.graph.tracer); the split's ``mismatch`` says which inputs they run.
    """
    if not stages:
        raise ConfigError("stages is empty; list the module paths of each pipeline stage")
    args, kwargs = split_inputs(example_inputs)
    flat_example, _ = tree_flatten((args, kwargs))
    args, kwargs = torch.utils._pytree.tree_map(to_meta, (args, kwargs))
    if (
        traced is not None
        and traced.traced is not None
        and method in ("auto", traced.method)
        and not dynamic
    ):
        program = traced.traced.copy()
    else:
        program = first_program(model, args, kwargs, method, dynamic=dynamic)
    graph = program.gm.graph
    _lift_state(program, model)
    restore_module_calls(graph)  # Note [a module call a trace keeps] (hyparallel.graph.opaque)
    _drop_concrete_placeholders(program)
    stage_of = _assign(model, graph, [list(s) for s in stages])
    names = tuple(n.name for n in program.user_inputs)
    traced_kwargs = program.artifact.example_inputs[1] if program.method == "export" else {}
    fixed = {
        k: v
        for k, v in traced_kwargs.items()
        if k not in kwargs and not isinstance(v, torch.Tensor)
    }
    output_spec = program.artifact.call_spec.out_spec if program.method == "export" else None
    input_spec = program.artifact.call_spec.in_spec if program.method == "export" else None
    split = PipelineSplit(
        model=model,
        graph=graph,
        stage_of=stage_of,
        io=(),
        method=program.method,
        input_names=names,
        input_spec=input_spec,
        output_spec=output_spec,
        signature=inspect.signature(model.forward),
        example_shapes=tuple(
            tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in flat_example
        ),
        fixed_kwargs=fixed,
        subgraphs=_subgraphs(program, model),
    )
    if program.method == "export":
        split.example_shapes, split.size_ranges = _input_sizes(program)
    split.io = _stage_io(split, [tuple(s) for s in stages])
    return split


def _input_sizes(program: Any) -> tuple[tuple, dict[str, tuple[int, int | None]]]:
    """The exported program's user inputs' shapes, each dim a size or the name of a symbolic one,
    and each symbolic size's range (Note [one export for every length], hyparallel.graph.tracer).

    A program whose graph asserts on sizes (a relation the inputs' ranges do not state, or a size
    the data decides) is taken at its example's exact shapes: only those are known to pass.
    """
    shapes: list[tuple | None] = []
    ranges: dict[str, tuple[int, int | None]] = {}
    checked = any(
        node.op == "call_function" and node.target is torch.ops.aten._assert_scalar.default
        for node in program.gm.graph.nodes
    )
    constraints = program.artifact.range_constraints
    for node in program.user_inputs:
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            shapes.append(None)
            continue
        dims: list[int | str] = []
        for size in value.shape:
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            if expr is None or checked or not expr.is_Symbol or expr not in constraints:
                dims.append(_hint(size))
                continue
            bounds = constraints[expr]
            # torch's int_oo calls itself finite: an unbounded size is the one that is no Integer
            most = int(bounds.upper) if bounds.upper.is_Integer else None
            least = int(bounds.lower) if bounds.lower.is_Integer else 0
            ranges[str(expr)] = (least, most)
            dims.append(str(expr))
        shapes.append(tuple(dims))
    return tuple(shapes), ranges


def _hint(size: Any) -> int:
    """A size as the example had it (a symbolic one by its example value)."""
    if isinstance(size, torch.SymInt):
        return int(size.node.hint)
    return int(size)


class _Root(nn.Module):
    """What a stage's get_attr and call_module targets resolve in: the model, then the export's
    subgraphs."""

    def __init__(self, model: nn.Module, subgraphs: dict[str, nn.Module]):
        super().__init__()
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_subgraphs", subgraphs)

    def __getattr__(self, name: str) -> Any:
        if name in self._subgraphs:
            return self._subgraphs[name]
        return getattr(self._model, name)


def _subgraphs(program, model: nn.Module) -> dict[str, nn.Module]:
    """The exported graph module's submodules that are not the model's (higher-order ops'
    bodies)."""
    if program.method != "export":
        return {}
    own = {name for name, _ in model.named_children()}
    return {name: sub for name, sub in program.gm.named_children() if name not in own}


def _children(spec: TreeSpec) -> list[TreeSpec]:
    # torch < 2.10
    return spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs


def _lift_state(program, model: nn.Module) -> None:
    """Export passes parameters and buffers as graph inputs; read them with get_attr under the
    model's names.

    The graph then runs over the model's own (later materialised) tensors, as an fx trace does.
    Device constants the meta trace baked in (``arange(..., device='meta')``) follow the input
    tensors instead.
    """
    graph = program.gm.graph
    if program.method == "export":
        signature = program.artifact.graph_signature
        if any(spec.kind.name != "USER_OUTPUT" for spec in signature.output_specs):
            mutated = [
                spec.target for spec in signature.output_specs if spec.kind.name != "USER_OUTPUT"
            ]
            raise ConfigError(
                f"the model updates state in forward ({', '.join(map(str, mutated))}); pipeline"
                " stages cannot split a model that mutates buffers"
            )
        constants = set(program.artifact.constants) - {
            s.target for s in signature.input_specs if s.kind.name == "BUFFER"
        }
        first = next(n for n in graph.nodes if n.op != "placeholder")
        for node, target in list(program.state_of.items()):
            if target in constants:
                _adopt_constant(model, target, program.artifact.constants[target])
            # create_node: the export module has no such attribute, the model has
            with graph.inserting_before(first):
                attr = graph.create_node("get_attr", target)
            attr.meta = dict(node.meta)
            node.replace_all_uses_with(attr)
            graph.erase_node(node)


def _adopt_constant(model: nn.Module, target: str, value: Any) -> None:
    """A tensor constant the forward creates (``torch.tensor(...)``, lifted by torch.export)
    registered as a non-persistent buffer where the graph reads it, so the stage that uses it has it
    (checkpoints do not change); refused when the trace gave no value (Note [exported for the device
    it runs on], hyparallel.graph.tracer)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(value, torch.Tensor) or value.is_meta or isinstance(value, FakeTensor):
        raise ConfigError(
            f"the model creates tensor constant '{target}' in forward; torch.export lifted it and "
            "a meta-device trace cannot give its value; register it as a buffer in __init__"
        )
    owner, _, leaf = target.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if leaf not in module._buffers:
        module.register_buffer(leaf, value.detach().clone(), persistent=False)


def _drop_concrete_placeholders(program) -> None:
    """fx keeps a placeholder for each argument traced with its default (concrete) value: bind
    it."""
    user = set(program.user_inputs)
    placeholders = [n for n in program.gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, program.run_args):
        if node in user:
            continue
        for consumer in list(node.users):
            consumer.args, consumer.kwargs = fx.node.map_arg(
                (consumer.args, consumer.kwargs),
                lambda n, node=node, value=value: value if n is node else n,
            )
        program.gm.graph.erase_node(node)


def _assign(model: nn.Module, graph: fx.Graph, stages: list[list[str]]) -> dict[str, int]:
    """Graph node name -> stage; see Note [which stage runs a node] (the rule:
    hyparallel.graph.checks.assign_stages)."""
    listed = listed_stages(
        [path for path, _ in model.named_modules() if path], stages, type(model).__name__
    )
    compute = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    stage_of = assign_stages(listed, [module_of(n) for n in compute], len(stages), stages)
    return {node.name: stage for node, stage in zip(compute, stage_of)}
    # get_attr nodes have no stage: every stage that reads a tensor gets its own get_attr


def _stage_io(split: PipelineSplit, stages: list[tuple[str, ...]]) -> tuple[StageIO, ...]:
    """Which split-graph values each stage receives and sends on (relayed through stages that do not
    read them)."""
    made_in: dict[str, int] = {}  # value (original node name) -> stage that computes it
    last_read: dict[str, int] = {}
    num_stages = len(stages)
    for node in split.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        stage = split.stage_of[node.name]
        made_in[node.name] = stage
        for source in node.all_input_nodes:
            if source.name in made_in and made_in[source.name] != stage:
                last_read[source.name] = max(last_read.get(source.name, stage), stage)
    output = next(n for n in split.graph.nodes if n.op == "output")
    for source in output.all_input_nodes:
        if source.name in made_in and made_in[source.name] != num_stages - 1:
            last_read[source.name] = num_stages - 1
    order = [n.name for n in split.graph.nodes if n.name in last_read]
    io = []
    for k in range(num_stages):
        inputs = tuple(v for v in order if made_in[v] < k <= last_read[v])
        outputs = (
            tuple(v for v in order if made_in[v] <= k < last_read[v]) if k < num_stages - 1 else ()
        )
        io.append(StageIO(index=k, inputs=inputs, outputs=outputs, modules=stages[k]))
    return tuple(io)


# Note [why not split_module]
# torch.fx.passes.split_module cuts a graph into submodules called from a root graph, and hands
# every parameter read with get_attr to its submodules as an *argument* from that root: the
# submodules would own no parameters, and the root (on every rank) would hold them all. A pipeline
# stage must own its parameters (for the optimizer, for materialising only them) and receive values
# only from its neighbour, so each stage is copied out of the graph with Graph.node_copy:
# placeholders for the user inputs and the received values, the stage's nodes, its own get_attr for
# each tensor it reads (fx.GraphModule then copies just those from the model), and an output tuple
# of what it hands on.


def _stage_graph(split: PipelineSplit, index: int) -> fx.Graph:
    io, graph = split.io[index], fx.Graph()
    env: dict[str, fx.Node] = {}
    for name in (*split.input_names, *io.inputs):
        env[name] = graph.placeholder(name)
    for node in split.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output") or split.stage_of[node.name] != index:
            continue
        for source in node.all_input_nodes:
            if source.op == "get_attr" and source.name not in env:
                env[source.name] = graph.get_attr(source.target)
                env[source.name].meta = dict(source.meta)
        env[node.name] = graph.node_copy(node, lambda n: env[n.name])
    if index == split.num_stages - 1:
        output = next(n for n in split.graph.nodes if n.op == "output")
        graph.output(fx.node.map_arg(output.args[0], lambda n: env[n.name]))
    else:
        graph.output(tuple(env[name] for name in io.outputs))
    graph.lint()
    return graph
