"""Checkpoint cost and goodput under failures: the save time, the best checkpoint interval, the
expected goodput.

Pure functions of bytes, bandwidths and seconds (docs/cost-model.md, "Checkpoints and goodput");
``with_goodput`` reads them off a plan and writes the plan's ``checkpoint`` section.

Note [checkpoint bytes per rank]
    ``hp.checkpoint.save`` writes, through DCP, every parameter as the runtime holds it (fp32:
    autocast keeps fp32 weights) and AdamW's m and v (fp32): 12 bytes per parameter whatever the
    training dtype; gradients are not saved. On disk, a piece several ranks hold (replicated over
    dp, over tp, or both) is written by one of them (DCP's dedup_save_plans, which gives each
    duplicate to the rank with the least to write so far), so a pipeline stage's ranks together
    write its parameters once, and the busiest rank writes

        disk_bytes_per_rank = stage_params x 12 / (tp x dp)

    with stage_params the parameters of the busiest pipeline rank (all its virtual stages), before
    tensor splitting: the even spread DCP's balancing approaches, whatever the ZeRO stage (the same
    unique pieces are written, only by other ranks). A memory checkpoint (Note [memory checkpoints]
    in hyparallel/runtime/checkpoint.py) first snapshots every piece the rank holds, with no
    deduplication:

        held_bytes_per_rank = stage_params x 12 / tp          (ZeRO 0: replicated over dp)
                            = stage_params x 12 / (tp x dp)   (ZeRO >= 1: a 1/dp shard per rank)

    and its background writer then persists the deduplicated pieces, as a disk save. Not modelled:
    pieces DCP cannot balance exactly (one large replicated tensor), pieces tp replicates (norms,
    biases: each tp rank holds them whole), vocabulary padding.

Note [Young/Daly]
    With a checkpoint every T seconds that stops training for C seconds, failures at mean interval M
    (the job's MTBF) and R seconds to restart, the first-order fraction of wall time lost is

        waste(T) = C / T + (T / 2 + R) / M

    (the checkpoints themselves, half an interval of work lost per failure on average, the restart);
    it is least at T* = sqrt(2 C M) (J. W. Young 1974, "A first order approximation to the optimum
    checkpoint interval"; J. T. Daly 2006, "A higher order estimate of the optimum checkpoint
    interval for restart dumps", whose first-order term this is), and goodput = 1 - waste. The
    interval is taken in whole steps: of the two whole numbers of steps around T*, the one with the
    higher goodput, and at least one step.
"""

from __future__ import annotations

import math

from hyparallel.planner import costs
from hyparallel.spec import limits
from hyparallel.spec.cluster import ClusterSpec
from hyparallel.spec.errors import PlanError
from hyparallel.spec.schema import CheckpointCost, CheckpointStorage, Plan

# Note [checkpoint bytes per rank]: fp32 weights (4) + AdamW m and v (8).
CHECKPOINT_BYTES_PER_PARAM = costs.MASTER_BYTES_PER_PARAM + costs.OPTIMIZER_BYTES_PER_PARAM["fp32"]

# Seconds from a failure to training again, when the caller does not say: an estimate for a restart
# on healthy nodes (torchrun or dlrover-run detect the failure and relaunch the workers, which
# import torch, initialise CUDA and the process groups and load the checkpoint: tens of seconds to
# minutes). A job that waits for a replacement node, or loads a large checkpoint from a shared file
# system, takes longer; pass what yours takes.
DEFAULT_RESTART_S = 60.0

SECONDS_PER_HOUR = 3600.0
STORAGES: tuple[CheckpointStorage, ...] = ("memory", "disk")


def checkpoint_bytes_per_rank(plan: Plan) -> float:
    """Bytes the busiest rank writes to disk per checkpoint (Note [checkpoint bytes per rank])."""
    par = plan.parallel
    return _busiest_stage_params(plan) * CHECKPOINT_BYTES_PER_PARAM / (par.tp * par.dp)


def held_bytes_per_rank(plan: Plan) -> float:
    """Bytes of checkpointed state the busiest rank holds: what a memory checkpoint copies to host
    memory (Note [checkpoint bytes per rank])."""
    par = plan.parallel
    sharded_over = par.dp if par.zero >= 1 else 1
    return _busiest_stage_params(plan) * CHECKPOINT_BYTES_PER_PARAM / (par.tp * sharded_over)


def _busiest_stage_params(plan: Plan) -> float:
    """Parameters (before tensor splitting) of the pipeline rank that holds the most, all its
    virtual stages."""
    par = plan.parallel
    if plan.stages and all(stage.num_params is not None for stage in plan.stages):
        per_device = [0] * par.pp
        for stage in plan.stages:
            per_device[stage.index % par.pp] += stage.num_params
        return float(max(per_device))
    # no per-stage counts (a hand-written plan): the parameters split evenly
    if plan.model is not None:
        return plan.model.num_params / par.pp
    raise PlanError(
        "the plan gives neither stages[].num_params nor model.num_params, so its checkpoint size is"
        " unknown; plan it with `hyparallel plan` (or complete it with `hyparallel show PLAN"
        " --model MODEL`)"
    )


def host_copy_s(held_bytes: float, host_memory_bandwidth_bytes_per_s: float) -> float:
    """Seconds for one device's memory checkpoint: ``held_bytes`` into the node's shared memory,
    every device of the node saving at once."""
    return held_bytes / host_memory_bandwidth_bytes_per_s


def disk_write_s(
    bytes_per_rank: float, ranks_per_node: int, disk_bandwidth_bytes_per_s: float
) -> float:
    """Seconds for one node to write its ranks' checkpoints: they share the node's disk
    bandwidth."""
    return bytes_per_rank * ranks_per_node / disk_bandwidth_bytes_per_s


def blocking_save_s(
    host_copy_seconds: float, disk_write_seconds: float, storage: CheckpointStorage
) -> float:
    """Seconds training stops per checkpoint: ``memory`` the host copy (the disk write runs in the
    background),
    ``disk`` the disk write (its copies off the device, at PCIe speed, are left out: a few percent
    of it)."""
    return host_copy_seconds if storage == "memory" else disk_write_seconds


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """The checkpoint interval with the least waste to first order: sqrt(2 x save_s x mtbf_s) (Note
    [Young/Daly])."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def waste_fraction(interval_s: float, save_s: float, mtbf_s: float, restart_s: float) -> float:
    """Fraction of wall time lost: save_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s (Note
    [Young/Daly])."""
    return save_s / interval_s + (interval_s / 2.0 + restart_s) / mtbf_s


def goodput_fraction(interval_s: float, save_s: float, mtbf_s: float, restart_s: float) -> float:
    """Expected fraction of wall time spent on steps that are kept: 1 - waste, clipped to [0, 1]."""
    return min(max(1.0 - waste_fraction(interval_s, save_s, mtbf_s, restart_s), 0.0), 1.0)


def interval_steps(
    step_time_s: float, save_s: float, mtbf_s: float, restart_s: float, fewest_steps: int = 1
) -> int:
    """Whole steps between checkpoints: of the two around Young/Daly's interval, the one with the
    higher goodput, at least ``fewest_steps`` (and one)."""
    ideal = young_daly_interval_s(save_s, mtbf_s) / step_time_s
    fewest = max(fewest_steps, 1)
    candidates = sorted({max(math.floor(ideal), fewest), max(math.ceil(ideal), fewest)})
    return max(
        candidates, key=lambda n: goodput_fraction(n * step_time_s, save_s, mtbf_s, restart_s)
    )


def checkpoint_cost(
    plan: Plan,
    mtbf_hours: float,
    *,
    restart_s: float = DEFAULT_RESTART_S,
    storage: CheckpointStorage = "disk",
    cluster: ClusterSpec | None = None,
) -> CheckpointCost:
    """The ``checkpoint`` section for ``plan``: save time, best interval and expected goodput.

    ``mtbf_hours`` is the mean time between failures of the whole job; ``restart_s`` the seconds
    from a failure to training again (default DEFAULT_RESTART_S); ``storage`` as
    ``hp.checkpoint.save`` takes it. ``cluster`` defaults to the plan's; it must give
    host_memory_bandwidth_bytes_per_s and disk_bandwidth_bytes_per_s. Needs the plan's predicted
    step time (a plan from the planner has it).
    """
    cluster = cluster if cluster is not None else plan.cluster
    if cluster is None:
        raise PlanError(
            "the plan has no cluster; pass cluster= or plan it for one (`hyparallel plan"
            " --cluster`)"
        )
    check_goodput_request(mtbf_hours, restart_s, storage, cluster)
    if plan.predicted is None or plan.predicted.step_time_s <= 0:
        raise PlanError(
            "the plan has no predicted step time, which the checkpoint interval is counted in; plan"
            " it with `hyparallel plan` (or complete it with `hyparallel show PLAN --model MODEL`)"
        )
    step_s = plan.predicted.step_time_s
    per_rank = checkpoint_bytes_per_rank(plan)
    held = held_bytes_per_rank(plan)
    # also for `disk`: the alternative's
    copy_s = host_copy_s(held, cluster.host_memory_bandwidth_bytes_per_s)
    write_s = disk_write_s(
        per_rank, min(cluster.gpus_per_node, plan.world_size), cluster.disk_bandwidth_bytes_per_s
    )
    save_s = blocking_save_s(copy_s, write_s, storage)
    mtbf_s = mtbf_hours * SECONDS_PER_HOUR
    # Every memory checkpoint should reach the disk: a memory save that finds the background writer
    # still busy stays in memory only, and a failure that takes a node with it falls back to the
    # last one on disk.
    fewest = math.ceil(write_s / step_s) if storage == "memory" else 1
    steps = interval_steps(step_s, save_s, mtbf_s, restart_s, fewest)
    figures = {
        "mtbf_hours": mtbf_hours,
        "restart_s": restart_s,
        "storage": storage,
        "checkpoint_gib": per_rank / 2**30,
        "host_copy_gib": held / 2**30,
        "host_copy_s": copy_s,
        "disk_write_s": write_s,
        "save_time_s": save_s,
        "interval_steps": steps,
        "interval_s": steps * step_s,
        "goodput": goodput_fraction(steps * step_s, save_s, mtbf_s, restart_s),
    }
    return CheckpointCost(
        **{k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in figures.items()}
    )


def with_goodput(
    plan: Plan,
    mtbf_hours: float,
    *,
    restart_s: float = DEFAULT_RESTART_S,
    storage: CheckpointStorage = "disk",
    cluster: ClusterSpec | None = None,
) -> Plan:
    """``plan`` with its ``checkpoint`` section: ``checkpoint_cost(plan, mtbf_hours, ...)`` (same
    arguments)."""
    cost = checkpoint_cost(plan, mtbf_hours, restart_s=restart_s, storage=storage, cluster=cluster)
    return plan.model_copy(update={"checkpoint": cost})


def check_goodput_request(
    mtbf_hours: float, restart_s: float, storage: str, cluster: ClusterSpec | None = None
) -> None:
    """A one-line PlanError for an MTBF, restart time or storage that means nothing, or a
    ``cluster`` without the figures the checkpoint cost reads."""
    for name, value, low_ok, high in (
        ("mtbf_hours", mtbf_hours, False, limits.MAX_MTBF_HOURS),
        ("restart_s", restart_s, True, limits.MAX_RESTART_S),
    ):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not (0 <= value <= high if low_ok else 0 < value <= high):
            what = "hours, more than 0" if name == "mtbf_hours" else "seconds, at least 0"
            raise PlanError(
                f"{name} must be a number of {what} and at most {high:g}, got {value!r}"
            )
    if storage not in STORAGES:
        raise PlanError(f"storage must be one of {', '.join(STORAGES)}, got {storage!r}")
    missing = [
        name
        for name in ("host_memory_bandwidth_bytes_per_s", "disk_bandwidth_bytes_per_s")
        if cluster is not None and getattr(cluster, name) is None
    ]
    if missing:
        raise PlanError(
            f"cluster '{cluster.name}' gives no {' and no '.join(missing)}, which the checkpoint"
            " cost needs; add them to the cluster file (docs/clusters.md)"
        )
