"""One training step of a plan, timed: the blocks ``hyparallel simulate`` draws.

:func:`timeline` runs ``lower(schedule(...))`` for a plan event by event (Note [timed execution])
with the planner's per-stage seconds, then adds each rank's tail (data-parallel gradient sync and
optimizer step) and its memory over time (Note [timeline memory]).
:func:`~hyparallel.pipeline.schedule.simulate` stays the unit-step checker of the same IR
(deadlocks, peak micro-batches in flight); this is its timed counterpart. Pure Python: no torch, no
processes, no plotting (``hyparallel.tools.pictures`` draws).

    tl = timeline(Plan.load("plan.yaml"))
    tl.total_s, tl.bubble_fraction[0], len(tl.compute_blocks())
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from hyparallel.pipeline.schedule import Action, lower, needs, schedule
from hyparallel.spec.errors import ConfigError
from hyparallel.spec.limits import MAX_SIMULATED_ACTIONS, MAX_SIMULATED_PP
from hyparallel.spec.schema import Plan

BlockKind = Literal["F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "tail"]
Units = Literal["seconds", "relative"]

# Relative units for a plan the planner never costed: a backward does about twice a forward's matrix
# products (input and weight gradients), the ratio pipeline papers draw their schedules with.
RELATIVE_FORWARD, RELATIVE_BACKWARD = 1.0, 2.0


@dataclass(frozen=True)
class Block:
    """One interval on one rank's row of the picture; what it covers depends on ``kind``.

    F and B: the computation. SEND_*: the transfer on the wire, from the send to its arrival (the
    sending rank does not wait for it). RECV_*: the part of a receive the rank waits for the
    transfer itself, from the later of posting and sending to the arrival (empty when the data was
    already there; waiting for the peer to compute is bubble, not p2p). tail: the gradient sync and
    the optimizer step.
    """

    rank: int
    kind: BlockKind
    start_s: float
    end_s: float
    stage: int | None = None  # virtual stage of an action; None for the tail
    microbatch: int | None = None

    @property
    def duration_s(self) -> float:
        """end_s - start_s."""
        return self.end_s - self.start_s


@dataclass
class Timeline:
    """One simulated training step of a plan: what :func:`timeline` computed, everything the picture
    needs."""

    schedule: str
    pp: int
    virtual_stages: int
    num_microbatches: int
    mesh: dict[str, int]  # axis -> degree, outermost first
    model: str | None
    units: Units  # "relative": F = 1, B = 2, no transfers or tail (the plan has no planner figures)
    blocks: list[Block]
    total_s: float  # the step: the last block's end
    bubble_fraction: dict[int, float]  # per rank: time waiting for other ranks' compute / total_s
    # per rank: (time, memory) points of a step function
    memory: dict[int, list[tuple[float, float]]]
    memory_units: Literal["GiB", "micro-batches"]
    memory_limit: float | None  # the device's memory, in memory_units; None when unknown
    predicted_step_s: float | None = None
    predicted_bubble_fraction: float | None = None
    notes: list[str] = field(default_factory=list)

    def compute_blocks(self) -> list[Block]:
        """The F and B blocks: pp * virtual_stages * num_microbatches of each."""
        return [b for b in self.blocks if b.kind in ("F", "B")]


# Note [timed execution]
# Each rank runs its lowered action list in order, keeping its own clock. An F or B starts at the
# later of the rank's clock and its inputs' completion (schedule.needs, the unit-step simulator's
# rule too: F of s needs F of s - 1; B of s needs F of s and, unless s is last, B of s + 1) and
# lasts that stage's forward_s or backward_s. A send costs its rank nothing (sends are buffered, as
# in the runtime): the data arrives p2p_s after it is sent. A receive posted at t completes at
# max(t, arrival). Ranks are advanced in turn until none can move; since every start time is a
# function of completed actions only, the order in which ranks are advanced does not change any
# time. A schedule whose ranks all block is reported as a deadlock.


def run_timed(
    actions: Mapping[int, Sequence[Action]],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    p2p_s: Sequence[float] = (),
) -> list[Block]:
    """Time per-rank action lists (lowered or compute-only); see Note [timed execution].

    ``forward_s[s]`` and ``backward_s[s]`` are virtual stage s's seconds per micro-batch;
    ``p2p_s[s]`` the transfer between stages s and s + 1 in either direction (0 where not given).
    One Block per action. Raises ValueError naming each rank's blocked action if the schedule
    deadlocks.
    """
    last = len(forward_s) - 1
    # (stage, F/B, mb) -> end; (stage, SEND_x, mb) -> arrival
    done: dict[tuple[int, str, int], float] = {}
    sent: dict[tuple[int, str, int], float] = {}  # (stage, SEND_x, mb) -> time sent
    clock, position = dict.fromkeys(actions, 0.0), dict.fromkeys(actions, 0)
    blocks: list[Block] = []

    def transfer_s(a: Action) -> float:
        boundary = min(a.stage, a.peer)  # type: ignore[type-var]  # only sends and receives get here
        return p2p_s[boundary] if boundary < len(p2p_s) else 0.0

    moved = True
    while moved:
        moved = False
        for rank, acts in actions.items():
            while position[rank] < len(acts):
                a = acts[position[rank]]
                ready = _ready_s(a, done, last)
                if ready is None:
                    break
                key = (a.stage, a.kind, a.microbatch)
                now = clock[rank]
                if a.is_compute:
                    start = max(now, ready)
                    end = clock[rank] = done[key] = (
                        start + (forward_s if a.kind == "F" else backward_s)[a.stage]
                    )
                elif a.kind.startswith("SEND"):
                    start, end = now, now + transfer_s(a)
                    sent[key], done[key] = start, end
                else:
                    send = (a.peer, "SEND_" + a.kind[-1], a.microbatch)
                    start, end = max(now, sent[send]), max(now, ready)
                    clock[rank] = end
                blocks.append(Block(rank, a.kind, start, end, a.stage, a.microbatch))
                position[rank] += 1
                moved = True
    blocked = {
        rank: str(acts[position[rank]])
        for rank, acts in actions.items()
        if position[rank] < len(acts)
    }
    if blocked:
        raise ValueError(
            "schedule deadlocks; each blocked rank's next action: "
            + ", ".join(f"rank {rank}: {a}" for rank, a in blocked.items())
        )
    return blocks


def _ready_s(a: Action, done: Mapping[tuple[int, str, int], float], last: int) -> float | None:
    """When ``a``'s inputs (:func:`~hyparallel.pipeline.schedule.needs`) are complete, or None if
    one is not yet."""
    waits_for = needs(a, last)
    if any(key not in done for key in waits_for):
        return None
    return max((done[key] for key in waits_for), default=0.0)


@dataclass(frozen=True)
class _Figures:
    """Per virtual stage seconds and activations, per rank tail and peak memory, in one set of
    units."""

    units: Units
    forward_s: list[float]
    backward_s: list[float]
    p2p_s: list[float]
    activation: list[float]  # per in-flight micro-batch, in memory units
    tail_s: float
    peak_memory: list[float] | None  # per rank; None: count activations only


def _figures(plan: Plan) -> _Figures:
    """The planner's figures from the plan, or relative units when it has none."""
    par, stages, predicted = plan.parallel, plan.stages or [], plan.predicted
    num_stages = par.pp * par.virtual_stages
    planned = (
        predicted is not None
        and len(stages) == num_stages
        and all(None not in (s.forward_s, s.backward_s, s.activation_gib) for s in stages)
    )
    if not planned:
        return _Figures(
            "relative",
            [RELATIVE_FORWARD] * num_stages,
            [RELATIVE_BACKWARD] * num_stages,
            [],
            [1 / par.virtual_stages] * num_stages,
            0.0,
            None,
        )
    return _Figures(
        "seconds",
        [s.forward_s for s in stages],
        [s.backward_s for s in stages],  # type: ignore[misc]
        [s.p2p_s or 0.0 for s in stages[:-1]],
        [s.activation_gib for s in stages],  # type: ignore[misc]
        predicted.comm_s.dp,
        list(predicted.memory_gib),
    )  # type: ignore[union-attr]


# Note [timeline memory]
# A rank's memory is static (weights, gradients, optimizer state, workspace, reserved) plus the
# activations of its micro-batches in flight: a micro-batch's activations on a chunk are allocated
# when its forward starts and freed when its backward ends. The static part is the planner's
# predicted peak less the simulated peak of activations, so the curve peaks exactly at the
# prediction. (The planner counts a rank's chunks at their mean size; the simulation knows which
# chunk each micro-batch is on.) Without planner figures, memory counts micro-batches in flight, a
# chunk being 1/v of one.


def _by_rank(blocks: Sequence[Block], pp: int) -> dict[int, list[Block]]:
    """Each rank's blocks, in one pass (a pipeline may have a thousand ranks)."""
    grouped: dict[int, list[Block]] = {rank: [] for rank in range(pp)}
    for b in blocks:
        grouped[b.rank].append(b)
    return grouped


def _memory(
    blocks: Sequence[Block], figures: _Figures, pp: int, total_s: float
) -> dict[int, list[tuple[float, float]]]:
    """Per rank, (time, memory) points of a step function; see Note [timeline memory]."""
    series = {}
    for rank, own in _by_rank(blocks, pp).items():
        # Frees sort before allocations at the same instant: a backward ending as the next forward
        # starts.
        events = sorted(
            [(b.start_s, 1, figures.activation[b.stage]) for b in own if b.kind == "F"]
            + [(b.end_s, 0, -figures.activation[b.stage]) for b in own if b.kind == "B"]
        )
        level, points = 0.0, [(0.0, 0.0)]
        for time_s, _, change in events:
            level += change
            if len(points) > 1 and math.isclose(
                time_s, points[-1][0], rel_tol=1e-9
            ):  # a free and an allocation at once
                points.pop()
            points.append((time_s, level))
        peak = max(level for _, level in points)
        static = figures.peak_memory[rank] - peak if figures.peak_memory else 0.0
        series[rank] = [(t, static + level) for t, level in points] + [
            (total_s, static + points[-1][1])
        ]
    return series


def _bubbles(blocks: Sequence[Block], pp: int, total_s: float) -> dict[int, float]:
    """Per rank, the fraction of the step it neither computes, waits on a transfer, nor runs its
    tail."""
    busy = dict.fromkeys(range(pp), 0.0)
    for b in blocks:
        if not b.kind.startswith("SEND"):
            busy[b.rank] += b.duration_s
    return {rank: (1 - busy[rank] / total_s) if total_s else 0.0 for rank in range(pp)}


def check_simulable(plan: Plan) -> None:
    """Refuse, in one line, a plan whose schedule is too large to simulate action by action in
    seconds."""
    par = plan.parallel
    actions = 2 * par.pp * par.virtual_stages * plan.num_microbatches
    if par.pp > MAX_SIMULATED_PP:
        raise ConfigError(
            f"pp is {par.pp:,}; simulate draws one row per pipeline rank, at most"
            f" {MAX_SIMULATED_PP}; simulate a copy of the plan with a smaller pp"
        )
    if actions > MAX_SIMULATED_ACTIONS:
        raise ConfigError(
            f"the schedule has 2 x pp ({par.pp}) x virtual_stages ({par.virtual_stages}) x"
            f" num_microbatches ({plan.num_microbatches:,}) = {actions:,} forwards and backwards,"
            f" more than the {MAX_SIMULATED_ACTIONS:,} simulate times one by one; simulate a copy"
            " with fewer micro-batches (a smaller global_batch or a larger micro_batch)"
        )


def timeline(plan: Plan) -> Timeline:
    """Simulate one training step of ``plan``'s pipeline schedule with the planner's per-stage
    times.

    A plan without them (written by hand, never planned) is timed in relative units (F = 1, B = 2,
    free transfers, no tail) and says so in ``units`` and ``notes``; nothing here fails for lack of
    figures.
    """
    check_simulable(plan)
    par = plan.parallel
    m, pp, v = plan.num_microbatches, par.pp, par.virtual_stages
    figures = _figures(plan)
    blocks = run_timed(
        lower(schedule(par.schedule, pp, m, v), pp, v),
        figures.forward_s,
        figures.backward_s,
        figures.p2p_s,
    )
    ends = {
        rank: max(b.end_s for b in own if not b.kind.startswith("SEND"))
        for rank, own in _by_rank(blocks, pp).items()
    }
    if figures.tail_s > 0:
        blocks += [Block(rank, "tail", end, end + figures.tail_s) for rank, end in ends.items()]
    total_s = max(b.end_s for b in blocks)
    if not math.isfinite(total_s):
        raise ConfigError(
            "the plan's per-stage seconds add up to more than a float holds; check the stages' "
            "forward_s, backward_s and p2p_s"
        )
    notes = []
    if figures.units == "relative":
        notes.append(
            f"relative units (F = {RELATIVE_FORWARD:g}, B = {RELATIVE_BACKWARD:g}, transfers free):"
            " the plan has no planner timings; write it with `hyparallel plan` for seconds and GiB"
        )
    device = plan.cluster.device if plan.cluster else None
    predicted = plan.predicted
    return Timeline(
        schedule=par.schedule,
        pp=pp,
        virtual_stages=v,
        num_microbatches=m,
        mesh=plan.mesh_shape(),
        model=plan.model.name if plan.model else None,
        units=figures.units,
        blocks=blocks,
        total_s=total_s,
        bubble_fraction=_bubbles(blocks, pp, total_s),
        memory=_memory(blocks, figures, pp, total_s),
        memory_units="GiB" if figures.peak_memory else "micro-batches",
        memory_limit=device.memory_bytes / 2**30 if device and figures.peak_memory else None,
        predicted_step_s=predicted.step_time_s if predicted else None,
        predicted_bubble_fraction=predicted.bubble_fraction if predicted else None,
        notes=notes,
    )
