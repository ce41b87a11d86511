"""Expert parallelism: each MoE layer's experts split over ep ranks taken from dp, tokens moved to
their experts' ranks and back with ``all_to_all_single`` (Note [expert parallelism]).

    experts = apply_expert_parallel(model, graph, mesh, ep)   # before materialising, after tp
    ...                                                         # forward / backward as usual
    experts.reduce_grads(named_parameters)                      # after the step's last backward
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyparallel.graph.model_graph import ModelGraph
from hyparallel.graph.moe import MoELayer, expert_output_width
from hyparallel.spec.errors import ConfigError
from hyparallel.tensor.init import ShardLayout

# Note [expert parallelism]
#     ``parallel.ep = k`` cuts the dp ranks of each (pp, tp) coordinate into groups of k
#     consecutive ones (the ep groups; with tp innermost, neighbours on a node, where the
#     all-to-all is cheap, as Megatron-Core places them). Rank j of a group holds experts
#     [j E/k, (j+1) E/k) of every MoE layer graph.moe found (Note [an MoE layer read from the
#     trace]) and no other expert; the rest of the model stays as dp and tp have it. The ranks
#     holding the same experts, one in each ep group, are the expert-data-parallel group (dp / k
#     ranks): after the step's backward an expert's gradient is averaged over that group
#     (Note [an expert's gradient is a mean over dp]); DDP leaves the expert weights alone, and
#     ZeRO shards them over that group (Note [experts under ZeRO]).
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


@dataclass(frozen=True)
class ExpertParallel:
    """What ``apply_expert_parallel`` did: the ep groups, and this rank's expert parameters."""

    ep: int
    rank: int  # in the ep group
    dp: int
    replica: int  # this rank's index in its expert-data-parallel group (0: it counts in norms)
    group: Any  # the ep group
    replicas: Any  # the expert-data-parallel group (None: dp == ep)
    replica_mesh: Any  # its DeviceMesh (ZeRO shards the experts over it)
    names: frozenset[str]  # this rank's expert parameters, by name
    layers: tuple[MoELayer, ...]

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """This rank's expert parameters in ``model``."""
        return [p for name, p in model.named_parameters() if name in self.names]

    def units(self, model: nn.Module) -> list[nn.Module]:
        """The modules ZeRO shards over the expert replicas: each layer's stacked experts, each
        expert of a ModuleList this rank holds (Note [experts under ZeRO])."""
        found = []
        for layer in self.layers:
            experts = model.get_submodule(layer.experts)
            if layer.layout == "grouped":
                found.append(experts)
            else:
                found += [e for e in experts if not isinstance(e, _RemoteExpert)]
        return found

    def reduce_grads(self, model: nn.Module) -> None:
        """After the step's last backward: each expert gradient FSDP2 does not reduce, averaged over
        the ranks holding the same experts (it is already 1/ep of its ep group's sum: Note [an
        expert's gradient is a mean over dp])."""
        from hyparallel.runtime.data_parallel import all_reduce_mean

        # FSDP2 reduces the experts ZeRO shards (Note [experts under ZeRO])
        grads = [
            p.grad
            for p in self.parameters(model)
            if p.grad is not None and not hasattr(p.grad, "to_local")
        ]
        if self.replicas is not None:
            all_reduce_mean(grads, self.replicas, self.dp // self.ep)


def expert_mesh(mesh, ep: int):
    """``mesh`` with its dp axis cut into (edp, ep): ep consecutive dp ranks, then their
    replicas."""
    from torch.distributed.device_mesh import DeviceMesh

    names = mesh.mesh_dim_names
    axis = names.index("dp")
    shape = list(mesh.mesh.shape)
    shape[axis : axis + 1] = [shape[axis] // ep, ep]
    return DeviceMesh(
        mesh.device_type,
        mesh.mesh.reshape(shape),
        mesh_dim_names=(*names[:axis], "edp", "ep", *names[axis + 1 :]),
    )


def apply_expert_parallel(
    model: nn.Module, graph: ModelGraph, mesh, ep: int
) -> ExpertParallel | None:
    """Split every MoE layer of ``model`` (``graph.moe``) over ``ep`` ranks of ``mesh``'s dp axis
    (Note [expert parallelism]); None when ep is 1. Runs on the model before it is materialised (a
    meta model allocates only this rank's experts) and after tensor parallelism swapped modules."""
    if ep == 1:
        return None
    full = expert_mesh(mesh, ep)
    rank = full["ep"].get_local_rank()
    group = full["ep"].get_group()
    replicas = full["edp"].get_group() if full["edp"].size() > 1 else None
    dp = mesh["dp"].size()
    layers = graph.moe.layers
    anchor = _Anchor()
    for number, layer in enumerate(layers):
        experts = model.get_submodule(layer.experts)
        per = layer.num_experts // ep
        first = rank * per
        if layer.layout == "grouped":
            _split_grouped(experts, layer, first, per, group, ep, anchor)
        else:
            width = _output_width(graph, layer)
            for index in range(layer.num_experts):
                call = _Call(
                    key=number * layer.num_experts + index,
                    owner=index // per,
                    rank=rank,
                    ep=ep,
                    group=group,
                    width=width,
                    path=f"{layer.experts}.{index}",
                    anchor=anchor,
                )
                if first <= index < first + per:
                    _own(experts[index], call)
                else:
                    experts[index] = _RemoteExpert(call, experts[index])
    names = frozenset(
        name
        for name, _ in model.named_parameters()
        if any(name.startswith(layer.experts + ".") for layer in layers)
    )
    return ExpertParallel(
        ep=ep,
        rank=rank,
        dp=dp,
        replica=full["edp"].get_local_rank(),
        group=group,
        replicas=replicas,
        replica_mesh=full["edp"],
        names=names,
        layers=layers,
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


def _counts(send: torch.Tensor, group) -> torch.Tensor:
    """How many rows each rank of ``group`` sends this one, given how many this one sends each."""
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send.contiguous(), group=group)
    return receive


# Note [an expert's gradient is a mean over dp]
#     Every weight's gradient is the mean over dp of the ranks' gradients (DDP's, FSDP2's). An
#     expert's, on the rank holding it, is already the sum of its ep group's contributions (the
#     exchange's backward brings them all there), so it must be divided by ep before the mean over
#     its dp / ep replicas. The exchange does so itself: the owner's computation is wrapped in a
#     gradient scaling of 1/ep on its outputs and ep on its inputs (hidden rows and routing
#     weights), so the weights inside get 1/ep and everything outside is unchanged. What is left is
#     the plain mean over the replicas: reduce_grads' all-reduce under ZeRO 0, FSDP2's default
#     reduce-scatter under ZeRO 1-3 (a divide factor of dp would need NCCL's PREMUL_SUM, which gloo
#     lacks).


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


class _RemoteExpert(nn.Module):
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


class _OwnedExpert:
    """Mixed into an expert this rank holds: its call computes every rank's rows for it."""

    _ep_call: _Call

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


class _GroupedExperts:
    """Mixed into a module of stacked expert weights of which this rank holds rows [first, first +
    per): a call moves each (token, choice) to its expert's rank, runs the module's own forward
    there, and sums each token's outputs back home (Note [expert parallelism])."""

    _ep: dict[str, Any]

    def shard_layout(self, leaf: str) -> ShardLayout | None:
        """Where this rank's rows of stacked weight ``leaf`` sit in the whole one (dim 0: the
        expert)."""
        shape = self._ep["shapes"].get(leaf)
        if shape is None:
            return None
        first, per = self._ep["first"], self._ep["per"]
        return ShardLayout(full_shape=shape, rows=((first, first + per),))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self._ep
        signature = inspect.signature(super().forward)
        bound = signature.bind(*args, **kwargs)
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
        ep, group, per = state["ep"], state["group"], state["per"]
        expert = choices.reshape(-1)
        order = torch.argsort(expert, stable=True)
        token = order // top_k
        destination = expert[order] // per
        send_counts = torch.bincount(destination, minlength=ep)
        receive_counts = _counts(send_counts, group)
        send, receive = send_counts.tolist(), receive_counts.tolist()
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
        bound.arguments[hidden_name] = _ScaleGrad.apply(pair_rows, ep)
        bound.arguments[index_name] = local.unsqueeze(-1)
        bound.arguments[weights_name] = _ScaleGrad.apply(pair_weights.to(weights.dtype), ep)
        out = super().forward(*bound.args, **bound.kwargs)
        if not isinstance(out, torch.Tensor) or out.shape != pair_rows.shape:
            raise ConfigError(
                f"parallel.ep: {state['path']} returned"
                f" {tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}"
                f" for {tuple(pair_rows.shape)} rows, not one row per row; use ep: 1 for this model"
            )
        back = _exchange(_ScaleGrad.apply(out, 1 / ep), receive, send, group, anchor)
        combined = torch.zeros_like(rows, dtype=out.dtype).index_add(0, token, back)
        return combined.to(hidden.dtype).reshape(hidden.shape)


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
    experts: nn.Module, layer: MoELayer, first: int, per: int, group, ep: int, anchor: _Anchor
) -> None:
    """Keep rows [first, first + per) of each stacked weight of ``experts`` and route its calls."""
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
        "group": group,
        "shapes": shapes,
        "path": layer.experts,
        "anchor": anchor,
    }
