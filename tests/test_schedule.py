"""The pipeline schedule IR: schedules, the send/recv lowering pass, and the lock-step simulator."""

from __future__ import annotations

import pytest

from hyparallel.pipeline.schedule import (
    Action,
    compute_only,
    format_schedule,
    lower,
    p2p_order_mismatches,
    parse_action,
    schedule,
    simulate,
    validate,
)
from hyparallel.planner.inflight import inflight_microbatches

from .expected_orders import HAND_WRITTEN, expected


def cases():
    """(kind, pp, m, v) for every schedule over pp 1..6, m from below pp to a few times pp."""
    for pp in range(1, 7):
        for m in sorted({1, 2, 3, pp, pp + 1, 2 * pp, 3 * pp, 8}):
            yield "gpipe", pp, m, 1
            yield "1f1b", pp, m, 1
            if m % pp == 0:
                for v in (2, 3):
                    yield "interleaved-1f1b", pp, m, v


CASES = list(cases())


def case_id(case):
    kind, pp, m, v = case
    return f"{kind}-pp{pp}-m{m}-v{v}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_schedules_are_complete_lower_cleanly_and_never_deadlock(case):
    kind, pp, m, v = case
    compute = schedule(kind, pp, m, v)
    validate(compute, pp, m, v)
    lowered = lower(compute, pp, v)
    validate(lowered, pp, m, v)
    assert compute_only(lowered) == compute
    plain, comm = simulate(compute, pp, v), simulate(lowered, pp, v)
    assert not plain.deadlock and not comm.deadlock
    for rank in range(pp):
        assert plain.order[rank] == [str(a) for a in compute[rank]]
        assert [a for a in comm.order[rank] if parse_action(a).is_compute] == plain.order[rank]
        assert comm.order[rank] == [str(a) for a in lowered[rank]]
    # Sends and receives take no time, so lowering changes neither the steps nor the memory.
    assert comm.steps == plain.steps
    assert comm.peak_inflight == plain.peak_inflight
    assert comm.timeline == plain.timeline
    # Between any two ranks, receives come in the order of the sends: what NCCL (which ignores tags)
    # needs.
    assert p2p_order_mismatches(lowered, pp) == []


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_simulated_peak_inflight_matches_the_cost_model(case):
    kind, pp, m, v = case
    result = simulate(schedule(kind, pp, m, v), pp, v)
    for rank in range(pp):
        assert result.peak_inflight[rank] == pytest.approx(
            inflight_microbatches(kind, pp, m, rank, v)
        ), rank


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_peak_inflight_closed_forms(case):
    kind, pp, m, v = case
    peak = simulate(schedule(kind, pp, m, v), pp, v).peak_inflight
    for rank in range(pp):
        if kind == "gpipe":
            expected = m
        elif kind == "1f1b":
            expected = min(pp - rank, m)
        else:
            expected = min(2 * (pp - rank - 1) + (v - 1) * pp + 1, m * v) / v
        assert peak[rank] == pytest.approx(expected), rank


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_step_counts(case):
    kind, pp, m, v = case
    steps = simulate(lower(schedule(kind, pp, m, v), pp, v), pp, v).steps
    if kind != "interleaved-1f1b":
        # Unit-time F and B: the last micro-batch's forward leaves rank 0 at step m, reaches the
        # last rank pp - 1 steps later, and its backward needs pp more; the other m - 1 backwards on
        # rank 0 follow back to back: m + (pp - 1) + (pp - 1) + 1 + (m - 1) = 2 (m + pp - 1), i.e.
        # the ideal 2m plus a bubble of 2 (pp - 1) (Narayanan et al. 2021: (p - 1) / m of the
        # ideal).
        assert steps == 2 * (m + pp - 1)
    else:
        # Each chunk action takes one step, i.e. 1/v of a whole stage's F or B. The ideal is 2 m v
        # chunk steps, and the fill and drain still cross pp - 1 rank boundaries each way, but now
        # one chunk at a time: 2 m v + 2 (pp - 1) chunk steps. The same work without interleaving is
        # 2 (m + pp - 1) whole-stage steps = 2 m v + 2 (pp - 1) v chunk steps: the bubble shrinks by
        # v, the (p - 1) / (v m) of costs.bubble_fraction.
        assert steps == 2 * m * v + 2 * (pp - 1)
        assert steps < 2 * (m + pp - 1) * v or pp == 1


@pytest.mark.parametrize("case", sorted(HAND_WRITTEN), ids=case_id)
def test_schedules_equal_the_orders_written_by_hand(case):
    # tests/expected_orders.py writes each order out from the schedule's definition, independently
    # of schedule().
    kind, pp, m, v = case
    compute = schedule(kind, pp, m, v)
    assert {rank: [str(a) for a in actions] for rank, actions in compute.items()} == expected(*case)
    # and the lowered program runs them in that order
    result = simulate(lower(compute, pp, v), pp, v)
    assert not result.deadlock
    ran = {
        rank: [a for a in order if parse_action(a).is_compute]
        for rank, order in result.order.items()
    }
    assert ran == expected(*case)


def test_gpipe_lowering_written_by_hand():
    # Receive before each F of a later stage and each B of an earlier one; send after, to the other
    # neighbour.
    lowered = lower(schedule("gpipe", pp=2, num_microbatches=2), pp=2)
    assert [str(a) for a in lowered[0]] == [
        "0F0",
        "0SEND_F0",
        "0F1",
        "0SEND_F1",
        "0RECV_B0",
        "0B0",
        "0RECV_B1",
        "0B1",
    ]
    assert [str(a) for a in lowered[1]] == [
        "1RECV_F0",
        "1F0",
        "1RECV_F1",
        "1F1",
        "1B0",
        "1SEND_B0",
        "1B1",
        "1SEND_B1",
    ]


def test_lowering_inserts_sends_and_receives():
    lowered = lower(schedule("1f1b", pp=2, num_microbatches=2), pp=2)
    assert [str(a) for a in lowered[0]] == [
        "0F0",
        "0SEND_F0",
        "0F1",
        "0SEND_F1",
        "0RECV_B0",
        "0B0",
        "0RECV_B1",
        "0B1",
    ]
    assert [str(a) for a in lowered[1]] == [
        "1RECV_F0",
        "1F0",
        "1B0",
        "1SEND_B0",
        "1RECV_F1",
        "1F1",
        "1B1",
        "1SEND_B1",
    ]
    assert Action(0, "SEND_F", 1).peer == 1 and Action(1, "RECV_F", 1).peer == 0
    assert (
        Action(1, "SEND_B", 0).peer == 0
        and Action(0, "RECV_B", 0).peer == 1
        and Action(0, "F", 0).peer is None
    )


def test_virtual_stages_on_one_rank_hand_over_without_communication():
    compute = schedule("interleaved-1f1b", pp=1, num_microbatches=2, virtual_stages=3)
    assert lower(compute, pp=1, virtual_stages=3) == compute
    # With pp > 1, the hop from the last rank's chunk back to rank 0's next chunk is a real
    # transfer.
    lowered = lower(
        schedule("interleaved-1f1b", pp=2, num_microbatches=2, virtual_stages=2),
        pp=2,
        virtual_stages=2,
    )
    assert Action(1, "SEND_F", 0) in lowered[1] and Action(2, "RECV_F", 0) in lowered[0]
    assert Action(2, "SEND_B", 0) in lowered[0] and Action(1, "RECV_B", 0) in lowered[1]


def test_lower_rejects_a_lowered_schedule():
    lowered = lower(schedule("gpipe", 2, 2), 2)
    with pytest.raises(ValueError, match="compute-only"):
        lower(lowered, 2)


def test_interleaved_order_follows_megatron():
    # pp = 2, v = 2, m = 4: rank 0 holds stages 0 and 2. Micro-batches go through chunk 0 in groups
    # of pp, then the same group through chunk 1; warmup 2 (pp - 1) + (v - 1) pp = 4 chunk forwards
    # on rank 0.
    compute = schedule("interleaved-1f1b", pp=2, num_microbatches=4, virtual_stages=2)
    assert [str(a) for a in compute[0]] == [
        "0F0",
        "0F1",
        "2F0",
        "2F1",  # warmup
        "0F2",
        "2B0",
        "0F3",
        "2B1",
        "2F2",
        "0B0",
        "2F3",
        "0B1",  # steady 1F1B over chunks
        "2B2",
        "2B3",
        "0B2",
        "0B3",  # cooldown
    ]
    assert [str(a) for a in compute[1]][:4] == ["1F0", "1F1", "3F0", "3B0"]  # warmup (v - 1) pp = 2


def test_deadlock_is_reported_not_raised():
    compute = schedule("1f1b", pp=2, num_microbatches=2)
    # Rank 1 runs micro-batch 1 first; its first backward then waits on a forward queued behind it.
    compute[1] = [Action(1, "F", 1), Action(1, "B", 0), Action(1, "F", 0), Action(1, "B", 1)]
    validate(compute, 2, 2)  # complete, yet it cannot run
    result = simulate(compute, pp=2)
    assert result.deadlock
    assert result.blocked == {0: "0B0", 1: "1B0"}
    assert result.order[1] == ["1F1"]


def test_deadlock_on_a_receive_that_waits_for_its_own_reply():
    lowered = lower(schedule("1f1b", pp=2, num_microbatches=2), pp=2)
    # Rank 0 waits for micro-batch 0's gradient before sending its activations: neither side can
    # move.
    lowered[0].remove(Action(0, "SEND_F", 0))
    lowered[0].insert(lowered[0].index(Action(0, "RECV_B", 0)) + 1, Action(0, "SEND_F", 0))
    result = simulate(lowered, pp=2)
    assert result.deadlock
    assert result.blocked == {0: "0RECV_B0", 1: "1RECV_F0"}


@pytest.mark.parametrize("text", ["1F0", "0B12", "3SEND_F2", "2RECV_F0", "0SEND_B7", "11RECV_B3"])
def test_action_string_round_trip(text):
    action = parse_action(text)
    assert str(action) == text
    assert parse_action(str(action)) == action


def test_parse_action_fields_and_errors():
    assert parse_action("1F0") == Action(stage=1, kind="F", microbatch=0)
    assert parse_action("2RECV_B3") == Action(2, "RECV_B", 3)
    for bad in ("F0", "1X0", "1F", "1 F 0", "-1F0"):
        with pytest.raises(ValueError, match="cannot parse"):
            parse_action(bad)
    with pytest.raises(ValueError, match="unknown action kind"):
        Action(0, "W", 0)  # type: ignore[arg-type]


def test_validate_names_what_is_wrong():
    compute = schedule("1f1b", pp=2, num_microbatches=2)
    broken = {0: compute[0] + [Action(0, "F", 1)], 1: [a for a in compute[1] if str(a) != "1B1"]}
    with pytest.raises(ValueError, match=r"missing 1B1.*duplicated 0F1"):
        validate(broken, 2, 2)
    with pytest.raises(ValueError, match=r"misplaced 1F0 on rank 0 \(stage 1 runs on rank 1\)"):
        validate({0: compute[0] + compute[1], 1: []}, 2, 2)
    with pytest.raises(ValueError, match="out of range.*0F5"):
        validate({0: compute[0] + [Action(0, "F", 5)], 1: compute[1]}, 2, 2)
    lowered = lower(compute, 2)
    lowered[1].remove(Action(1, "RECV_F", 0))
    with pytest.raises(ValueError, match=r"unpaired transfers .*\(0, 'F', 0\)"):
        validate(lowered, 2, 2)


def test_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"num_microbatches \(6\) % pp \(4\) = 2 != 0; use 8 or 4"):
        schedule("interleaved-1f1b", pp=4, num_microbatches=6, virtual_stages=2)
    with pytest.raises(ValueError, match="virtual stages need interleaved-1f1b"):
        schedule("1f1b", pp=2, num_microbatches=4, virtual_stages=2)
    with pytest.raises(ValueError, match="unknown schedule"):
        schedule("zero-bubble", pp=2, num_microbatches=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be >= 1"):
        schedule("gpipe", pp=0, num_microbatches=4)


def test_format_schedule_and_timeline_picture():
    compute = schedule("1f1b", pp=2, num_microbatches=3)
    assert (
        format_schedule(compute)
        == "rank 0 | 0F0 0F1 0B0 0F2 0B1 0B2\nrank 1 | 1F0 1B0 1F1 1B1 1F2 1B2"
    )
    result = simulate(lower(compute, 2), pp=2)
    assert result.steps == 8
    assert (
        format_schedule(result.timeline)
        == "rank 0 | 0F0 0F1   . 0B0 0F2 0B1   . 0B2\nrank 1 |   . 1F0 1B0 1F1 1B1 1F2 1B2   ."
    )


def test_p2p_order_mismatch_is_found():
    lowered = lower(schedule("gpipe", pp=2, num_microbatches=2), pp=2)
    swapped = {
        0: lowered[0],
        1: [lowered[1][2], lowered[1][3], lowered[1][0], lowered[1][1], *lowered[1][4:]],
    }
    assert [str(a) for a in swapped[1][:4]] == ["1RECV_F1", "1F1", "1RECV_F0", "1F0"]
    assert p2p_order_mismatches(swapped, pp=2) == [(0, 1)]
