"""Checkpoint cost and goodput (hyparallel/planner/goodput.py): the formulas against hand-computed
numbers, the plan's `checkpoint` section from the API and `hyparallel plan --mtbf`, and `hyparallel
show` printing it."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import hyparallel as hp
from hyparallel.cli import main
from hyparallel.planner import goodput
from hyparallel.spec import limits
from hyparallel.spec.errors import ConfigError, PlanError
from hyparallel.spec.schema import Plan

HOUR_S = 3600.0
DAY_S = 24 * HOUR_S


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def hand_plan(num_params: int = 2_000_000_000, step_time_s: float = 2.0, **parallel) -> Plan:
    """A plan on the cpu preset (8 processes, 0.17 GB/s memory checkpoint each, 0.7 GB/s disk per
    node), dp 8 by default."""
    parallel = parallel or {"dp": 8}
    pp = parallel.get("pp", 1)
    return Plan.from_dict(
        {
            "cluster": "cpu",
            "model": {"name": "m", "num_params": num_params, "num_layers": 2, "fingerprint": ""},
            "training": {"global_batch": 64, "seq_len": 16, "dtype": "bf16"},
            "parallel": parallel,
            "predicted": {
                "step_time_s": step_time_s,
                "tokens_per_s": 1.0,
                "tflops_per_gpu": 1.0,
                "mfu": 0.5,
                "bubble_fraction": 0.0,
                "memory_gib": [1.0] * pp,
                "comm_s": {"tp": 0.0, "dp": 0.0, "pp": 0.0},
            },
        }
    )


# ---- the formulas --------------------------------------------------------------------------------


def test_young_daly_interval_and_goodput_by_hand():
    # C = 10 s, M = 24 h: T = sqrt(2 x 10 x 86,400) = 1,314.53 s.
    interval = goodput.young_daly_interval_s(10.0, DAY_S)
    assert interval == pytest.approx(1314.534, abs=1e-3)
    # waste = 10 / 1,314.53 + (657.27 + 60) / 86,400 = 0.0076073 + 0.0083017.
    assert goodput.waste_fraction(interval, 10.0, DAY_S, 60.0) == pytest.approx(0.015909, abs=1e-6)
    assert goodput.goodput_fraction(interval, 10.0, DAY_S, 60.0) == pytest.approx(
        0.984091, abs=1e-6
    )
    # A job failing more often than it can save does no useful work: clipped at 0, not negative.
    assert goodput.goodput_fraction(10.0, 100.0, 60.0, 60.0) == 0.0


@pytest.mark.parametrize(
    ("save_s", "mtbf_s", "restart_s"),
    [(10.0, DAY_S, 60.0), (0.05, 2 * HOUR_S, 0.0), (300.0, 7 * DAY_S, 600.0)],
)
def test_the_interval_maximises_goodput(save_s, mtbf_s, restart_s):
    best = goodput.young_daly_interval_s(save_s, mtbf_s)

    def at(interval):
        return goodput.goodput_fraction(interval, save_s, mtbf_s, restart_s)

    assert at(best) >= at(0.5 * best) and at(best) >= at(2 * best)
    grid = [best * (0.5 + i / 100) for i in range(151)]  # 0.5 T .. 2 T
    assert max(grid, key=at) == pytest.approx(best, rel=0.011)


def test_save_times_by_hand():
    # 3 GB per rank, 8 ranks per node: 1 s to host memory at 3 GB/s, 24 GB / 0.7 GB/s to disk.
    assert goodput.host_copy_s(3e9, 3e9) == pytest.approx(1.0)
    assert goodput.disk_write_s(3e9, 8, 0.7e9) == pytest.approx(34.285714)
    # the write in the background
    assert goodput.blocking_save_s(1.0, 34.285714, "memory") == pytest.approx(1.0)
    assert goodput.blocking_save_s(1.0, 34.285714, "disk") == pytest.approx(34.285714)


def test_interval_in_whole_steps():
    # C = 1 s, M = 3.125 s: T = sqrt(2 x 1 x 3.125) = 2.5 steps of 1 s; the better of 2 and 3 steps.
    save_s, mtbf_s, restart_s = 1.0, 3.125, 0.0
    assert goodput.young_daly_interval_s(save_s, mtbf_s) == pytest.approx(2.5)
    steps = goodput.interval_steps(1.0, save_s, mtbf_s, restart_s)
    assert steps == max(
        (2, 3), key=lambda n: goodput.goodput_fraction(n, save_s, mtbf_s, restart_s)
    )
    # Never less than one step, however cheap the save; never less than asked.
    assert goodput.interval_steps(1e4, 0.001, DAY_S, 60.0) == 1
    assert goodput.interval_steps(1e4, 0.0, DAY_S, 60.0) == 1
    assert goodput.interval_steps(1.0, 1.0, DAY_S, 0.0, fewest_steps=5000) == 5000


# ---- bytes per rank ------------------------------------------------------------------------------


def test_bytes_per_rank_spread_over_tp_and_dp():
    # 12 bytes per parameter (fp32 weights + AdamW m, v), the stage's pieces written once over tp x
    # dp ranks.
    assert goodput.CHECKPOINT_BYTES_PER_PARAM == 12
    plan = hand_plan(num_params=2_000_000_000)  # dp 8
    assert goodput.checkpoint_bytes_per_rank(plan) == pytest.approx(2e9 * 12 / 8)
    # A memory checkpoint snapshots what each rank holds: everything under DDP, a 1/dp shard under
    # ZeRO.
    assert goodput.held_bytes_per_rank(plan) == pytest.approx(2e9 * 12)
    zero = hand_plan(num_params=2_000_000_000, dp=8, zero=1)
    assert (
        goodput.held_bytes_per_rank(zero)
        == goodput.checkpoint_bytes_per_rank(zero)
        == pytest.approx(2e9 * 12 / 8)
    )
    plan = hand_plan(num_params=1_000_000, dp=2, tp=2, pp=2)  # no stages: split evenly over pp
    assert goodput.checkpoint_bytes_per_rank(plan) == pytest.approx(1e6 / 2 * 12 / 4)
    with_stages = Plan.from_dict(
        {
            **plan.to_dict(),
            "stages": [
                {"index": 0, "modules": ["a"], "num_params": 1000},
                {"index": 1, "modules": ["b"], "num_params": 3000},
            ],
        }
    )
    # the busiest stage
    assert goodput.checkpoint_bytes_per_rank(with_stages) == pytest.approx(3000 * 12 / 4)
    # ZeRO 0: over tp only
    assert goodput.held_bytes_per_rank(with_stages) == pytest.approx(3000 * 12 / 2)


def test_bytes_per_rank_sums_the_virtual_stages_of_a_device():
    plan = hand_plan(
        num_params=850, dp=2, tp=2, pp=2, schedule="interleaved-1f1b", virtual_stages=2
    )
    stages = [
        {"index": i, "modules": [f"m{i}"], "num_params": n}
        for i, n in enumerate([100, 400, 300, 50])
    ]
    plan = Plan.from_dict({**plan.to_dict(), "stages": stages})
    # device 1: stages 1, 3
    assert goodput.checkpoint_bytes_per_rank(plan) == pytest.approx((400 + 50) * 12 / 4)


def test_bytes_per_rank_needs_parameter_counts():
    plan = Plan.from_dict({"training": {"global_batch": 8, "seq_len": 16}, "parallel": {"dp": 1}})
    with pytest.raises(PlanError, match="checkpoint size is unknown"):
        goodput.checkpoint_bytes_per_rank(plan)


# ---- the plan section ----------------------------------------------------------------------------


def test_checkpoint_cost_by_hand():
    # 2e9 parameters, ZeRO 1 over dp 8: 3 GB per rank, held and written; step 2 s
    plan = hand_plan(zero=1, dp=8)
    disk = goodput.checkpoint_cost(plan, 24)
    save_s = 3e9 * 8 / 0.7e9  # the node's 24 GB at 0.7 GB/s: 34.29 s
    assert (
        disk.checkpoint_gib == pytest.approx(3e9 / 2**30, rel=1e-5)
        and disk.host_copy_gib == disk.checkpoint_gib
    )
    assert (
        disk.disk_write_s == pytest.approx(save_s, rel=1e-5)
        and disk.save_time_s == disk.disk_write_s
    )
    # what a memory checkpoint would take
    assert disk.host_copy_s == pytest.approx(3e9 / 0.17e9, rel=1e-5)
    ideal_steps = math.sqrt(2 * save_s * DAY_S) / 2.0  # 1,217.1
    assert disk.interval_steps in (math.floor(ideal_steps), math.ceil(ideal_steps))
    assert disk.interval_s == pytest.approx(disk.interval_steps * 2.0)
    expected = 1 - save_s / disk.interval_s - (disk.interval_s / 2 + 60) / DAY_S
    assert disk.goodput == pytest.approx(expected, rel=1e-5)
    assert (disk.storage, disk.mtbf_hours, disk.restart_s) == (
        "disk",
        24,
        goodput.DEFAULT_RESTART_S,
    )

    memory = goodput.checkpoint_cost(plan, 24, storage="memory", restart_s=0)
    copy_s = 3e9 / 0.17e9  # 17.65 s; the disk write runs in the background
    assert memory.save_time_s == pytest.approx(copy_s, rel=1e-5)
    ideal_steps = math.sqrt(2 * copy_s * DAY_S) / 2.0  # 873.1
    assert memory.interval_steps in (math.floor(ideal_steps), math.ceil(ideal_steps))
    assert memory.goodput > disk.goodput


def test_a_memory_checkpoint_under_ddp_copies_the_whole_replica():
    # ZeRO 0, dp 8: each rank holds all 24 GB of state, and writes 3 GB of it to disk
    plan = hand_plan()
    memory = goodput.checkpoint_cost(plan, 24, storage="memory")
    assert memory.host_copy_gib == pytest.approx(24e9 / 2**30, rel=1e-5)
    assert memory.save_time_s == pytest.approx(24e9 / 0.17e9, rel=1e-5)
    assert memory.checkpoint_gib == pytest.approx(3e9 / 2**30, rel=1e-5)


def test_a_memory_checkpoint_waits_for_its_background_write():
    # MTBF 0.01 h = 36 s: Young/Daly says sqrt(2 x C x 36) with C = 1 s (at 3 GB/s), 4 steps of 2 s,
    # but the disk write takes 34.3 s (18 steps): every checkpoint reaches the disk only at 18
    # steps, and the job makes no progress.
    cluster = hp.ClusterSpec.preset("cpu").model_copy(
        update={"host_memory_bandwidth_bytes_per_s": 3e9}
    )
    cost = goodput.checkpoint_cost(hand_plan(zero=1, dp=8), 0.01, storage="memory", cluster=cluster)
    assert cost.save_time_s == pytest.approx(1.0)
    assert cost.interval_steps == 18 and cost.goodput == 0.0


def test_with_goodput_adds_the_section_and_it_round_trips(tmp_path):
    plan = hand_plan()
    assert plan.checkpoint is None
    planned = hp.planner.with_goodput(plan, 24, restart_s=120, storage="memory")
    assert planned.checkpoint == goodput.checkpoint_cost(plan, 24, restart_s=120, storage="memory")
    assert planned.model_copy(update={"checkpoint": None}) == plan  # nothing else changes
    planned.save(tmp_path / "plan.yaml")
    loaded = Plan.load(tmp_path / "plan.yaml")
    assert loaded == planned and loaded.checkpoint.storage == "memory"
    plan.save(tmp_path / "bare.yaml")
    assert "checkpoint" not in yaml.safe_load((tmp_path / "bare.yaml").read_text())
    assert Plan.load(tmp_path / "bare.yaml").checkpoint is None


def test_hp_plan_takes_mtbf_hours():
    model, cluster = hp.models.build("gpt-tiny", device="meta"), hp.ClusterSpec.preset("cpu")
    kwargs = {"global_batch": 16, "seq_len": 32, "dtype": "fp32"}
    bare = hp.plan(model, cluster, **kwargs)
    assert bare.checkpoint is None
    planned = hp.plan(
        model, cluster, **kwargs, mtbf_hours=12, restart_s=30, checkpoint_storage="memory"
    )
    assert (
        planned.checkpoint
        == hp.planner.with_goodput(bare, 12, restart_s=30, storage="memory").checkpoint
    )
    assert planned.checkpoint.interval_steps >= 1 and 0 < planned.checkpoint.goodput < 1


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"mtbf_hours": 0}, "mtbf_hours must be a number of hours, more than 0"),
        ({"mtbf_hours": -24}, "mtbf_hours must be"),
        ({"mtbf_hours": math.nan}, "mtbf_hours must be"),
        ({"mtbf_hours": math.inf}, "mtbf_hours must be"),
        ({"mtbf_hours": True}, "mtbf_hours must be"),
        ({"mtbf_hours": "24"}, "mtbf_hours must be"),
        ({"mtbf_hours": 24, "restart_s": -1}, "restart_s must be a number of seconds, at least 0"),
        ({"mtbf_hours": 24, "storage": "tape"}, "storage must be one of memory, disk, got 'tape'"),
    ],
)
def test_nonsense_input_is_one_line(kwargs, expected):
    with pytest.raises(PlanError, match=expected) as error:
        goodput.checkpoint_cost(hand_plan(), **kwargs)
    assert "\n" not in str(error.value)


def test_a_cluster_without_the_figures_is_refused_in_one_line():
    cluster = hp.ClusterSpec.preset("cpu").model_copy(update={"disk_bandwidth_bytes_per_s": None})
    with pytest.raises(PlanError, match="cluster 'cpu' gives no disk_bandwidth_bytes_per_s"):
        goodput.checkpoint_cost(hand_plan(), 24, cluster=cluster)
    unpredicted = hand_plan().model_copy(update={"predicted": None})
    with pytest.raises(PlanError, match="no predicted step time"):
        goodput.checkpoint_cost(unpredicted, 24)


@pytest.mark.parametrize("value", [0, -2.0e9, ".nan", "fast"])
def test_cluster_figures_are_validated(tmp_path, value):
    data = hp.ClusterSpec.preset("cpu").model_dump(mode="json")
    data["host_memory_bandwidth_bytes_per_s"] = value
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data).replace("'.nan'", ".nan"))
    with pytest.raises(ConfigError, match="host_memory_bandwidth_bytes_per_s: expected") as error:
        hp.ClusterSpec.load(tmp_path / "c.yaml")
    assert "\n" not in str(error.value)


def test_a_cluster_file_without_the_figures_still_loads(tmp_path):
    spec = hp.ClusterSpec.preset("h200").model_copy(
        update={"host_memory_bandwidth_bytes_per_s": None, "disk_bandwidth_bytes_per_s": None}
    )
    spec.save(tmp_path / "old.yaml")
    assert "bandwidth_bytes_per_s: null" not in (tmp_path / "old.yaml").read_text()
    assert hp.ClusterSpec.load(tmp_path / "old.yaml") == spec
    for name in hp.ClusterSpec.presets():  # every preset gives both
        preset = hp.ClusterSpec.preset(name)
        assert (
            preset.host_memory_bandwidth_bytes_per_s > 0 and preset.disk_bandwidth_bytes_per_s > 0
        )


# ---- the command line ----------------------------------------------------------------------------

PLAN_ARGV = (
    "plan",
    "--model",
    "gpt-tiny",
    "--gpus",
    "8",
    "--cluster",
    "cpu",
    "--global-batch",
    "16",
    "--seq-len",
    "32",
)


def test_plan_mtbf_writes_the_section_and_show_prints_it(capsys, tmp_path):
    out_file = tmp_path / "plan.yaml"
    code, out, err = run(
        capsys,
        *PLAN_ARGV,
        "--mtbf",
        "24",
        "--restart-s",
        "90",
        "--checkpoint",
        "memory",
        "-o",
        str(out_file),
    )
    assert code == 0, err
    section = yaml.safe_load(out_file.read_text())["checkpoint"]
    assert (
        section["mtbf_hours"] == 24
        and section["restart_s"] == 90
        and section["storage"] == "memory"
    )
    assert {"save_time_s", "interval_steps", "interval_s", "goodput"} <= set(section)
    assert "goodput " in out and "Young/Daly, MTBF 24 h" in out
    plan = Plan.load(out_file)
    code, out, err = run(capsys, "show", str(out_file))
    assert code == 0, err
    assert f"a checkpoint every {plan.checkpoint.interval_steps:,} steps" in out
    assert (
        f"{plan.checkpoint.goodput:.1%} expected" in out and "GiB per rank into host memory" in out
    )
    code, out, _ = run(capsys, *PLAN_ARGV, "--mtbf", "24", "--json")
    assert code == 0 and json.loads(out)["checkpoint"]["storage"] == "disk"


def test_plan_without_mtbf_has_no_section(capsys, tmp_path):
    out_file = tmp_path / "plan.yaml"
    code, out, err = run(capsys, *PLAN_ARGV, "-o", str(out_file))
    assert code == 0, err
    assert "checkpoint" not in yaml.safe_load(out_file.read_text()) and "goodput" not in out
    assert Plan.load(out_file).checkpoint is None
    code, out, _ = run(capsys, "show", str(out_file))
    assert code == 0 and "goodput" not in out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("--mtbf", "0"), "argument --mtbf: expected a number of hours above 0"),
        (("--mtbf", "-24"), "argument --mtbf: expected a number of hours above 0"),
        (("--mtbf", "a day"), "argument --mtbf: expected a number of hours above 0"),
        (("--mtbf", "nan"), "argument --mtbf"),
        (("--mtbf", "inf"), "argument --mtbf"),
        (
            ("--mtbf", "24", "--restart-s", "-5"),
            "argument --restart-s: expected a number of seconds from 0",
        ),
        (("--mtbf", "24", "--checkpoint", "tape"), "argument --checkpoint: invalid choice"),
        (("--restart-s", "30"), "add --mtbf HOURS"),
        (("--checkpoint", "memory"), "add --mtbf HOURS"),
    ],
)
def test_bad_mtbf_exits_2_with_one_line(capsys, argv, expected):
    code, out, err = run(capsys, *PLAN_ARGV, *argv)
    assert code == 2 and out == ""
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err


def test_plan_mtbf_on_a_cluster_without_the_figures_exits_2_before_the_search(capsys, tmp_path):
    spec = hp.ClusterSpec.preset("cpu").model_copy(
        update={"host_memory_bandwidth_bytes_per_s": None}
    )
    spec.save(tmp_path / "c.yaml")
    argv = [*PLAN_ARGV[:6], str(tmp_path / "c.yaml"), *PLAN_ARGV[7:]]
    code, _, err = run(capsys, *argv, "--mtbf", "24")
    assert (
        code == 2 and "gives no host_memory_bandwidth_bytes_per_s" in err and err.count("\n") == 1
    )
    assert "searched" not in err


def _not_an_mtbf(text: str) -> bool:
    try:
        return not 0 < float(text) <= limits.MAX_MTBF_HOURS
    except ValueError:
        return True


@settings(max_examples=40, deadline=None)
@given(
    st.one_of(
        st.floats(max_value=0).map(repr),
        st.floats(min_value=limits.MAX_MTBF_HOURS, exclude_min=True).map(repr),
        st.sampled_from(["nan", "-inf", "1e400", "", " ", "0x10", "24h", "1,5", "--"]),
        # one line to show
        st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=8),
    ).filter(_not_an_mtbf)
)
def test_any_bad_mtbf_is_one_line(value):
    # The float flags are fuzzed here: tests/test_fuzz_cli.py's NUMERIC_FLAGS draws integers. No
    # capsys under hypothesis (a function-scoped fixture is not reset between examples): the streams
    # are redirected.
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main([*PLAN_ARGV, "--mtbf", value])
    assert code == 2 and out.getvalue() == ""
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyparallel plan: error:"), lines
