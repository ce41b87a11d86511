"""Expert parallelism: each MoE layer's experts split over ep ranks taken from dp, tokens moved to
their experts' ranks and back with ``all_to_all_single`` (Note [expert parallelism]).

    experts = apply_expert_parallel(model, graph, mesh, ep)   # before materialising, after tp
    ...                                                         # forward / backward as usual
    experts.reduce_grads(named_parameters)                      # after the step's last backward
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyparallel.graph.model_graph import ModelGraph
from hyparallel.graph.moe import MoELayer, expert_output_width
from hyparallel.graph.opaque import traced_call, tracing
from hyparallel.spec.errors import ConfigError
from hyparallel.tensor.collectives import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from hyparallel.tensor.init import ShardLayout

# Note [expert parallelism]
#     ``parallel.ep = k`` splits every MoE layer graph.moe found (Note [an MoE layer read from the
#     trace]) over groups of k ranks (the ep groups): rank j of a group holds experts [j E/k,
#     (j+1) E/k) of every layer and no other expert; the rest of the model stays as dp and tp have
#     it. The ranks holding the same experts, one in each ep group, are the expert-data-parallel
#     group: after the step's backward an expert's gradient is averaged over it (Note [an expert's
#     gradient is a mean over dp]); DDP leaves the expert weights alone, and ZeRO shards them over
#     that group (Note [experts under ZeRO]). Where the groups lie depends on the experts' layout
#     (Note [tp folded into the experts' ranks]).
#
#     Tokens travel by the experts' layout:
#     * grouped: one module of stacked [E, ...] weights called as ``experts(hidden, top_k_index,
#       top_k_weights)`` (transformers' MoEs). It keeps rows [j E/k, (j+1) E/k) of each weight. A
#       call sends each (token, choice) pair to its expert's rank in one all_to_all_single (the
#       token's row, its weight, which expert), runs the module's own forward there on the pairs
#       received (top-1, the expert index made local) and sends the outputs back in a second, where
#       each token's k outputs are summed. The module's own forward computes, so whatever it does
#       per expert (activation, biases, clamping: gpt-oss) is kept. What the split needs of it: its
#       output is the sum over the k choices of one expert's output each, as transformers' experts
#       are; a call whose arguments are not one hidden tensor, one integer index and float weights
#       shaped like it is refused, on every rank at once (the same code, the same shapes).
#     * list: a ModuleList of E identical experts the MoE calls one at a time (a hand-written
#       ``torch.where`` dispatch). Each expert becomes a call across its ep group: every rank sends
#       the rows it gives the expert to the rank holding it, which runs it on all of them and
#       returns each rank's outputs. The ranks of a group call the experts in one order (the same
#       code); each call first exchanges which expert it is, so a forward that skips an expert on
#       some ranks (``if not len(token): continue``) is refused on every rank at that call, never
#       waited on.
#     Both are dropless (every routed token is computed), differentiable (the backward sends the
#     gradients back the same way), and sum each token's outputs in another order than one device:
#     fp32 rounding only.


# Note [tp folded into the experts' ranks]
#     Tensor parallelism splits a ModuleList's experts column/row as any other Linear pair, so under
#     tp their ep groups are k consecutive dp ranks of one tp coordinate (dp / k replicas of each).
#     Stacked experts are not split by tp: every tp rank of a dp rank would run the same pairs
#     through the same expert rows. Instead tp is folded into their mapping, as Megatron-Core does
#     with an expert tensor-parallel size of 1: tp rank t of a dp rank takes chunk t of its
#     tokens (they are the same on every tp rank: the residual stream is replicated), and the ep
#     groups are k consecutive ranks of the flattened (dp, tp) block (tp innermost: one node's ranks
#     for k <= gpus per node), dp tp / k replicas of each. Each token is computed once, by one tp
#     rank; the outputs are all-gathered over tp (gather_from_tp: the gradient's own chunk back,
#     the same on every tp rank) and the hidden rows and routing weights enter through
#     scatter_to_tp (the gradient all-gathered, so every tp rank holds the whole one, as a
#     replicated activation's must be). Tokens that do not divide by tp are split unevenly and
#     summed back with an all-reduce instead (copy_to_tp / reduce_from_tp). Memory is as before
#     (E / k experts a rank, replicated dp tp / k times); the compute and the exchange shrink by tp.


class _Loads:
    """Stacked experts' routing since it was last read (ExpertParallel.imbalance): per MoE call,
    the busiest ep rank's (token, expert) pairs and the mean, summed."""

    def __init__(self) -> None:
        self.busiest = self.mean = 0.0
        self.measured: float | None = None  # the last reading

    def add(self, per_rank: list[int]) -> None:
        self.busiest += max(per_rank)
        self.mean += sum(per_rank) / len(per_rank)


@dataclass(frozen=True)
class ExpertGroups:
    """Where one layout's experts lie: this rank's ep group and expert-data-parallel group (Note
    [tp folded into the experts' ranks])."""

    rank: int  # in the ep group
    group: Any  # the ep group
    replicas: Any  # the ranks holding the same experts (None: this one alone)
    replica: int  # this rank's index among them (0: it counts in norms)
    count: int  # how many they are
    mesh: Any  # their DeviceMesh (ZeRO shards the experts over it)
    tp_group: Any = None  # the tp ranks splitting the tokens (None: each runs all of its own)
    tp: int = 1


@dataclass(frozen=True)
class ExpertParallel:
    """What ``apply_expert_parallel`` did: the ep groups of each layout, and this rank's expert
    parameters."""

    ep: int
    names: frozenset[str]  # this rank's expert parameters, by name
    layers: tuple[MoELayer, ...]
    listed: ExpertGroups  # a ModuleList's experts
    stacked: ExpertGroups  # stacked experts (the same as ``listed`` when tp is 1)
    stacked_names: frozenset[str] = frozenset()  # the parameters of stacked experts
    loads: _Loads = field(default_factory=_Loads)

    def groups_of(self, name: str) -> ExpertGroups:
        """The groups of expert parameter ``name``."""
        return self.stacked if name in self.stacked_names else self.listed

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """This rank's expert parameters in ``model``."""
        return [p for name, p in model.named_parameters() if name in self.names]

    def units(self, model: nn.Module) -> list[tuple[nn.Module, Any]]:
        """The modules ZeRO shards over the expert replicas, each with their mesh: each layer's
        stacked experts, each expert of a ModuleList this rank holds (Note [experts under
        ZeRO])."""
        found = []
        for layer in self.layers:
            try:  # a pipeline stage holds some layers (its graph module the modules it calls)
                experts = model.get_submodule(layer.experts)
            except AttributeError:
                continue
            if layer.layout == "grouped":
                found.append((experts, self.stacked.mesh))
            else:
                found += [
                    (e, self.listed.mesh)
                    for e in experts.children()
                    if not isinstance(e, _RemoteExpert)
                ]
        return found

    def imbalance(self, device: torch.device) -> float | None:
        """Stacked experts' calls since the last read: the busiest ep rank's (token, expert) pairs
        over the mean, summed over calls, over every ep group (None: none routed). A collective
        over every rank (each reads it at the same point); ``hyparallel plan --expert-imbalance``
        takes it (Note [expert parallelism's costs] in hyparallel/planner/costs.py). The last
        reading stays in ``loads.measured``."""
        figures = torch.tensor(
            [self.loads.busiest, self.loads.mean], dtype=torch.float64, device=device
        )
        self.loads.busiest = self.loads.mean = 0.0
        dist.all_reduce(figures)  # every ep group's, each counted by all of its ranks alike
        if figures[1] > 0:
            self.loads.measured = float(figures[0] / figures[1])
            return self.loads.measured
        return None

    def local_imbalance(self) -> float | None:
        """``imbalance`` over the calls this rank took part in since the last read, without a
        collective or a reset: what one rank may read alone (the online fit, on rank 0)."""
        return self.loads.busiest / self.loads.mean if self.loads.mean > 0 else None

    def reduce_grads(self, model: nn.Module) -> None:
        """After the step's last backward: each expert gradient FSDP2 does not reduce, averaged over
        the ranks holding the same experts (it is already their share of its ep group's sum: Note
        [an expert's gradient is a mean over dp])."""
        from hyparallel.runtime.data_parallel import all_reduce_mean

        # FSDP2 reduces the experts ZeRO shards (Note [experts under ZeRO])
        by_groups: dict[int, tuple[ExpertGroups, list[torch.Tensor]]] = {}
        for name, p in model.named_parameters():
            if name in self.names and p.grad is not None and not hasattr(p.grad, "to_local"):
                groups = self.groups_of(name)
                by_groups.setdefault(id(groups), (groups, []))[1].append(p.grad)
        for groups, grads in by_groups.values():
            if groups.replicas is not None:
                all_reduce_mean(grads, groups.replicas, groups.count)


def expert_mesh(mesh, ep: int, fold_tp: bool = False):
    """``mesh`` with its dp axis (``fold_tp``: its dp and tp axes, flattened in mesh order) cut
    into (edp, ep): ep consecutive ranks, then their replicas (Note [tp folded into the experts'
    ranks])."""
    from torch.distributed.device_mesh import DeviceMesh

    names = list(mesh.mesh_dim_names)
    folded = ["dp", "tp"] if fold_tp else ["dp"]
    folded = [n for n in names if n in folded]  # in mesh order
    rest = [n for n in names if n not in folded]
    tensor = mesh.mesh.permute([names.index(n) for n in rest + folded])
    shape = [mesh.mesh.shape[names.index(n)] for n in rest]
    ranks = math.prod(mesh.mesh.shape[names.index(n)] for n in folded)
    return DeviceMesh(
        mesh.device_type,
        tensor.reshape(*shape, ranks // ep, ep),
        mesh_dim_names=(*rest, "edp", "ep"),
    )


def _groups(mesh, ep: int, fold_tp: bool) -> ExpertGroups:
    full = expert_mesh(mesh, ep, fold_tp)
    tp = mesh["tp"].size() if fold_tp else 1
    return ExpertGroups(
        rank=full["ep"].get_local_rank(),
        group=full["ep"].get_group(),
        replicas=full["edp"].get_group() if full["edp"].size() > 1 else None,
        replica=full["edp"].get_local_rank(),
        count=full["edp"].size(),
        mesh=full["edp"],
        tp_group=mesh["tp"].get_group() if fold_tp else None,
        tp=tp,
    )


def apply_expert_parallel(
    model: nn.Module, graph: ModelGraph, mesh, ep: int
) -> ExpertParallel | None:
    """Split every MoE layer of ``model`` (``graph.moe``) over ``ep`` ranks of ``mesh`` (Note
    [expert parallelism]); None when ep is 1. Runs on the model before it is materialised (a meta
    model allocates only this rank's experts) and after tensor parallelism swapped modules."""
    if ep == 1:
        return None
    layers = graph.moe.layers
    listed = _groups(mesh, ep, fold_tp=False)
    fold = "tp" in mesh.mesh_dim_names and mesh["tp"].size() > 1
    stacked = (
        _groups(mesh, ep, fold_tp=True)
        if fold and any(layer.layout == "grouped" for layer in layers)
        else listed
    )
    anchor, loads = _Anchor(), _Loads()
    for number, layer in enumerate(layers):
        experts = model.get_submodule(layer.experts)
        per = layer.num_experts // ep
        if layer.layout == "grouped":
            _split_grouped(experts, layer, stacked, per, ep, anchor)
            experts._ep["loads"] = loads
            continue
        first = listed.rank * per
        width = _output_width(graph, layer)
        for index in range(layer.num_experts):
            call = _Call(
                key=number * layer.num_experts + index,
                owner=index // per,
                rank=listed.rank,
                ep=ep,
                group=listed.group,
                width=width,
                path=f"{layer.experts}.{index}",
                anchor=anchor,
            )
            if first <= index < first + per:
                _own(experts[index], call)
            else:
                experts[index] = _RemoteExpert(call, experts[index])

    def under(kind: str):
        return frozenset(
            name
            for name, _ in model.named_parameters()
            if any(
                name.startswith(layer.experts + ".")
                for layer in layers
                if kind in ("any", layer.layout)
            )
        )

    return ExpertParallel(
        ep=ep,
        names=under("any"),
        layers=layers,
        listed=listed,
        stacked=stacked,
        stacked_names=under("grouped"),
        loads=loads,
    )


def _output_width(graph: ModelGraph, layer: MoELayer) -> int:
    """The last dimension of expert 0's output (check_plan refused a layer without one)."""
    width = expert_output_width(graph, layer)
    assert width is not None, layer.experts  # graph.checks.check_expert_parallel
    return width


class _Anchor:
    """A tensor needing a gradient that every exchange takes as an input while grad mode is on, so
    that every rank's exchange is in its autograd graph and each backward runs on every rank (one
    rank's empty share needing no gradient would skip it there and leave the others waiting)."""

    def __init__(self) -> None:
        self._tensor: torch.Tensor | None = None

    def get(self, device: torch.device) -> torch.Tensor | None:
        if not torch.is_grad_enabled():
            return None
        if self._tensor is None or self._tensor.device != device:
            self._tensor = torch.zeros((), requires_grad=True, device=device)
        return self._tensor


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows, ``send[i]`` rows to rank i, ``receive[i]`` from it; the backward
    sends the gradients back."""

    @staticmethod
    def forward(ctx, rows, anchor, send: list[int], receive: list[int], group):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return back, None, None, None, None


def _exchange(rows: torch.Tensor, send: list[int], receive: list[int], group, anchor) -> Any:
    return _AllToAll.apply(rows, anchor.get(rows.device), send, receive, group)


# Note [an expert's gradient is a mean over dp]
#     Every weight's gradient is the mean over dp of the ranks' gradients (DDP's, FSDP2's). An
#     expert's, on the rank holding it, is already the sum of its ep group's contributions (the
#     exchange's backward brings them all there); the sum over its R replicas of those sums is the
#     sum over the dp ranks' losses, each token counted once. R is dp / ep, or dp tp / ep with tp
#     folded in (Note [tp folded into the experts' ranks]), so the plain mean over the replicas
#     needs each sum scaled by R / dp: 1 / ep, or tp / ep. The exchange does so itself: the owner's
#     computation is wrapped in a gradient scaling of R / dp on its outputs and dp / R on its inputs
#     (hidden rows and routing weights), so the weights inside get R / dp and everything outside is
#     unchanged. What is left is the plain mean over the replicas: reduce_grads' all-reduce under
#     ZeRO 0, FSDP2's default reduce-scatter under ZeRO 1-3 (a divide factor of dp would need
#     NCCL's PREMUL_SUM, which gloo lacks).


# Note [experts under ZeRO]
#     Under ZeRO 1-3 each layer's stacked experts, and each expert of a ModuleList a rank holds,
#     are an FSDP2 unit of their own over the expert-data-parallel mesh (torchtitan's dp_mod_ep
#     mesh): weights, gradients and optimizer state sharded over the dp / ep ranks holding the same
#     experts, the gradient averaged there (Note [an expert's gradient is a mean over dp]). With
#     ep = dp that mesh has one rank, and they are a unit over it all the same: left to FSDP2 as
#     ignored parameters inside their block's unit instead, the weights before them got wrong
#     gradients (hf:MixtralForCausalLM, dp 2 x ep 2, ZeRO 1: post_attention_layernorm 1.0 off;
#     not understood yet).


# Note [an expert unit prefetches nothing]
#     FSDP2 prefetches in the backward: a unit's pre-backward all-gathers the unit that ran before
#     it in the forward. For an expert unit that is another expert, or the block before (an
#     all-gather over the whole dp mesh), and which it is differs between ranks holding other
#     experts: rank 0 (experts 0, 1) reached it at expert 0's exchange, rank 1 (experts 2, 3) at
#     expert 2's, so rank 1 waited in the block's all-gather while rank 0 waited for it in an
#     exchange (tests.tiny_lms:where_moe_lm, dp 4 x ep 2, ZeRO 3: a hang in the first backward).
#     An expert unit prefetches only itself (already gathered by its own pre-backward: a no-op);
#     FSDP2 has no other way to say none, an empty list being its default. The block it would have
#     prefetched is gathered by its own pre-backward, at the same place on every rank.


# Note [what a remote expert keeps]
#     A rank not holding an expert calls a _RemoteExpert in its place, which must be called as the
#     expert would be: it takes over the expert's forward hooks. Tensor parallelism enters its
#     region at a module's call (a forward pre-hook on the expert whose first Linear is a column:
#     the input's gradient all-reduced over tp), and a ModuleList's experts split column/row by tp
#     under ep (expert tensor parallelism beside expert parallelism) got every weight below the
#     MoE 0.2 off (tests.tiny_lms:where_moe_lm, dp 2 x tp 2 x ep 2, the loss equal) while the
#     remote experts dropped that hook: the rows they sent came back with the owner's gradient
#     of its column slice only. On the rank holding the expert the hook runs on its own rows
#     before the exchange, on every other rank on theirs: the partial gradients that come back
#     are summed over tp where the rows were made, as without ep.


class _KeptInTraces:
    """Mixed into each module expert parallelism changed: a traced graph keeps its call whole, and
    a pipeline stage runs it as written (Note [a module call a trace keeps],
    hyparallel.graph.opaque); ``_ep_output`` gives the call's output shape and dtype."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if tracing():
            return traced_call(self._ep_path(), args, kwargs, lambda: self._ep_output(args, kwargs))
        return self._ep_eager_call(*args, **kwargs)

    @torch.compiler.disable
    def _ep_eager_call(self, *args: Any, **kwargs: Any) -> Any:
        """The call as written, never compiled (Note [experts under torch.compile])."""
        return super().__call__(*args, **kwargs)

    def _ep_path(self) -> str:
        raise NotImplementedError

    def _ep_output(self, args: tuple, kwargs: dict) -> tuple[tuple[Any, ...], torch.dtype]:
        raise NotImplementedError


# Note [experts under torch.compile]
#     parallel.compile compiles each repeated block (each stage's graph under pp), and the experts'
#     call runs inside it. Compiled by torch.compile (aot_eager on the CPU), Mixtral's dp 2 x ep 2
#     trained on wrong gradients above the experts (post_attention_layernorm 0.5 off, the loss
#     3.6e-5): the exchange's sizes come from the data (read back to the host), its autograd
#     Functions take lists and a process group, and what the compiled graph made of them was not
#     the eager backward. The experts' call is excluded from compilation (torch.compiler.disable:
#     a graph break before and after it), so it runs eagerly, as under pp's traced stages; the
#     rest of the block compiles as before.


# --- the list layout: one call across the ep group per expert ---


@dataclass(frozen=True)
class _Call:
    key: int  # which expert of which layer: the same on every rank of the group
    owner: int  # the ep rank holding it
    rank: int
    ep: int
    group: Any
    width: int  # the last dimension of its output
    path: str
    anchor: _Anchor

    def __call__(self, rows: torch.Tensor, compute) -> torch.Tensor:
        if not isinstance(rows, torch.Tensor) or rows.dim() < 1:
            raise ConfigError(
                f"parallel.ep: {self.path} was called with {type(rows).__name__}; an expert split"
                " over ep ranks takes one tensor of rows; use ep: 1 for this model"
            )
        header = torch.tensor(
            [self.key, rows.size(0), math.prod(rows.shape[1:])], device=rows.device
        )
        headers = torch.empty(self.ep * 3, dtype=header.dtype, device=rows.device)
        dist.all_gather_into_tensor(headers, header, group=self.group)
        headers = headers.view(self.ep, 3)
        if (headers[:, 0] != self.key).any() or (headers[:, 2] != headers[0, 2]).any():
            raise ConfigError(
                f"parallel.ep: the ranks of an expert-parallel group called different experts"
                f" ({headers[:, 0].tolist()}) where this one called {self.path}: the MoE's forward"
                " calls its experts by the data (skipping one with no tokens, say); every rank must"
                " call each expert, with no rows if none; use ep: 1 for this model"
            )
        counts = headers[:, 1].tolist()
        send = [rows.size(0) if r == self.owner else 0 for r in range(self.ep)]
        receive = counts if self.rank == self.owner else [0] * self.ep
        flat = rows.reshape(rows.size(0), -1)
        gathered = _exchange(flat, send, receive, self.group, self.anchor)
        if self.rank == self.owner:
            # Note [an expert's gradient is a mean over dp]
            out = compute(_ScaleGrad.apply(gathered, self.ep).reshape(-1, *rows.shape[1:]))
            out = _ScaleGrad.apply(out.reshape(out.size(0), -1), 1 / self.ep)
        else:  # no rows, but from the exchange's: its backward must run here too
            out = gathered[:, :1].expand(0, math.prod(rows.shape[1:-1]) * self.width)
        back = _exchange(out, receive, send, self.group, self.anchor)
        return back.reshape(*rows.shape[:-1], self.width)


def _expert_output(call: _Call, args: tuple, kwargs: dict) -> tuple[tuple[Any, ...], torch.dtype]:
    rows = _one_tensor(call, args, kwargs)
    return (*rows.shape[:-1], call.width), rows.dtype


class _RemoteExpert(_KeptInTraces, nn.Module):
    """An expert another rank of the ep group holds: its call sends the rows there and returns
    what comes back."""

    def __init__(self, call: _Call, expert: nn.Module):
        super().__init__()
        self._call = call
        # Note [what a remote expert keeps]: the hooks on the expert's own call
        self._forward_pre_hooks.update(expert._forward_pre_hooks)
        self._forward_pre_hooks_with_kwargs.update(expert._forward_pre_hooks_with_kwargs)
        self._forward_hooks.update(expert._forward_hooks)
        self._forward_hooks_with_kwargs.update(expert._forward_hooks_with_kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._call(_one_tensor(self._call, args, kwargs), None)

    def extra_repr(self) -> str:
        return f"on ep rank {self._call.owner}"

    def _ep_path(self) -> str:
        return self._call.path

    def _ep_output(self, args: tuple, kwargs: dict) -> tuple[tuple[Any, ...], torch.dtype]:
        return _expert_output(self._call, args, kwargs)


class _OwnedExpert(_KeptInTraces):
    """Mixed into an expert this rank holds: its call computes every rank's rows for it."""

    _ep_call: _Call

    def _ep_path(self) -> str:
        return self._ep_call.path

    def _ep_output(self, args: tuple, kwargs: dict) -> tuple[tuple[Any, ...], torch.dtype]:
        return _expert_output(self._ep_call, args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._ep_call(_one_tensor(self._ep_call, args, kwargs), super().forward)


def _one_tensor(call: _Call, args: tuple, kwargs: dict) -> Any:
    """The one argument of an expert's call; anything else is refused, on every rank alike."""
    if kwargs or len(args) != 1:
        raise ConfigError(
            f"parallel.ep: {call.path} was called with {len(args)} arguments and {len(kwargs)}"
            " keywords; an expert split over ep ranks takes one tensor of rows; use ep: 1 for this"
            " model"
        )
    return args[0]


_CLASSES: dict[tuple[type, type], type] = {}


def _swap_class(module: nn.Module, mixin: type) -> None:
    """Give ``module`` a class that is its own with ``mixin`` first (as FSDP2's fully_shard does):
    its parameter names, state dict and attributes stay."""
    cls = type(module)
    key = (mixin, cls)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"ExpertParallel{cls.__name__}", (mixin, cls), {})
    module.__class__ = _CLASSES[key]


def _own(expert: nn.Module, call: _Call) -> None:
    _swap_class(expert, _OwnedExpert)
    expert._ep_call = call


# --- the grouped layout: one module of stacked weights, two all-to-alls per call ---


class _GroupedExperts(_KeptInTraces):
    """Mixed into a module of stacked expert weights of which this rank holds rows [first, first +
    per): a call moves each (token, choice) to its expert's rank, runs the module's own forward
    there, and sums each token's outputs back home (Note [expert parallelism]); under tp each tp
    rank does so for its chunk of the tokens (Note [tp folded into the experts' ranks])."""

    _ep: dict[str, Any]

    def shard_layout(self, leaf: str) -> ShardLayout | None:
        """Where this rank's rows of stacked weight ``leaf`` sit in the whole one (dim 0: the
        expert)."""
        shape = self._ep["shapes"].get(leaf)
        if shape is None:
            return None
        first, per = self._ep["first"], self._ep["per"]
        return ShardLayout(full_shape=shape, rows=((first, first + per),))

    def _ep_path(self) -> str:
        return self._ep["path"]

    def _ep_output(self, args: tuple, kwargs: dict) -> tuple[tuple[Any, ...], torch.dtype]:
        arguments = _signature(type(self)).bind(self, *args, **kwargs).arguments
        hidden = arguments[_roles(arguments, self._ep["path"])[0]]
        return tuple(hidden.shape), hidden.dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self._ep
        bound = _signature(type(self)).bind(self, *args, **kwargs)
        hidden_name, index_name, weights_name = _roles(bound.arguments, state["path"])
        hidden = bound.arguments[hidden_name]
        index, weights = bound.arguments[index_name], bound.arguments[weights_name]
        top_k, width = index.shape[-1], hidden.shape[-1]
        rows = hidden.reshape(-1, width)
        choices = index.reshape(-1, top_k)
        if choices.size(0) != rows.size(0):
            raise ConfigError(
                f"parallel.ep: {state['path']} was called with {rows.size(0)} hidden rows but"
                f" {choices.size(0)} rows of expert indices; use ep: 1 for this model"
            )
        groups: ExpertGroups = state["groups"]
        mine, weights = _TokenChunk(rows, groups), weights.reshape(-1, top_k)
        rows, choices, weights = mine.take(rows), mine.take(choices), mine.take(weights)
        ep, group, per = state["ep"], groups.group, state["per"]
        expert = choices.reshape(-1)
        order = torch.argsort(expert, stable=True)
        token = order // top_k
        destination = expert[order] // per
        send_counts = torch.bincount(destination, minlength=ep)
        # every rank's counts to every rank (row: the sender): what this one receives, and each
        # rank's load
        counts = torch.empty(ep * ep, dtype=send_counts.dtype, device=send_counts.device)
        dist.all_gather_into_tensor(counts, send_counts, group=group)
        matrix = counts.view(ep, ep).tolist()  # the call's one read back to the host
        send, receive = matrix[groups.rank], [row[groups.rank] for row in matrix]
        state["loads"].add([sum(column) for column in zip(*matrix)])
        anchor = state["anchor"]
        pair_rows = _exchange(rows.index_select(0, token), send, receive, group, anchor)
        pair_weights = _exchange(
            weights.reshape(-1)[order].unsqueeze(-1), send, receive, group, anchor
        )
        with torch.no_grad():
            local = torch.empty(sum(receive), dtype=expert.dtype, device=expert.device)
            dist.all_to_all_single(local, expert[order].contiguous(), receive, send, group=group)
            local -= state["first"]
        # Note [an expert's gradient is a mean over dp]
        share = groups.tp / ep
        bound.arguments[hidden_name] = _ScaleGrad.apply(pair_rows, 1 / share)
        bound.arguments[index_name] = local.unsqueeze(-1)
        bound.arguments[weights_name] = _ScaleGrad.apply(pair_weights.to(weights.dtype), 1 / share)
        out = super().forward(*tuple(bound.args)[1:], **bound.kwargs)
        if not isinstance(out, torch.Tensor) or out.shape != pair_rows.shape:
            raise ConfigError(
                f"parallel.ep: {state['path']} returned"
                f" {tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}"
                f" for {tuple(pair_rows.shape)} rows, not one row per row; use ep: 1 for this model"
            )
        back = _exchange(_ScaleGrad.apply(out, share), receive, send, group, anchor)
        combined = torch.zeros_like(rows, dtype=out.dtype).index_add(0, token, back)
        return mine.put(combined).to(hidden.dtype).reshape(hidden.shape)


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    """The signature of the forward a _GroupedExperts subclass ``cls`` wraps, ``self`` included
    (read once per class)."""
    return inspect.signature(super(_GroupedExperts, cls).forward)


class _TokenChunk:
    """This tp rank's chunk of a call's token rows, and the way back to all of them (Note [tp
    folded into the experts' ranks]); every row when the tokens are not split."""

    def __init__(self, rows: torch.Tensor, groups: ExpertGroups) -> None:
        self.group, self.count = groups.tp_group, rows.size(0)
        self.even = self.group is None or self.count % groups.tp == 0
        if self.group is not None:
            rank = dist.get_rank(self.group)
            bounds = [self.count * r // groups.tp for r in range(groups.tp + 1)]
            self.start, self.stop = bounds[rank], bounds[rank + 1]

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``x`` (its gradient whole on every tp rank)."""
        if self.group is None or not x.is_floating_point():
            return x if self.group is None else x[self.start : self.stop]
        if self.even:
            return scatter_to_tp(x, 0, self.group)
        return copy_to_tp(x, self.group)[self.start : self.stop]

    def put(self, x: torch.Tensor) -> torch.Tensor:
        """Every tp rank's rows, this one's being ``x`` (its gradient: this rank's rows)."""
        if self.group is None:
            return x
        if self.even:
            return gather_from_tp(x, 0, self.group)
        whole = nn.functional.pad(x, (0, 0, self.start, self.count - self.stop))
        return reduce_from_tp(whole, self.group)


def _roles(arguments: dict[str, Any], path: str) -> tuple[str, str, str]:
    """The names of the hidden rows, the expert indices and their weights among a grouped experts
    call's arguments."""
    tensors = {k: v for k, v in arguments.items() if isinstance(v, torch.Tensor)}
    integer = [k for k, v in tensors.items() if not v.is_floating_point()]
    if len(integer) == 1:
        index = tensors[integer[0]]
        weights = [
            k for k, v in tensors.items() if v.is_floating_point() and v.shape == index.shape
        ]
        hidden = [k for k in tensors if k not in integer and k not in weights]
        if len(weights) == 1 and len(hidden) == 1 and len(tensors) == 3:
            return hidden[0], integer[0], weights[0]
    raise ConfigError(
        f"parallel.ep: {path} was called with tensors"
        f" {', '.join(f'{k} {tuple(v.shape)}' for k, v in tensors.items())}: not (hidden rows,"
        " top-k expert indices, their weights), so its experts cannot be split over ep ranks; use"
        " ep: 1 for this model"
    )


def _split_grouped(
    experts: nn.Module, layer: MoELayer, groups: ExpertGroups, per: int, ep: int, anchor: _Anchor
) -> None:
    """Keep this rank's rows [first, first + per) of each stacked weight of ``experts`` and route
    its calls."""
    first = groups.rank * per
    shapes = {}
    for leaf, param in list(experts.named_parameters(recurse=False)):
        shapes[leaf] = tuple(param.shape)
        kept = nn.Parameter(param.detach()[first : first + per].clone(), param.requires_grad)
        setattr(experts, leaf, kept)
    # the count of experts the module declares (transformers' and torchtitan's experts size their
    # dispatch by it, and transformers' own expert parallelism sets it so): the ones held here
    if getattr(experts, "num_experts", None) == layer.num_experts:
        experts.num_experts = per
    _swap_class(experts, _GroupedExperts)
    experts._ep = {
        "first": first,
        "per": per,
        "ep": ep,
        "groups": groups,
        "shapes": shapes,
        "path": layer.experts,
        "anchor": anchor,
    }
