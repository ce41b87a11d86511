"""A launch whose second case fails on rank 1 while rank 0 waits in a collective:
tests/test_harness.py.

Without Note [a failing rank ends the launch] rank 0 would wait in the all-reduce for the group's
timeout.
"""

from __future__ import annotations

import sys

import harness  # tests/distributed/harness.py, beside this script
import torch
import torch.distributed as dist


def fine() -> dict:
    total = torch.ones(1)
    dist.all_reduce(total)
    return {"sum": total.item()}


def fails_on_rank_1() -> dict:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up before the all-reduce")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes
    return {}


if __name__ == "__main__":
    harness.init()
    harness.run_cases(
        sys.argv[1], [("fine", fine), ("fails-on-rank-1", fails_on_rank_1), ("never-run", fine)]
    )
