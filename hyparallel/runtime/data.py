"""The data position of a run, in global batches: a sampler whose sequence does not depend on the
plan.

    # shuffled with seed 0, resumable
    sampler = pmodel.sampler(dataset)
    # share = global_batch // dp
    loader = DataLoader(dataset, batch_size=sampler.share, sampler=sampler)
    for inputs, targets in loader:
        loss = pmodel.train_step(inputs, targets)                   # counts the batch as consumed

Note [global batches, whatever the plan]
    Epoch e orders the dataset by one permutation (``torch.randperm`` seeded ``seed + e``; the
    identity without shuffling). Global batch s of the epoch is rows ``[s*G, (s+1)*G)`` of it (G =
    ``training.global_batch``), and data-parallel rank r takes the contiguous chunk r of each,
    exactly the rows ``pmodel.shard(global_batch)`` gives it. So every plan of the same global batch
    trains on the same global batches in the same order, and the loss curve does not depend on dp.
    An epoch ends when no full global batch is left (``drop_last``, the default) or, without it,
    after a last one padded by wrapping round to the epoch's first rows, as DistributedSampler does.

Note [what the position counts]
    A DataLoader with workers draws indices ahead of the training loop (``prefetch_factor`` batches
    a worker), so what the sampler has handed out is not what was trained on. The position counts
    only batches the loop consumed: ``train_step`` calls :meth:`DataSampler.step_consumed` once per
    call. The position (epoch, global rows consumed in it, seed) is the same on every rank and is in
    global rows, so it resumes under any dp: a checkpoint saves it (``hp.checkpoint.save``: the
    marker's ``data``) and ``hp.checkpoint.load`` restores it into ``pmodel.data_sampler``, or keeps
    it until ``pmodel.sampler(...)`` makes one. An iterator started (``iter``) after the restore
    begins at the first row not consumed; one started before it keeps its own order.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sized
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from hyparallel.spec.errors import ConfigError

__all__ = ["DataPosition", "DataSampler"]


@dataclass(frozen=True)
class DataPosition:
    """Where a run is in its data: the epoch, the global rows consumed in it, the order's seed (and
    its dataset)."""

    epoch: int
    # global rows of this epoch's order already trained on (a multiple of the global batch then
    # used)
    consumed: int
    seed: int
    shuffle: bool
    dataset_rows: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, as a checkpoint's marker stores it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> DataPosition:
        """The position ``to_dict`` wrote; anything else is one ConfigError line naming
        ``where``."""
        fields = cls.__dataclass_fields__
        if not isinstance(data, dict) or set(data) != set(fields):
            raise ConfigError(
                f"{where}: the data position is not {{{', '.join(fields)}}}; the checkpoint was"
                " edited or is damaged"
            )
        for name, value in data.items():
            kind = bool if name == "shuffle" else int
            if type(value) is not kind or (kind is int and name != "seed" and value < 0):
                raise ConfigError(
                    f"{where}: data position {name}={value!r} is not a valid {kind.__name__}"
                )
        return cls(**data)


class DataSampler(Sampler[int]):
    """This data-parallel rank's rows of each global batch (Note [global batches, whatever the
    plan]), resumable.

    ``train`` samplers count what was consumed (``step_consumed``) and roll over epochs; an
    evaluation sampler (``train=False``) always starts from the first global batch of its epoch and
    is never advanced or saved.
    """

    def __init__(
        self,
        dataset: Sized,
        global_batch: int,
        dp_size: int,
        dp_rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        train: bool = True,
    ):
        rows = len(dataset)
        if global_batch % dp_size or not 0 <= dp_rank < dp_size:
            raise ConfigError(
                f"global batch {global_batch} over dp {dp_size} (rank {dp_rank}): no equal shares"
            )
        if drop_last and rows < global_batch:
            raise ConfigError(
                f"the dataset has {rows} rows, fewer than one global batch ({global_batch}); give"
                " more data, a smaller training.global_batch, or drop_last=False (the batch is"
                " filled by wrapping round)"
            )
        if rows == 0:
            raise ConfigError("the dataset is empty; give the sampler a dataset with rows")
        self.rows, self.global_batch, self.dp_size, self.dp_rank = (
            rows,
            global_batch,
            dp_size,
            dp_rank,
        )
        # the DataLoader's batch_size: this rank's rows of a global batch
        self.share = global_batch // dp_size
        self.shuffle, self.seed, self.drop_last, self.train = shuffle, seed, drop_last, train
        self.epoch, self.consumed = 0, 0

    # ---- the order -------------------------------------------------------------------------------

    def batches_left(self) -> int:
        """Global batches of this epoch after the consumed rows (a padded last one counted without
        ``drop_last``)."""
        left = self.rows - self.consumed
        return left // self.global_batch if self.drop_last else -(-left // self.global_batch)

    def __len__(self) -> int:
        return self.batches_left() * self.share

    def __iter__(self) -> Iterator[int]:
        # Computed now, not lazily: the order is the one at iter() time (Note [what the position
        # counts]).
        return iter(
            self.global_rows(self.epoch, self.consumed, self.batches_left())[:, self.dp_rank]
            .flatten()
            .tolist()
        )

    def global_rows(self, epoch: int, start: int, batches: int) -> torch.Tensor:
        """Dataset indices of ``batches`` global batches from row ``start`` of ``epoch``'s order,
        shaped
        ``(batches, dp, share)``: ``[s, r]`` is dp rank r's chunk of global batch s."""
        if self.shuffle:
            order = torch.randperm(
                self.rows, generator=torch.Generator().manual_seed(self.seed + epoch)
            )
        else:
            order = torch.arange(self.rows)
        needed = start + batches * self.global_batch
        # drop_last=False: the last batch wraps round to the epoch's first rows
        if needed > self.rows:
            order = torch.cat([order, order.repeat(-(-(needed - self.rows) // self.rows))])
        return order[start:needed].view(batches, self.dp_size, self.share)

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch`` (DistributedSampler's call); the current epoch keeps its
        position.

        Not needed: epochs roll over by themselves. A loop that calls it counts from
        ``sampler.epoch`` after a resume.
        """
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    # ---- the position ----------------------------------------------------------------------------

    def step_consumed(self) -> None:
        """One global batch was trained on (``train_step`` calls it); past the epoch's last one, the
        next epoch."""
        if not self.train:
            return
        self.consumed += self.global_batch
        if self.batches_left() == 0:
            self.epoch, self.consumed = self.epoch + 1, 0

    def position(self) -> DataPosition:
        """The position to save: the same on every rank, in global rows (Note [what the position
        counts])."""
        return DataPosition(self.epoch, self.consumed, self.seed, self.shuffle, self.rows)

    def resume(self, position: DataPosition) -> None:
        """Continue from a saved ``position``, under this dp and global batch: its order (seed,
        shuffling) is kept.

        A dataset of another length, or a position no full global batch follows, starts the next
        epoch's order there; the first is warned about.
        """
        if position.dataset_rows != self.rows:
            warnings.warn(
                f"the checkpoint's data position is for a dataset of {position.dataset_rows} rows,"
                f" this one has {self.rows}: its order differs; resuming at epoch {position.epoch},"
                f" row {position.consumed}",
                stacklevel=2,
            )
        self.seed, self.shuffle = position.seed, position.shuffle
        self.epoch, self.consumed = position.epoch, min(position.consumed, self.rows)
        if self.batches_left() == 0:
            self.epoch, self.consumed = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """``position().to_dict()``, under torch's usual name."""
        return self.position().to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``resume`` from a ``state_dict()``."""
        self.resume(DataPosition.from_dict(state, "DataSampler.load_state_dict"))
