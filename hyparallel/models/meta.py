"""Build a model with its parameters on the meta device and its buffers real (``empty_init``)."""

# Note [parameters on meta, buffers real]
#     Buffers are computed in ``__init__`` (an embedding scale, rotary tables, ALiBi slopes, a causal mask),
#     often on modules that also hold parameters, and nothing after construction knows how to compute them
#     again: a buffer built on meta is lost. Parameters are the opposite: large, and initialised afterwards
#     (hyparallel.tensor.init). So the meta build keeps every buffer real on the CPU (they are small) and puts
#     only parameters on meta, as accelerate's ``init_empty_weights(include_buffers=False)`` does:
#     - ``torch.empty`` / ``torch.empty_strided`` without a device allocate on meta, so no parameter ever
#       holds real memory (``nn.Linear`` and its kind allocate their weights with ``torch.empty``);
#     - every parameter registered moves to meta (one made with ``torch.ones``, say);
#     - a buffer registered from an uninitialised ``torch.empty`` (now meta) gets a real CPU tensor instead,
#       for ``__init__`` to fill in place (``self.cos.copy_(...)``); one that ``__init__`` never writes (its
#       version counter unchanged) goes back to meta: it holds no value, and ``materialize_`` recomputes or
#       refuses it.

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

T = TypeVar("T")

_UNINITIALISED = {torch.empty, torch.empty_strided}


class _EmptyOnMeta(TorchFunctionMode):
    """``torch.empty`` and ``torch.empty_strided`` without a device allocate on meta."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _UNINITIALISED and kwargs.get("device") is None:
            kwargs["device"] = torch.device("meta")
        return func(*args, **kwargs)


@contextmanager
def empty_init() -> Iterator[None]:
    """Within it, modules built get their parameters on meta and their buffers real (on the CPU).

    See Note [parameters on meta, buffers real]. ``hp.models.build``, ``load`` and ``build_hf`` use it for
    ``device="meta"``; use it to build your own model the same way before ``hp.parallelize``.
    """
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer
    pending: list[tuple[nn.Module, str, torch.Tensor]] = []  # buffers given real memory: were they written?

    def parameter_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register_parameter(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = _on_meta(param)

    def buffer_real(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        if tensor is not None and tensor.is_meta:
            tensor = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
            pending.append((module, name, tensor))
        register_buffer(module, name, tensor, persistent)

    nn.Module.register_parameter, nn.Module.register_buffer = parameter_on_meta, buffer_real
    try:
        with _EmptyOnMeta():
            yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer
    for module, name, tensor in pending:
        if module._buffers.get(name) is tensor and tensor._version == 0:  # never written: no value to keep
            module._buffers[name] = tensor.to("meta")


def build_on(device: torch.device | str, factory: Callable[[], T]) -> T:
    """``factory()`` with its tensors on ``device``; for meta, under :func:`empty_init`, and any parameter it
    left real (set past ``register_parameter``) moves to meta too, tied ones staying one tensor."""
    if torch.device(device).type != "meta":
        with torch.device(device):
            return factory()
    with empty_init():
        model = factory()
    if isinstance(model, nn.Module):
        _parameters_to_meta(model)
    return model


def _parameters_to_meta(model: nn.Module) -> None:
    moved: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and not param.is_meta:
                module._parameters[name] = moved.setdefault(id(param), _on_meta(param))


def _on_meta(param: nn.Parameter) -> Any:
    """The same parameter (class, requires_grad and attributes) on the meta device."""
    cls = type(param) if isinstance(param, nn.Parameter) else nn.Parameter
    try:
        moved = cls(param.detach().to("meta"), requires_grad=param.requires_grad)
    except TypeError:  # a Parameter subclass constructed differently: a plain Parameter keeps the tensor's role
        moved = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
    moved.__dict__.update(param.__dict__)
    return moved
