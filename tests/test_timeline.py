"""The timed step simulation (hyparallel.planner.timeline), its picture, and `hyparallel
simulate`."""

from __future__ import annotations

import pytest

import hyparallel as hp
from hyparallel.cli import main
from hyparallel.pipeline.schedule import lower, schedule
from hyparallel.planner.timeline import run_timed, timeline
from hyparallel.spec.errors import ConfigError
from hyparallel.tools.pictures import render_timeline


def hand_plan(schedule_kind: str, pp: int, m: int, v: int = 1) -> hp.Plan:
    """A plan written by hand: no stages, no predictions, so the timeline is in relative units."""
    return hp.Plan.from_dict(
        {
            "training": {"global_batch": m, "seq_len": 16},
            "parallel": {"pp": pp, "schedule": schedule_kind, "virtual_stages": v},
        }
    )


@pytest.fixture(scope="module")
def tiny_plans():
    """gpt-tiny planned on the CPU preset with pp forced: 4 micro-batches; stages unequal
    (embedding, head).

    tp and micro_batch are fixed so that both have 4 micro-batches whatever else the search prefers
    (it once picked one micro-batch for 1F1B, and now two: the closed form and the timed run agree
    less closely there).
    """
    model = hp.models.build("gpt-tiny", device="meta")
    cluster = hp.ClusterSpec.preset("cpu")
    return {
        kind: hp.plan(
            model, cluster, global_batch=32, seq_len=64, pp=pp, schedule=kind, tp=1, micro_batch=mb
        )
        for kind, pp, mb in (("gpipe", 4, 4), ("1f1b", 2, 2))
    }


def makespan(blocks):
    return max(b.end_s for b in blocks)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("pp", "m"), [(4, 8), (2, 3), (1, 4)])
def test_equal_stages_take_the_textbook_time(kind, pp, m):
    # (m + pp - 1)(F + B) for GPipe and 1F1B with equal stages and free transfers (Narayanan et al.
    # 2021).
    forward, backward = 1.0, 2.0
    blocks = run_timed(lower(schedule(kind, pp, m), pp), [forward] * pp, [backward] * pp)
    assert makespan(blocks) == pytest.approx((m + pp - 1) * (forward + backward))


def test_interleaving_shrinks_the_bubble_by_v():
    # Each of v chunks does 1/v of a stage's work: (m + (pp - 1) / v)(F + B).
    pp, m, v = 4, 8, 2
    blocks = run_timed(
        lower(schedule("interleaved-1f1b", pp, m, v), pp, v), [0.5] * pp * v, [1.0] * pp * v
    )
    assert makespan(blocks) == pytest.approx((m + (pp - 1) / v) * 3.0)


def test_transfers_delay_only_the_critical_path():
    # GPipe over 2 ranks with transfers of c: the first forward crosses once and the first backward
    # once, everything else overlaps with compute: (m + 1)(F + B) + 2c.
    m, c = 4, 0.25
    blocks = run_timed(lower(schedule("gpipe", 2, m), 2), [1.0, 1.0], [2.0, 2.0], [c])
    assert makespan(blocks) == pytest.approx((m + 1) * 3.0 + 2 * c)
    waits = [b for b in blocks if b.kind.startswith("RECV") and b.duration_s > 0]
    assert waits and all(b.duration_s <= c + 1e-12 for b in waits)


@pytest.mark.parametrize(
    ("kind", "pp", "m", "v"), [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved-1f1b", 4, 8, 2)]
)
def test_every_action_appears_once_in_its_order(kind, pp, m, v):
    tl = timeline(hand_plan(kind, pp, m, v))
    lowered = lower(schedule(kind, pp, m, v), pp, v)
    for rank, actions in lowered.items():
        ran = [b for b in tl.blocks if b.rank == rank and b.kind != "tail"]
        assert [(b.stage, b.kind, b.microbatch) for b in ran] == [
            (a.stage, a.kind, a.microbatch) for a in actions
        ]
        computes = [b for b in ran if b.kind in ("F", "B")]
        # one computation at a time
        assert all(a.end_s <= b.start_s for a, b in zip(computes, computes[1:]))
    assert len(tl.compute_blocks()) == pp * v * m * 2


def test_hand_plan_falls_back_to_relative_units():
    tl = timeline(hand_plan("gpipe", 4, 8))
    assert tl.units == "relative" and "relative units" in tl.notes[0]
    assert (
        tl.memory_units == "micro-batches"
        and tl.memory_limit is None
        and tl.predicted_step_s is None
    )
    assert tl.total_s == (8 + 3) * 3.0 and not [b for b in tl.blocks if b.kind == "tail"]
    # Every rank idles (pp - 1)(F + B) of the (m + pp - 1)(F + B) step.
    assert tl.bubble_fraction == pytest.approx(dict.fromkeys(range(4), 3 / 11))


def test_1f1b_holds_fewer_microbatches_than_gpipe_in_the_same_time():
    gpipe, one_f_one_b = timeline(hand_plan("gpipe", 4, 8)), timeline(hand_plan("1f1b", 4, 8))
    assert gpipe.total_s == one_f_one_b.total_s

    def peak(tl, rank):
        return max(level for _, level in tl.memory[rank])

    # pp - rank (1F1B)
    assert peak(gpipe, 0) == 8 and [peak(one_f_one_b, r) for r in range(4)] == [4, 3, 2, 1]
    interleaved = timeline(hand_plan("interleaved-1f1b", 4, 8, 2))
    assert peak(interleaved, 0) == (2 * 3 + 4 + 1) / 2  # Megatron's warm-up + 1 chunks, each 1/v


def test_planned_memory_peaks_at_the_prediction_and_returns_to_static(tiny_plans):
    for plan in tiny_plans.values():
        tl = timeline(plan)
        assert tl.units == "seconds" and tl.memory_units == "GiB"
        assert tl.memory_limit == pytest.approx(plan.cluster.device.memory_bytes / 2**30)
        for rank, series in tl.memory.items():
            levels = [level for _, level in series]
            assert max(levels) == pytest.approx(plan.predicted.memory_gib[rank])
            assert levels[-1] == pytest.approx(levels[0])  # every activation freed by its backward
            assert series[-1][0] == tl.total_s
        tails = [b for b in tl.blocks if b.kind == "tail"]
        assert len(tails) == plan.parallel.pp and all(
            b.duration_s == pytest.approx(plan.predicted.comm_s.dp) for b in tails
        )


def test_planner_writes_the_stage_timings(tiny_plans):
    plan = tiny_plans["1f1b"]
    for stage in plan.stages:
        # tp = 1 and ZeRO < 2: no all-reduces, nothing else charged per micro-batch; 6-digit
        # rounding.
        assert stage.forward_s + stage.backward_s == pytest.approx(stage.compute_s, rel=1e-5)
        assert stage.backward_s > stage.forward_s > 0 and stage.activation_gib > 0
    assert plan.stages[0].p2p_s > 0 and plan.stages[-1].p2p_s is None


def test_makespan_agrees_with_the_planner(tiny_plans):
    # The planner's step (Note [step time] in planner/search.py) is max_s[(m - 1/v) t_s + x_s] +
    # sum_s t_s / v, with 2 v p2p_s in every t_s: transfers charged as if they never overlapped
    # compute. The timed run pays a transfer only where it is on the critical path, so it is shorter
    # by at most that charge. Without transfers, GPipe's critical path is the closed form exactly;
    # 1F1B's order differs from it by a few percent when stages are unequal (here the embedding and
    # head stages are 10x lighter than the blocks): 5%.
    for kind, plan in tiny_plans.items():
        par, c = plan.parallel, plan.stages[0].p2p_s
        p2p_charge = 2 * c * (par.virtual_stages * plan.num_microbatches - 1 + par.pp)
        predicted = plan.predicted.step_time_s
        tl = timeline(plan)
        assert predicted - p2p_charge * 1.05 <= tl.total_s <= predicted * 1.05
        free = plan.model_copy(
            update={"stages": [s.model_copy(update={"p2p_s": None}) for s in plan.stages]}
        )
        # gpipe: 6-digit rounding of the plan's figures
        tolerance = 1e-5 if kind == "gpipe" else 0.05
        assert timeline(free).total_s == pytest.approx(predicted - p2p_charge, rel=tolerance)


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_picture_draws_one_bar_per_forward_and_backward(tmp_path, tiny_plans, suffix):
    plan = tiny_plans["gpipe"]
    drawn = render_timeline(timeline(plan), tmp_path / f"step{suffix}")
    assert drawn.path.exists() and drawn.path.stat().st_size > 20_000
    par = plan.parallel
    assert drawn.compute_bars == par.pp * par.virtual_stages * plan.num_microbatches * 2
    # the embedding's and head's forwards are too narrow to number
    assert 0 < drawn.labels and not drawn.magnified


def test_picture_numbers_every_block_of_a_small_schedule(tmp_path):
    drawn = render_timeline(timeline(hand_plan("interleaved-1f1b", 4, 8, 2)), tmp_path / "step.svg")
    assert drawn.compute_bars == drawn.labels == 4 * 2 * 8 * 2 and not drawn.magnified


def test_picture_of_many_microbatches_magnifies_the_ends(tmp_path):
    tl = timeline(hand_plan("interleaved-1f1b", 4, 256, 2))
    drawn = render_timeline(tl, tmp_path / "step.png")
    assert drawn.magnified and drawn.compute_bars == 4 * 2 * 256 * 2
    # numbers only where they fit: in the magnified ends
    assert 0 < drawn.labels < drawn.compute_bars


def test_picture_refuses_an_unknown_extension(tmp_path):
    with pytest.raises(
        ConfigError, match=r"unknown picture extension '\.jpg'; use one of \.png, \.svg"
    ):
        render_timeline(timeline(hand_plan("1f1b", 2, 4)), tmp_path / "step.jpg")


def test_cli_simulate_draws_a_planned_plan(capsys, tmp_path, tiny_plans):
    plan_path, picture = tmp_path / "plan.yaml", tmp_path / "timeline.png"
    tiny_plans["1f1b"].save(plan_path)
    assert main(["simulate", str(plan_path), "--out", str(picture)]) == 0
    out = capsys.readouterr().out
    assert picture.stat().st_size > 20_000
    assert (
        "simulated step" in out
        and "(planner:" in out
        and "bubble per rank 0 " in out
        and f"wrote {picture}" in out
    )
    assert main(["simulate", str(plan_path)]) == 0
    out = capsys.readouterr().out
    assert "rank 0 | 0F0" in out and "rank 1 |" in out and "--out" in out


def test_cli_simulate_errors_are_one_line(capsys, tmp_path, tiny_plans):
    plan_path = tmp_path / "plan.yaml"
    tiny_plans["1f1b"].save(plan_path)
    assert main(["simulate", str(plan_path), "--out", str(tmp_path / "timeline.gif")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown picture extension '.gif'" in err
    assert main(["simulate", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
