"""Module calls a trace keeps whole (Note [a module call a trace keeps]).

class Split(nn.Module):                  # a module whose eager call must run as written
    def __call__(self, *args, **kwargs):
        if tracing():
            return traced_call(self.path, args, kwargs, lambda: (shape, dtype))
        return super().__call__(*args, **kwargs)

graph = torch.export.export(model, ...).graph_module.graph
restore_module_calls(graph)              # each stand-in is `call_module path` again
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

# Note [a module call a trace keeps]
#     A pipeline stage runs a graph traced from the model (hyparallel.pipeline.split), in which
#     torch.export and torch.fx record the ops a module's forward ran, not the call. A module whose
#     call must run as written cannot be recorded so: expert parallelism's experts (Note [expert
#     parallelism], hyparallel.runtime.experts) exchange rows with all_to_all_single in sizes the
#     data decides, read the counts back to the host and compute under their own gradient
#     scalings; a trace has none of that. While a graph is traced (torch.export, or torch.fx's
#     symbolic tracing; not torch.compile, which runs the call), such a module's __call__ stands in
#     the graph as one opaque op, ``hyparallel::module_call``, whose fake kernel gives the output's
#     shape and dtype and whose arguments are the call's tensors; the call's structure and its other
#     arguments wait in a table under a key the op carries. ``restore_module_calls`` then puts a
#     ``call_module`` node of the module's path in its place, with the call's arguments as they
#     were: the stage runs the module itself, eagerly, its hooks and its autograd included. The
#     stand-in replaces the whole __call__, so hooks on the module (tensor parallelism's region
#     entry) are not also recorded in the graph: they run once, at the stage's call.

_TENSOR = object()  # the place of a tensor among a call's flattened arguments
# key -> (module path, how the arguments flatten, the non-tensor leaves with _TENSOR for tensors)
_CALLS: dict[str, tuple[str, TreeSpec, tuple[Any, ...]]] = {}
_NUMBER = itertools.count()


@torch.library.custom_op("hyparallel::module_call", mutates_args=())
def module_call(
    tensors: list[torch.Tensor], call: str, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """The stand-in of a module call in a traced graph (Note [a module call a trace keeps]); never
    run: the graph gets the call back first."""
    path = _CALLS[call][0] if call in _CALLS else call
    raise RuntimeError(
        f"the call of {path} in a traced graph was not put back (hyparallel.graph.opaque."
        "restore_module_calls); a graph with it cannot run"
    )


@module_call.register_fake
def _(tensors: list[torch.Tensor], call: str, shape: Sequence[int], dtype: torch.dtype):
    return tensors[0].new_empty(shape, dtype=dtype)


def symbolic_tracing() -> bool:
    """Whether torch.fx is tracing symbolically (Proxies, not tensors, flow through the code)."""
    trace = torch.fx._symbolic_trace
    if hasattr(trace, "is_fx_symbolic_tracing"):
        return bool(trace.is_fx_symbolic_tracing())
    return bool(trace._is_fx_tracing_flag)


def tracing() -> bool:
    """Whether a graph is being traced that would record a module call's ops instead of the call
    (torch.export, torch.fx symbolic tracing; not torch.compile)."""
    exporting = getattr(torch.compiler, "is_exporting", lambda: False)()
    return bool(symbolic_tracing() or exporting)


def traced_call(
    path: str,
    args: tuple,
    kwargs: dict,
    output: Callable[[], tuple[Sequence[Any], torch.dtype]],
) -> Any:
    """The stand-in of the call ``module(*args, **kwargs)`` of the module at ``path`` (from the
    traced model's root), whose output is one tensor: ``output()`` gives its shape and dtype; see
    Note [a module call a trace keeps]."""
    flat, spec = tree_flatten((args, kwargs))
    proxy = next((v for v in flat if isinstance(v, fx.Proxy)), None)
    if proxy is not None:  # torch.fx: the call as fx records a leaf module's
        return proxy.tracer.create_proxy("call_module", path, args, kwargs)
    tensors = [v for v in flat if isinstance(v, torch.Tensor)]
    if not tensors:
        raise ValueError(f"{path} was called with no tensor; a kept call needs one")
    leaves = tuple(_TENSOR if isinstance(v, torch.Tensor) else v for v in flat)
    key = f"{path}#{next(_NUMBER)}"
    _CALLS[key] = (path, spec, leaves)
    shape, dtype = output()
    return torch.ops.hyparallel.module_call(tensors, key, list(shape), dtype)


def restore_module_calls(graph: fx.Graph) -> int:
    """Put a ``call_module`` of the module's path in place of every stand-in in ``graph``; returns
    how many (Note [a module call a trace keeps])."""
    op = torch.ops.hyparallel.module_call
    restored = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (op, op.default):
            continue
        tensors, key = node.args[0], node.args[1]
        path, spec, leaves = _CALLS.pop(key)
        given = iter(tensors)
        flat = [next(given) if leaf is _TENSOR else leaf for leaf in leaves]
        args, kwargs = tree_unflatten(flat, spec)
        with graph.inserting_before(node):  # create_node: the traced module may not hold it
            call = graph.create_node("call_module", path, tuple(args), dict(kwargs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        restored += 1
    return restored
