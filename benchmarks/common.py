"""What the peer benchmarks share: timing a step, checking two runs agree, and alternating the
two."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist


def timed(
    run: Callable[[], torch.Tensor], before: Callable[[], None] | None = None
) -> tuple[float, torch.Tensor]:
    """Seconds for one ``run`` (returning its loss) on this rank, the ranks starting together."""
    if before is not None:
        before()
    dist.barrier()
    start = time.perf_counter()
    loss = run()
    return time.perf_counter() - start, loss


def agreement(
    pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], rtol: float, atol: float
) -> torch.Tensor:
    """(tensors that differ, tensors compared, largest absolute difference) over every rank's
    pairs."""
    pairs = list(pairs)
    summary = torch.tensor(
        [
            sum(not torch.allclose(a, b, rtol=rtol, atol=atol) for a, b in pairs),
            len(pairs),
            max((a - b).abs().max().item() for a, b in pairs),
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(summary[:2])
    dist.all_reduce(summary[2:], op=dist.ReduceOp.MAX)
    return summary


def alternate(
    runs: dict[str, tuple[Callable[[], torch.Tensor], Callable[[], None] | None]],
    steps: int,
    warmup: int,
) -> dict[str, float]:
    """Median milliseconds per step of each run, taken in turn; a step ends when the slowest rank
    finishes."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + steps):
        for name, (run, before) in runs.items():
            seconds, _ = timed(run, before)
            if i >= warmup:
                times[name].append(seconds)
    per_rank = torch.tensor(list(times.values()), dtype=torch.float64)
    dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)
    return {name: statistics.median(row.tolist()) * 1e3 for name, row in zip(times, per_rank)}
