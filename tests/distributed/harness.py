"""What every torchrun worker of the suite shares: one gloo group for all its cases, and a launch
that stops at once.

Note [a failing rank ends the launch]
    A case that raises on one rank leaves its peers waiting in a collective that rank will never
    join (or, worse, pairs their next collective with the wrong one). So the failing rank writes its
    traceback to ``OUT.rank<R>`` and leaves with ``os._exit(1)`` at once, skipping the interpreter's
    teardown (a gloo group torn down mid-collective can block); torchrun's agent sees the exit
    within its monitor interval (0.1 s) and stops the other workers. conftest.torchrun shows those
    files when the launch fails. The group's timeout (GROUP_TIMEOUT_S) is only the last resort for a
    launch whose agent is gone.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import torch.distributed as dist
from torch import nn

# Longer than any one case's wait for a slower peer (8 processes on 2 cores, a rank still computing
# its reference).
GROUP_TIMEOUT_S = 300


def parameter_groups(model: nn.Module) -> list[list[str]]:
    """The model's parameter names, those of one tensor (a tied embedding and head) in one group.

    What a parity test must have compared: every group, on every data-parallel replica (conftest's
    ``assert_every_parameter_compared``).
    """
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return list(groups.values())


def init() -> None:
    """The launch's default gloo group, with a timeout that ends a collective waiting for a rank
    that is gone."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))


def abort(out_path: str, case: str) -> None:
    """Report the exception being handled for ``case`` in ``OUT.rank<R>`` and end this process: the
    launch stops."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", -1))
    text = traceback.format_exc()
    kind, error = sys.exc_info()[:2]
    report = {
        "case": case,
        "rank": rank,
        "error": f"{kind.__name__}: {error}",
        "traceback": text[-3000:],
    }
    Path(f"{out_path}.rank{rank}").write_text(json.dumps(report) + "\n")
    print(f"rank {rank}, case {case}:\n{text}", file=sys.stderr, flush=True)
    os._exit(1)


def run_cases(out_path: str, cases: Iterable[tuple[str, Callable[[], dict]]]) -> None:
    """Run each (name, case) on every rank; rank 0 writes one JSON line per case: the list of every
    rank's result.

    Each result gets its ``case`` name and global ``rank``. An exception on any rank ends the launch
    (Note [a failing rank ends the launch]); then the group is torn down after a final barrier.
    """
    rank, rows = dist.get_rank(), []
    for name, case in cases:
        start = time.perf_counter()
        try:
            result = {"case": name, "rank": rank, **case()}
            result.setdefault("case_seconds", time.perf_counter() - start)
        except BaseException:  # noqa: BLE001 -- any failure, assertion or not, ends the launch with its traceback
            abort(out_path, name)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        rows.append(gathered)
    if rank == 0:
        Path(out_path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    dist.barrier()  # every rank done with every collective before the groups go
    dist.destroy_process_group()


def main(run_case: Callable[[str], dict]) -> None:
    """A worker's entry point: ``script OUT CASE...`` runs ``run_case(name)`` for each case on every
    rank."""
    out_path, names = sys.argv[1], sys.argv[2:]
    init()
    run_cases(out_path, [(name, functools.partial(run_case, name)) for name in names])
