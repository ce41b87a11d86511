"""Sharded checkpoints that load under any plan: ``save(pmodel, optimizer, dir, step)`` /
``load(...)``.

Every tensor is written with ``torch.distributed.checkpoint`` (DCP) in the *original model's*
coordinates: a parameter's key is its name in the single-device model (``layers.3.mlp.fc.weight``; a
tied head under its first name), its shape the single-device shape, and each rank writes the pieces
it holds at their offsets there (Note [pieces]). Loading under another plan (any dp, tp, pp, ZeRO)
reads, for each piece the new rank holds, whatever saved pieces overlap it: DCP's resharding, with
no rank ever holding a full tensor. AdamW-style optimizer state (tensors shaped like their
parameter) is saved the same way, under
``optim.<param name>.<state key>``.

A checkpoint is a folder ``step-00000010`` under the given directory, written as
``.step-00000010.tmp`` and renamed only when every rank has finished and ``hyparallel.json`` (step,
extra, plan) is in it; ``latest`` names the newest complete one. A crash mid-save leaves the
previous checkpoint current.

``storage="memory"`` (Note [memory checkpoints]) saves to the node's shared memory in a fraction of
the disk save's time, and a background writer persists the same checkpoint to the directory; a group
restarted on the same nodes resumes from memory, and from disk otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import queue
import random
import shutil
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
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

from hyparallel.runtime import launch
from hyparallel.runtime.data import DataPosition
from hyparallel.spec import files
from hyparallel.spec.errors import ConfigError

MARKER = files.CHECKPOINT_MARKER
FORMAT = 1

# Note [pieces]
# A rank's tensor maps onto the single-device tensor as a few rectangular pieces. Tensor parallelism
# keeps row ranges (several for a fused [q | k | v]) or a column range; FSDP then keeps a run of
# those local rows; a vocabulary-parallel row range may run past the real vocabulary (padding: not
# saved); transformers' Conv1D stores its weight (in, out), so a piece of the (out, in) local weight
# is written transposed. Copies of the same piece on several ranks (replicated over dp or tp, a tied
# weight on two pipeline ranks, key/value heads several tp ranks hold) have the same key and
# offsets: DCP writes one of them.


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
    *,
    extra: dict[str, Any] | None = None,
    asynchronous: bool = False,
    storage: str = "disk",
    keep: int | None = None,
) -> Path | PendingSave:
    """Write a checkpoint of ``pmodel`` (and the optimizer's state) for ``step``; every rank calls
    it.

    Args:
        pmodel: the ParallelModel (any plan; the checkpoint loads under any other).
        optimizer: its optimizer, or None.
        directory: the checkpoint root; the step's folder is made under it.
        step: the step saved. ``extra``, ``asynchronous``, ``storage``, ``keep``: below.

    Returns:
        The checkpoint folder, or a PendingSave (``asynchronous``).

    Raises:
        ConfigError: a bad ``storage`` or ``keep``, or an unwritable folder, in one line.

    Example::

        hp.checkpoint.save(
            pmodel, optimizer, "ckpt", step, extra={"epoch": epoch}, storage="memory", keep=2
        )

    ``extra`` (JSON-able: anything the loop needs) comes back from :func:`load`; the data position
    of ``pmodel.sampler(...)``'s training sampler is saved with it on its own
    (hyparallel/runtime/data.py). Returns the checkpoint folder. With ``asynchronous`` the tensors
    are copied (staged) and written by a background thread over a process group of its own while
    training goes on; the returned :class:`PendingSave`'s ``wait()``, on every rank, makes the
    checkpoint current (call it before the next save and before exiting). ``storage="memory"`` (Note
    [memory checkpoints]) returns once every rank's pieces are in the node's shared memory; the same
    checkpoint reaches ``directory`` in the background (call :func:`finish` after the last save).
    ``keep``: once a checkpoint is complete in ``directory``, only the newest ``keep`` complete ones
    stay there (default: all).
    """
    if storage not in ("disk", "memory"):
        raise ConfigError(f"checkpoint storage {storage!r}: use 'disk' or 'memory'")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ConfigError(
            f"keep={keep!r}: the number of checkpoints to keep is a whole number, 1 or more"
        )
    if getattr(pmodel, "ps_mode", False):  # parameter-server mode: the servers write their shards
        return pmodel.save_checkpoint(directory, step, extra)
    with launch.long_timeouts(), launch.phase(f"the {storage} checkpoint save of step {step}"):
        if storage == "memory":
            return _save_to_memory(pmodel, optimizer, Path(directory), step, extra, keep)
        return _save_to_disk(pmodel, optimizer, Path(directory), step, extra, asynchronous, keep)


def _save_to_disk(
    pmodel, optimizer, root: Path, step: int, extra, asynchronous: bool, keep: int | None
) -> Path | PendingSave:
    final, temporary = _prepare(root, step, _rank_state(pmodel))
    entries = state_entries(pmodel, optimizer)
    pending = PendingSave(root, temporary, final, _meta(pmodel, optimizer, step, extra), keep=keep)
    if not asynchronous:
        dcp.save({}, storage_writer=dcp.FileSystemWriter(temporary), planner=_SavePieces(entries))
        return pending.wait()
    pending.group = pmodel.io_group()
    launch.set_phase(f"writing step {step} to disk", role="asynchronous save")
    pending.future = dcp.async_save(
        {},
        storage_writer=dcp.FileSystemWriter(temporary),
        planner=_SavePieces(_staged(entries)),
        process_group=pending.group,
    )
    return pending


def _prepare(root: Path, step: int, rng: Any, group=None) -> tuple[Path, Path]:
    """The folders of a disk checkpoint of ``step``: ``(final, temporary)``, the temporary one made
    afresh by rank 0 and holding this rank's random streams once every rank (of ``group``) is past
    the barrier."""
    final, temporary = root / f"step-{step:08d}", root / f".step-{step:08d}.tmp"
    if _rank() == 0:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
    _barrier(group)
    torch.save(rng, temporary / f"rng-{_rank()}.pt")
    return final, temporary


def _meta(pmodel, optimizer, step: int, extra) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "step": step,
        "extra": extra or {},
        # global rows: resumes under any dp (hyparallel/runtime/data.py)
        "data": _data_position(pmodel),
        "world_size": _world(),
        "plan": pmodel.plan.parallel.model_dump(),
        "model": pmodel.plan.model.model_dump() if pmodel.plan.model else None,
        # a transformers model's class and config: export rebuilds it
        "hf": hf_spec(getattr(pmodel, "module", None)),
        "optimizer": _hyperparameters(optimizer),
        "tied": {
            alias: first for alias, first in _canonical_names(pmodel).items() if alias != first
        },
        "compression_step": getattr(
            getattr(pmodel, "data_parallel", None), "compression_step", None
        ),
        "loss_scale": _loss_scale(
            pmodel
        ),  # fp16's dynamic loss scale (Note [fp16 loss scaling], hyparallel.runtime.parallel)
    }


def _loss_scale(pmodel) -> dict[str, Any] | None:
    scaler = getattr(pmodel, "scaler", None)
    return scaler.state_dict() if scaler is not None else None


def _data_position(pmodel) -> dict[str, Any] | None:
    """The training sampler's position (pmodel.data_position), the same on every rank; None without
    a sampler."""
    position = pmodel.data_position() if hasattr(pmodel, "data_position") else None
    return None if position is None else position.to_dict()


def _staged(entries: dict[str, Entry]) -> dict[str, Entry]:
    """A host copy of every piece: training may change the tensors while a background writer
    runs."""
    return {
        fqn: Entry(
            e.shape, [Piece(p.offsets, p.view.detach().to("cpu", copy=True)) for p in e.pieces]
        )
        for fqn, e in entries.items()
    }


@dataclass
class PendingSave:
    """A checkpoint being written; ``wait()`` (every rank) finishes it and makes it current."""

    root: Path
    temporary: Path
    final: Path
    meta: dict[str, Any]
    future: Any = None
    group: Any = None
    keep: int | None = None

    def wait(self) -> Path:
        """Block until written, then mark it complete and current; returns its folder."""
        if self.future is not None:
            with launch.phase(f"waiting for the asynchronous save of step {self.meta['step']}"):
                self.future.result()
            self.future = None
            launch.set_phase("", role="asynchronous save")
        _barrier(self.group)
        if _rank() == 0:
            (self.temporary / MARKER).write_text(json.dumps(self.meta, indent=1))
            previous = self.final.with_name(f".{self.final.name}.old")
            # the same step saved again: the old copy goes only once the new is in place
            if self.final.exists():
                shutil.rmtree(previous, ignore_errors=True)
                os.replace(self.final, previous)
            os.replace(self.temporary, self.final)  # complete: now it is current
            shutil.rmtree(previous, ignore_errors=True)
            _write_atomically(self.root / "latest", self.final.name)  # for people; latest() scans
            if self.keep is not None:
                _prune(self.root, self.keep)
        _barrier(self.group)
        return self.final


def _prune(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints under ``root``: each renamed out of
    sight first, so a crash mid-delete never leaves a folder that looks complete but is not."""
    complete = sorted(p for p in root.glob("step-*") if (p / MARKER).is_file())
    for old in complete[:-keep]:
        hidden = old.with_name(f".{old.name}.old")
        shutil.rmtree(hidden, ignore_errors=True)
        os.replace(old, hidden)
        shutil.rmtree(hidden, ignore_errors=True)


# Note [memory checkpoints]
#     A disk checkpoint blocks training for as long as every rank takes to write its pieces;
#     checkpointing rarely then costs the work since the last one at every failure. save(...,
#     storage="memory") instead:
#     1. writes this rank's pieces with torch.distributed.checkpoint, as a checkpoint of this rank
#        alone (no_dist: no collective, no deduplication, every piece the rank holds), to the node's
#        shared memory: a tmpfs folder (/dev/shm, or HYPARALLEL_MEMORY_DIR) named after the
#        checkpoint directory, one folder per rank, renamed into place once complete as on disk.
#        Files in tmpfs outlive the process: a worker killed by SIGKILL leaves its snapshot behind
#        for the group the agent restarts on that node (torch's own shared-memory staging for
#        async_save lives in the process and dies with it; DLRover's flash checkpoint keeps it in
#        its agent and writes its own file layout, not these resharding pieces);
#     2. all ranks agree (one small all-reduce) whether every background writer is idle; if so, a
#        writer thread reads the snapshot back into host tensors and saves them to the checkpoint
#        directory in the usual resharding format, over a gloo group of its own
#        (launch.background_group()), and makes it current there as a disk save does. Training goes
#        on meanwhile: the one copy that blocks it is the write to shared memory. A save that finds
#        a writer busy keeps memory only: the disk copy lags by as much as the disk needs;
#     3. a rank deletes its previous snapshot only once the all-reduce of step 2 shows every rank
#        wrote the new one: a rank killed mid-save leaves every rank holding the step before. load()
#        resumes from memory when every rank has a snapshot of the same step (the newest they all
#        have), written by this run (TORCHELASTIC_RUN_ID) under this plan and world, at least as new
#        as the newest on disk; each rank then reads only its own folder. Otherwise (a node
#        replaced, another world size: a re-plan) it loads from disk, resharded. Shared memory holds
#        the rank's checkpoint bytes (twice while a save replaces the previous snapshot), the writer
#        as much again while it persists; finish() persists the newest snapshot if the disk lags and
#        frees the memory.
MEMORY_ENV = "HYPARALLEL_MEMORY_DIR"


def memory_dir(directory: str | Path) -> Path:
    """The node-local shared-memory folder that holds memory checkpoints of ``directory`` (one
    folder per rank)."""
    base = os.environ.get(MEMORY_ENV) or (
        "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()
    )
    key = hashlib.sha1(str(Path(directory).resolve()).encode()).hexdigest()[:12]
    return Path(base) / f"hyparallel-{os.getuid()}-{key}"


def _run_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


@dataclass
class _Job:
    """A memory checkpoint to persist: where it lies in shared memory, and the layout of its
    pieces."""

    root: Path
    step: int
    snapshot: Path
    meta: dict
    rng: Any
    layout: dict[str, tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Size, torch.dtype]]]]
    keep: int | None = None


@dataclass
class _DiskWriter:
    """The background thread that persists memory checkpoints, one job at a time, over its own
    group."""

    group: Any
    jobs: queue.Queue = field(default_factory=lambda: queue.Queue(maxsize=1))
    busy: bool = False
    error: BaseException | None = None
    newest: _Job | None = None  # the newest memory checkpoint
    reading: int | None = None  # the step whose snapshot the writer reads: not deleted under it
    persisted: int = -1

    def __post_init__(self) -> None:
        threading.Thread(target=self._run, name="hyparallel-checkpoint-writer", daemon=True).start()

    def submit(self, job: _Job) -> None:
        self.busy, self.reading = True, job.step
        self.jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                with launch.phase(f"persisting step {job.step} to disk", role="background writer"):
                    _persist(job, self.group)
                self.persisted = job.step
            # reported by the next save or finish(), on the main thread
            except BaseException as exc:
                self.error = exc
            finally:
                self.reading = None
                # superseded while being read
                if self.newest is None or self.newest.step != job.step:
                    shutil.rmtree(job.snapshot, ignore_errors=True)
                self.busy = False
                self.jobs.task_done()

    def wait_idle(self) -> None:
        self.jobs.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"the background checkpoint writer failed: {error}") from error


def _persist(job: _Job, group) -> None:
    """Read a rank's memory snapshot back into host tensors and save them to disk in the resharding
    format."""
    staged = {
        fqn: Entry(
            shape,
            [Piece(offsets, torch.empty(size, dtype=dtype)) for offsets, size, dtype in pieces],
        )
        for fqn, (shape, pieces) in job.layout.items()
    }
    with warnings.catch_warnings():  # a memory checkpoint is one rank's own: no_dist, as intended
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(
            {},
            storage_reader=dcp.FileSystemReader(job.snapshot),
            planner=_LoadPieces(staged),
            no_dist=True,
        )
    final, temporary = _prepare(job.root, job.step, job.rng, group)
    dcp.save(
        {},
        storage_writer=dcp.FileSystemWriter(temporary),
        planner=_SavePieces(staged),
        process_group=group,
    )
    PendingSave(job.root, temporary, final, job.meta, group=group, keep=job.keep).wait()


def _writer(pmodel) -> _DiskWriter:
    writer = getattr(pmodel, "_checkpoint_writer", None)
    if writer is None:
        # A group of its own: an asynchronous disk save may be using pmodel.io_group() from another
        # thread.
        writer = pmodel._checkpoint_writer = _DiskWriter(launch.background_group())
    return writer


def _save_to_memory(pmodel, optimizer, root: Path, step: int, extra, keep: int | None) -> Path:
    rank = _rank()
    entries = state_entries(pmodel, optimizer)
    meta = {**_meta(pmodel, optimizer, step, extra), "rank": rank, "run": _run_id()}
    rng = _rank_state(pmodel)
    folder = memory_dir(root) / f"rank-{rank}"
    final, temporary = folder / f"step-{step:08d}", folder / f".step-{step:08d}.tmp"
    failed = ""
    try:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
        writer = dcp.FileSystemWriter(temporary, sync_files=False)  # tmpfs: nothing to sync
        # "assuming the intent is to save in a single process": it is
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.save({}, storage_writer=writer, planner=_SavePieces(entries), no_dist=True)
        torch.save(rng, temporary / "rng.pt")
        (temporary / MARKER).write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(temporary, final)
    # every rank learns of it below: none is left waiting in the all-reduce
    except Exception as exc:
        shutil.rmtree(temporary, ignore_errors=True)
        failed = (
            f"{folder}: {exc.strerror or exc}"
            if isinstance(exc, OSError)
            else f"{type(exc).__name__}: {exc}"
        )
    disk = _writer(pmodel)
    failed_anywhere, busy_anywhere, broken_anywhere = _all_max(
        [float(bool(failed)), float(disk.busy), float(disk.error is not None)], pmodel
    )
    if failed_anywhere:
        raise ConfigError(
            f"a memory checkpoint of step {step} failed"
            f" ({failed or 'on another rank: see its log'}); if shared memory is full, make room in"
            f" {memory_dir(root).parent} (a container's /dev/shm: docker --shm-size) or set"
            f" {MEMORY_ENV} to a larger tmpfs"
        )
    if broken_anywhere:
        disk.wait_idle()  # raises this rank's error
        raise RuntimeError("the background checkpoint writer failed on another rank: see its log")
    layout = {
        fqn: (e.shape, [(piece.offsets, piece.view.shape, piece.view.dtype) for piece in e.pieces])
        for fqn, e in entries.items()
    }
    disk.newest = _Job(root, step, final, meta, rng, layout, keep)
    reading = disk.reading
    # every rank has this step now: the one before can go (Note [memory ...])
    for older in folder.glob("step-*"):
        if older != final and (reading is None or older.name != f"step-{reading:08d}"):
            shutil.rmtree(older, ignore_errors=True)
    if not busy_anywhere:
        disk.submit(disk.newest)
    return final


def finish(pmodel, directory: str | Path) -> Path | None:
    """After the last memory save (every rank): wait for the background writer, persist the newest
    memory checkpoint if the directory lags behind it, and free the shared memory. Returns the
    newest on disk."""
    disk = getattr(pmodel, "_checkpoint_writer", None)
    if disk is not None:
        with launch.long_timeouts(), launch.phase("finishing the memory checkpoints"):
            disk.wait_idle()
            if disk.newest is not None and disk.persisted < disk.newest.step:
                disk.submit(disk.newest)
                disk.wait_idle()
        disk.newest = None
        _barrier()
    shutil.rmtree(memory_dir(directory) / f"rank-{_rank()}", ignore_errors=True)
    with contextlib.suppress(OSError):  # the last rank of the node out removes the folder
        memory_dir(directory).rmdir()
    return latest(directory)


def _memory_snapshots(pmodel, directory: Path) -> dict[int, Path]:
    """This rank's complete memory checkpoints of ``directory`` that this run and plan can load, by
    step."""
    found: dict[int, Path] = {}
    folder = memory_dir(directory) / f"rank-{_rank()}"
    # the directory removed: a fresh start, not a resume
    if not folder.is_dir() or not Path(directory).is_dir():
        return found
    planned = pmodel.plan.model
    for path in folder.glob("step-*"):
        try:
            meta = json.loads((path / MARKER).read_text())
        except (OSError, ValueError):
            continue
        if (
            meta.get("format") == FORMAT
            and meta.get("run") == _run_id()
            and meta.get("world_size") == _world()
            and meta.get("rank") == _rank()
            and meta.get("plan") == pmodel.plan.parallel.model_dump()
            and (
                planned is None
                or (meta.get("model") or {}).get("fingerprint") == planned.fingerprint
            )
        ):
            found[int(meta["step"])] = path
    return found


def _all_max(values: list[float], pmodel) -> list[float]:
    """Each value's maximum over all ranks (one all-reduce on the default group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    device = pmodel.device if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory`` (None if there is none).

    Complete means renamed into place with its marker written; the folders are scanned rather than
    the ``latest`` pointer trusted, so a crash between the rename and the pointer, or a folder cut
    off mid-write (no marker), never hides the newest good one.
    """
    complete = sorted(p for p in Path(directory).glob("step-*") if (p / MARKER).is_file())
    return complete[-1] if complete else None


def load(
    pmodel,
    optimizer: torch.optim.Optimizer | None,
    directory: str | Path,
    *,
    missing_ok: bool = False,
) -> dict[str, Any] | None:
    """Load the newest complete checkpoint under ``directory`` into ``pmodel`` (any plan) and the
    optimizer.

    Args:
        pmodel: the ParallelModel to load into, under any plan (the pieces are resharded).
        optimizer: its optimizer, or None.
        directory: the checkpoint root ``save`` wrote to.
        missing_ok: return None when there is no complete checkpoint, instead of refusing.

    Returns:
        ``{"step", "extra", "path", "storage"}`` of the checkpoint loaded, or None (``missing_ok``).

    Raises:
        ConfigError: no complete checkpoint, or one made for another model, in one line.

    Example::

        resumed = hp.checkpoint.load(pmodel, optimizer, "ckpt", missing_ok=True)
        start = resumed["step"] + 1 if resumed else 0

    Returns ``{"step": ..., "extra": {...}, "path": ..., "storage": "disk" | "memory"}``: a memory
    checkpoint of this run is read when every rank has one at least as new as the directory's (Note
    [memory checkpoints]). Every rank calls it. Refuses a folder with no complete checkpoint
    (returns None with ``missing_ok``), or one made for another model, with one line each. A saved
    data position resumes ``pmodel.data_sampler``, or the training sampler ``pmodel.sampler(...)``
    makes next, under any dp.
    """
    directory = Path(directory)
    if getattr(pmodel, "ps_mode", False):  # parameter-server mode: the servers re-shard by row
        return _load_ps(pmodel, directory, missing_ok)
    with launch.long_timeouts(), launch.phase(f"the checkpoint load from {directory}"):
        memory, disk = _memory_snapshots(pmodel, directory), latest(directory)
        # The newest step every rank holds in memory: a rank killed mid-save has the one before,
        # which every rank keeps until all hold the new one (Note [memory checkpoints]).
        least_newest, disk_newest, disk_oldest = _all_max(
            [-max(memory, default=-1), _step_of(disk), -_step_of(disk)], pmodel
        )
        common = -least_newest
        (anyone_lacks,) = _all_max([float(common not in memory)], pmodel)
        # every rank sees the same newest checkpoint on disk
        one_disk_step = disk_newest == -disk_oldest
        if common >= 0 and not anyone_lacks and one_disk_step and common >= disk_newest:
            return _load_from(pmodel, optimizer, memory[int(common)], no_dist=True)
        if disk is None and missing_ok:
            return None
        if disk is None:
            raise ConfigError(
                f"{directory}: no complete checkpoint (a step-* folder with {MARKER}); check the"
                " path, or start without one"
            )
        return _load_from(pmodel, optimizer, disk, no_dist=False)


def _load_ps(pmodel, directory: Path, missing_ok: bool) -> dict[str, Any] | None:
    path = latest(directory)
    if path is None:
        if missing_ok:
            return None
        raise ConfigError(
            f"{directory}: no complete checkpoint (a step-* folder with {MARKER}); check the path"
        )
    meta = _read_marker(path)
    if "ps" not in meta:
        raise ConfigError(
            f"{path}: a checkpoint of a plan without ps; parameter-server mode loads only its own"
        )
    pmodel.load_checkpoint(path)
    return {"step": meta["step"], "extra": meta.get("extra", {}), "path": path, "storage": "disk"}


def _step_of(path: Path | None) -> int:
    return int(path.name.split("-", 1)[1]) if path is not None else -1


def _load_from(pmodel, optimizer, path: Path, no_dist: bool) -> dict[str, Any]:
    meta = _read_marker(path)
    data = meta.get("data")  # checked before any tensor is read
    data = None if data is None else DataPosition.from_dict(data, f"{path / MARKER}: data")
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
    saved_optimizer = any(
        key.startswith("optim.") for key in reader.read_metadata().state_dict_metadata
    )
    # none saved (before the first step): the optimizer starts fresh
    if optimizer is not None and saved_optimizer:
        _initialise_state(optimizer)
    entries = state_entries(pmodel, optimizer if saved_optimizer else None)
    with warnings.catch_warnings():  # a memory checkpoint is one rank's own: no_dist, as intended
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({}, storage_reader=reader, planner=_LoadPieces(entries), no_dist=no_dist)
    if optimizer is not None:
        _restore_hyperparameters(optimizer, meta.get("optimizer") or [], path)
    rng = path / ("rng.pt" if no_dist else f"rng-{_rank()}.pt")
    data_parallel = getattr(pmodel, "data_parallel", None)
    # same layout: each rank resumes its own streams
    if rng.exists() and meta["world_size"] == _world():
        state = torch.load(rng, weights_only=False)
        _set_rng_state(state)
        # PowerSGD's residuals: this rank's own (Note [error feedback that outlives ...])
        if data_parallel is not None:
            data_parallel.load_compression_state(
                state.get("grad_compression"), meta.get("compression_step")
            )
    elif (
        data_parallel is not None
        and data_parallel.compression_step is not None
        and meta["world_size"] != _world()
    ):
        data_parallel.load_compression_state(None, meta.get("compression_step"))
        warnings.warn(
            f"{path} was saved by {meta['world_size']} processes, this run has {_world()}:"
            " PowerSGD's error feedback starts afresh (each rank's residuals are its own)",
            stacklevel=3,
        )
    # an fp16 run resumes its scale
    if meta.get("loss_scale") and getattr(pmodel, "scaler", None) is not None:
        pmodel.scaler.load_state_dict(meta["loss_scale"])
    if data is not None and hasattr(pmodel, "restore_data_position"):
        # now, or when pmodel.sampler(...) makes the training sampler
        pmodel.restore_data_position(data)
    return {
        "step": meta["step"],
        "extra": meta["extra"],
        "path": path,
        "storage": "memory" if no_dist else "disk",
    }


def export(
    directory: str | Path,
    out: str | Path,
    *,
    format: str = "auto",
    max_shard_size: int | str = "5GB",
) -> Path:
    """Consolidate the newest checkpoint under ``directory`` into one single-device state dict file,
    or a folder.

    Args:
        directory: the checkpoint root.
        out: the file or folder to write. ``format``, ``max_shard_size``: below.

    Returns:
        The path written.

    Raises:
        ConfigError: no complete checkpoint, or ``out`` cannot be written, in one line (before
            reading gigabytes).

    Example::

        hp.checkpoint.export("ckpt", "model.safetensors")  # or "hf-folder/" for from_pretrained

    Keys are the model's parameter names (tied weights under their first name), values full tensors;
    ``format`` ``auto`` follows OUT's name (hyparallel.runtime.pretrained.export_format):
    ``.safetensors`` (transformers' and safetensors' loaders read it), a folder (no suffix, a
    trailing ``/`` or an existing folder: ``hf``, a Hugging Face folder of an ``hf:`` model, shards
    of at most ``max_shard_size``, that ``from_pretrained`` loads) or else a ``torch.save`` file
    (tied names included, sharing the tensor; safetensors keeps one name, as transformers does).
    Runs in one process, no process group.
    """
    written = export_format(out, format)
    if written == "hf":
        return export_hf(directory, out, max_shard_size)
    out = files.check_writable(out)  # before reading gigabytes
    save_file = _safetensors_writer() if written == "safetensors" else None
    path = newest_checkpoint(directory)
    marker = _read_marker(path)
    if "ps" in marker:  # parameter-server mode: every server's rows, put back in order
        from hyparallel.runtime.ps.server import assemble

        shards = [
            torch.load(f, weights_only=False) for f in sorted((path / "ps").glob("server-*.pt"))
        ]
        return _write_export(assemble(shards), {}, out, save_file)
    return _write_export(consolidated(path), marker.get("tied", {}), out, save_file)


def newest_checkpoint(directory: str | Path) -> Path:
    """``directory`` if it is one checkpoint, else its newest complete one; none there is a one-line
    ConfigError."""
    kind = files.kind_of(directory)
    if kind != "folder":
        what = "no such folder" if kind == "missing" else "not a folder"
        raise ConfigError(
            f"{directory}: {what}; give a checkpoint directory or one of its step-* folders"
        )
    path = latest(directory) if not (Path(directory) / MARKER).exists() else Path(directory)
    if path is None:
        raise ConfigError(
            f"{directory}: no complete checkpoint (a step-* folder with {MARKER}) to export"
        )
    return path


def consolidated(path: Path) -> dict[str, torch.Tensor]:
    """The single-device model state the checkpoint ``path`` holds, every tensor whole (one process,
    no group)."""
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

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
    _load_state_dict(
        everything,
        storage_reader=reader,
        planner=_EmptyStateDictLoadPlanner(keys=keys),
        no_dist=True,
    )
    return {key[len("model.") :]: value for key, value in everything.items()}


def _write_export(
    model: dict[str, torch.Tensor], tied: dict[str, str], out: Path, save_file
) -> Path:
    with files.atomic_output(out) as tmp:
        if save_file is not None:
            save_file({k: v.contiguous() for k, v in model.items()}, str(tmp))
        # tied names too, one tensor: load_state_dict(strict=True) works on the original model
        else:
            torch.save(
                {
                    **model,
                    **{alias: model[first] for alias, first in tied.items() if first in model},
                },
                tmp,
            )
    return out


def _safetensors_writer():
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError(
            "writing .safetensors needs the safetensors package (pip install safetensors); or give"
            " OUT a .pt name"
        ) from None
    return save_file


def _read_marker(path: Path) -> dict[str, Any]:
    """The checkpoint's ``hyparallel.json``, checked; anything else there is a one-line
    ConfigError."""
    try:
        meta = json.loads((path / MARKER).read_bytes())
    except OSError as exc:
        raise ConfigError(f"{path / MARKER}: cannot read: {exc.strerror or exc}") from None
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(
            f"{path}: not a hyparallel checkpoint of format {FORMAT} ({MARKER} is not its marker)"
        )
    return meta


def state_entries(pmodel, optimizer: torch.optim.Optimizer | None) -> dict[str, Entry]:
    """Every tensor to save or load, keyed in the single-device model's terms (Note [pieces])."""
    # A forward the user ran on pmodel.module itself leaves ZeRO 1-2's units gathered: their shards
    # are the state (a plain module, hyparallel.runtime.pretrained's _Whole, has no data
    # parallelism)
    if hasattr(pmodel, "data_parallel"):
        pmodel.data_parallel.reshard(pmodel.local_modules())
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
                    f"optimizer state '{slot}' of {key} has shape {tuple(value.shape)}, not its"
                    f" parameter's {tuple(param.shape)}: factored state (Adafactor's row/col)"
                    " cannot be resharded; use an optimizer whose state is shaped like the"
                    " parameters (Adam, AdamW, SGD)"
                )
    # The model's persistent buffers (running statistics, counters; not rotary tables it
    # recomputes): replicated.
    persistent = {
        name
        for name, t in pmodel.module.state_dict(keep_vars=True).items()
        if not isinstance(t, torch.nn.Parameter)
    }
    for module in pmodel.local_modules():
        for name, tensor in module.named_buffers():
            if name in persistent:
                entries[f"model.{name}"] = Entry(
                    tuple(tensor.shape), [Piece((0,) * tensor.dim(), tensor.detach())]
                )
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
        model_lo, model_hi = (
            model_start + lo - local_start,
            min(model_start + hi - local_start, full[0]),
        )
        if model_hi <= model_lo:  # not here, or vocabulary padding past the real rows
            continue
        view = local[lo - first_row : lo - first_row + model_hi - model_lo]
        if len(full) == 1:
            pieces.append(Piece((model_lo,), view))
        elif layout.transposed:  # Conv1D: the model's tensor is (in, out)
            pieces.append(Piece((cols[0], model_lo), view.t()))
        else:  # dims past the second whole (stacked experts: [E, out, in])
            pieces.append(Piece((model_lo, cols[0]) + (0,) * (len(full) - 2), view))
    shape = (full[1], full[0]) if layout.transposed and len(full) == 2 else full
    return Entry(shape, pieces)


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The local tensor and the first of its rows in the rank's whole tensor (FSDP shards rows over
    dp)."""
    if not hasattr(tensor, "to_local"):
        return tensor, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tensor.to_local(), (offsets[0] if offsets else 0)


def _canonical_names(pmodel) -> dict[str, str]:
    """A tied weight's other names -> its first name (the key it is saved under)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in pmodel.module.named_parameters(remove_duplicate=False):
        aliases[name] = first.setdefault(id(param), name)
    return aliases


class _SavePieces(SavePlanner):
    """Writes each rank's pieces at their single-device offsets; identical pieces on several ranks
    once."""

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
                            chunk=ChunkStorageMetadata(
                                offsets=torch.Size(piece.offsets), sizes=data.shape
                            ),
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

        plans, metadata = create_default_global_save_plan(
            dedup_save_plans(all_plans), rewrite_index_hints=False
        )
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
    """Reads, for every piece this rank holds, the overlapping saved pieces straight into its
    view."""

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
                f"the checkpoint has no {missing[0]} ({len(missing)} tensors missing); it was saved"
                " from another model, or without the optimizer"
            )
        items: list[ReadItem] = []
        for fqn, entry in self.entries.items():
            if tuple(saved[fqn].size) != entry.shape:
                raise ConfigError(
                    f"{fqn}: saved with shape {tuple(saved[fqn].size)}, this model has"
                    f" {entry.shape}"
                )
            for piece in entry.pieces:
                chunk = ChunkStorageMetadata(
                    offsets=torch.Size(piece.offsets), sizes=piece.view.shape
                )
                items += create_read_items_for_chunk_list(fqn, saved[fqn], [chunk])
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise ConfigError(
            f"unexpected bytes entry {read_item.dest_index.fqn} in a hyparallel checkpoint"
        )

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self.views[read_item.dest_index.fqn, tuple(read_item.dest_index.offset)]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # read straight into the view


@torch.no_grad()
def _initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (torch builds them at the first step) so they can be
    loaded into.

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
        group["lr"] = (
            0.0 if not isinstance(group["lr"], torch.Tensor) else torch.zeros_like(group["lr"])
        )
    try:
        optimizer.step()
    finally:
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate
        for p, grad in zip(params, grads):
            p.grad = grad


def _restore_hyperparameters(
    optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]], path: Path
) -> None:
    """Each param group's saved hyperparameters (the learning rate a scheduler set, betas, weight
    decay) back into the optimizer, as ``Optimizer.load_state_dict`` does; keys the group does not
    have are left out."""
    if not saved:
        return
    if len(saved) != len(optimizer.param_groups):
        warnings.warn(
            f"{path}: saved with {len(saved)} optimizer param groups, this optimizer has"
            f" {len(optimizer.param_groups)}: its hyperparameters (learning rates) are kept as"
            " they are",
            stacklevel=4,
        )
        return
    for group, values in zip(optimizer.param_groups, saved):
        for key, value in values.items():
            if key in group and not isinstance(group[key], torch.Tensor):
                group[key] = tuple(value) if isinstance(group[key], tuple) else value


def _hyperparameters(optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    if optimizer is None:
        return []
    return [
        {
            k: v
            for k, v in group.items()
            if k != "params" and isinstance(v, (int, float, bool, str, tuple, list))
        }
        for group in optimizer.param_groups
    ]


def _rank_state(pmodel) -> dict[str, Any]:
    """What only this rank holds and resumes when the world size is the same: random streams,
    PowerSGD's state."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    state["grad_compression"] = _compression_state(pmodel)
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _compression_state(pmodel) -> dict[str, Any] | None:
    data_parallel = getattr(pmodel, "data_parallel", None)
    return data_parallel.compression_state() if data_parallel is not None else None


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


# Pretrained weights in and Hugging Face folders out (hp.checkpoint.load_pretrained); that module
# imports this one only inside its functions, so either may be imported first.
from hyparallel.runtime.pretrained import (  # noqa: E402, F401
    PretrainedLoad,
    export_format,
    export_hf,
    hf_spec,
    load_pretrained,
)
