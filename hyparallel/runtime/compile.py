"""torch.compile as a plan asks for it (``parallel.compile``): ``apply_compile(modules, backend)``.

``parallelize`` compiles the forward of each repeated block when pp = 1 (the whole model when it has
none) and of each pipeline stage's graph when pp > 1: the regions recomputation wraps, after it, so
that a recomputed region is compiled with its checkpoint (torch.compile traces
``torch.utils.checkpoint`` as one higher-order op), and before data parallelism. See Note [what
compiling changes].

Note [what compiling changes]
    As for recomputation, the module's ``forward`` is replaced, not its ``__call__``: hooks on it
    (sequence parallelism's scatter and gather, FSDP2's gathers) run eagerly around the compiled
    region, and parameter names stay the model's. torchtitan registers ``torch.compile(block)`` in
    the block's place instead; that wrapper names every parameter under it ``..._orig_mod...``, and
    hyparallel's checkpoints key tensors by name. Tensor-parallel collectives are a custom op under
    a tracer (Note [collectives in traced graphs] in hyparallel/tensor/collectives.py), so a
    compiled block keeps them in its graph, each with its mirror backward. Identical blocks share
    one compiled graph (dynamo caches by code; each block's parameters are the graph's inputs), so a
    96-layer model compiles one block. The micro-batch shape is fixed by the plan: compiled with
    ``dynamic=False``. Numerics: ``aot_eager`` runs the same ATen ops as eager mode (the parity test
    compares them at fp32, rtol 1e-5); ``inductor`` fuses them into its own kernels, which round
    differently (as torch.compile does anywhere). The planner's costs do not model compilation
    (neither its speed-up nor its compile time).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import nn

from hyparallel.spec.errors import ConfigError

BACKEND_ENV = "HYPARALLEL_COMPILE_BACKEND"
DEFAULT_BACKEND = "inductor"

__all__ = [
    "BACKEND_ENV",
    "DEFAULT_BACKEND",
    "apply_compile",
    "compile_backend",
    "compile_backend_of",
]


def compile_backend_of(enabled: bool, backend: str | None = None) -> str | None:
    """The backend a plan with ``parallel.compile`` = ``enabled`` compiles with (None: it does not
    compile)."""
    return compile_backend(backend) if enabled else None


def compile_backend(backend: str | None = None) -> str:
    """The torch.compile backend to use: ``backend``, else ``$HYPARALLEL_COMPILE_BACKEND``, else
    inductor.

    The backends are torch's registry (``torch._dynamo.list_backends``, plus any a user registered),
    an open set, so the name is checked against it here rather than typed as a Literal; an unknown
    one is one ConfigError line.
    """
    name = backend if backend is not None else os.environ.get(BACKEND_ENV) or DEFAULT_BACKEND
    where = (
        "compile_backend"
        if backend is not None
        else (BACKEND_ENV if os.environ.get(BACKEND_ENV) else "default")
    )
    from torch._dynamo import list_backends

    if name not in list_backends(exclude_tags=()):  # every registered one, a user's own included
        raise ConfigError(
            f"{where}: torch.compile has no backend {name!r}; use one of"
            f" {', '.join(list_backends())} (inductor needs a C++ compiler on the CPU, triton on a"
            " GPU), or aot_eager (eager's ATen ops, any CPU)"
        )
    return name


def apply_compile(modules: Iterable[nn.Module], backend: str) -> None:
    """torch.compile each of ``modules``' forward with ``backend``; see Note [what compiling
    changes]."""
    for module in modules:
        module.forward = torch.compile(module.forward, backend=backend, dynamic=False)
