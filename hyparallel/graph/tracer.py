"""``trace(model, example_inputs) -> ModelGraph``: torch.fx first, torch.export as the fallback.

Both paths end in one fx graph that is run once on meta tensors (no real memory, whatever the
model's size) under ``torch.utils.flop_counter.FlopCounterMode``, recording each node's FLOPs
and output shapes. Nodes are then grouped into ops: a leaf module call (a module without child
modules: Linear, LayerNorm, transformers' Conv1D, ...) is one op on both paths; other functional
ops stay one op each, annotated with the module they ran in.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import inspect
import io
import itertools
import logging
import operator
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils._traceback import CapturedTraceback

from hyparallel.graph.kinds import (
    EMBEDDING_BAG_OPS,
    GROUPED_MM,
    VIEW_OPS,
    base_forward,
    embedding_bag_flops,
    function_kind,
    logits_of,
    module_kind,
    target_name,
    writes_in_place,
)
from hyparallel.graph.model_graph import Block, ModelGraph, Op, Value
from hyparallel.graph.repeats import repeated_blocks_once
from hyparallel.graph.trace_errors import Failure, explain, remember_source
from hyparallel.spec.errors import TraceError

log = logging.getLogger(__name__)

Method = Literal["auto", "fx", "export"]


@dataclass
class Program:
    """A traced fx graph plus what is needed to run and read it."""

    gm: fx.GraphModule
    method: Literal["fx", "export"]
    run_args: list[Any]
    user_inputs: list[fx.Node]
    # get_attr / lifted placeholder -> state name
    state_of: dict[fx.Node, str] = field(default_factory=dict)
    artifact: Any = None
    # (module path, class) of each custom torch.autograd.Function the traced forward applied (Note
    # [a custom backward a traced stage cannot keep])
    custom_backwards: tuple[tuple[str, str], ...] = ()

    def copy(self) -> Program:
        """This program over a copy of its graph, to edit (the pipeline splitter's) without changing
        this one."""
        # node for node, under the same names (a fresh graph has no clashes)
        graph = copy.deepcopy(self.gm.graph)
        by_name = {node.name: node for node in graph.nodes}
        return dataclasses.replace(
            self,
            gm=fx.GraphModule(self.gm, graph, type(self.gm).__name__),
            run_args=list(self.run_args),
            user_inputs=[by_name[node.name] for node in self.user_inputs],
            state_of={by_name[node.name]: name for node, name in self.state_of.items()},
        )


def trace(
    model: nn.Module, example_inputs: Any, *, name: str | None = None, method: Method = "auto"
) -> ModelGraph:
    """Trace ``model`` called on ``example_inputs`` (a tensor, a tuple of args, or a dict of
    kwargs).

    Runs on meta tensors only, so meta-device models of any size trace in seconds. ``method``
    forces one tracer; by default torch.fx is tried first and torch.export (``strict=False``)
    when symbolic tracing fails, as it does for Hugging Face models.
    """
    args, kwargs = split_inputs(example_inputs)
    # only shapes and dtypes matter: no real memory
    args, kwargs = tree_map(to_meta, (args, kwargs))
    return first_program(
        model,
        args,
        kwargs,
        method,
        lambda program: _build(model, program, name or type(model).__name__),
    )


def first_program(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    method: Method,
    finish: Any = None,
    *,
    dynamic: bool = False,
) -> Any:
    """``finish(program)`` for the first tracer (fx, then export) that traces ``model`` and
    finishes.

    A failure in either tracing or ``finish`` moves on to the next tracer; when all fail, one
    TraceError names the construct, module and source line for each. ``finish`` defaults to
    returning the traced program (what the pipeline splitter cuts). ``dynamic``: torch.export keeps
    the inputs' batch and sequence sizes symbolic where the model allows (Note [one export for
    every length]).
    """
    failures: list[Failure] = []
    attempts = {"auto": ("fx", "export"), "fx": ("fx",), "export": ("export",)}[method]
    for attempt in attempts:
        found: list[tuple[str, str]] = []

        def finished(program: Program, found: list = found) -> Any:
            program.custom_backwards = tuple(dict.fromkeys(found))
            return finish(program) if finish is not None else program

        with ModuleStack(model) as calls, kept_torch_state(), _custom_functions(calls, found):
            # Note [a failed trace leaves torch as it found it]
            try:
                if attempt == "fx":
                    return finished(_fx_program(model, args, kwargs))
                return _exported(model, args, kwargs, finished, dynamic=dynamic)
            except TraceError:
                raise
            except Exception as exc:  # noqa: BLE001 -- any tracer failure means: try the next tracer, then report all
                failures.append(Failure(attempt, exc, calls.innermost))
    raise TraceError(explain(model, failures, _given(model, args, kwargs)))


# Note [a custom backward a traced stage cannot keep]
#     A torch.autograd.Function with its own backward (Yoso's LSH cumulation: an approximate
#     gradient) runs as written in eager, tensor and data parallel layouts; a pipeline stage runs
#     the traced graph, in which the tracers record the Function's forward ops and autograd then
#     differentiates those instead (Yoso pp 2: query and key gradients 25% off, no error). The
#     tracer records each such Function applied outside torch itself; check_plan refuses pp > 1 for
#     the model in one line, so the planner keeps it to pp 1.


@contextlib.contextmanager
def _custom_functions(calls: ModuleStack, found: list[tuple[str, str]]) -> Iterator[None]:
    """Record (innermost module, class) of each torch.autograd.Function applied in this block,
    torch's own left out (Note [a custom backward a traced stage cannot keep])."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith("torch."):
            found.append((calls.innermost or "", f"{cls.__module__}.{cls.__qualname__}"))
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


# Note [a failed trace leaves torch as it found it]
#     A tracer or meta run that fails midway skips the cleanup of what it entered: torch.export
#     failing inside a no-grad region leaves the grad mode off (HRM), and failing inside a
#     torch.vmap (Hugging Face's mask functions; T5Gemma2's export) leaves functorch's vmap level
#     pushed, after which every random op of the process raises "vmap: called random operation while
#     in randomness error mode": the user's next model cannot even be initialised. Each attempt
#     restores the grad mode and functorch's layer stack depth as torch.compile does.


@contextlib.contextmanager
def kept_torch_state() -> Iterator[None]:
    """Restore the grad mode and functorch's transform stack on leaving, however the block ended
    (Note [a failed trace leaves torch as it found it])."""
    depth = torch._C._functorch.get_dynamic_layer_stack_depth()
    try:
        with torch.set_grad_enabled(torch.is_grad_enabled()):
            yield
    finally:
        if torch._C._functorch.get_dynamic_layer_stack_depth() != depth:
            torch._C._functorch.pop_dynamic_layer_stack_and_undo_to_depth(depth)


def _given(model: nn.Module, args: tuple, kwargs: dict) -> set[str]:
    """Names of the forward arguments ``args`` and ``kwargs`` bind (what the example inputs
    give)."""
    try:
        return set(inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return set(kwargs)


class ModuleStack:
    """Follows module calls with hooks so that a failure can name the module it happened in.

    ``eager``: the block only runs the model eagerly (a dry run), so two process-wide module hooks
    follow it, instead of two hooks on each of its modules (GPT-3 175B's 967: most of a dry run's
    own time, which runs each distinct block once). Tracers keep hooks on the modules: a
    process-wide hook is not theirs to meet.
    """

    def __init__(self, model: nn.Module, eager: bool = False):
        self.model = model
        self.eager = eager
        self.stack: list[str] = []
        self.handles: list[Any] = []

    def __enter__(self) -> ModuleStack:
        if self.eager:
            paths = {id(module): path for path, module in self.model.named_modules()}

            def enter(module: nn.Module, _args: Any) -> None:
                if id(module) in paths:
                    self.stack.append(paths[id(module)])

            def leave(module: nn.Module, _args: Any, _output: Any) -> None:
                if id(module) in paths:
                    self._leave(paths[id(module)])

            self.handles.append(nn.modules.module.register_module_forward_pre_hook(enter))
            self.handles.append(nn.modules.module.register_module_forward_hook(leave))
            return self
        for path, module in self.model.named_modules():
            self.handles.append(
                module.register_forward_pre_hook(lambda _m, _a, path=path: self.stack.append(path))
            )
            self.handles.append(
                module.register_forward_hook(lambda _m, _a, _o, path=path: self._leave(path))
            )
        return self

    def _leave(self, path: str) -> None:
        if self.stack and self.stack[-1] == path:
            self.stack.pop()

    @property
    def innermost(self) -> str | None:
        """Path of the innermost module still running (None if the failure was outside any)."""
        return self.stack[-1] if self.stack else None

    def __exit__(self, *exc_info: Any) -> None:
        for handle in self.handles:
            handle.remove()


def first_failure(
    model: nn.Module, example_inputs: Any, method: str
) -> tuple[str, BaseException] | None:
    """Where ``model`` fails first when run on meta at the shapes of ``example_inputs``: (the
    innermost module running, the exception), or None when it runs.

    ``method`` is how its graph was traced: after "export" it is exported again (torch.export takes
    the data-dependent Python an eager run on meta cannot, such as Hugging Face's mask checks);
    after "fx" it runs eagerly on meta.
    """
    args, kwargs = split_inputs(example_inputs)
    args, kwargs = tree_map(to_meta, (args, kwargs))
    repeats = repeated_blocks_once(model) if method != "export" else contextlib.nullcontext()
    calls = ModuleStack(model, eager=method != "export")
    with repeats, calls, kept_torch_state():  # Note [a repeated block runs once on meta]
        try:
            if method == "export":
                _exported(model, args, kwargs, None)
            else:
                with torch.no_grad():
                    model(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- any failure is the answer
            return calls.innermost or "(root)", exc
    return None


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for calling a model on ``example_inputs``: a mapping is keyword arguments,
    a tuple or list positional ones, anything else (a tensor) the single positional argument."""
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def call_with(module: Any, inputs: Any) -> Any:
    """``module`` called on ``inputs`` by the one rule of :func:`split_inputs` (what the trace
    called it with)."""
    args, kwargs = split_inputs(inputs)
    return module(*args, **kwargs)


def to_meta(value: Any) -> Any:
    """A tensor moved to the meta device (shape and dtype kept, no memory); any other value
    unchanged."""
    from torch._subclasses.fake_tensor import FakeTensor

    # an exported program's state (Note [exported for the device it runs on])
    if isinstance(value, FakeTensor):
        meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        # a parameter stays one (Note [a gradient path])
        return meta.requires_grad_(value.requires_grad)
    return value.to("meta") if isinstance(value, torch.Tensor) else value


# ---- torch.fx ------------------------------------------------------------------------------------


# Note [stack traces made when asked]
#     An error raised while the profiler runs a node names the user's line that traced it
#     (remember_source), from the stack recorded with the node. fx's own ``record_stack_traces``
#     formats every node's stack as it traces, and its first filtering imports torch.export._trace
#     and torch._inductor (0.3 s and more of a `hyparallel plan` on top of formatting some 2,000
#     stacks). So the tracer records each node's stack in fx's fast raw form
#     (``CapturedTraceback.extract``) and formats it as fx would, filtered alike, only for a node
#     that fails.
_TRACEBACK = "hyparallel_traceback"  # node.meta key: the node's CapturedTraceback


# Note [torch's own layers with children are traced into]
#     fx keeps every torch.nn module as one call_module node, so nn.TransformerEncoder was one
#     opaque op: tensor parallelism split only the embedding and head around it, and no pipeline
#     could cut between its layers. A torch.nn module with children is traced into like a user's own
#     (its children are then the ops and its ModuleList the blocks), except nn.MultiheadAttention,
#     whose forward reads out_proj's weight without calling it (F.multi_head_attention_forward): it
#     stays one op, kept whole by tensor parallelism. The encoder layer's forward branches on its
#     tensors' dtypes and devices, which fx cannot record, so such a model is traced by
#     torch.export. Once split, the encoder layer's fused inference path
#     (torch._transformer_encoder_layer_fwd, taken in eval under no_grad) would read the split
#     weights as whole; tensor parallelism turns it off (Note [torch's fused encoder path],
#     hyparallel/tensor/apply.py).


class _LeafTracer(fx.Tracer):
    """Keeps every module without children (standard or custom) as one call_module node
    (Note [torch's own layers with children are traced into])."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            return False
        if next(m.children(), None) is None or isinstance(m, nn.MultiheadAttention):
            return True
        return super().is_leaf_module(m, module_qualified_name) and not type(
            m
        ).__module__.startswith("torch.nn.")

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        self.grad_mode = torch.is_grad_enabled()
        return super().trace(root, concrete_args)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        # torch.fx runs forward's Python, so a `with torch.no_grad():` is in force while its ops are
        # recorded, but the graph keeps no trace of it: run again, those ops would build gradients
        # (HRM's no-grad cycles). Such a forward is left to torch.export, which records the region
        # (wrap_with_set_grad_enabled).
        if torch.is_grad_enabled() != self.grad_mode:
            raise RuntimeError(
                "torch.fx cannot record a grad-mode change (torch.no_grad() or enable_grad in"
                " forward)"
            )
        node = super().create_node(*args, **kwargs)
        node.meta[_TRACEBACK] = CapturedTraceback.extract()  # Note [stack traces made when asked]
        return node


def stack_trace(node: fx.Node) -> str | None:
    """Where in the user's forward ``node`` was traced, as fx's ``record_stack_traces`` would have
    recorded it (Note [stack traces made when asked]); torch.export's nodes carry their own."""
    captured = node.meta.get(_TRACEBACK)
    if node.stack_trace or captured is None:
        return node.stack_trace
    summary = captured.summary()
    if summary:
        summary = _LeafTracer()._filter_traceback_frames(summary)
    return "".join(summary.format()).strip() if summary else None


def _fx_program(model: nn.Module, args: tuple, kwargs: dict) -> Program:
    signature = inspect.signature(model.forward)
    # a required argument left out: TypeError naming it
    bound = signature.bind(*args, **kwargs).arguments
    concrete = {
        p.name: p.default
        for p in signature.parameters.values()
        if p.name not in bound and p.default is not inspect.Parameter.empty
    }
    tracer = _LeafTracer()
    graph = tracer.trace(model, concrete_args=concrete or None)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    run_args, user_inputs = [], []
    for node, param in zip(placeholders, signature.parameters.values()):
        if param.name in bound:
            run_args.append(bound[param.name])
            user_inputs.append(node)
        else:
            run_args.append(concrete[param.name])
    state_of = {n: n.target for n in gm.graph.nodes if n.op == "get_attr"}
    return Program(
        gm=gm,
        method="fx",
        run_args=run_args,
        user_inputs=user_inputs,
        state_of=state_of,
        artifact=gm,
    )


# ---- torch.export --------------------------------------------------------------------------------


# Note [exported for the device it runs on]
#     A meta-device model exported as it is sees ``device.type == "meta"`` wherever its code asks,
#     and code that branches on the device bakes the wrong branch into the graph the pipeline then
#     runs: transformers' MoE counts tokens per expert with ``histc`` on floats on the CPU and on
#     ints elsewhere, and the int branch, traced on meta, fails on the CPU ("histogram_cpu" not
#     implemented for 'Int'). So a meta model is exported on fake tensors of the device it will run
#     on (``tracing_device``, the CPU unless parallelize says cuda): the same meta storage, nothing
#     allocated, but the device its code sees is the real one. Device arguments baked into the graph
#     are then moved back to meta (the tracer runs the graph on meta; the pipeline splitter makes
#     device constants follow its inputs). Tensor constants the forward creates from Python values
#     (``torch.tensor(0)``) come out real, so the splitter can give them to the stage that uses
#     them. Kernels lay out their outputs per device: a program exported for the CPU may drop a
#     ``.contiguous()`` the meta kernel's strides need (nanoGPT's attention output), and a device
#     branch may view what meta lays out otherwise (Afmoe). A model whose device export fails, or
#     whose program then does not run on meta, is exported on plain meta tensors as before
#     (``_exported``).
_TRACE_DEVICE: contextvars.ContextVar[str] = contextvars.ContextVar("trace_device", default="cpu")


@contextlib.contextmanager
def tracing_device(device: torch.device | str) -> Iterator[None]:
    """Export meta models as if on ``device`` inside this block (Note [exported for the device it
    runs on])."""
    token = _TRACE_DEVICE.set(str(torch.device(device)))
    try:
        yield
    finally:
        _TRACE_DEVICE.reset(token)


def _exported(
    model: nn.Module, args: tuple, kwargs: dict, finish: Any, *, dynamic: bool = False
) -> Any:
    """``finish`` of the export for the run device, or of the plain meta export when that one fails
    or does not run on meta (Note [exported for the device it runs on]); ``dynamic``: with the
    batch and sequence sizes symbolic, else (when that fails) fixed (Note [one export for every
    length])."""
    if dynamic:
        try:
            with kept_torch_state():
                return _exported_at(model, args, kwargs, finish, dynamic=True)
        except Exception:  # noqa: BLE001 -- the sizes fixed below is the answer, its failure the one reported
            log.debug("the export with symbolic sizes failed; exporting with fixed sizes")
    return _exported_at(model, args, kwargs, finish)


def _exported_at(
    model: nn.Module, args: tuple, kwargs: dict, finish: Any, *, dynamic: bool = False
) -> Any:
    # torch restored after it: a failure inside a no_grad region (a higher-order op's body run on
    # meta)
    try:
        # leaves the grad mode off, and the next export would then not see that region (HRM's
        # no-grad cycles, 1.1e-4)
        with kept_torch_state():
            program = _export_program(model, args, kwargs, dynamic=dynamic)
            return finish(program) if finish is not None else program
    except Exception:  # noqa: BLE001 -- the plain meta export below is the answer, its failure the one reported
        if next((p.device for p in model.parameters()), torch.device("meta")).type != "meta":
            raise
    program = _export_program(model, args, kwargs, on_device=False, dynamic=dynamic)
    return finish(program) if finish is not None else program


# Note [one export for every length]
#     torch.export fixes every shape it is given unless told which sizes may vary. A pipeline's
#     forward-only stages (Note [a forward under any plan], hyparallel.pipeline.forward) are traced
#     for inputs the training stages do not run: another batch, and while generating a new length
#     for every token. They are exported with the batch and sequence dimensions (dims 0 and 1 of
#     each tensor input) marked Dim.AUTO: torch.export keeps a size symbolic where the model's code
#     allows and fixes it where the code depends on its value (a reshape to a configured width, a
#     Python branch on the length), so the program is right for every size its input constraints
#     admit. Those constraints (each symbolic size's range, and which inputs share a size) are read
#     from the program and checked before a call runs it (PipelineSplit.mismatch); a program that
#     also asserts on sizes inside its graph (aten._assert_scalar: relations between sizes, or a
#     size the data decides) is not reused for other sizes. Sizes 0 and 1 are always fixed by
#     torch.export (it specialises them), so a one-row or one-token input gets a program of its
#     own. The training stages stay exported at the micro-batch's exact shape.
def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """torch.export's ``dynamic_shapes`` for ``model(*args, **kwargs)``: dims 0 and 1 of every
    tensor input Dim.AUTO, by the forward's parameter names (Note [one export for every
    length])."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments

    def sizes(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return {dim: torch.export.Dim.AUTO for dim in range(min(value.dim(), 2))}
        return None

    return {name: tree_map(sizes, value) for name, value in bound.items()}


def _export_program(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    on_device: bool = True,
    *,
    dynamic: bool = False,
) -> Program:
    if "use_cache" in inspect.signature(model.forward).parameters and "use_cache" not in kwargs:
        # Hugging Face: no KV cache while tracing for training
        kwargs = {**kwargs, "use_cache": False}
    shapes = {"dynamic_shapes": _dynamic_shapes(model, args, kwargs)} if dynamic else {}
    device = next((p.device for p in model.parameters()), torch.device("meta"))
    # torch.export wants inputs beside the weights; it runs nothing for real
    if device.type != "meta":
        args, kwargs = tree_map(
            lambda t: torch.zeros_like(t, device=device) if isinstance(t, torch.Tensor) else t,
            (args, kwargs),
        )
        with _quiet_torch_logs(), _no_kv_cache(model):
            # a failure is reported as one line
            exported = torch.export.export(model, args, kwargs, strict=False, **shapes)
    elif on_device:
        on = torch.device(_TRACE_DEVICE.get())
        # fake CUDA tensors without CUDA abort in C++
        if on.type == "cuda" and not torch.cuda.is_available():
            on = torch.device("cpu")
        with (
            _quiet_torch_logs(),
            _no_kv_cache(model),
            _on_fake_device(model, on, (args, kwargs)) as (fargs, fkwargs),
        ):
            exported = torch.export.export(model, fargs, fkwargs, strict=False, **shapes)
        _device_arguments_to_meta(exported.graph_module)
    else:
        with _quiet_torch_logs(), _no_kv_cache(model), _buffers_on_meta(model):
            exported = torch.export.export(model, args, kwargs, strict=False, **shapes)
    signature = exported.graph_signature
    placeholders = [n for n in exported.graph_module.graph.nodes if n.op == "placeholder"]
    flat_user, _ = tree_flatten((args, kwargs))
    flat_user = iter(flat_user)
    state = {**exported.state_dict, **exported.constants}
    run_args, user_inputs, state_of = [], [], {}
    for node, spec in zip(placeholders, signature.input_specs):
        if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT:
            value = to_meta(next(flat_user))
            run_args.append(value)
            user_inputs.append(node)
        else:
            run_args.append(to_meta(state[spec.target]))
            state_of[node] = spec.target
    return Program(
        gm=exported.graph_module,
        method="export",
        run_args=run_args,
        user_inputs=user_inputs,
        state_of=state_of,
        artifact=exported,
    )


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module) -> Iterator[None]:
    """Every Hugging Face config of the model (nested ones too: a multimodal model's text_config)
    with ``use_cache`` off while tracing: a forward taking ``use_cache`` only through ``**kwargs``
    (VibeVoiceAsr, MossTranscribe) returned a DynamicCache, which torch.export cannot take as an
    output."""
    changed: list[Any] = []
    seen: set[int] = set()

    def visit(config: Any) -> None:
        if id(config) in seen or not hasattr(config, "to_dict"):
            return
        seen.add(id(config))
        if getattr(config, "use_cache", None):
            config.use_cache = False
            changed.append(config)
        for value in list(vars(config).values()):
            visit(value)

    for module in model.modules():
        visit(getattr(module, "config", None))
    try:
        yield
    finally:
        for config in changed:
            config.use_cache = True


@contextlib.contextmanager
def _buffers_on_meta(model: nn.Module) -> Iterator[None]:
    """Meta copies of the model's real buffers while it is exported beside meta parameters and
    inputs: a meta build keeps its buffers real (Note [parameters on meta, buffers real]), and fake
    tensors refuse to mix devices.
    """
    saved = [
        (m, leaf, t)
        for m in model.modules()
        for leaf, t in m._buffers.items()
        if t is not None and not t.is_meta
    ]
    copies: dict[int, torch.Tensor] = {}
    for module, leaf, tensor in saved:
        module._buffers[leaf] = copies.setdefault(id(tensor), tensor.to("meta"))
    try:
        yield
    finally:
        for module, leaf, tensor in saved:
            module._buffers[leaf] = tensor


@contextlib.contextmanager
def _on_fake_device(model: nn.Module, device: torch.device, inputs: Any) -> Iterator[Any]:
    """The model's parameters, buffers and ``inputs`` as fake tensors on ``device`` (meta storage)
    inside the block: what torch.export traces a meta model with (Note [exported for the device it
    runs
    on])."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    mode = FakeTensorMode()

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        meta = tensor if tensor.is_meta else tensor.detach().to("meta")
        return mode.fake_tensor_converter.from_meta_and_device(mode, meta, device)

    state: dict[str, torch.Tensor] = {
        name: nn.Parameter(fake(p), p.requires_grad) for name, p in model.named_parameters()
    }
    state.update({name: fake(b) for name, b in model.named_buffers()})
    with _reparametrize_module(model, state, tie_weights=True):
        yield tree_map(lambda t: fake(t) if isinstance(t, torch.Tensor) else t, inputs)


def _device_arguments_to_meta(gm: fx.GraphModule) -> None:
    """Device arguments the export baked in (``arange(..., device=cpu)``) moved to meta, where the
    graph is run."""
    meta = torch.device("meta")
    # the graph and the bodies of its higher-order ops (a no_grad region)
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if (
                isinstance(node.kwargs.get("device"), torch.device)
                and node.kwargs["device"].type != "meta"
            ):
                node.update_kwarg("device", meta)
        module.recompile()


@contextlib.contextmanager
def _quiet_torch_logs():
    """Silence torch's logs and stderr: a failed torch.export prints its partial graph to stderr.

    CRITICAL, not ERROR: fake tensors log each op that fails on meta (a shape overflow, say) with
    its traceback at ERROR, through a handler holding the original stderr; the failure is reported
    as one line.
    """
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


# ---- running on meta -----------------------------------------------------------------------------


# Ops that never perform matrix products: run without the FLOP counter, whose dispatch is the
# slowest part of tracing a large model (Note [what counts as a FLOP] in model_graph.py).
_NO_FLOPS = frozenset(VIEW_OPS) | {
    "add",
    "sub",
    "mul",
    "truediv",
    "div",
    "neg",
    "pow",
    "cat",
    "stack",
    "to",
    "type",
    "float",
    "arange",
    "zeros",
    "ones",
    "full",
    "new_ones",
    "new_zeros",
    "zeros_like",
    "ones_like",
    "where",
    "masked_fill",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "and_",
    "or_",
    "__and__",
    "__or__",
    "cumsum",
    "sum",
    "mean",
    "rsqrt",
    "sqrt",
    "exp",
    "tanh",
    "sigmoid",
    "silu",
    "gelu",
    "relu",
    "softmax",
    "log_softmax",
    "dropout",
    "native_dropout",
    "embedding",
    "layer_norm",
    "rms_norm",
    "repeat_interleave",
    "_assert_tensor_metadata",
    "_assert",
    "_assert_is_none",
    "index",
    "diff",
    "cos",
    "sin",
    "swiglu",
    "bias_dropout_residual",
}


@dataclass(frozen=True)
class _MetaSpec:
    """Shape, strides and dtype of a tensor: all a meta tensor is."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def _to_meta_spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _MetaSpec(
            tuple(value.shape), tuple(value.stride()), value.dtype, value.requires_grad
        )
    return value


def _meta_device(value: Any) -> Any:
    return torch.device("meta") if isinstance(value, torch.device) else value


def _from_meta(value: Any) -> Any:
    if isinstance(value, _MetaSpec):
        meta = torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device="meta")
        # An op's output, not a leaf: a later op may write into it in place (a gated delta rule's
        # chunk loop), which autograd refuses on a leaf that requires grad.
        return meta.requires_grad_().clone() if value.requires_grad else meta
    return value


# Note [a view the run device's strides allow]
#     A program exported for the device it runs on (Note [exported for the device it runs on]) is
#     profiled on meta tensors, whose kernels may lay out an output with other strides than that
#     device's: the CPU flash attention returns (batch, seq, heads, head_dim)-strided output, its
#     meta kernel a contiguous (batch, heads, seq, head_dim) one, so Afmoe's `output.transpose(1,
#     2).view(batch, seq, -1)` runs on the CPU and is refused on meta. Only the shapes are profiled:
#     such a view is profiled as the reshape it equals in shape. A pipeline stage runs its graph's
#     views as reshapes too (PipelineSplit.stage_module): the strides the export saw are one
#     kernel's, and another may run (at a rank's head count under tp x pp, Afmoe's view failed on
#     the CPU). A reshape is the view wherever the view is possible, the same values and the same
#     aliasing; where it is not, a copy instead of an error.
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
_STRIDES = "view size is not compatible with input tensor's size and stride"


# In-place ops that give a tensor no gradient path from their inputs: requires_grad_() makes a new
# leaf of it.
_NO_GRADIENT_WRITES = {"requires_grad_", "detach_", "zero_"}


class _Profiler(fx.Interpreter):
    """Runs the graph, recording each node's output and the FLOPs it performed."""

    def __init__(self, gm: fx.GraphModule, counter: Any):
        super().__init__(gm)
        self.counter = counter
        self.outputs: dict[fx.Node, Any] = {}
        # whether the node's output required grad when it ran (or written)
        self.grad: dict[fx.Node, bool] = {}
        self.producer: dict[int, fx.Node] = {}  # id of each output tensor -> the node that gave it
        self.flops: dict[fx.Node, int] = {}
        self.cache: dict[tuple, tuple[int, Any]] = {}

    def run_node(self, n: fx.Node) -> Any:
        try:
            return self._run_node(n)
        # a shape error, say: its traceback is generated graph code; name the user's line
        except Exception as exc:
            remember_source(exc, stack_trace(n))
            raise

    def _run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "get_attr", "output"):
            out = super().run_node(n)
        else:
            key = self._key(n)
            # a repeated layer: same op on the same shapes
            if key is not None and key in self.cache:
                flops, meta = self.cache[key]
                out = tree_map(_from_meta, meta)
            else:
                flops, out = self._execute(n)
                if key is not None:
                    self.cache[key] = (flops, tree_map(_to_meta_spec, out))
            if flops:
                self.flops[n] = flops
        self.outputs[n] = out
        # Read now: a later in-place requires_grad_() would change the answer (Note [a gradient
        # path]).
        self.grad[n] = any(t.requires_grad for t in _tensors(out))
        for t in _tensors(out):
            self.producer.setdefault(id(t), n)
        if n.op != "output" and writes_in_place(target_name(n.target)):
            self._written(n)
        return out

    def _written(self, n: fx.Node) -> None:
        """A write in place into a tensor that now requires grad (``out[:, t] = state``,
        ``out.add_(y)``): the nodes giving that tensor and its base carry a gradient from here on
        (Note [a gradient path])."""
        if target_name(n.target) in _NO_GRADIENT_WRITES or not n.args:
            return
        written = self.env.get(n.args[0]) if isinstance(n.args[0], fx.Node) else None
        if not isinstance(written, torch.Tensor) or not written.requires_grad:
            return
        for tensor in (written, written._base):
            source = self.producer.get(id(tensor)) if tensor is not None else None
            if source is not None:
                self.grad[source] = True

    def call_function(self, target, args, kwargs):
        # An exported graph can hold the device it was traced on (x.to(device=cpu)): stay on meta.
        args, kwargs = tree_map(_meta_device, (args, kwargs))
        try:
            return super().call_function(target, args, kwargs)
        except RuntimeError as exc:
            # Note [a view the run device's strides allow]
            if target in _VIEWS and _STRIDES in str(exc):
                return torch.ops.aten.reshape.default(*args, **kwargs)
            raise

    def call_method(self, target, args, kwargs):
        args, kwargs = tree_map(_meta_device, (args, kwargs))
        try:
            return super().call_method(target, args, kwargs)
        except RuntimeError as exc:
            # Note [a view the run device's strides allow]
            if target == "view" and _STRIDES in str(exc):
                return super().call_method("reshape", args, kwargs)
            raise

    def _execute(self, n: fx.Node) -> tuple[int, Any]:
        if n.op == "call_function" and n.target in _DATA_DEPENDENT:
            return 0, self._expected_selection(n)
        if target_name(n.target) in _NO_FLOPS:
            return 0, super().run_node(n)
        with self.counter:  # entering clears the counter: it then holds this node's FLOPs only
            out = super().run_node(n)
        flops = self.counter.get_total_flops()
        return flops or self._uncounted_flops(n, out), out

    def _expected_selection(self, n: fx.Node) -> Any:
        """A selection whose size is the data's (Note [a size the data decides]), on meta at its
        expected size."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        condition = args[1] if n.target is torch.ops.aten.masked_select.default else args[0]
        source = n.args[1] if n.target is torch.ops.aten.masked_select.default else n.args[0]
        count = expected_selected(source, condition.numel(), self.outputs)
        meta = {"device": "meta", "dtype": torch.int64}
        if n.target is torch.ops.aten.masked_select.default:
            return torch.empty(count, dtype=args[0].dtype, device="meta")
        if n.target in (torch.ops.aten.nonzero.default, torch.ops.aten.argwhere.default):
            return torch.empty(count, condition.dim(), **meta)
        return [torch.empty(count, **meta) for _ in range(max(condition.dim(), 1))]

    def _uncounted_flops(self, n: fx.Node, out: Any) -> int:
        """FLOPs torch's counter does not know: grouped matrix products (Note [grouped matmul
        FLOPs]) and embedding bags' pooling (Note [embedding bag FLOPs]), from a leaf EmbeddingBag
        call or its ATen op."""
        name = target_name(n.target)
        module = self.fetch_attr(n.target) if n.op == "call_module" else None
        if (
            name not in GROUPED_MM
            and name not in EMBEDDING_BAG_OPS
            and not isinstance(module, nn.EmbeddingBag)
        ):
            return 0
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if name in GROUPED_MM:
            return grouped_mm_flops(*args[:2], out)
        if module is not None:  # EmbeddingBag.forward(input, offsets=None, per_sample_weights=None)
            weights = args[2] if len(args) > 2 else kwargs.get("per_sample_weights")
            return embedding_bag_flops(
                args[0] if args else kwargs.get("input"), module.embedding_dim, weights
            )
        # aten embedding_bag(weight, indices, offsets, scale_grad_by_freq, mode, sparse,
        # per_sample_weights, ...)
        weights = args[6] if len(args) > 6 else kwargs.get("per_sample_weights")
        return embedding_bag_flops(args[1], args[0].shape[-1], weights) if len(args) > 1 else 0

    def _key(self, n: fx.Node) -> tuple | None:
        """What determines a node's output shapes and FLOPs; None when it cannot be told (then no
        caching)."""
        if writes_in_place(target_name(n.target)):
            # a write changes its input: it runs each time (Note [a gradient path] reads its effect)
            return None
        if n.target in _DATA_DEPENDENT:
            return None  # its size is read from the mask's producer, not its shape alone
        if torch._C._functorch.get_dynamic_layer_stack_depth() or "_functorch" in getattr(
            n.target, "__module__", ""
        ):
            # A torch.vmap the exported graph runs (Hugging Face's masks): entering and leaving it
            # changes functorch's state, and the outputs inside are batched wrappers; each runs,
            # none is replayed.
            return None
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if n.op == "call_module":
            module = self.fetch_attr(n.target)
            settings = tuple(
                sorted(
                    (k, v)
                    for k, v in vars(module).items()
                    if isinstance(v, (int, float, str, bool, tuple))
                )
            )
            target = (
                type(module),
                settings,
                tuple((k, _to_meta_spec(v)) for k, v in module.state_dict(keep_vars=True).items()),
            )
        else:
            target = n.target
        try:
            key = (n.op, target, tree_map(_to_meta_spec, (args, kwargs)))
            hash(key)
        except TypeError:
            return None
        return key


# Note [a size the data decides]
#     Selecting the elements a mask holds (``token, slot = torch.where(chosen == e)``, the dispatch
#     of a hand-written mixture of experts; nonzero, argwhere, masked_select) gives as many as the
#     data holds: torch.export records an unbacked size (u0, bounded by the mask's size) and runs,
#     but no meta kernel can, so the profile runs such an op at the size expected of it. A mask
#     comparing top-k choices among E (routed indices, through views) with one value holds 1/E of
#     its elements: each token picks k distinct experts, every expert equally likely, as a planner
#     of expert parallelism assumes balanced routing (Megatron-Core's capacity factor 1). Any other
#     mask is taken as full: its size's bound, never less work or memory than the run's. The graph
#     the runtime cuts and runs is the exported one, which takes the data's own sizes.
_DATA_DEPENDENT = {
    torch.ops.aten.nonzero.default,
    torch.ops.aten.nonzero_numpy.default,
    torch.ops.aten.where.default,
    torch.ops.aten.argwhere.default,
    torch.ops.aten.masked_select.default,
}
_PASS_THROUGH = {"view", "reshape", "_unsafe_view", "flatten", "contiguous", "clone", "expand"}


def expected_selected(mask: Any, numel: int, outputs: Mapping[fx.Node, Any]) -> int:
    """How many of a mask's ``numel`` elements a selection is expected to give (Note [a size the
    data decides]); ``mask`` the node computing it."""
    if (
        isinstance(mask, fx.Node)
        and target_name(mask.target) == "eq"
        and len(mask.args) == 2
        and not isinstance(mask.args[1], fx.Node)
    ):
        source = mask.args[0]
        while isinstance(source, fx.Node) and target_name(source.target) in _PASS_THROUGH:
            source = source.args[0]
        if (
            isinstance(source, fx.Node)
            and source.target is operator.getitem
            and source.args[1] == 1
            and isinstance(source.args[0], fx.Node)
            and target_name(source.args[0].target) == "topk"
        ):
            topk = source.args[0]
            scores = outputs.get(topk.args[0]) if isinstance(topk.args[0], fx.Node) else None
            dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
            if isinstance(scores, torch.Tensor) and scores.dim():
                return -(-numel // scores.shape[dim])
    return numel


# Note [grouped matmul FLOPs]
#     A grouped matrix product (``torch._grouped_mm(a, b, offs)``, the op a mixture-of-experts layer
#     runs its experts with) multiplies each group of rows of ``a`` by its group's matrix of ``b``:
#     every output element is one dot product over the contracted dimension, ``a``'s last, so it
#     costs 2 * numel(out) * K, as an (M, K) x (K, N) product costs 2*M*N*K. The one exception: two
#     2-D operands group the contracted dimension itself (out is (groups, M, N), the groups' K
#     summing to ``a``'s): 2 * M * K * N in all.


def grouped_mm_flops(a: Any, b: Any, out: Any) -> int:
    """Forward FLOPs of a grouped matrix product of ``a`` and ``b`` giving ``out`` (Note [grouped
    matmul FLOPs])."""
    if not all(isinstance(t, torch.Tensor) for t in (a, b, out)):
        return 0
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out.numel() * a.shape[-1]


class _Runner(nn.Module):
    """Lets ``torch.func.functional_call`` swap the graph module's state for meta tensors."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__()
        self.gm = gm

    def forward(self, args: list[Any]) -> _Profiler:
        # Imported here: torch.utils.flop_counter pulls in triton, which `import hyparallel` must
        # not.
        from torch.utils.flop_counter import FlopCounterMode

        profiler = _Profiler(self.gm, FlopCounterMode(display=False))
        with torch.enable_grad():  # which outputs require grad is what Note [a gradient path] reads
            profiler.run(*args)
        return profiler


def _profile(program: Program) -> _Profiler:
    runner = _Runner(program.gm)
    if program.method == "export":  # state arrives as (meta) graph inputs
        return runner(program.run_args)
    # fx: the graph module shares the user's modules; run them with meta copies of their state.
    # One entry per tensor: tied weights (embedding and head) appear once, so functional_call keeps
    # them tied.
    state = itertools.chain(program.gm.named_parameters(), program.gm.named_buffers())
    meta_state = {f"gm.{k}": to_meta(v) for k, v in state}
    return torch.func.functional_call(
        runner, meta_state, (program.run_args,), tie_weights=True, strict=False
    )


# ---- grouping nodes into ops ---------------------------------------------------------------------


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def module_of(node: fx.Node) -> str:
    """The innermost module path a traced node ran in ('' for the root): its target for a
    call_module node, otherwise the last entry of its ``nn_module_stack``."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


_OUTPUT = "<output>"


@dataclass
class _State:
    """The model's parameters and buffers under canonical names (tied aliases map to the first
    name)."""

    alias: dict[str, str]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    order: dict[str, int]

    @classmethod
    def of(cls, model: nn.Module) -> _State:
        alias: dict[str, str] = {}
        tables: list[dict[str, torch.Tensor]] = [{}, {}]
        for table, named in zip(tables, (model.named_parameters, model.named_buffers)):
            first: dict[int, str] = {}
            for name, tensor in named(remove_duplicate=False):
                alias[name] = first.setdefault(id(tensor), name)
                table.setdefault(alias[name], tensor)
        params, buffers = tables
        return cls(
            alias=alias,
            params=params,
            buffers=buffers,
            order={name: i for i, name in enumerate(params)},
        )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _OpBuilder:
    """Turns a profiled fx graph into the ops and values of a ModelGraph."""

    def __init__(self, model: nn.Module, program: Program):
        self.program = program
        self.profiler = _profile(program)
        self.modules = dict(model.named_modules())
        self.state = _State.of(model)
        self.group_of: dict[fx.Node, str] = {node: node.name for node in program.user_inputs}
        self.groups: dict[str, list[fx.Node]] = {}
        self.group_module: dict[str, nn.Module | None] = {}
        self.consumers: dict[fx.Node, list[str]] = {}
        self.reads: dict[str, list[str]] = {}
        self.owned: set[str] = set()

    def build(self) -> tuple[list[Op], list[Value]]:
        """Ops in execution order (inputs first, output last) and the values passed between them."""
        self._group_nodes()
        self._dataflow()
        outputs = self.profiler.outputs
        ops = [
            Op(
                name=node.name,
                index=i,
                kind="input",
                module="",
                target="input",
                output_shapes=tuple(tuple(t.shape) for t in _tensors(outputs[node])),
                output_bytes=_bytes(outputs[node]),
            )
            for i, node in enumerate(self.program.user_inputs)
        ]
        ops += [self._make_op(key, len(ops) + i) for i, key in enumerate(self.groups)]
        ops.append(Op(name=_OUTPUT, index=len(ops), kind="output", module="", target="output"))
        self.loss_inputs = self._loss_inputs()
        values = []
        for source, readers in self.consumers.items():
            tensors = _tensors(outputs[source])
            values.append(
                Value(
                    name=source.name,
                    producer=self.group_of[source],
                    consumers=tuple(readers),
                    shape=tuple(tensors[0].shape) if len(tensors) == 1 else (),
                    bytes=_bytes(outputs[source]),
                )
            )
        return ops, values

    def _loss_inputs(self) -> tuple[str, ...]:
        """The ops giving the output's ``logits`` (what the default loss reads); () when it has
        none."""
        node = next(n for n in self.program.gm.graph.nodes if n.op == "output")
        value = self.profiler.outputs.get(node)
        if self.program.method == "export" and isinstance(value, (tuple, list)):
            try:
                value = tree_unflatten(list(value), self.program.artifact.call_spec.out_spec)
            except Exception:  # noqa: BLE001 -- an output the spec does not rebuild: every output counts
                return ()
        logits = logits_of(value)
        if not isinstance(logits, torch.Tensor):
            return ()
        found = [n for n in node.all_input_nodes if self.profiler.outputs.get(n) is logits]
        return tuple(dict.fromkeys(self.group_of[n] for n in found if n in self.group_of))

    def _group_nodes(self) -> None:
        """Assign every live compute node to an op: its own, its leaf module call's, or its tuple
        source's."""
        program, outputs = self.program, self.profiler.outputs
        live = _live_nodes(list(program.gm.graph.nodes), outputs, program)
        used_names = set(self.group_of.values()) | {_OUTPUT}
        # (leaf module path, op name) of the last exported leaf call
        previous: tuple[str, str] | None = None
        ran = {
            path
            for n in program.gm.graph.nodes
            for path, _ in (n.meta.get("nn_module_stack") or {}).values()
        }

        # no children, or a torch.nn layer none of whose children's forward ran
        def is_leaf(path: str) -> bool:
            # (Note [torch's own layers ...])
            module, prefix = self.modules.get(path), f"{path}." if path else ""
            if module is None or next(module.children(), None) is None:
                return module is not None
            own = type(module).__module__.startswith("torch.nn.")
            return own and not any(prefix + c in ran for c, _ in module.named_children())

        for node in program.gm.graph.nodes:
            if node not in live or node in program.state_of or node.op in ("output", "placeholder"):
                continue
            source = (
                node.args[0]
                if node.op == "call_function" and node.target is operator.getitem
                else None
            )
            if source in self.groups.get(self.group_of.get(source), ()) and isinstance(
                outputs[source], (tuple, list)
            ):
                key = self.group_of[source]  # unpacking a multi-output op stays part of that op
            else:
                owner = module_of(node)
                leaf = (
                    owner
                    if node.op == "call_module" or (program.method == "export" and is_leaf(owner))
                    else None
                )
                if (
                    leaf is not None
                    and node.op != "call_module"
                    and previous
                    and previous[0] == leaf
                ):
                    key = previous[1]  # the next ATen op of the same leaf module call
                else:
                    key = _unique(leaf if leaf is not None else node.name, used_names)
                    self.groups[key] = []
                    self.group_module[key] = self.modules[leaf] if leaf is not None else None
                previous = (leaf, key) if leaf is not None else None
            self.group_of[node] = key
            self.groups[key].append(node)

    def _dataflow(self) -> None:
        """Which ops read each node's output, and which state (parameters, buffers) each op
        reads."""
        state_of = self.program.state_of
        for key, members in self.groups.items():
            reads = self.reads.setdefault(key, [])
            for node in members:
                if node.op == "call_module":
                    module, prefix = self.modules[node.target], f"{node.target}."
                    reads.extend(
                        prefix + n for n, _ in module.named_parameters(remove_duplicate=False)
                    )
                    reads.extend(
                        prefix + n for n, _ in module.named_buffers(remove_duplicate=False)
                    )
                for source in node.all_input_nodes:
                    if source in state_of:
                        reads.append(state_of[source])
                    elif self.group_of.get(
                        source, key
                    ) != key and key not in self.consumers.setdefault(source, []):
                        self.consumers[source].append(key)
        output_node = next(n for n in self.program.gm.graph.nodes if n.op == "output")
        for source in output_node.all_input_nodes:
            if source in self.group_of:
                self.consumers.setdefault(source, []).append(_OUTPUT)

    def _make_op(self, key: str, index: int) -> Op:
        """Summarise one group of fx nodes as an Op (kind, parameters owned, FLOPs, shapes,
        bytes)."""
        members, module, outputs, state = (
            self.groups[key],
            self.group_module[key],
            self.profiler.outputs,
            self.state,
        )
        read = list(dict.fromkeys(state.alias.get(r, r) for r in self.reads[key]))
        # the model's own order
        params = sorted((r for r in read if r in state.params), key=state.order.__getitem__)
        new = [p for p in params if p not in self.owned]
        self.owned.update(new)
        head = members[0]
        inner: tuple[str, ...] = ()
        if module is not None:
            target = type(module).__name__
            inner = (
                () if head.op == "call_module" else tuple(target_name(n.target) for n in members)
            )
            kind = module_kind(module, list(inner) or None)
        else:
            target = target_name(head.target)
            kind = function_kind(target)
            if kind == "matmul" and params and not target.startswith("conv"):
                # F.linear / matmul against a parameter (a convolution mixes positions: not one)
                kind = "linear"
        inputs = dict.fromkeys(
            s for n in members for s in n.all_input_nodes if self.group_of.get(s, key) != key
        )
        leaving = [n for n in members if n in self.consumers] or [members[-1]]
        exits = [outputs[n] for n in leaving]  # what leaves the op
        return Op(
            name=key,
            index=index,
            kind=kind,
            module=module_of(head),
            target=target,
            params=tuple(params),
            param_count=sum(state.params[p].numel() for p in new),
            param_shapes=tuple(tuple(state.params[p].shape) for p in new),
            param_bytes=sum(_nbytes(state.params[p]) for p in new),
            buffer_bytes=sum(_nbytes(state.buffers[b]) for b in read if b in state.buffers),
            flops=sum(self.profiler.flops.get(n, 0) for n in members),
            input_shapes=tuple(tuple(t.shape) for s in inputs for t in _tensors(outputs[s])),
            output_shapes=tuple(tuple(t.shape) for t in _tensors(exits)),
            output_bytes=_bytes(exits),
            base_forward=base_forward(module) if module is not None else "",
            inner=inner,
            grad=any(self.profiler.grad.get(n, True) for n in leaving),
            variant=_variant(module, members),
        )


def _variant(module: nn.Module | None, members: list[fx.Node]) -> str:
    """GELU's approximation ("tanh"), from the module or the call's keyword; "" for the exact form
    and others."""
    approximate = getattr(module, "approximate", None) if module is not None else None
    for node in members if approximate is None else ():
        approximate = node.kwargs.get("approximate", approximate)
    return approximate if isinstance(approximate, str) and approximate != "none" else ""


def _build(model: nn.Module, program: Program, name: str) -> ModelGraph:
    # models import this package's users; keep the import one-way at load
    from hyparallel.models import fingerprint

    builder = _OpBuilder(model, program)
    ops, values = builder.build()
    return ModelGraph(
        name=name,
        method=program.method,
        ops=tuple(ops),
        values=tuple(values),
        blocks=_find_blocks(model, ops),
        fingerprint=fingerprint(model),
        program=program.artifact,
        modules=tuple(path for path, _ in model.named_modules() if path),
        ties=tied_names(model),
        traced=program,
        loss_inputs=builder.loss_inputs,
        custom_backwards=program.custom_backwards,
    )


def tied_names(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """Groups of parameter names that share one tensor (tied weights), in ``named_parameters``
    order."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def _unique(base: str, used: set[str]) -> str:
    """``base``, or ``base#k`` with the smallest k not yet used; records the result in ``used``."""
    name, k = base, 1
    while name in used:
        name, k = f"{base}#{k}", k + 1
    used.add(name)
    return name


def _live_nodes(
    nodes: list[fx.Node], outputs: dict[fx.Node, Any], program: Program
) -> set[fx.Node]:
    """Nodes that produce a tensor or feed one that does; drops asserts and other dead checks."""
    live: set[fx.Node] = set()
    for node in reversed(nodes):
        keep = (
            node.op in ("output", "placeholder")
            or node in program.state_of
            or _tensors(outputs.get(node))
        )
        if keep or any(user in live for user in node.users):
            live.add(node)
    return live


def _find_blocks(model: nn.Module, ops: list[Op]) -> tuple[Block, ...]:
    """Children of ModuleList/Sequential/ModuleDict containers that have children and share one
    structure (a
    ModuleDict: torchtitan keeps its layers in one, by their indices as strings)."""
    candidates: list[str] = []
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        children = [(f"{path}.{n}" if path else n, c) for n, c in container.named_children()]
        by_shape: dict[tuple, list[str]] = {}
        for child_path, child in children:
            if next(child.children(), None) is None:
                continue
            shape = (
                type(child).__name__,
                tuple((n, tuple(p.shape)) for n, p in child.named_parameters()),
            )
            by_shape.setdefault(shape, []).append(child_path)
        for paths in by_shape.values():
            if len(paths) >= 2:
                candidates.extend(paths)
    blocks = []
    modules = dict(model.named_modules())
    # a ModuleList of repeated layers that is itself repeated (Funnel's blocks of layers):
    for path in candidates:
        # its layers are the blocks; counting both would count their work twice
        if type(modules[path]).forward is nn.Module.forward and any(
            c.startswith(path + ".") for c in candidates
        ):
            continue
        # Repeated modules inside a block that runs them itself (a layer's ModuleList of experts)
        # are parts of that block, not blocks: a pipeline cuts between layers, never between one
        # layer's experts.
        if any(
            path.startswith(c + ".") and type(modules[c]).forward is not nn.Module.forward
            for c in candidates
        ):
            continue
        members = [
            op
            for op in ops
            if op.module == path or op.module.startswith(path + ".") or op.name == path
        ]
        if members:
            blocks.append(
                Block(
                    path=path,
                    ops=tuple(op.name for op in members),
                    flops=sum(op.flops for op in members),
                    param_count=sum(op.param_count for op in members),
                    param_bytes=sum(op.param_bytes for op in members),
                    activation_bytes=sum(op.output_bytes for op in members),
                )
            )
    index = {op.name: op.index for op in ops}
    return tuple(sorted(blocks, key=lambda b: index[b.ops[0]]))
