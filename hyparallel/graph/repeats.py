"""A dry run on meta that runs each distinct repeated block once: ``repeated_blocks_once(model)``.

Used by ``first_failure`` (the tensor-parallel dry runs of hyparallel.graph.local_shapes); nothing
here touches torch.distributed.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

# Note [a repeated block runs once on meta]
#     The dry runs of Note [one rank's sizes, run on meta] run the model's own forward eagerly on
#     meta tensors, a few times per `hyparallel plan` (the unsplit model, then one rank's sizes
#     under each tp degree), and torch runs each meta op through its Python reference
#     implementation: GPT-3 175B's 96 layers took about 0.8 s of CPU a run, most of the command. On
#     meta an op's outputs are a function of its inputs' shapes, dtypes and strides and of the
#     module's own state, so a block of a ModuleList (or Sequential) called with the same input
#     shapes as an equal block before it gives outputs of the same shapes: the repeat returns fresh
#     meta tensors of those shapes instead of running again. "Equal" is checked, never assumed: the
#     same classes module for module, parameters and buffers of the same shapes, dtypes and strides,
#     all on meta, the same plain attribute values (numbers, strings, dtypes, functions by identity;
#     a layer index differs, and then the block runs), and no hook of its own (a hook could size
#     something per layer). Anything else (an attribute holding an object, a real tensor among the
#     inputs or parameters, an output that is neither a meta tensor nor a plain value, a hook
#     anywhere in the process) runs the block as before. A block that fails raises as before: only a
#     block that ran is ever skipped.

_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}
_PLAIN = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType)
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class _Unkeyable(Exception):
    """A value a block's key cannot hold: the block runs."""


@contextlib.contextmanager
def repeated_blocks_once(model: nn.Module) -> Iterator[None]:
    """Within it, an eager run of ``model`` on meta runs each distinct block of its ModuleLists and
    Sequentials once per input shapes; an equal block called the same way gets fresh meta outputs of
    the same shapes (Note [a repeated block runs once on meta]). Enter it before registering hooks
    of your own on ``model``."""
    if any(getattr(nn.modules.module, name, None) for name in _GLOBAL_HOOKS):
        yield
        return
    outputs: dict[Any, tuple[pytree.TreeSpec, list]] = {}
    patched: dict[int, nn.Module] = {}
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        for block in container.children():
            if "forward" in block.__dict__ or id(block) in patched or _hooked(block):
                continue
            block.forward = _once(block, block.forward, outputs)
            patched[id(block)] = block
    try:
        yield
    finally:
        for block in patched.values():
            del block.__dict__["forward"]


def _hooked(block: nn.Module) -> bool:
    return any(getattr(module, name, None) for module in block.modules() for name in _HOOKS)


def _once(block: nn.Module, forward: Callable, outputs: dict) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            key = (_state_key(block), _inputs_key(args, kwargs))
            hash(key)
        except (_Unkeyable, TypeError):
            return forward(*args, **kwargs)
        if key in outputs:
            spec, leaves = outputs[key]
            return pytree.tree_unflatten([_fresh(leaf) for leaf in leaves], spec)
        result = forward(*args, **kwargs)
        leaves, spec = pytree.tree_flatten(result)
        try:
            outputs[key] = (spec, [_output_leaf(leaf) for leaf in leaves])
        except _Unkeyable:
            pass  # an output the repeat could not rebuild: equal blocks keep running
        return result

    run._runs_once = True
    return run


def _state_key(block: nn.Module) -> tuple:
    """Everything of ``block`` its forward can read on meta: classes, attributes, parameter and
    buffer shapes."""
    key: list = []
    for path, module in block.named_modules(remove_duplicate=False):
        attributes = tuple(
            (name, _plain(value))
            for name, value in module.__dict__.items()
            # our own forward
            if name not in _MODULE_INTERNALS and not getattr(value, "_runs_once", False)
        )
        tensors = tuple(
            (kind, name, _tensor_key(tensor))
            for kind, named in (("p", module._parameters), ("b", module._buffers))
            for name, tensor in named.items()
        )
        key.append((path, type(module), attributes, tensors))
    return tuple(key)


def _inputs_key(args: tuple, kwargs: dict) -> tuple:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return spec, tuple(
        _tensor_key(leaf) if isinstance(leaf, torch.Tensor) else _plain(leaf) for leaf in leaves
    )


def _tensor_key(tensor: torch.Tensor | None) -> tuple | None:
    if tensor is None:
        return None
    if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
        raise _Unkeyable  # a real tensor's values may size what follows
    shape, stride, offset = tuple(tensor.shape), tensor.stride(), tensor.storage_offset()
    return type(tensor), shape, stride, offset, tensor.dtype, tensor.requires_grad


def _plain(value: Any) -> Any:
    if isinstance(value, _PLAIN) or isinstance(value, _FUNCTIONS):
        return (type(value), value)
    if isinstance(value, (tuple, list, frozenset, set)):
        return type(value), tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return dict, tuple((_plain(k), _plain(v)) for k, v in value.items())
    raise _Unkeyable


def _output_leaf(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        if type(leaf) is not torch.Tensor or not leaf.is_meta or leaf.requires_grad:
            raise _Unkeyable
        return _MetaOutput((tuple(leaf.shape), leaf.stride(), leaf.dtype))
    _plain(leaf)
    return leaf


class _MetaOutput(tuple):
    """(shape, stride, dtype) of a meta tensor a block returned."""


def _fresh(leaf: Any) -> Any:
    if isinstance(leaf, _MetaOutput):
        shape, stride, dtype = leaf
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return leaf
