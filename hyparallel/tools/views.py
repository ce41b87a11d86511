"""Rich tables of a Plan, for ``hyparallel show`` and ``hyparallel plan``: the device map, the
stages with their memory against the device's, the predicted step time taken apart, and the
checkpoint cost and goodput.

Note [what the time breakdown adds up]
    The planner's step time is max over devices of (m - 1/v) x t_s + tail_s, plus sum(t_s) / v, with
    t_s a device's time per micro-batch (its compute, exposed tensor-parallel communication and
    pipeline sends) and tail_s the data-parallel gradient sync and optimizer step after the last
    backward (search.py, ``_finish``). The plan keeps the exposed tp, pp and dp+optimizer time per
    step (``predicted.comm_s``) and each stage's compute per micro-batch, so the table shows compute
    as m x the slowest device's compute, those three, and the rest of the step as the pipeline
    bubble (fill and drain, plus any imbalance between stages), so the rows add up to the predicted
    step time.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from hyparallel.spec.schema import Plan

BAR_WIDTH = 24
MAX_NODES = 6  # device-map rows; larger clusters show the first and last nodes (the layout repeats)
MAX_STAGE_ROWS = 32  # stage-table rows; deeper pipelines show the first stages and the last


def count(n: float) -> str:
    """1.32B, 125M, 64K: a count in a few characters."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def memory_bar(used_gib: float, capacity_gib: float, width: int = BAR_WIDTH) -> Text:
    """A bar of ``used`` against ``capacity``, green under 80 %, yellow under 95 %, red beyond."""
    fraction = used_gib / capacity_gib if capacity_gib else 0.0
    filled = min(width, round(fraction * width))
    style = "green" if fraction < 0.8 else "yellow" if fraction < 0.95 else "red"
    bar = Text("█" * filled, style=style)
    bar.append("░" * (width - filled), style="dim")
    bar.append(f" {used_gib:,.1f} / {capacity_gib:,.0f} GiB ({fraction:.0%})")
    return bar


def device_map(plan: Plan) -> Table:
    """Which node and GPU holds which pipeline stage, data-parallel replica and tensor-parallel
    shard."""
    per_node = plan.cluster.gpus_per_node if plan.cluster else min(plan.world_size, 8)
    nodes = -(-plan.world_size // per_node)
    shown = list(range(nodes)) if nodes <= MAX_NODES else [*range(MAX_NODES - 1), nodes - 1]
    table = Table(
        title="device map: pp stage / dp replica"
        + (" / cp rank" if plan.parallel.cp > 1 else "")
        + " / tp shard of each GPU (global rank)"
        + ("" if plan.cluster else "; no cluster in the plan: rows of 8 ranks")
    )
    table.add_column("node")
    for gpu in range(per_node):
        table.add_column(f"GPU {gpu}", justify="center")
    for node in shown:
        if node == nodes - 1 and nodes > MAX_NODES:
            table.add_row("...", *["..."] * per_node)
        cells = []
        for gpu in range(min(per_node, plan.world_size - node * per_node)):
            rank = node * per_node + gpu
            c = plan.coords(rank)
            cp = f" cp{c['cp']}" if "cp" in c else ""
            cells.append(f"pp{c['pp']} dp{c['dp']}{cp} tp{c['tp']}\n[dim]rank {rank}[/dim]")
        table.add_row(str(node), *cells)
    return table


def stage_nodes(plan: Plan) -> dict[int, tuple[int, int]]:
    """Pipeline stage -> the first and last node its GPUs are on.

    Computed from the rank layout, not by visiting every rank (a plan may have a million): the ranks
    of stage s are ``outer`` blocks of ``inner`` consecutive ranks, ``inner`` the product of the
    axes after pp in the placement order; the first block starts at s x inner, the last at ((outer -
    1) x pp + s) x inner.
    """
    per_node = plan.cluster.gpus_per_node if plan.cluster else min(plan.world_size, 8)
    shape, pp = plan.mesh_shape(), plan.parallel.pp
    axes = list(shape)
    inner = 1
    for axis in axes[axes.index("pp") + 1 :]:
        inner *= shape[axis]
    outer = plan.world_size // (pp * inner)
    return {
        stage: (
            stage * inner // per_node,
            (((outer - 1) * pp + stage) * inner + inner - 1) // per_node,
        )
        for stage in range(pp)
    }


def stage_table(plan: Plan) -> Table:
    """One row per pipeline device: its layers, parameters, compute per micro-batch and peak memory
    as a bar."""
    par, pred = plan.parallel, plan.predicted
    capacity = plan.cluster.device.memory_bytes / 2**30 if plan.cluster else None
    table = Table(
        title="pipeline stages (per device"
        + (f", {par.virtual_stages} chunks each" if par.virtual_stages > 1 else "")
        + ")"
    )
    for column in (
        "stage",
        "nodes",
        "layers",
        "parameters",
        "compute s / micro-batch",
        "peak memory per GPU",
    ):
        table.add_column(
            column, justify="left" if column in ("layers", "peak memory per GPU") else "right"
        )
    where, by_device = stage_nodes(plan), _chunks_by_device(plan)
    shown = range(par.pp) if par.pp <= MAX_STAGE_ROWS else [*range(MAX_STAGE_ROWS - 1), par.pp - 1]
    for device in shown:
        if device == par.pp - 1 and par.pp > MAX_STAGE_ROWS:
            table.add_row(
                "...", "...", f"({par.pp - MAX_STAGE_ROWS} more stages)", "...", "...", "..."
            )
        chunks = by_device.get(device, [])
        modules = [m for st in chunks for m in st.modules]
        label = (
            f"{modules[0]} .. {modules[-1]} ({len(modules)} modules)"
            if len(modules) > 2
            else ", ".join(modules) or "(planned at launch)"
        )
        memory = pred.memory_gib[device] if pred else None
        bar = memory_bar(memory, capacity) if memory is not None and capacity else Text("-")
        compute = sum(st.compute_s or 0 for st in chunks)
        first, last = where[device]
        table.add_row(
            str(device),
            f"{first}" if first == last else f"{first}-{last}",
            label,
            count(sum(st.num_params or 0 for st in chunks)) if chunks else "-",
            f"{compute:.4f}" if compute else "-",
            bar,
        )
    return table


def _chunks_by_device(plan: Plan) -> dict:
    """Pipeline device -> its (virtual) stages, in one pass over the stage list."""
    by_device: dict[int, list] = {}
    for stage in plan.stages or []:
        by_device.setdefault(stage.index % plan.parallel.pp, []).append(stage)
    return by_device


def time_breakdown(plan: Plan) -> Table:
    """The predicted step time taken apart; see Note [what the time breakdown adds up]."""
    pred, m = plan.predicted, plan.num_microbatches
    per_device = [
        sum(st.compute_s or 0 for st in chunks) for chunks in _chunks_by_device(plan).values()
    ]
    parts = {
        "tensor-parallel communication (exposed)": pred.comm_s.tp,
        "pipeline sends": pred.comm_s.pp,
        (
            "parameter servers: pull, push, their update"
            if plan.ps is not None
            else "data-parallel gradient sync + optimizer step"
        ): pred.comm_s.dp,
    }
    if pred.comm_s.ep is not None:
        parts["expert-parallel all-to-alls"] = pred.comm_s.ep
    if pred.comm_s.cp is not None:
        parts["context-parallel key/value traffic (exposed)"] = pred.comm_s.cp
    rest = max(pred.step_time_s - sum(parts.values()), 0.0)
    compute = min(m * max(per_device, default=0.0), rest)
    if compute:
        other = "pipeline bubble and stage imbalance" + (
            f", ZeRO-{plan.parallel.zero} traffic per micro-batch"
            if plan.parallel.zero >= 2 and plan.parallel.dp * plan.parallel.cp > 1
            else ""
        )
        parts = {"compute (m x slowest stage)": compute, **parts, other: rest - compute}
    else:  # a plan without per-stage compute figures
        parts = {"compute and pipeline bubble": rest, **parts}
    # a recommendation model's "sequence" is a sample
    unit = "samples" if plan.training.seq_len == 1 else "tokens"
    table = Table(
        title=f"predicted step {pred.step_time_s:.3f} s, taken apart",
        caption=(
            f"{pred.tokens_per_s:,.0f} {unit}/s, {pred.tflops_per_gpu:.3g} TFLOP/s per GPU, MFU"
            f" {pred.mfu:.1%}, pipeline bubble {pred.bubble_fraction:.1%} of compute"
        ),
    )
    for column in ("part", "seconds", "share"):
        table.add_column(column, justify="left" if column == "part" else "right")
    for part, seconds in parts.items():
        table.add_row(
            part, f"{seconds:.4f}", f"{seconds / pred.step_time_s:.1%}" if pred.step_time_s else "-"
        )
    return table


def compression(plan: Plan) -> str:
    """The plan's gradient compression in a few words: ``none``, ``bf16``, ``powersgd (rank 4, from
    step 1,000)``."""
    par = plan.parallel
    if par.grad_compression != "powersgd":
        return par.grad_compression
    return f"powersgd (rank {par.powersgd_rank}, from step {par.powersgd_start_step:,})"


def compression_line(plan: Plan) -> str | None:
    """What the plan's gradient compression saves per step against the same plan uncompressed (None:
    it compresses nothing, or has no such prediction)."""
    pred = plan.predicted
    if pred is None or pred.uncompressed is None:
        return None
    plain = pred.uncompressed
    saved = plain.step_time_s - pred.step_time_s
    share = f" ({abs(saved) / plain.step_time_s:.1%})" if plain.step_time_s else ""
    return (
        f"gradient compression {compression(plan)}: {pred.step_time_s:.3g} s per step against"
        f" {plain.step_time_s:.3g} s uncompressed, {abs(saved):.3g} s{share}"
        f" {'saved' if saved >= 0 else 'lost'}; dp sync + optimizer {pred.comm_s.dp:.3g} s against"
        f" {plain.dp_comm_s:.3g} s"
    )


def duration(seconds: float) -> str:
    """95.2 s, 20.4 min, 3.1 h: a duration in the unit it is read in."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def checkpoint_lines(plan: Plan) -> list[str]:
    """The plan's checkpoint cost and expected goodput in two lines (docs/cost-model.md,
    "Checkpoints and goodput")."""
    ck = plan.checkpoint
    mtbf_s = ck.mtbf_hours * 3600
    if ck.storage == "memory":
        cost = (
            f"checkpoint {ck.host_copy_gib:,.3g} GiB per rank into host memory: training stops"
            f" {duration(ck.save_time_s)} per save; {ck.checkpoint_gib:,.3g} GiB per rank to disk"
            f" in the background ({duration(ck.disk_write_s)} per node)"
        )
    else:
        cost = (
            f"checkpoint {ck.checkpoint_gib:,.3g} GiB per rank to disk: training stops"
            f" {duration(ck.save_time_s)} per save (the node's write); a memory checkpoint would"
            f" stop it {duration(ck.host_copy_s)}"
        )
    lost = {
        "saves": ck.save_time_s / ck.interval_s if ck.interval_s else 0.0,
        "redone": ck.interval_s / 2 / mtbf_s,
        "restarts": ck.restart_s / mtbf_s,
    }
    return [
        cost,
        f"goodput    {ck.goodput:.1%} expected with a checkpoint every {ck.interval_steps:,} steps"
        f" ({duration(ck.interval_s)}; Young/Daly, MTBF {ck.mtbf_hours:g} h, restart"
        f" {duration(ck.restart_s)}); lost: "
        + ", ".join(f"{part} {fraction:.2%}" for part, fraction in lost.items()),
    ]


def ps_line(plan: Plan) -> str:
    """A ps plan's servers in one line: how many beside the workers, what they hold, how they update
    it."""
    ps = plan.ps
    tables = (
        "every embedding table" if ps.tables == "auto" else f"{len(ps.tables)} embedding table(s)"
    )
    sync = "synchronous" if ps.staleness == 0 else f"up to {ps.staleness} step(s) stale"
    return (
        f"parameter servers {ps.servers} beside the {plan.parallel.dp} workers (launch"
        f" {plan.launch_size} processes): {tables} and the dense weights, {ps.optimizer} at lr"
        f" {ps.lr:g}, {sync}"
    )


def table_options(choice) -> Table:
    """Where the embedding tables could go (a planner.tables.TableChoice): each option's step time,
    memory, and why it was not picked."""
    table = Table(title="where the embedding tables go")
    for column in ("option", "step ms", "GiB per GPU", "GiB per server", "why not"):
        table.add_column(column, justify="left" if column in ("option", "why not") else "right")
    for option in sorted(
        choice.options, key=lambda o: (o is not choice.pick, not o.fits, o.step_time_s)
    ):
        table.add_row(
            option.label,
            f"{option.step_time_s * 1e3:.3g}" if option.fits else "-",
            f"{option.gpu_memory_bytes / 2**30:.1f}" if option.fits else "-",
            (
                f"{option.server_memory_bytes / 2**30:.1f}"
                if option.server_memory_bytes is not None
                else "-"
            ),
            choice.why_not(option),
        )
    return table
