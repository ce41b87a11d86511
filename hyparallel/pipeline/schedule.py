"""Pipeline schedules as a small printable IR, a lowering pass, and a simulator.

A schedule is, per pipeline rank, an ordered list of :class:`Action`s: ``"1F0"`` is virtual stage
1's forward of micro-batch 0, ``"2B3"`` stage 2's backward of micro-batch 3, ``"1SEND_F0"`` stage 1
sending micro-batch 0's activations on to stage 2 (as in torch.distributed.pipelining's schedules).
Virtual stage ``s`` runs on rank ``s % pp``, so with ``v`` virtual stages rank ``r`` holds stages
``r, r + pp, ..., r + (v - 1) * pp`` (Megatron-LM's interleaved layout).

    compute = schedule("1f1b", pp=4, num_microbatches=8)   # F and B only
    lowered = lower(compute, pp=4)                          # + SEND/RECV, what the runtime executes
    result = simulate(lowered, pp=4)                        # steps, peak activations, deadlocks
    print(format_schedule(result.timeline))                 # the picture, bubbles as "."

Everything here is pure Python: no torch, no processes.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, get_args

from hyparallel.spec.schema import Schedule


class ActionKind(str, Enum):
    """What a pipeline action does. Each prints as its name, the form schedules are written in
    (``"1SEND_F0"``), and equals that string; hyparallel.pipeline.executor has one named handler for
    each."""

    F = "F"  # a stage's forward of one micro-batch
    B = "B"  # its backward
    SEND_F = "SEND_F"  # the forward's output sent to the next stage
    RECV_F = "RECV_F"  # the previous stage's output received
    SEND_B = "SEND_B"  # the input's gradient sent back to the previous stage
    RECV_B = "RECV_B"  # the next stage's gradient received

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


COMPUTE_KINDS = ("F", "B")
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)$")


@dataclass(frozen=True)
class Action:
    """One step of a pipeline rank's program; ``str()`` gives ``"<stage><kind><microbatch>"``, e.g.
    ``"1F0"``."""

    stage: int  # virtual stage, 0 .. pp * virtual_stages - 1; runs on rank stage % pp
    kind: ActionKind
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in ActionKind.__members__:
            raise ValueError(
                f"unknown action kind {self.kind!r}; expected one of"
                f" {tuple(ActionKind.__members__)}"
            )
        object.__setattr__(self, "kind", ActionKind(self.kind))  # a string given: its member
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(
                f"stage ({self.stage}) and microbatch ({self.microbatch}) must be >= 0"
            )

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        """True for F and B, False for sends and receives."""
        return self.kind in COMPUTE_KINDS

    @property
    def peer(self) -> int | None:
        """The stage a send goes to or a receive comes from (None for F and B).

        Derived, not stored: activations flow to ``stage + 1`` and gradients to ``stage - 1``, so
        the printed form ``"1SEND_F0"`` already says everything and parses back to an equal Action.
        """
        return {
            "SEND_F": self.stage + 1,
            "RECV_F": self.stage - 1,
            "SEND_B": self.stage - 1,
            "RECV_B": self.stage + 1,
        }.get(self.kind)


def parse_action(text: str) -> Action:
    """The inverse of ``str(Action)``: ``parse_action("1F0") == Action(1, "F", 0)``."""
    match = _ACTION_RE.match(text.strip())
    if not match:
        raise ValueError(
            f"cannot parse action {text!r}; expected <stage><kind><microbatch> such as '1F0' or"
            " '2RECV_B3'"
        )
    return Action(int(match[1]), match[2], int(match[3]))  # type: ignore[arg-type]


# Note [one shape for three schedules]
# Every schedule here is, per rank, the same three phases over that rank's list of forwards and its
# list of backwards: `warmup` forwards, then alternately one forward and one backward (forward
# first), then the remaining backwards. Only the warmup count and the order of the lists differ:
#   gpipe: warmup = m, i.e. all forwards then all backwards. Backwards run in micro-batch order
#   0..m-1,
#     as torch's ScheduleGPipe does (the GPipe paper draws them reversed; the step count is the
#     same).
#   1f1b (PipeDream-flush, Narayanan et al. 2021, Sec. 2.2): rank r warms up with min(pp - r - 1, m)
#     forwards, so it holds at most pp - r micro-batches: the first backward reaches it after the
#     forward has gone down pp - r - 1 more ranks and come back.
#   interleaved-1f1b (Narayanan et al. 2021, Sec. 2.2; Megatron-LM's
#     forward_backward_pipelining_with_interleaving): the k-th chunk forward of rank r is
#     micro-batch (k // (pp v)) * pp + k % pp on its chunk (k % (pp v)) // pp, i.e. pp micro-batches
#     go through chunk 0, then the same pp through chunk 1, ...; backwards walk the chunks in
#     reverse. Warmup is 2 (pp - r - 1) + (v - 1) pp chunk forwards, capped at m v. Megatron
#     special-cases m == pp as all-warmup (its batched p2p would otherwise hang); our sends are
#     buffered, so we keep the formula.


def schedule(
    kind: Schedule, pp: int, num_microbatches: int, virtual_stages: int = 1
) -> dict[int, list[Action]]:
    """Per rank, the ordered compute actions (F and B only) of ``kind``; see Note [one shape for
    three schedules]."""
    if pp < 1 or num_microbatches < 1 or virtual_stages < 1:
        raise ValueError(
            f"pp ({pp}), num_microbatches ({num_microbatches}) and virtual_stages"
            f" ({virtual_stages}) must be >= 1"
        )
    if kind not in get_args(Schedule):
        raise ValueError(f"unknown schedule {kind!r}; expected one of {get_args(Schedule)}")
    m, v = num_microbatches, virtual_stages
    if kind != "interleaved-1f1b" and v != 1:
        raise ValueError(
            f"virtual_stages is {v} but schedule is '{kind}'; virtual stages need interleaved-1f1b"
        )
    if kind == "interleaved-1f1b" and m % pp:
        raise ValueError(
            "interleaved-1f1b groups micro-batches by pp as Megatron-LM does: num_microbatches"
            f" ({m}) % pp ({pp}) = {m % pp} != 0; use {m + pp - m % pp} or {m - m % pp or pp}"
            " micro-batches"
        )
    result = {}
    for rank in range(pp):
        if kind == "interleaved-1f1b":
            forwards = [_interleaved_action(k, "F", rank, pp, v) for k in range(m * v)]
            backwards = [_interleaved_action(k, "B", rank, pp, v) for k in range(m * v)]
            warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, m * v)
        else:
            forwards = [Action(rank, "F", mb) for mb in range(m)]
            backwards = [Action(rank, "B", mb) for mb in range(m)]
            warmup = m if kind == "gpipe" else min(pp - rank - 1, m)
        result[rank] = _warmup_steady_cooldown(forwards, backwards, warmup)
    return result


def _interleaved_action(k: int, kind: Literal["F", "B"], rank: int, pp: int, v: int) -> Action:
    group, within = divmod(k, pp * v)
    chunk = within // pp
    if kind == "B":
        chunk = v - 1 - chunk
    return Action(chunk * pp + rank, kind, group * pp + within % pp)


def _warmup_steady_cooldown(
    forwards: list[Action], backwards: list[Action], warmup: int
) -> list[Action]:
    steady = len(forwards) - warmup
    order = forwards[:warmup]
    for i in range(steady):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[steady:]


def validate(
    actions: Mapping[int, Sequence[Action]], pp: int, num_microbatches: int, virtual_stages: int = 1
) -> None:
    """Check each (stage, F/B, micro-batch) appears exactly once, on its own rank; sends and
    receives pair up.

    Raises ValueError naming what is missing, duplicated, misplaced or unpaired.
    """
    num_stages = pp * virtual_stages
    expected = {
        (s, k, mb)
        for s in range(num_stages)
        for k in COMPUTE_KINDS
        for mb in range(num_microbatches)
    }
    problems = []
    misplaced = [
        f"{a} on rank {rank} (stage {a.stage} runs on rank {a.stage % pp})"
        for rank, acts in actions.items()
        for a in acts
        if a.stage % pp != rank
    ]
    if misplaced:
        problems.append("misplaced " + ", ".join(misplaced))
    compute = Counter(
        (a.stage, a.kind, a.microbatch) for acts in actions.values() for a in acts if a.is_compute
    )
    unexpected = sorted(key for key in compute if key not in expected)
    if unexpected:
        problems.append(
            f"out of range for {num_stages} stages x {num_microbatches} micro-batches: "
            + _names(unexpected)
        )
    missing = sorted(expected - compute.keys())
    if missing:
        problems.append("missing " + _names(missing))
    duplicated = sorted(key for key, count in compute.items() if count > 1)
    if duplicated:
        problems.append("duplicated " + _names(duplicated))
    # A transfer is keyed by (sending stage, direction, micro-batch), from either end.
    flat = [a for acts in actions.values() for a in acts]
    sends = Counter((a.stage, a.kind[-1], a.microbatch) for a in flat if a.kind.startswith("SEND"))
    recvs = Counter((a.peer, a.kind[-1], a.microbatch) for a in flat if a.kind.startswith("RECV"))
    if sends != recvs:
        unpaired = sorted((sends - recvs) + (recvs - sends))
        problems.append(
            "unpaired transfers (sender stage, F/B, micro-batch): " + ", ".join(map(str, unpaired))
        )
    if problems:
        raise ValueError("invalid schedule: " + "; ".join(problems))


def _names(keys) -> str:
    return ", ".join(str(Action(*key)) for key in keys)


def lower(
    compute: Mapping[int, Sequence[Action]], pp: int, virtual_stages: int = 1
) -> dict[int, list[Action]]:
    """The send/recv pass: wrap each F and B with the receives it needs and the sends it owes.

    Before an F of stage s > 0 comes RECV_F from s - 1, after it SEND_F to s + 1 (unless s is last);
    the mirror for B: RECV_B from s + 1 before, SEND_B to s - 1 after. Neighbouring virtual stages
    on the same rank (only when pp == 1) hand over in memory: no send, no receive.
    """
    last = pp * virtual_stages - 1

    def remote(stage: int, other: int) -> bool:
        return 0 <= other <= last and other % pp != stage % pp

    lowered = {}
    for rank, acts in compute.items():
        out: list[Action] = []
        for a in acts:
            if not a.is_compute:
                raise ValueError(
                    f"lower() takes compute-only schedules; rank {rank} already has {a}"
                )
            upstream, downstream = (
                (a.stage - 1, a.stage + 1) if a.kind == "F" else (a.stage + 1, a.stage - 1)
            )
            if remote(a.stage, upstream):
                out.append(Action(a.stage, f"RECV_{a.kind}", a.microbatch))  # type: ignore[arg-type]
            out.append(a)
            if remote(a.stage, downstream):
                out.append(Action(a.stage, f"SEND_{a.kind}", a.microbatch))  # type: ignore[arg-type]
        lowered[rank] = out
    return lowered


def p2p_order_mismatches(lowered: Mapping[int, Sequence[Action]], pp: int) -> list[tuple[int, int]]:
    """Rank pairs (sender, receiver) whose sends are not received in the order they are sent.

    Gloo matches a receive to its send by tag, whatever the order; NCCL ignores tags and matches the
    k-th send between two ranks with the k-th receive. A schedule the runtime runs on NCCL must
    therefore list, for every pair, its receives in its sends' order; this returns the pairs that do
    not.
    """
    bad = []
    for sender in range(pp):
        for receiver in range(pp):
            if sender == receiver:
                continue
            sends = [
                (a.stage, a.kind[-1], a.microbatch)
                for a in lowered.get(sender, ())
                if a.kind.startswith("SEND") and a.peer % pp == receiver
            ]
            recvs = [
                (a.peer, a.kind[-1], a.microbatch)
                for a in lowered.get(receiver, ())
                if a.kind.startswith("RECV") and a.peer % pp == sender
            ]
            if sends != recvs:
                bad.append((sender, receiver))
    return bad


def send_window(program: Sequence[Action]) -> int:
    """Gradients a pipeline device keeps sent back and undelivered, at most (Note [gradients sent
    back] in hyparallel/pipeline/executor.py): one per micro-batch chunk its program holds in flight
    at its peak (forwards run and not yet backwarded; at least one), never more than it sends back.

    Read off the device's own lowered program, so the runtime needs no formula; the planner's memory
    model counts the same bound by formula (hyparallel.planner.inflight.backward_sends_held, checked
    equal in tests/test_planner_costs.py).
    """
    sends = sum(a.kind == "SEND_B" for a in program)
    level = peak = 0
    for a in program:
        level += (a.kind == "F") - (a.kind == "B")
        peak = max(peak, level)
    return min(sends, max(1, peak))


def compute_only(actions: Mapping[int, Sequence[Action]]) -> dict[int, list[Action]]:
    """The F and B actions of each rank, in order: undoes :func:`lower`."""
    return {rank: [a for a in acts if a.is_compute] for rank, acts in actions.items()}


@dataclass
class SimulationResult:
    """What :func:`simulate` saw; see Note [simulator step model]."""

    steps: int  # rounds in which some compute action ran
    order: dict[int, list[str]]  # the actions each rank executed, in order
    # most micro-batches with F run and B not, in whole-rank units (a chunk = 1/v)
    peak_inflight: dict[int, float]
    deadlock: bool
    # on deadlock: each unfinished rank's next action
    blocked: dict[int, str] = field(default_factory=dict)
    # per rank per step: the compute run, or None
    timeline: dict[int, list[str | None]] = field(default_factory=dict)


# Note [simulator step model]
# The simulator runs in lock-step rounds. Each round first lets every rank run the sends and
# receives at the head of its list (they take no time: sends are buffered and never wait for the
# receiver, a receive waits only for its matching send), then every rank whose next action is an F
# or B with its inputs done runs it. Inputs (`needs`): F of s > 0 needs F of s - 1 (same
# micro-batch); B of s needs F of s, and B of s + 1 unless s is last; a send needs the compute it
# sends. A compute action finishes at the end of its round, so nothing it produces is used in the
# same round: with unit-time F and B, a lowered schedule and its compute-only form take the same
# number of steps. A round in which nothing at all can run while actions remain is a deadlock: it is
# reported, with each rank's blocked action, never raised.


def simulate(
    actions: Mapping[int, Sequence[Action]], pp: int, virtual_stages: int = 1
) -> SimulationResult:
    """Execute per-rank action lists (lowered or not) without processes; see Note [simulator step
    model]."""
    last = pp * virtual_stages - 1
    ranks = sorted(actions)
    done: set[tuple[int, str, int]] = set()
    position = dict.fromkeys(ranks, 0)
    order: dict[int, list[str]] = {rank: [] for rank in ranks}
    timeline: dict[int, list[str | None]] = {rank: [] for rank in ranks}
    inflight, peak = dict.fromkeys(ranks, 0), dict.fromkeys(ranks, 0)

    def head(rank: int) -> Action | None:
        return actions[rank][position[rank]] if position[rank] < len(actions[rank]) else None

    def run(rank: int, a: Action) -> None:
        done.add((a.stage, a.kind, a.microbatch))
        order[rank].append(str(a))
        position[rank] += 1
        if a.is_compute:
            inflight[rank] += 1 if a.kind == "F" else -1
            peak[rank] = max(peak[rank], inflight[rank])

    steps = 0
    while any(head(rank) is not None for rank in ranks):
        communicated = False
        changed = True
        # sends may unblock receives on other ranks within the same (zero-time) phase
        while changed:
            changed = False
            for rank in ranks:
                while (
                    (a := head(rank)) is not None
                    and not a.is_compute
                    and _inputs_done(a, done, last)
                ):
                    run(rank, a)
                    changed = communicated = True
        ready = [
            rank
            for rank in ranks
            if (a := head(rank)) is not None and a.is_compute and _inputs_done(a, done, last)
        ]
        if not ready and not communicated:
            blocked = {rank: str(head(rank)) for rank in ranks if head(rank) is not None}
            return SimulationResult(
                steps, order, _per_rank(peak, virtual_stages), True, blocked, timeline
            )
        if ready:
            steps += 1
            for rank in ranks:
                timeline[rank].append(str(head(rank)) if rank in ready else None)
            # decided before any runs: nothing finished this round feeds this round
            for rank in ready:
                run(rank, head(rank))  # type: ignore[arg-type]
    return SimulationResult(steps, order, _per_rank(peak, virtual_stages), False, {}, timeline)


def needs(a: Action, last: int) -> tuple[tuple[int, str, int], ...]:
    """The keys ``(stage, kind, microbatch)`` of the actions ``a`` waits for; ``last`` is the last
    virtual stage.

    The one dependency rule of the IR, shared by :func:`simulate` and the timed execution
    (:func:`hyparallel.planner.timeline.run_timed`): an F of stage s > 0 needs the F of s - 1 (same
    micro-batch); a B of s needs the F of s and, unless s is last, the B of s + 1; a send needs the
    compute it sends; a receive needs the peer's matching send. F and B wait on F and B keys only
    (in a lowered list the receive before an F or B orders it), so the rule serves compute-only and
    lowered lists alike.
    """
    s, mb = a.stage, a.microbatch
    if a.kind == "F":
        return ((s - 1, "F", mb),) if s > 0 else ()
    if a.kind == "B":
        return ((s, "F", mb),) if s == last else ((s, "F", mb), (s + 1, "B", mb))
    if a.kind in ("SEND_F", "SEND_B"):
        return ((s, a.kind[-1], mb),)
    return ((a.peer, "SEND_" + a.kind[-1], mb),)  # type: ignore[return-value]  # RECV_F / RECV_B: peer is an int


def _inputs_done(a: Action, done: set[tuple[int, str, int]], last: int) -> bool:
    return all(key in done for key in needs(a, last))


def _per_rank(peak: dict[int, int], virtual_stages: int) -> dict[int, float]:
    return {rank: count / virtual_stages for rank, count in peak.items()}


def format_schedule(actions: Mapping[int, Sequence[Action | str | None]]) -> str:
    """A table with one line per rank of action strings, columns aligned; None (an idle step) prints
    as ".".

    Takes a schedule (compute-only or lowered) or a :attr:`SimulationResult.timeline`.
    """
    cells = {
        rank: ["." if a is None else str(a) for a in acts] for rank, acts in sorted(actions.items())
    }
    width = max((len(c) for row in cells.values() for c in row), default=1)
    label = max((len(str(rank)) for rank in cells), default=1)
    return "\n".join(
        f"rank {str(rank).rjust(label)} | " + " ".join(c.rjust(width) for c in row)
        for rank, row in cells.items()
    )
