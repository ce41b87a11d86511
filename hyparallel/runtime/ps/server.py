"""One parameter server: its rows of every table, the dense weights assigned to it, and their
optimizer state.

Row r of a table lives on server ``r % servers`` at local index ``r // servers`` (Note [rows by
modulo]).
``ServerShard`` is plain Python, tested without any engine; :func:`server_actor` wraps it in a Ray
actor that Ray restarts after a crash, from the newest checkpoint the dispatcher knows of.

Note [rows by modulo]
    Click logs are Zipf-distributed and most id spaces hand out small ids first, so the hot rows are
    the low ones. Contiguous ranges would put them all on server 0; ``r % servers`` spreads them
    evenly and lets any number of servers re-shard a checkpoint row by row.

Note [each batch applied once]
    Every push names the data batch it comes from, and a server remembers the batches it has applied
    (in its checkpoints too). A push for a batch already applied is dropped. This is what makes
    re-queuing safe: a worker that died after pushing to server 0 but before server 1 leaves its
    batch to another worker, whose pushes server 0 drops and server 1 applies. At staleness 0 a
    step's pushes are only staged, and the dispatcher's ``apply_step`` names the batches the step
    counts (those whose worker finished them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from hyparallel.runtime.ps.optim import RowOptimizer, Rule


def assemble(shards: list[dict]) -> dict[str, torch.Tensor]:
    """The whole model's weights from every server's ``tables`` and ``dense`` (``index``-ed,
    ``servers`` of them): each table as ``<module path>.weight`` with its rows back in order, the
    dense weights by name."""
    shards = sorted(shards, key=lambda shard: shard["index"])
    servers = len(shards)
    state = {}
    for name, rows in shards[0]["tables"].items():
        total = sum(shard["tables"][name].shape[0] for shard in shards)
        full = torch.empty(total, *rows.shape[1:], dtype=rows.dtype)
        for shard in shards:  # server i held rows i, i + servers, i + 2 servers, ...
            full[shard["index"] :: servers] = shard["tables"][name]
        state[f"{name}.weight"] = full
    for shard in shards:
        state.update(shard["dense"])
    return state


@dataclass
class Push:
    """One worker's gradients for one batch, on one server: sparse rows by table, dense tensors by
    name."""

    worker: str
    step: int
    batch: int
    samples: int
    # table -> (local rows (U,), grad (U, dim)), rows unique
    sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]
    dense: dict[str, torch.Tensor] = field(default_factory=dict)


class ServerShard:
    """Server ``index`` of ``servers``: pull rows, take pushes, apply them (staleness 0: one step at
    a time)."""

    def __init__(
        self,
        index: int,
        servers: int,
        tables: dict[str, torch.Tensor],
        dense: dict[str, torch.Tensor],
        rule: Rule,
        lr: float,
        synchronous: bool,
    ) -> None:
        self.index, self.servers, self.synchronous = index, servers, synchronous
        self.rule, self.lr = rule, lr
        self.tables = {name: rows.detach().clone() for name, rows in tables.items()}
        self.dense = {name: weight.detach().clone() for name, weight in dense.items()}
        self.optimizers = {
            name: RowOptimizer(rule, lr, w) for name, w in {**self.tables, **self.dense}.items()
        }
        self.applied: set[int] = set()  # Note [each batch applied once]
        self.staged: dict[int, list[Push]] = {}  # step -> pushes waiting for apply_step
        # (worker, step, batch) of each applied update, in order
        self.updates: list[tuple[str, int, int]] = []

    # ---- workers ------------------------------------------------------------------------------

    def pull(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The current values of some local rows of some tables."""
        return {name: self.tables[name][index] for name, index in rows.items()}

    def pull_dense(self) -> dict[str, torch.Tensor]:
        """The dense weights this server holds."""
        return dict(self.dense)

    def push(self, push: Push) -> bool:
        """Apply (or, at staleness 0, stage) one push; False when its batch was applied already."""
        if push.batch in self.applied:
            return False
        if self.synchronous:
            self.staged.setdefault(push.step, []).append(push)
            return True
        self._apply([push], scale=1.0)
        self.applied.add(push.batch)
        self.updates.append((push.worker, push.step, push.batch))
        return True

    def apply_step(self, step: int, batches: list[int]) -> list[int]:
        """Staleness 0: apply the staged pushes of ``batches`` as one mean gradient; returns the
        batches applied."""
        wanted = set(batches) - self.applied
        pushes = [p for p in self.staged.pop(step, []) if p.batch in wanted]
        # a step closed without them: their worker was evicted
        for late in [s for s in self.staged if s < step]:
            del self.staged[late]
        if pushes:
            # Each worker pushed the gradient of its mean loss; weighting by samples gives the mean
            # over the step.
            total = sum(p.samples for p in pushes)
            self._apply(pushes, scale=None, total=total)
        for p in pushes:
            self.applied.add(p.batch)
            self.updates.append((p.worker, p.step, p.batch))
        return [p.batch for p in pushes]

    def _apply(self, pushes: list[Push], scale: float | None, total: int = 1) -> None:
        weight = (lambda p: p.samples / total) if scale is None else (lambda p: scale)
        for name in {name for p in pushes for name in p.sparse}:
            parts = [(p.sparse[name], weight(p)) for p in pushes if name in p.sparse]
            rows = torch.cat([r for (r, _), _ in parts])
            grads = torch.cat([g * w for (_, g), w in parts])
            unique, inverse = torch.unique(rows, return_inverse=True)
            summed = torch.zeros(len(unique), grads.shape[1], dtype=grads.dtype).index_add_(
                0, inverse, grads
            )
            self.optimizers[name].apply(self.tables[name], unique, summed)
        for name in {name for p in pushes for name in p.dense}:
            grad = sum(p.dense[name] * weight(p) for p in pushes if name in p.dense)
            self.optimizers[name].apply(self.dense[name], None, grad)

    # ---- checkpoints --------------------------------------------------------------------------

    def state(self) -> dict:
        """Everything a restart needs: weights, optimizer state, the batches applied."""
        return {
            "index": self.index,
            "servers": self.servers,
            "rule": self.rule,
            "tables": self.tables,
            "dense": self.dense,
            "optimizer": {name: opt.state for name, opt in self.optimizers.items()},
            "applied": sorted(self.applied),
        }

    def save(self, path: str | Path) -> None:
        """Write :meth:`state` to ``path`` (replaced only once complete)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(self.state(), tmp)
        tmp.replace(path)

    def load(self, files: list[Path]) -> None:
        """Take this server's rows from the shards of a checkpoint written by any number of
        servers."""
        states = [torch.load(f, weights_only=False) for f in files]
        old = states[0]["servers"]
        if len(states) != old or sorted(s["index"] for s in states) != list(range(old)):
            raise ValueError(
                f"a parameter-server checkpoint needs all {old} shards, found {len(states)}"
            )
        states.sort(key=lambda s: s["index"])
        if states[0]["rule"] != self.rule:
            raise ValueError(
                f"the checkpoint's servers applied {states[0]['rule']}, this plan's ps.optimizer is"
                f" {self.rule}"
            )
        for name, mine in self.tables.items():
            total = sum(s["tables"][name].shape[0] for s in states)
            full = torch.empty(total, *mine.shape[1:], dtype=mine.dtype)
            full_state = {
                k: torch.empty(total, *v.shape[1:], dtype=v.dtype)
                for k, v in self.optimizers[name].state.items()
            }
            for s in states:  # old server j held rows j, j + old, j + 2 old, ...
                full[s["index"] :: old] = s["tables"][name]
                for key, value in s["optimizer"][name].items():
                    full_state[key][s["index"] :: old] = value
            self.tables[name] = full[self.index :: self.servers].clone()
            self.optimizers[name].state = {
                k: v[self.index :: self.servers].clone() for k, v in full_state.items()
            }
        for name in self.dense:
            owner = next(s for s in states if name in s["dense"])
            self.dense[name] = owner["dense"][name].clone()
            self.optimizers[name].state = {
                k: v.clone() for k, v in owner["optimizer"][name].items()
            }
        # Note [each batch applied once]: after a re-shard a row's history came from one old server;
        # the union is exact when the shards were saved at one step boundary (what the dispatcher's
        # checkpoint does).
        self.applied = set().union(*(set(s["applied"]) for s in states))
        self.staged.clear()
