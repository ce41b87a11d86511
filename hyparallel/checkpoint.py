"""Sharded checkpoints that load under any plan: ``save(pmodel, optimizer, dir, step)`` / ``load(...)``.

Every tensor is written with ``torch.distributed.checkpoint`` (DCP) in the *original model's* coordinates:
a parameter's key is its name in the single-device model (``layers.3.mlp.fc.weight``; a tied head under
its first name), its shape the single-device shape, and each rank writes the pieces it holds at their
offsets there (Note [pieces]). Loading under another plan (any dp, tp, pp, ZeRO) reads, for each piece the
new rank holds, whatever saved pieces overlap it: DCP's resharding, with no rank ever holding a full tensor.
AdamW-style optimizer state (tensors shaped like their parameter) is saved the same way, under
``optim.<param name>.<state key>``.

A checkpoint is a folder ``step-00000010`` under the given directory, written as ``.step-00000010.tmp`` and
renamed only when every rank has finished and ``hyparallel.json`` (step, extra, plan) is in it; ``latest``
names the newest complete one. A crash mid-save leaves the previous checkpoint current.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from hyparallel import _files
from hyparallel.errors import ConfigError

MARKER = "hyparallel.json"
FORMAT = 1

# Note [pieces]
# A rank's tensor maps onto the single-device tensor as a few rectangular pieces. Tensor parallelism keeps
# row ranges (several for a fused [q | k | v]) or a column range; FSDP then keeps a run of those local rows;
# a vocabulary-parallel row range may run past the real vocabulary (padding: not saved); transformers'
# Conv1D stores its weight (in, out), so a piece of the (out, in) local weight is written transposed.
# Copies of the same piece on several ranks (replicated over dp or tp, a tied weight on two pipeline ranks,
# key/value heads several tp ranks hold) have the same key and offsets: DCP writes one of them.


@dataclass
class Piece:
    """A rectangle of the single-device tensor: where it sits, and this rank's view of it."""

    offsets: tuple[int, ...]
    view: torch.Tensor  # in the single-device tensor's orientation (a transposed view for Conv1D)


@dataclass
class Entry:
    """One single-device tensor as this rank holds it."""

    shape: tuple[int, ...]
    pieces: list[Piece]


def save(
    pmodel,
    optimizer: torch.optim.Optimizer | None,
    directory: str | Path,
    step: int,
    extra: dict[str, Any] | None = None,
    asynchronous: bool = False,
) -> Path | PendingSave:
    """Write a checkpoint of ``pmodel`` (and the optimizer's state) for ``step``; every rank calls it.

    ``extra`` (JSON-able: the data position, anything the loop needs) comes back from :func:`load`.
    Returns the checkpoint folder. With ``asynchronous`` the tensors are copied (staged) and written by a
    background thread over a process group of its own while training goes on; the returned
    :class:`PendingSave`'s ``wait()``, on every rank, makes the checkpoint current (call it before the
    next save and before exiting).
    """
    root = Path(directory)
    final, temporary = root / f"step-{step:08d}", root / f".step-{step:08d}.tmp"
    if _rank() == 0:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
    _barrier()
    entries = state_entries(pmodel, optimizer)
    torch.save(_rng_state(), temporary / f"rng-{_rank()}.pt")
    meta = {
        "format": FORMAT,
        "step": step,
        "extra": extra or {},
        "world_size": _world(),
        "plan": pmodel.plan.parallel.model_dump(),
        "model": pmodel.plan.model.model_dump() if pmodel.plan.model else None,
        "optimizer": _hyperparameters(optimizer),
        "tied": {alias: first for alias, first in _canonical_names(pmodel).items() if alias != first},
    }
    pending = PendingSave(root, temporary, final, meta)
    if not asynchronous:
        dcp.save({}, storage_writer=dcp.FileSystemWriter(temporary), planner=_SavePieces(entries))
        return pending.wait()
    staged = {
        fqn: Entry(e.shape, [Piece(p.offsets, p.view.detach().to("cpu", copy=True)) for p in e.pieces])
        for fqn, e in entries.items()
    }  # a copy: training may change the tensors while the writer runs
    pending.group = pmodel.io_group()
    pending.future = dcp.async_save(
        {}, storage_writer=dcp.FileSystemWriter(temporary), planner=_SavePieces(staged), process_group=pending.group
    )
    return pending


@dataclass
class PendingSave:
    """A checkpoint being written; ``wait()`` (every rank) finishes it and makes it current."""

    root: Path
    temporary: Path
    final: Path
    meta: dict[str, Any]
    future: Any = None
    group: Any = None

    def wait(self) -> Path:
        """Block until written, then mark it complete and current; returns its folder."""
        if self.future is not None:
            self.future.result()
            self.future = None
        _barrier(self.group)
        if _rank() == 0:
            (self.temporary / MARKER).write_text(json.dumps(self.meta, indent=1))
            previous = self.final.with_name(f".{self.final.name}.old")
            if self.final.exists():  # the same step saved again: the old copy goes only once the new is in place
                shutil.rmtree(previous, ignore_errors=True)
                os.replace(self.final, previous)
            os.replace(self.temporary, self.final)  # complete: now it is current
            shutil.rmtree(previous, ignore_errors=True)
            _write_atomically(self.root / "latest", self.final.name)  # for people; latest() scans
        _barrier(self.group)
        return self.final


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory`` (None if there is none).

    Complete means renamed into place with its marker written; the folders are scanned rather than the
    ``latest`` pointer trusted, so a crash between the rename and the pointer, or a folder cut off mid-write
    (no marker), never hides the newest good one.
    """
    complete = sorted(p for p in Path(directory).glob("step-*") if (p / MARKER).is_file())
    return complete[-1] if complete else None


def load(pmodel, optimizer: torch.optim.Optimizer | None, directory: str | Path) -> dict[str, Any]:
    """Load the newest complete checkpoint under ``directory`` into ``pmodel`` (any plan) and the optimizer.

    Returns ``{"step": ..., "extra": {...}, "path": ...}``. Refuses a folder with no complete checkpoint, or
    one made for another model, with one line each.
    """
    path = latest(directory)
    if path is None:
        raise ConfigError(
            f"{directory}: no complete checkpoint (a step-* folder with {MARKER}); check the path, or start without one"
        )
    meta = _read_marker(path)
    planned = pmodel.plan.model
    if (
        planned is not None
        and meta.get("model")
        and meta["model"].get("fingerprint") not in (None, planned.fingerprint)
    ):
        raise ConfigError(
            f"{path}: saved from model '{meta['model']['name']}', not '{planned.name}'; "
            "load it into the model it was saved from"
        )
    reader = dcp.FileSystemReader(path)
    saved_optimizer = any(key.startswith("optim.") for key in reader.read_metadata().state_dict_metadata)
    if optimizer is not None and saved_optimizer:  # none saved (before the first step): the optimizer starts fresh
        _initialise_state(optimizer)
    entries = state_entries(pmodel, optimizer if saved_optimizer else None)
    dcp.load({}, storage_reader=reader, planner=_LoadPieces(entries))
    rng = path / f"rng-{_rank()}.pt"
    if rng.exists() and meta["world_size"] == _world():  # same layout: each rank resumes its own streams
        _set_rng_state(torch.load(rng, weights_only=False))
    return {"step": meta["step"], "extra": meta["extra"], "path": path}


def export(directory: str | Path, out: str | Path) -> Path:
    """Consolidate the newest checkpoint under ``directory`` into one single-device state dict file.

    Keys are the model's parameter names (tied weights under their first name), values full tensors; the
    format follows the extension: ``.safetensors`` (transformers' and safetensors' loaders read it) or a
    ``torch.save`` file (tied names included, sharing the tensor; safetensors keeps one name, as
    transformers does). Runs in one process, no process group.
    """
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    out = _files.check_writable(out)  # before reading gigabytes
    save_file = _safetensors_writer() if out.suffix == ".safetensors" else None
    kind = _files.kind_of(directory)
    if kind != "folder":
        what = "no such folder" if kind == "missing" else "not a folder"
        raise ConfigError(f"{directory}: {what}; give a checkpoint directory or one of its step-* folders")
    path = latest(directory) if not (Path(directory) / MARKER).exists() else Path(directory)
    if path is None:
        raise ConfigError(f"{directory}: no complete checkpoint (a step-* folder with {MARKER}) to export")
    tied = _read_marker(path).get("tied", {})
    reader = dcp.FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError):
        raise ConfigError(
            f"{path}: no readable torch.distributed.checkpoint metadata (.metadata); "
            "not a complete hyparallel checkpoint"
        ) from None
    keys = [key for key in metadata.state_dict_metadata if key.startswith("model.")]
    everything: dict[str, Any] = {}
    _load_state_dict(everything, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    model = {key[len("model.") :]: value for key, value in everything.items()}
    with _files.atomic_output(out) as tmp:
        if save_file is not None:
            save_file({k: v.contiguous() for k, v in model.items()}, str(tmp))
        else:  # tied names too, one tensor: load_state_dict(strict=True) works on the original model
            torch.save({**model, **{alias: model[first] for alias, first in tied.items() if first in model}}, tmp)
    return out


def _safetensors_writer():
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError(
            "writing .safetensors needs the safetensors package (pip install safetensors); or give OUT a .pt name"
        ) from None
    return save_file


def _read_marker(path: Path) -> dict[str, Any]:
    """The checkpoint's ``hyparallel.json``, checked; anything else there is a one-line ConfigError."""
    try:
        meta = json.loads((path / MARKER).read_bytes())
    except OSError as exc:
        raise ConfigError(f"{path / MARKER}: cannot read: {exc.strerror or exc}") from None
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"{path}: not a hyparallel checkpoint of format {FORMAT} ({MARKER} is not its marker)")
    return meta


def state_entries(pmodel, optimizer: torch.optim.Optimizer | None) -> dict[str, Entry]:
    """Every tensor to save or load, keyed in the single-device model's terms (Note [pieces])."""
    entries: dict[str, Entry] = {}
    aliases = _canonical_names(pmodel)
    state = optimizer.state if optimizer is not None else {}
    for name, param in pmodel.named_parameters():
        key = aliases.get(name, name)
        entries[f"model.{key}"] = _entry(pmodel, name, param.detach())
        for slot, value in state.get(param, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.shape == param.shape:  # moments: laid out like the parameter
                entries[f"optim.{key}.{slot}"] = _entry(pmodel, name, value)
            elif value.dim() == 0:  # step counters: the same on every rank
                local = value.to_local() if hasattr(value, "to_local") else value
                entries[f"optim.{key}.{slot}"] = Entry((), [Piece((), local)])
            else:
                raise ConfigError(
                    f"optimizer state '{slot}' of {key} has shape {tuple(value.shape)}, not its parameter's "
                    f"{tuple(param.shape)}: factored state (Adafactor's row/col) cannot be resharded; "
                    "use an optimizer whose state is shaped like the parameters (Adam, AdamW, SGD)"
                )
    # The model's persistent buffers (running statistics, counters; not rotary tables it recomputes): replicated.
    persistent = {
        name for name, t in pmodel.module.state_dict(keep_vars=True).items() if not isinstance(t, torch.nn.Parameter)
    }
    for module in pmodel.local_modules():
        for name, tensor in module.named_buffers():
            if name in persistent:
                entries[f"model.{name}"] = Entry(tuple(tensor.shape), [Piece((0,) * tensor.dim(), tensor.detach())])
    return entries


def _entry(pmodel, name: str, tensor: torch.Tensor) -> Entry:
    owner_path, _, leaf = name.rpartition(".")
    owner = pmodel.module.get_submodule(owner_path) if owner_path else pmodel.module
    layout = owner.shard_layout(leaf) if callable(getattr(owner, "shard_layout", None)) else None
    local, first_row = _local_rows(tensor)
    if layout is None:
        return Entry(tuple(tensor.shape), [Piece((first_row,) + (0,) * (local.dim() - 1), local)])
    full = tuple(layout.full_shape)
    cols = layout.cols or ((0, full[1]) if len(full) > 1 else None)
    # Local row i of the tensor-parallel tensor -> its row in the single-device tensor, run by run.
    runs, offset = [], 0
    for start, stop in layout.rows or ((0, full[0]),):
        runs.append((offset, start, stop - start))
        offset += stop - start
    pieces = []
    for local_start, model_start, length in runs:
        lo, hi = max(local_start, first_row), min(local_start + length, first_row + local.size(0))
        model_lo, model_hi = model_start + lo - local_start, min(model_start + hi - local_start, full[0])
        if model_hi <= model_lo:  # not here, or vocabulary padding past the real rows
            continue
        view = local[lo - first_row : lo - first_row + model_hi - model_lo]
        if len(full) == 1:
            pieces.append(Piece((model_lo,), view))
        elif layout.transposed:  # Conv1D: the model's tensor is (in, out)
            pieces.append(Piece((cols[0], model_lo), view.t()))
        else:
            pieces.append(Piece((model_lo, cols[0]), view))
    shape = (full[1], full[0]) if layout.transposed and len(full) == 2 else full
    return Entry(shape, pieces)


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The local tensor and the first of its rows in the rank's whole tensor (FSDP shards rows over dp)."""
    if not hasattr(tensor, "to_local"):
        return tensor, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), (offsets[0] if offsets else 0)


def _canonical_names(pmodel) -> dict[str, str]:
    """A tied weight's other names -> its first name (the key it is saved under)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in pmodel.module.named_parameters(remove_duplicate=False):
        aliases[name] = first.setdefault(id(param), name)
    return aliases


class _SavePieces(SavePlanner):
    """Writes each rank's pieces at their single-device offsets; identical pieces on several ranks once."""

    def __init__(self, entries: dict[str, Entry]):
        self.entries = entries
        self.data: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, entry in self.entries.items():
            for piece in entry.pieces:
                data = piece.view.detach().contiguous()
                self.data[fqn, piece.offsets] = data
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, piece.offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=data.shape),
                            properties=TensorProperties.create_from_tensor(data),
                            size=torch.Size(entry.shape),
                        ),
                    )
                )
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]):
        from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        plans, metadata = create_default_global_save_plan(dedup_save_plans(all_plans), rewrite_index_hints=False)
        metadata.planner_data = {
            fqn: (fqn,) for fqn in metadata.state_dict_metadata
        }  # flat keys (export filters by them)
        self.metadata = metadata
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.data[write_item.index.fqn, tuple(write_item.index.offset)]


class _LoadPieces(LoadPlanner):
    """Reads, for every piece this rank holds, the overlapping saved pieces straight into its view."""

    def __init__(self, entries: dict[str, Entry]):
        self.entries = entries
        self.views = {(fqn, p.offsets): p.view for fqn, e in entries.items() for p in e.pieces}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        missing = [fqn for fqn in self.entries if fqn not in saved]
        if missing:
            raise ConfigError(
                f"the checkpoint has no {missing[0]} ({len(missing)} tensors missing); it was saved from "
                "another model, or without the optimizer"
            )
        items: list[ReadItem] = []
        for fqn, entry in self.entries.items():
            if tuple(saved[fqn].size) != entry.shape:
                raise ConfigError(f"{fqn}: saved with shape {tuple(saved[fqn].size)}, this model has {entry.shape}")
            for piece in entry.pieces:
                chunk = ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=piece.view.shape)
                items += create_read_items_for_chunk_list(fqn, saved[fqn], [chunk])
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise ConfigError(f"unexpected bytes entry {read_item.dest_index.fqn} in a hyparallel checkpoint")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self.views[read_item.dest_index.fqn, tuple(read_item.dest_index.offset)]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # read straight into the view


@torch.no_grad()
def _initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (torch builds them at the first step) so they can be loaded into.

    One step on zero gradients with every learning rate at 0 changes no parameter; the gradients the
    parameters had are put back. The state's values are then overwritten by the load.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    grads = [p.grad for p in params]
    rates = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0 if not isinstance(group["lr"], torch.Tensor) else torch.zeros_like(group["lr"])
    try:
        optimizer.step()
    finally:
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate
        for p, grad in zip(params, grads):
            p.grad = grad


def _hyperparameters(optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    if optimizer is None:
        return []
    return [
        {k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float, bool, str, tuple, list))}
        for group in optimizer.param_groups
    ]


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier(group=None) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group)
