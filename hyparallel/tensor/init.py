"""Deterministic initialisation that any slice of a parameter computes on its own.

A model planned on the meta device is materialised rank by rank: each tensor-parallel rank allocates
only its slices and fills them from the same per-parameter random streams a single device would use,
so no rank ever holds a full split weight, and the result equals the unsplit model built the same
way (``materialize_`` on one device). Random values come in chunks of ``CHUNK_ROWS`` rows, each from
a generator seeded by (seed, parameter name, chunk): a slice regenerates only the chunks it
overlaps.

Rules follow the common initialisers (GPT-2, transformers' ``_init_weights``): biases zero, norm
weights one, other weights N(0, std) with std from ``model.init_std(name)`` when the model defines
it, else the config's ``initializer_range``, else 0.02. A parameter of any rank is drawn row by row
along dim 0 (Note [any rank]); a scalar (0-D) weight, a learned scale, starts at one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hyparallel.graph.tracer import tied_names

CHUNK_ROWS = 256


@dataclass(frozen=True)
class ShardLayout:
    """Where a local parameter sits in the full one: row ranges (dim 0), a column range (dim 1)."""

    full_shape: tuple[int, ...]
    rows: tuple[tuple[int, int], ...] | None = None  # None: all rows
    cols: tuple[int, int] | None = None  # None: all columns
    valid_rows: int | None = None  # rows at or past this are vocabulary padding: zeros
    # the model stores the full weight as (in, out) (transformers' Conv1D): values follow it
    transposed: bool = False


def init_rule(model: nn.Module, name: str, module: nn.Module, leaf: str) -> tuple[str, float]:
    """("zeros" | "ones" | "normal", std) for parameter ``name`` (``leaf`` of ``module``)."""
    if leaf == "bias":
        return "zeros", 0.0
    kind = type(module).__name__
    if "Norm" in kind:
        return "ones", 0.0
    if callable(getattr(model, "init_std", None)):
        return "normal", float(model.init_std(name))
    config = getattr(model, "config", None)
    return "normal", float(getattr(config, "initializer_range", None) or 0.02)


def _seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.sha256(f"{seed}:{name}:{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@torch.no_grad()
def fill_(
    tensor: torch.Tensor, rule: tuple[str, float], name: str, layout: ShardLayout, seed: int = 0
) -> None:
    """Fill ``tensor`` (this rank's slice) with the values the full parameter ``name`` has at
    ``layout``."""
    kind, std = rule
    if layout.transposed and kind == "normal" and tensor.dim() == 2:
        _fill_transposed(tensor, rule, name, layout, seed)
        return
    if kind != "normal" or tensor.dim() == 0:
        tensor.fill_(0.0 if kind == "zeros" else 1.0)
        return
    # Note [any rank]: a parameter of any rank is drawn as (rows, everything else): a chunk of rows
    # is one block of randn(rows, prod(shape[1:])), so a 2-D weight draws exactly what it always
    # did; ``cols`` slices dim 1, whose entries each span prod(shape[2:]) values (one for a 2-D
    # weight).
    full_rows, rest = layout.full_shape[0], layout.full_shape[1:]
    width, inner = math.prod(rest), math.prod(rest[1:])
    cols = layout.cols or (0, rest[0] if rest else 1)
    local = tensor.view(tensor.size(0), -1)
    offset = 0
    for start, stop in layout.rows or ((0, full_rows),):
        real_stop = min(stop, full_rows)
        for chunk in range(
            start // CHUNK_ROWS, (real_stop - 1) // CHUNK_ROWS + 1 if start < real_stop else 0
        ):
            first = chunk * CHUNK_ROWS
            rows_here = min(CHUNK_ROWS, full_rows - first)
            generator = torch.Generator().manual_seed(_seed(seed, name, chunk))
            # at most CHUNK_ROWS rows at a time
            block = torch.randn(rows_here, width, generator=generator) * std
            lo, hi = max(start, first), min(stop, first + rows_here)
            piece = (
                block[lo - first : hi - first]
                .view(hi - lo, -1, inner)[:, cols[0] : cols[1]]
                .reshape(hi - lo, -1)
            )
            local[offset : offset + hi - lo].copy_(piece.to(local.dtype))
            offset += hi - lo
        if stop > full_rows:  # vocabulary padding past the real rows
            padding = stop - max(start, full_rows)
            local[offset : offset + padding].zero_()
            offset += padding


def _fill_transposed(
    tensor: torch.Tensor, rule: tuple[str, float], name: str, layout: ShardLayout, seed: int
) -> None:
    """``tensor`` (out rows, in cols) holds a slice of a weight the model stores as (in, out): take
    the values that (in, out) weight has, so a split Conv1D starts as the unsplit one does."""
    out_features, in_features = layout.full_shape
    cols = layout.cols or (0, in_features)
    offset = 0
    for start, stop in layout.rows or ((0, out_features),):
        # (in, out) as stored
        stored = torch.empty(cols[1] - cols[0], stop - start, dtype=tensor.dtype)
        fill_(
            stored,
            rule,
            name,
            ShardLayout(full_shape=(in_features, out_features), rows=(cols,), cols=(start, stop)),
            seed,
        )
        tensor[offset : offset + stop - start].copy_(stored.t())
        offset += stop - start


@torch.no_grad()
def materialize_(
    model: nn.Module, device: torch.device | str, seed: int = 0, only: Collection[str] | None = None
) -> nn.Module:
    """Allocate a meta-device model on ``device`` and initialise it deterministically, slice by
    slice.

    ``only`` (parameter or buffer names) materialises just the modules owning them, as a pipeline
    rank does with its stages; everything else stays on meta. A tied weight keeps its first name's
    values wherever it is materialised, so every stage holding a copy starts equal. Real buffers
    (the meta build keeps them: Note [parameters on meta, buffers real]) move to ``device`` as they
    are; meta ones are recomputed where that is known to work, else refused (Note [buffers on
    meta]).
    """
    lost = meta_buffers(model, only)
    refuse_unrecoverable_buffers(model, only)
    if only is None:
        ties = tied_names(model)
        real = [
            (m, leaf, t)
            for m in model.modules()
            for leaf, t in m._buffers.items()
            if t is not None and not t.is_meta
        ]
        model.to_empty(device=device)  # allocates each module's parameters anew, which unties them
        for module, leaf, tensor in real:
            module._buffers[leaf] = tensor.to(device)
        retie(model, ties)
        fresh = None
    else:
        fresh = _allocate(model, torch.device(device), set(only))
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) in seen or (fresh is not None and id(param) not in fresh):
            continue
        seen.add(id(param))
        owner_path, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_path) if owner_path else model
        layout = (
            owner.shard_layout(leaf) if callable(getattr(owner, "shard_layout", None)) else None
        )
        layout = layout or ShardLayout(full_shape=tuple(param.shape))
        fill_(param.data, init_rule(model, name, owner, leaf), name, layout, seed)
    _recompute_buffers(model, lost)
    return model


# Note [buffers on meta]
#     A buffer on meta has no value, and only the code that computed it can give one. hyparallel's
#     own meta build never leaves one (Note [parameters on meta, buffers real]); a model built by
#     hand under ``torch.device("meta")`` does. Two recomputations are known to recompute a
#     parameter-free module's buffers and touch nothing else: its ``reset_parameters`` (hyparallel's
#     rotary tables) and, failing that, transformers' ``model._init_weights(module)`` (their rotary
#     embeddings). A meta buffer of a module WITH parameters is refused: either would re-initialise
#     the parameters too, and nothing else knows how the buffer was computed (Gemma's embedding
#     scale). A recomputation that leaves a buffer unwritten (its version counter unchanged) is
#     refused as well: its memory would be garbage.


def meta_buffers(model: nn.Module, only: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """The buffers of ``model`` on the meta device, by name; with ``only``, those of the modules
    owning a name in it (``materialize_`` allocates whole modules)."""
    owners = None if only is None else {name.rpartition(".")[0] for name in only}
    return {
        name: buf
        for name, buf in model.named_buffers(remove_duplicate=False)
        if buf.is_meta and (owners is None or name.rpartition(".")[0] in owners)
    }


def refuse_unrecoverable_buffers(model: nn.Module, only: Collection[str] | None = None) -> None:
    """ConfigError naming the first meta buffer nothing can recompute (Note [buffers on meta])."""
    from hyparallel.spec.errors import ConfigError

    for name in meta_buffers(model, only):
        owner_path, _, _ = name.rpartition(".")
        owner = model.get_submodule(owner_path) if owner_path else model
        if _recompute(model, owner) is None:
            raise ConfigError(
                f"materialize: buffer '{name}' of {type(owner).__name__} is on the meta device, so"
                " it has no value and nothing can recompute it; build the model with its buffers"
                " real (hp.models.load/build, or `with hp.models.empty_init(): model = ...`)"
                " instead of under torch.device('meta')"
            )


def _recompute(model: nn.Module, module: nn.Module):
    """The call that recomputes ``module``'s buffers, or None (Note [buffers on meta])."""
    if next(module.parameters(recurse=False), None) is not None:
        return None
    if callable(getattr(module, "reset_parameters", None)):
        return module.reset_parameters
    # transformers' models recompute rotary buffers here
    if callable(getattr(model, "_init_weights", None)):
        return lambda: model._init_weights(module)
    return None


def _recompute_buffers(model: nn.Module, lost: dict[str, torch.Tensor]) -> None:
    """Recompute the buffers that were on meta (now allocated, empty), refusing any left
    unwritten."""
    from hyparallel.spec.errors import ConfigError

    owners: dict[str, list[str]] = {}
    for name in lost:
        owners.setdefault(name.rpartition(".")[0], []).append(name)
    for owner_path, names in owners.items():
        owner = model.get_submodule(owner_path) if owner_path else model
        versions = {name: model.get_buffer(name)._version for name in names}
        _recompute(model, owner)()
        for name in names:
            if model.get_buffer(name)._version == versions[name]:
                raise ConfigError(
                    f"materialize: buffer '{name}' of {type(owner).__name__} is on the meta device"
                    " and recomputing it left it unwritten; build the model with its buffers real"
                    " (hp.models.load/build, or `with hp.models.empty_init(): model = ...`)"
                    " instead of under torch.device('meta')"
                )


def _allocate(model: nn.Module, device: torch.device, names: set[str]) -> set[int]:
    """Give every module owning one of ``names`` empty tensors on ``device``; returns the new
    tensors' ids.

    Whole modules, not single tensors: a module's buffers are recomputed together. A tensor shared
    by several modules (a tied weight) is allocated once and set on every owner, so it stays tied.
    """
    owners = {name.rpartition(".")[0] for name in names}
    # by id, holding the tensors: one replaced in its table below is freed otherwise, and a new
    # tensor made at its address would read as it (Note [the memo keeps what it copied alive],
    # hyparallel.graph.local_shapes)
    wanted = {
        id(t): t
        for path, module in model.named_modules(remove_duplicate=False)
        if path in owners
        for t in (*module._parameters.values(), *module._buffers.values())
        if t is not None and t.device != device
    }
    # Note [buffers on meta]: a real buffer keeps its values on the way to ``device``; a meta one is
    # recomputed.
    replaced: dict[int, torch.Tensor] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for table in (module._parameters, module._buffers):
            for leaf, tensor in table.items():
                if tensor is None or id(tensor) not in wanted:
                    continue
                if id(tensor) not in replaced:
                    real_buffer = not tensor.is_meta and not isinstance(tensor, nn.Parameter)
                    empty = (
                        tensor.to(device)
                        if real_buffer
                        else torch.empty_like(tensor, device=device)
                    )
                    replaced[id(tensor)] = (
                        nn.Parameter(empty, tensor.requires_grad)
                        if isinstance(tensor, nn.Parameter)
                        else empty
                    )
                table[leaf] = replaced[id(tensor)]
    return {id(t) for t in replaced.values()}


def retie(model: nn.Module, ties: Sequence[Sequence[str]]) -> None:
    """Tied weights (embedding and head) stay one parameter; both must have been split the same
    way."""
    from hyparallel.spec.errors import ConfigError

    for names in ties:
        first, *others = names
        source = model.get_parameter(first)
        for name in others:
            owner_path, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_path) if owner_path else model
            if getattr(owner, attr).shape != source.shape:
                raise ConfigError(
                    f"tensor_parallel: {first} and {name} are one tied weight but were split"
                    " differently; give both the same style (vocab)"
                )
            setattr(owner, attr, source)
