"""Build a model with its parameters on the meta device and its buffers real (``empty_init``)."""

# Note [parameters on meta, buffers real]
#     Buffers are computed in ``__init__`` (an embedding scale, rotary tables, ALiBi slopes, a
#     causal mask), often on modules that also hold parameters, and nothing after construction knows
#     how to compute them again: a buffer built on meta is lost. Parameters are the opposite: large,
#     and initialised afterwards (hyparallel.tensor.init). So the meta build keeps every buffer real
#     on the CPU (they are small) and puts only parameters on meta, as accelerate's
#     ``init_empty_weights(include_buffers=False)`` does:
#     - ``torch.empty`` / ``torch.empty_strided`` without a device allocate on meta, so no parameter
#       ever holds real memory (``nn.Linear`` and its kind allocate their weights with
#       ``torch.empty``);
#     - every parameter registered moves to meta (one made with ``torch.ones``, say);
#     - a buffer registered from an uninitialised ``torch.empty`` (now meta) gets a real CPU tensor
#       instead, for ``__init__`` to fill in place (``self.cos.copy_(...)``); one that ``__init__``
#       never writes (its version counter unchanged) goes back to meta: it holds no value, and
#       ``materialize_`` recomputes or refuses it.
# Note [no values written into meta parameters]
#     A meta tensor holds no values, so initialising one (``nn.init.normal_``,
#     ``weight.data.zero_()``) changes nothing but its version counter; yet torch runs each such
#     write on meta through its Python reference implementation, and the first one imports
#     torch._dynamo: GPT-3 175B's 389 initialisations took 0.4 s of the 0.55 s its build took, and
#     the import 1.6 s more (every meta op imports it in torch >= 2.7, so the trace pays that import
#     later anyway). Within ``empty_init`` a write of values into a floating-point meta tensor (the
#     initialisers of ``torch.nn.init``, and the value-filling Tensor methods with plain-number
#     arguments) returns the tensor as it is. Buffers are real there, and written as before; so is
#     any tensor not on meta. What is given up: an initialiser's own argument checks (a negative
#     std, ``kaiming_uniform_`` on a 1-D tensor) are not made on meta; they are when the model is
#     materialised.

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

T = TypeVar("T")

_UNINITIALISED = {torch.empty, torch.empty_strided}
# Note [no values written into meta parameters]: torch.nn.init's in-place initialisers (those
# reaching a mode call no Tensor method under it) and the Tensor methods that only fill in values.
_INITIALISERS = {
    getattr(nn.init, name)
    for name in dir(nn.init)
    if name.endswith("_") and not name.startswith("_")
}
_VALUE_WRITES = {
    getattr(torch.Tensor, name)
    for name in (
        "normal_",
        "uniform_",
        "zero_",
        "fill_",
        "random_",
        "bernoulli_",
        "exponential_",
        "cauchy_",
        "log_normal_",
        "geometric_",
    )
}


class _EmptyOnMeta(TorchFunctionMode):
    """``torch.empty`` and ``torch.empty_strided`` without a device allocate on meta."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _UNINITIALISED and kwargs.get("device") is None:
            kwargs["device"] = torch.device("meta")
        elif func in _INITIALISERS or func in _VALUE_WRITES:
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if _holds_no_values(target) and not any(
                isinstance(a, torch.Tensor)
                for a in (*args[1:], *kwargs.values())
                if a is not target
            ):
                return target  # Note [no values written into meta parameters]
        return func(*args, **kwargs)


def _holds_no_values(tensor: Any) -> bool:
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.is_meta
        and (tensor.is_floating_point() or tensor.is_complex())
    )


@contextmanager
def empty_init() -> Iterator[None]:
    """Within it, modules built get their parameters on meta and their buffers real (on the CPU).

    See Note [parameters on meta, buffers real]. ``hp.models.build``, ``load`` and ``build_hf`` use
    it for ``device="meta"``; use it to build your own model the same way before ``hp.parallelize``.
    """
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer
    # buffers given real memory: were they written?
    pending: list[tuple[nn.Module, str, torch.Tensor]] = []

    def parameter_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register_parameter(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = _on_meta(param)

    def buffer_real(
        module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        if tensor is not None and tensor.is_meta:
            tensor = torch.empty_strided(
                tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu"
            )
            pending.append((module, name, tensor))
        register_buffer(module, name, tensor, persistent)

    nn.Module.register_parameter, nn.Module.register_buffer = parameter_on_meta, buffer_real
    try:
        with _EmptyOnMeta():
            yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = (
            register_parameter,
            register_buffer,
        )
    for module, name, tensor in pending:
        # never written: no value to keep
        if module._buffers.get(name) is tensor and tensor._version == 0:
            module._buffers[name] = tensor.to("meta")


def build_on(device: torch.device | str, factory: Callable[[], T]) -> T:
    """``factory()`` with its tensors on ``device``; for meta, under :func:`empty_init`, and any
    parameter it left real (set past ``register_parameter``) moves to meta too, tied ones staying
    one tensor."""
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
    # a Parameter subclass constructed differently: a plain Parameter keeps the tensor's role
    except TypeError:
        moved = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
    moved.__dict__.update(param.__dict__)
    return moved
