"""Tensor-parallel collectives as autograd functions, each the mirror of its backward.

    copy_to_tp      forward: identity          backward: all-reduce
    reduce_from_tp  forward: all-reduce        backward: identity
    scatter_to_tp   forward: keep own chunk    backward: all-gather
    gather_from_tp  forward: all-gather        backward: keep own chunk
    all_gather_seq  forward: all-gather        backward: reduce-scatter   (sequence parallelism)
    reduce_scatter_seq forward: reduce-scatter backward: all-gather       (sequence parallelism)

The group is always passed in (Megatron-LM's mappings.py idiom, without its global state), and each
is a no-op for a group of one. Gloo has no reduce-scatter: there it is an all-reduce followed by
keeping the own chunk (same result, twice the traffic; gloo is for CPU tests).

Eagerly they are autograd Functions. Under a tracer (torch.fx, torch.export, torch.compile) they are
one custom op, ``hyparallel::tp_collective(x, kind, dim, group_name)``, whose backward is the same
op with the mirror kind: the op stays opaque in the traced graph, keeps its backward, and runs the
same collectives when a pipeline stage executes that graph (see Note [collectives in traced
graphs]).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from hyparallel.graph.opaque import symbolic_tracing


def _size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _own_chunk(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    size = _size(group)
    if x.size(dim) % size:
        raise ValueError(
            f"dimension {dim} of size {x.size(dim)} does not split over {size} tensor-parallel"
            " ranks"
        )
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    if dist.get_backend(group) == "gloo":
        return _own_chunk(_all_reduce(x, group), dim, group)
    size = _size(group)
    parts = [p.contiguous() for p in x.chunk(size, dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


def _identity(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    return x


def _pair(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd Function running ``forward(x, dim, group)`` and, on the gradient, its mirror
    ``backward``."""

    def forward_(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return forward(x, dim, group)

    def backward_(ctx, grad):
        return backward(grad, ctx.dim, ctx.group), None, None

    return type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward_), "backward": staticmethod(backward_)},
    )


def _reduce(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    return _all_reduce(x, group)


_CopyToTP = _pair("_CopyToTP", _identity, _reduce)
_ReduceFromTP = _pair("_ReduceFromTP", _reduce, _identity)
_ScatterToTP = _pair("_ScatterToTP", _own_chunk, _all_gather)
_GatherFromTP = _pair("_GatherFromTP", _all_gather, _own_chunk)
_AllGatherSeq = _pair("_AllGatherSeq", _all_gather, _reduce_scatter)
_ReduceScatterSeq = _pair("_ReduceScatterSeq", _reduce_scatter, _all_gather)
_AllReduceSum = _pair("_AllReduceSum", _reduce, _reduce)

# Note [collectives in traced graphs]
# A pipeline stage runs a graph traced from the (tensor-parallel) model. An autograd Function cannot
# be traced as itself: fx would call it on proxies, export would inline its forward and drop its
# backward. So while tracing, each collective is the custom op below, named by kind, with the group
# passed by name (a ProcessGroup cannot sit in a graph). Its fake kernel gives the output shape; its
# backward is the same op with the mirror kind. A custom op may not return its input, so the
# identity and own-chunk forwards copy: that cost is paid only in traced graphs.
_KINDS = {  # kind -> (forward, the kind its backward runs)
    "copy": (_identity, "reduce"),
    "reduce": (_reduce, "copy"),
    "scatter": (_own_chunk, "gather"),
    "gather": (_all_gather, "scatter"),
    "all_gather_seq": (_all_gather, "reduce_scatter_seq"),
    "reduce_scatter_seq": (_reduce_scatter, "all_gather_seq"),
    "all_reduce_sum": (_reduce, "all_reduce_sum"),
}


def _group_named(name: str) -> ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


@torch.library.custom_op("hyparallel::tp_collective", mutates_args=())
def tp_collective(x: torch.Tensor, kind: str, dim: int, group_name: str) -> torch.Tensor:
    """One tensor-parallel collective by kind (the traced form of the functions below)."""
    out = _KINDS[kind][0](x, dim, _group_named(group_name))
    return out.clone() if out.data_ptr() == x.data_ptr() else out


@tp_collective.register_fake
def _(x: torch.Tensor, kind: str, dim: int, group_name: str) -> torch.Tensor:
    size = _size(_group_named(group_name))
    shape = list(x.shape)
    if kind in ("gather", "all_gather_seq"):
        shape[dim] *= size
    elif kind in ("scatter", "reduce_scatter_seq"):
        shape[dim] //= size
    return x.new_empty(shape)


def _setup(ctx, inputs, output) -> None:
    _, ctx.kind, ctx.dim, ctx.group_name = inputs


def _mirror(ctx, grad):
    return (
        tp_collective(grad.contiguous(), _KINDS[ctx.kind][1], ctx.dim, ctx.group_name),
        None,
        None,
        None,
    )


tp_collective.register_autograd(_mirror, setup_context=_setup)


def _tracing() -> bool:
    return torch.compiler.is_compiling() or symbolic_tracing()


def _apply(
    function: type[torch.autograd.Function],
    kind: str,
    x: torch.Tensor,
    dim: int,
    group: ProcessGroup,
):
    if _tracing():
        return tp_collective(x, kind, dim, group.group_name)
    return function.apply(x, dim, group)


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward: where a replicated input enters split
    compute."""
    return x if _size(group) == 1 else _apply(_CopyToTP, "copy", x, -1, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-reduce forward (sum the partial results), identity backward."""
    return x if _size(group) == 1 else _apply(_ReduceFromTP, "reduce", x, -1, group)


def scatter_to_tp(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Keep this rank's chunk along ``dim`` forward; all-gather the gradient backward."""
    return x if _size(group) == 1 else _apply(_ScatterToTP, "scatter", x, dim, group)


def gather_from_tp(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """All-gather along ``dim`` forward; keep this rank's chunk of the gradient backward."""
    return x if _size(group) == 1 else _apply(_GatherFromTP, "gather", x, dim, group)


def all_gather_seq(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """All-gather along the sequence ``dim`` forward; reduce-scatter the gradient backward."""
    return x if _size(group) == 1 else _apply(_AllGatherSeq, "all_gather_seq", x, dim, group)


def reduce_scatter_seq(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Reduce-scatter along the sequence ``dim`` forward; all-gather the gradient backward."""
    return (
        x if _size(group) == 1 else _apply(_ReduceScatterSeq, "reduce_scatter_seq", x, dim, group)
    )


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The sum over ``group`` forward, the sum of the gradients backward: a quantity every rank
    then uses alike (a statistic of the whole data-parallel batch), whose gradient reaches each
    rank's part from every rank's use of it."""
    return x if _size(group) == 1 else _apply(_AllReduceSum, "all_reduce_sum", x, -1, group)


def all_reduce_(x: torch.Tensor, group: ProcessGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce without autograd (gradient synchronisation, loss statistics)."""
    if _size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x
