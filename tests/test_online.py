"""Online calibration (hyparallel.planner.online, RunMetrics.calibrate_online, `hyparallel calibrate
--from-run`).

The fit is checked against synthetic clusters whose true figures are known: their predictions are
the "measurements", and the fit must recover the figures. The 2-process run is in
tests/test_online_run.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hyparallel as hp
from hyparallel.cli import main
from hyparallel.planner import online
from hyparallel.runtime import metrics
from hyparallel.runtime.metrics import RunMetrics
from hyparallel.spec.errors import HyparallelError

SPEC = "gpt-tiny"


@pytest.fixture(scope="module")
def tiny():
    """(plan, planner): gpt-tiny planned for 2 processes of the cpu preset, traced once for the
    fits."""
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=2)
    plan = hp.plan(hp.models.load(SPEC).module, cluster, 16, 64, "fp32", name=SPEC)
    return plan, online.Planner(SPEC, plan)


@pytest.fixture(scope="module")
def gpu_plan():
    """gpt-tiny on 8 A100s with tp fixed: efficiencies below 1 and tensor-parallel traffic on the
    links."""
    cluster = hp.ClusterSpec.preset("a100-80g", num_nodes=1)
    plan = hp.plan(hp.models.load(SPEC).module, cluster, 64, 64, "bf16", name=SPEC, tp=2)
    return plan, online.Planner(SPEC, plan)


@pytest.mark.parametrize("factor", [0.37, 1.8])
def test_the_fit_recovers_a_clusters_true_compute_figures(gpu_plan, factor):
    plan, planner = gpu_plan
    stock = plan.cluster
    true = online.scaled(stock, factor)  # the machine as it really is
    measured = planner.evaluate(true)  # what a run on it measures, by the planner's own model
    result = online.calibrate(plan, measured, planner=planner)
    assert result.compute_factor == pytest.approx(factor, rel=1e-3) and not result.links_scaled
    device, real = result.cluster.device, true.device
    for name in ("matmul_efficiency", "attention_efficiency", "memory_efficiency", "op_overhead_s"):
        assert getattr(device, name) == pytest.approx(getattr(real, name), rel=2e-3), name
    assert result.cluster.intra_node == stock.intra_node  # the links are not what was off
    # re-evaluated, it reproduces the measurement
    assert result.refit_step_s == pytest.approx(measured, rel=1e-3)
    assert (
        result.reserved_added_bytes == 0
        and result.cluster.device.reserved_bytes == stock.device.reserved_bytes
    )


def test_a_rate_above_peak_moves_into_the_peak_and_the_rates_stay_proportional(tiny):
    plan, planner = tiny
    stock = plan.cluster.device  # matmul_efficiency 1: its peaks are measured rates
    measured = plan.predicted.step_time_s * 0.6
    result = online.calibrate(plan, measured, planner=planner)
    device, factor = result.cluster.device, result.compute_factor
    assert factor > 1 and device.matmul_efficiency == 1.0
    assert device.peak_flops.fp32 * device.matmul_efficiency == pytest.approx(
        stock.peak_flops.fp32 * factor, rel=1e-5
    )
    assert device.peak_flops.fp32 * device.attention_efficiency == pytest.approx(
        stock.peak_flops.fp32 * stock.attention_efficiency * factor, rel=1e-5
    )
    assert device.op_overhead_s == pytest.approx(stock.op_overhead_s / factor, rel=1e-5)
    assert result.refit_step_s == pytest.approx(measured, rel=1e-3)


def test_a_step_faster_than_the_plans_communication_scales_the_links_too(gpu_plan):
    plan, planner = gpu_plan
    true = online.scaled(plan.cluster, 20.0, links=True)
    measured = planner.evaluate(true)
    # compute alone cannot get there
    assert measured < planner.evaluate(online.scaled(plan.cluster, 1e3))
    result = online.calibrate(plan, measured, planner=planner)
    assert result.links_scaled and result.compute_factor == pytest.approx(20.0, rel=1e-3)
    assert result.refit_step_s == pytest.approx(measured, rel=1e-3)


def test_a_measured_peak_above_the_prediction_grows_the_reserve_and_never_shrinks_it(
    tiny, tmp_path
):
    plan, planner = tiny
    reserved = plan.cluster.device.reserved_bytes
    predicted = plan.predicted.memory_gib[0] * 2**30 - reserved
    step = plan.predicted.step_time_s * 1.5
    above = online.calibrate(
        plan, step, planner=planner, measured_memory_bytes=predicted + 100 * 2**20
    )
    assert above.cluster.device.reserved_bytes == pytest.approx(reserved + 100 * 2**20, abs=2)
    assert above.reserved_added_bytes > 0 and "reserve +100 MiB" in above.line()
    below = online.calibrate(plan, step, planner=planner, measured_memory_bytes=predicted / 2)
    assert below.cluster.device.reserved_bytes == reserved


def test_the_corrected_file_is_written_whole_and_an_existing_one_is_kept(tiny, tmp_path):
    plan, planner = tiny
    target = tmp_path / "corrected.yaml"
    target.write_text("an earlier file\n")
    path = online.free_path(target)
    assert path.name == "corrected-2.yaml" and target.read_text() == "an earlier file\n"
    result = online.calibrate(plan, plan.predicted.step_time_s * 2, planner=planner, out=path)
    loaded = hp.ClusterSpec.load(path)
    assert (
        loaded == result.cluster
        and loaded.name == "cpu-corrected"
        and "online calibration" in loaded.description
    )
    assert f"--cluster {path}" in result.command and str(path) in result.line()
    # no temporary file left
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_the_replan_is_the_one_hyparallel_plan_makes_with_the_corrected_file(
    tiny, tmp_path, capsys
):
    plan, planner = tiny
    path = tmp_path / "corrected.yaml"
    result = online.calibrate(plan, plan.predicted.step_time_s * 3, planner=planner, out=path)
    command = result.command.split()
    assert command[:2] == ["hyparallel", "plan"] and command[-2:] == ["-o", "plan.yaml"]
    assert main([*command[1:-2], "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["parallel"] == result.replanned.to_dict()["parallel"]
    assert printed["training"] == result.replanned.to_dict()["training"]


def record_file(tmp_path, plan, step_s):
    data = {
        "step_time_s": step_s,
        "steps": 5,
        "peak_memory_gib": None,
        "model": SPEC,
        "plan": plan.to_dict(),
    }
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps(data))
    return path


def test_calibrate_from_run_fits_what_the_run_measured(tiny, tmp_path, capsys):
    plan, planner = tiny
    measured = planner.evaluate(online.scaled(plan.cluster, 0.5))
    out = tmp_path / "fixed.yaml"
    assert (
        main(
            [
                "calibrate",
                "--from-run",
                str(record_file(tmp_path, plan, measured)),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    line = capsys.readouterr().out
    assert line.startswith("online calibration: step") and f"wrote {out}" in line
    fixed = hp.ClusterSpec.load(out)
    assert fixed.device.matmul_efficiency == pytest.approx(0.5, rel=1e-3)


def test_calibrate_from_run_takes_the_steps_after_the_warm_up_and_another_file_of_the_same_cluster(
    tiny, tmp_path, capsys
):
    plan, planner = tiny
    measured = planner.evaluate(online.scaled(plan.cluster, 0.25))
    # the summary's median: not what is fitted when every step is there
    path = record_file(tmp_path, plan, 99.0)
    data = json.loads(path.read_text())
    data["step_times_s"] = [5.0] * online.DEFAULT_WARMUP_STEPS + [
        measured * 0.99,
        measured,
        measured * 1.01,
    ]
    path.write_text(json.dumps(data))
    # the same devices, described by another file: the one corrected
    base = tmp_path / "my-cpu.yaml"
    plan.cluster.model_copy(update={"name": "my-cpu"}).save(base)
    out = tmp_path / "fixed.yaml"
    assert (
        main(["calibrate", "--from-run", str(path), "--cluster", str(base), "--out", str(out)]) == 0
    )
    assert "compute x0.25" in capsys.readouterr().out
    fixed = hp.ClusterSpec.load(out)
    assert fixed.name == "my-cpu-corrected" and fixed.device.matmul_efficiency == pytest.approx(
        0.25, rel=1e-3
    )


@pytest.mark.parametrize(
    "content, args, message",
    [
        (None, [], "no such file"),
        ("{not json", [], "not JSON"),
        ('{"step_time_s": 0.1, "steps": 3}', [], "no 'plan' in it"),
        ("plan-without-predictions", [], "its plan has no predictions"),
        ("good", ["--cluster", "h200"], "is not the one the run was planned for"),
        ("good", ["--model", "gpt-mini"], "is not the model the plan was made for"),
        ("good", ["--nproc", "2"], "--nproc: for measuring this machine"),
        ('{"step_time_s": -1, "steps": 3, "plan": {}}', [], "step_time_s"),
    ],
)
def test_calibrate_from_run_refuses_bad_input_in_one_line(
    tiny, tmp_path, capsys, content, args, message
):
    plan, _ = tiny
    path = tmp_path / "metrics.json"
    if content == "good":
        path = record_file(tmp_path, plan, 0.05)
    elif content == "plan-without-predictions":
        path = record_file(tmp_path, plan.model_copy(update={"predicted": None}), 0.05)
    elif content is not None:
        path.write_text(content)
    assert main(["calibrate", "--from-run", str(path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _resident_bytes() -> int:
    """This process's resident set now (VmRSS), not its high-water mark."""
    line = next(
        x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:")
    )
    return int(line.split()[1]) * 1024


def test_the_cpu_peak_stand_in_sees_memory_the_process_touches():
    # The peak resident set is a high-water mark: after other tests it may already be above what
    # this one adds, so the check is that the peak covers what the process holds now, 96 MiB more
    # than before.
    cluster = hp.ClusterSpec.preset("cpu")
    before = _resident_bytes()
    held = torch.ones(96 * 2**20 // 4)  # 96 MiB, every page written
    now = _resident_bytes()
    assert now - before >= 90 * 2**20 and held.sum() > 0
    assert (
        metrics.measured_peak_bytes(torch.device("cpu"), cluster)
        >= now - cluster.device.reserved_bytes
    )
    # no cluster: no reserve to take off
    assert metrics.measured_peak_bytes(torch.device("cpu"), None) is None


def test_run_metrics_fit_once_after_the_warm_up_and_outside_every_measured_step(
    tiny, monkeypatch, tmp_path
):
    plan, planner = tiny
    lines = []
    meter = RunMetrics(plan, flops_per_token=1e6, device=torch.device("cpu"), pp_rank=0, rank=0)
    meter.calibrate_online(
        tmp_path / "fixed.yaml", warmup=2, steps=3, threshold=0.1, log=lines.append
    )
    # traced once above, for speed
    monkeypatch.setattr(online, "Planner", lambda spec, plan: planner)
    now = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    step_s = plan.predicted.step_time_s * 2
    real_calibrate = online.calibrate

    # the fit takes 5 s of the clock: no measured step may contain them
    def slow_calibrate(*args, **kwargs):
        now[0] += 5.0
        return real_calibrate(*args, **kwargs)

    monkeypatch.setattr(online, "calibrate", slow_calibrate)
    for _ in range(8):
        meter.step_started(tokens=1024)
        now[0] += step_s
    assert len(lines) == 1 and "compute x0." in lines[0] and meter.calibration is not None
    assert meter.calibration.measured_step_s == pytest.approx(step_s)
    # the 5 s are in none
    assert all(seconds == pytest.approx(step_s) for seconds, _ in meter.steps())
    assert meter.comparison.step_error == pytest.approx(1.0, rel=1e-6)
    record = meter.record()
    assert record["calibration"]["compute_factor"] == meter.calibration.compute_factor
    assert hp.Plan.from_dict(record["plan"]) == plan


def test_other_ranks_compare_but_never_fit(tiny, monkeypatch):
    plan, _ = tiny
    lines = []
    meter = RunMetrics(plan, flops_per_token=1e6, device=torch.device("cpu"), pp_rank=0, rank=1)
    meter.calibrate_online(warmup=0, steps=2, log=lines.append)
    monkeypatch.setattr(online, "calibrate", lambda *a, **k: pytest.fail("rank 1 fitted"))
    # ep > 1: rank 0 alone reads the experts' imbalance it saw, no collective (the ranks reach the
    # comparison at different steps on CUDA, whose step events complete at different times)
    reads = []
    meter.read_imbalance = lambda: reads.append(1) or 1.3
    for _ in range(4):
        meter.step_started(tokens=1024)
    assert meter.comparison is not None and lines == [] and meter.calibration is None
    assert reads == []


@pytest.mark.parametrize("bad", [{"steps": 0}, {"threshold": -0.1}, {"warmup": True}])
def test_calibrate_online_refuses_bad_settings(tiny, bad):
    meter = RunMetrics(tiny[0], flops_per_token=1e6, device=torch.device("cpu"), pp_rank=0)
    with pytest.raises(HyparallelError, match=next(iter(bad))):
        meter.calibrate_online(**bad)


@pytest.mark.parametrize(
    "error, said",
    [
        (hp.planner.PlanError("nothing fits"), "no fit: nothing fits"),
        (RuntimeError("boom"), "a bug: please report"),
    ],
)
def test_a_failing_fit_is_one_line_and_training_goes_on(tiny, monkeypatch, error, said):
    plan, _ = tiny
    lines = []
    meter = RunMetrics(plan, flops_per_token=1e6, device=torch.device("cpu"), pp_rank=0, rank=0)
    meter.calibrate_online(warmup=0, steps=1, threshold=0.0, log=lines.append)

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(online, "calibrate", fail)
    for _ in range(3):
        meter.step_started(tokens=1024)
    assert (
        len(lines) == 1
        and said in lines[0]
        and meter.calibration is None
        and len(meter.steps()) == 2
    )


def test_the_replan_keeps_a_plans_gathered_logits():
    # A tp plan that gathers its logits (for a loss_fn of its own) is re-planned and costed
    # gathering them too.
    model = hp.models.build("gpt-tiny")
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=2)
    plan = hp.plan(model, cluster, 8, 64, "fp32", tp=2, vocab_parallel_loss=False)
    assert (
        online.asked(plan) == {"vocab_parallel_loss": False}
        and online.fixed(plan)["vocab_parallel_loss"] is False
    )
    vocab = hp.plan(model, cluster, 8, 64, "fp32", tp=2)
    assert online.asked(vocab) == {} and online.fixed(vocab)["vocab_parallel_loss"] is True


def test_scaling_the_links_scales_a_collectives_own_latency_too():
    stock = hp.ClusterSpec.preset("cpu")
    link = stock.intra_node.model_copy(update={"collective_latency_s": 2e-3})
    cluster = stock.model_copy(update={"intra_node": link, "inter_node": link})
    faster = online.scaled(cluster, 4.0, links=True)
    assert faster.intra_node.collective_latency_s == pytest.approx(5e-4)
    assert faster.intra_node.latency_s == pytest.approx(stock.intra_node.latency_s / 4, rel=1e-3)


def test_scaling_compute_scales_a_cpus_activation_costs():
    stock = hp.ClusterSpec.preset("cpu")
    gelu = hp.spec.cluster.ElementCost(forward_s=4e-9, backward_s=6e-9)
    cluster = stock.model_copy(
        update={"device": stock.device.model_copy(update={"activation_costs": {"gelu": gelu}})}
    )
    faster = online.scaled(cluster, 2.0).device.activation_costs["gelu"]
    assert (faster.forward_s, faster.backward_s) == pytest.approx((2e-9, 3e-9))


def test_the_fit_costs_the_experts_with_the_imbalance_the_plan_was_priced_with(tmp_path):
    from hyparallel.tools.parity import small_spec

    # a plan priced at an expert imbalance of 2.5 (hyparallel plan --expert-imbalance 2.5) records
    # it; the fit costs the plan with it (its own prediction back, not 1.2's) and the re-plan
    # command keeps it
    spec = small_spec("hf:MixtralForCausalLM")
    cluster = hp.ClusterSpec.preset("h100-sxm", num_nodes=1)
    model = hp.models.load(spec).module
    plan = hp.plan(model, cluster, 64, 64, "bf16", name=spec, ep=4, expert_imbalance=2.5)
    assert plan.predicted.expert_imbalance == 2.5
    planner = online.Planner(spec, plan)
    assert planner.evaluate(plan.cluster) == pytest.approx(plan.predicted.step_time_s, rel=1e-3)
    default = hp.plan(model, cluster, 64, 64, "bf16", name=spec, **online.fixed(plan))
    assert default.predicted.expert_imbalance == 1.2
    assert default.predicted.step_time_s < plan.predicted.step_time_s
    assert online.asked(plan) == {"expert_imbalance": 2.5}
    assert "--expert-imbalance 2.5" in online.plan_command(spec, plan, "h100-sxm")

    # the run measured 1.6 (pmodel.expert_imbalance): the fit, the re-plan and its command cost the
    # experts with that, so the compute rates are fitted to the rest; the plan's record is kept
    measured = plan.predicted.step_time_s * 1.5
    calibration = online.calibrate(plan, measured, model=spec, expert_imbalance=1.6)
    assert calibration.plan == plan and "--expert-imbalance 1.6" in calibration.command
    assert calibration.replanned.predicted.expert_imbalance == 1.6
    as_priced = online.calibrate(plan, measured, model=spec)
    assert "--expert-imbalance 2.5" in as_priced.command
    # less of the measured step is the experts' waiting: the compute rates are fitted slower
    assert calibration.compute_factor < as_priced.compute_factor
    assert calibration.refit_step_s == pytest.approx(measured, rel=0.02)
    # a run's record carries what it measured to `hyparallel calibrate --from-run`
    figures = metrics.StepFigures(4, measured, 1.0, 1.0, None, None)
    record = online.run_record(figures, plan, spec, [measured] * 4, None, 1.6)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(record))
    assert online.read_run(path).expert_imbalance == 1.6
    assert "--expert-imbalance 1.6" in online.from_run(path).command
