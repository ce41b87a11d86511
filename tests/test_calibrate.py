"""`hyparallel calibrate`: measured figures are plausible and become a ClusterSpec the planner plans
with."""

from __future__ import annotations

import dataclasses
import io
import statistics

import pytest
import torch
from rich.console import Console

import hyparallel as hp
from hyparallel.cli import main
from hyparallel.spec.cluster import MatmulCurve
from hyparallel.tools import calibrate


@pytest.fixture(scope="module")
def calibrated():
    """One quick calibration with 2 gloo processes on the CPU (a GPU present or not), shared by the
    tests."""
    return calibrate.calibrate(nproc=2, quick=True, device="cpu")


def test_measurements_are_plausible(calibrated):
    spec, measured = calibrated
    assert measured.nproc == 2 and measured.backend == "gloo" and measured.rank == 0
    assert set(measured.matmul_flops) == {"fp32", "bf16", "fp16"}  # no TF32 on a CPU
    assert all(
        len(rates) == len(calibrate.settings_for("cpu", True, 1).matmul_shapes)
        for rates in measured.matmul_flops.values()
    )
    assert 1e8 < measured.achievable_flops("fp32") < 1e13
    assert measured.achievable_flops("tf32") == measured.achievable_flops("fp32")
    assert measured.attention_flops > 0 and measured.memory_bandwidth_bytes_per_s > 1e7
    assert measured.allreduce_bus_bytes_per_s > 1e5 and 1e-6 < measured.latency_s < 1
    assert 2**20 < measured.reserved_bytes < measured.memory_bytes
    # A CPU's activations and further attention shapes (Notes [activations a CPU computes], [a CPU's
    # attention curve])
    assert set(measured.activation_s) == {"gelu", "gelu_tanh", "silu", "relu", "sigmoid", "tanh"}
    assert all(
        1e-12 < seconds < 1e-6 for pair in measured.activation_s.values() for seconds in pair
    )
    assert len(measured.attention_curve_flops) == len(
        calibrate.settings_for("cpu", True, 1).attention_curve_shapes
    )


def test_spec_without_base_uses_measured_rates(calibrated, tmp_path):
    spec, measured = calibrated
    device = spec.device
    assert (
        spec.gpus_per_node == 2 and spec.backend == "gloo" and spec.name.startswith("calibrated-")
    )
    # The peak is the fitted plateau (Note [fitting the curve]): at least the fastest shape, and
    # with the curve it gives back the compute-bound shapes' measured rates: the typical one within
    # 1.5x, each within 3x (quick mode times each shape briefly; on a loaded 2-core CI machine one
    # shape, 16x512x512, read 2.18x under its fit).
    assert device.peak_flops.fp32 >= measured.achievable_flops("fp32") * 0.999
    curve = device.matmul_curve
    bandwidth = measured.memory_bandwidth_bytes_per_s
    kept = calibrate._compute_bound(measured.matmul_flops["fp32"], "fp32", bandwidth)
    # the quick shapes keep three on AMD and Intel CPUs alike
    assert len(kept) >= 3 and curve is not None, kept
    ratios = []
    for shape, rate in kept.items():
        m, k, n = map(int, shape.split("x"))
        ratios.append(
            device.peak_flops.fp32 * device.matmul_efficiency * curve.factor(m * n, k) / rate
        )
        assert 1 / 3 < ratios[-1] < 3, shape
    assert 1 / 1.5 < statistics.median(ratios) < 1.5, ratios
    # The peak is the matmul plateau, raised to the attention plateau when attention measured faster
    # (Note [attention above the matmul plateau]): one of the two efficiencies is 1.
    assert 0 < device.attention_efficiency <= 1 and 0 < device.matmul_efficiency <= 1
    assert max(device.matmul_efficiency, device.attention_efficiency) == 1.0
    # The attention curve gives back the measured attention rates as the matmul curve does its
    # shapes'.
    attention = {
        "x".join(map(str, measured.attention_shape)): measured.attention_flops,
        **measured.attention_curve_flops,
    }
    assert device.attention_curve is not None
    ratios = []
    for shape, rate in attention.items():
        b, h, t, d = map(int, shape.split("x"))
        ratios.append(
            device.peak_flops.fp32
            * device.attention_efficiency
            * device.attention_curve.factor(b * h * t * d, t)
            / rate
        )
        assert 1 / 3 < ratios[-1] < 3, shape
    assert 1 / 1.5 < statistics.median(ratios) < 1.5, ratios
    assert set(device.activation_costs) == set(measured.activation_s)
    for name, cost in device.activation_costs.items():
        assert (cost.forward_s, cost.backward_s) == pytest.approx(
            measured.activation_s[name], rel=1e-3
        ), name
    assert device.reserved_bytes >= measured.reserved_bytes and device.reserved_bytes % 2**20 == 0
    assert spec.intra_node.latency_s == pytest.approx(measured.latency_s, rel=1e-3)
    # one machine
    assert spec.inter_node.bandwidth_bytes_per_s == spec.intra_node.bandwidth_bytes_per_s

    path = tmp_path / "cluster.yaml"
    calibrate.write(spec, measured, path)
    text = path.read_text()
    assert (
        text.startswith("# Written by `hyparallel calibrate`")
        and "512x512x512" in text
        and "All-reduce" in text
    )
    assert "curve fitted on fp32" in text and "matmul_curve:" in text
    assert "Activations, fp32" in text and "gelu_tanh:" in text and "attention_curve:" in text
    loaded = hp.ClusterSpec.load(path)
    # the curve round-trips
    assert loaded == spec and loaded.device.matmul_curve == spec.device.matmul_curve
    plan = hp.plan(
        hp.models.build("gpt-tiny", device="meta"), loaded, global_batch=8, seq_len=64, dtype="fp32"
    )
    assert plan.predicted.step_time_s > 0 and plan.world_size <= loaded.num_gpus


def test_base_keeps_datasheet_figures(calibrated):
    _, measured = calibrated
    base = hp.ClusterSpec.preset("cpu")
    spec = calibrate.to_cluster_spec(measured, base, name="here")
    assert spec.name == "here" and spec.device.peak_flops == base.device.peak_flops
    assert spec.device.memory_bytes == base.device.memory_bytes
    for fraction in (
        spec.device.matmul_efficiency,
        spec.device.attention_efficiency,
        spec.device.memory_efficiency,
    ):
        assert 0 < fraction <= 1
    assert spec.intra_node.name.endswith("(measured)") and spec.inter_node == base.inter_node
    assert spec.device.reserved_bytes >= base.device.reserved_bytes


def test_the_fit_recovers_a_known_curve():
    # Rates made from a known curve and plateau come back (to the fit's grid): small, skinny and
    # large shapes.
    true = MatmulCurve(half_output_elements=6e5, half_k=30.0)
    shapes = [(s, s, s) for s in (256, 512, 1024, 2048, 4096, 8192)] + [
        (8192, 128, 8192),
        (256, 8192, 8192),
    ]
    rates = {f"{m}x{k}x{n}": 2e14 * true.factor(m * n, k) for m, k, n in shapes}
    curve = calibrate.fit_matmul_curve(rates, "bf16", 4e12)
    assert curve.half_output_elements == pytest.approx(
        6e5, rel=0.1
    ) and curve.half_k == pytest.approx(30, rel=0.1)
    assert calibrate.matmul_plateau(rates, "bf16", 4e12, curve) == pytest.approx(2e14, rel=0.05)
    # Memory-bound shapes are the roofline's, not the curve's: with a slow memory they are left out,
    # and with fewer than three left nothing is fitted.
    assert calibrate.fit_matmul_curve(rates, "bf16", 1e9) is None


def test_the_attention_fit_recovers_a_known_curve(calibrated):
    # Attention rates made from a known curve and plateau come back, to the fit's grid.
    _, measured = calibrated
    true = MatmulCurve(half_output_elements=2e4, half_k=100.0)
    shapes = [(1, 4, 256, 64), (8, 8, 128, 16), (2, 8, 128, 32), (1, 8, 1024, 64), (4, 16, 512, 32)]
    rate = {s: 5e10 * true.factor(s[0] * s[1] * s[2] * s[3], s[2]) for s in shapes}
    known = dataclasses.replace(
        measured,
        attention_shape=shapes[0],
        attention_flops=rate[shapes[0]],
        attention_curve_flops={"x".join(map(str, s)): rate[s] for s in shapes[1:]},
    )
    curve, plateau = calibrate.fit_attention_curve(known)
    assert curve.half_output_elements == pytest.approx(
        2e4, rel=0.1
    ) and curve.half_k == pytest.approx(100, rel=0.1)
    assert plateau == pytest.approx(5e10, rel=0.05)
    # One shape (a GPU's calibration): no curve, its rate the plateau.
    assert calibrate.fit_attention_curve(dataclasses.replace(known, attention_curve_flops={})) == (
        None,
        rate[shapes[0]],
    )


def test_attention_above_the_matmul_plateau_raises_the_peak(calibrated):
    # A CPU's attention measured faster than its matmul plateau (the rates drift between them): the
    # peaks rise to it and both rates stay the measured ones, instead of clamping the attention
    # efficiency to 1 (Note [attention above the matmul plateau]).
    _, measured = calibrated
    before = calibrate.to_cluster_spec(measured).device
    fast = dataclasses.replace(
        measured,
        attention_flops=measured.attention_flops * 4,
        attention_curve_flops={
            shape: rate * 4 for shape, rate in measured.attention_curve_flops.items()
        },
    )
    after = calibrate.to_cluster_spec(fast).device
    assert after.attention_efficiency == 1.0 and after.matmul_efficiency < 1.0
    for dtype in ("fp32", "bf16", "fp16"):
        matmul_before = getattr(before.peak_flops, dtype) * before.matmul_efficiency
        # efficiencies keep 3 decimals: ~0.25 here, so 0.2% of rounding, and the peaks 3 significant
        # figures
        assert getattr(after.peak_flops, dtype) * after.matmul_efficiency == pytest.approx(
            matmul_before, rel=5e-3
        )
    assert after.peak_flops.fp32 == pytest.approx(
        4 * before.peak_flops.fp32 * before.attention_efficiency, rel=5e-3
    )  # the attention rate, four times the one measured before


def test_one_process_takes_links_from_the_base(calibrated):
    _, measured = calibrated
    alone = dataclasses.replace(measured, nproc=1, allreduce_bus_bytes_per_s=None, latency_s=None)
    base = hp.ClusterSpec.preset("cpu")
    spec = calibrate.to_cluster_spec(alone, base)
    assert spec.intra_node == base.intra_node and spec.inter_node == base.inter_node
    assert "one process" in spec.description and "not measured (one process)" in _render(
        calibrate.measurements_table(alone)
    )
    with pytest.raises(hp.ConfigError, match="no links to measure"):
        calibrate.to_cluster_spec(alone)


def test_cli_writes_a_loadable_spec(tmp_path, capsys, monkeypatch, calibrated):
    # The command's own work (arguments, table, file); what it measures is the shared calibration's,
    # checked above.
    asked = []

    def measured_once(**given):
        asked.append(given)
        return calibrated[0].model_copy(update={"name": given["name"]}), calibrated[1]

    monkeypatch.setattr(calibrate, "calibrate", measured_once)
    path = tmp_path / "c.yaml"
    assert (
        main(
            [
                "calibrate",
                "--quick",
                "--device",
                "cpu",
                "--nproc",
                "2",
                "--out",
                str(path),
                "--name",
                "ci",
            ]
        )
        == 0
    )
    assert [(a["nproc"], a["quick"], a["device"], a["name"]) for a in asked] == [
        (2, True, "cpu", "ci")
    ]
    out = capsys.readouterr().out
    assert "matmul fp32" in out and f"wrote {path}" in out
    assert hp.ClusterSpec.load(path).name == "ci"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--base", "no-such-preset"], "unknown cluster preset 'no-such-preset'"),
        (
            ["--nproc", "0"],
            "calibrate: error: argument --nproc: expected a positive integer up to 1,024, got '0'",
        ),
        (["--nproc", "1"], "one process has no links to measure"),
        (["--out", "/no/such/folder/c.yaml"], "cannot write /no/such/folder/c.yaml"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(capsys, argv, message):
    assert main(["calibrate", "--quick", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    # usage errors name the command
    assert err.startswith(("hyparallel: error: ", "hyparallel calibrate: error: "))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_gpu_keeps_the_base_links():
    base = hp.ClusterSpec.preset("h200")
    spec, measured = calibrate.calibrate(nproc=1, base=base, quick=True)
    assert (
        measured.backend == "nccl"
        and measured.allreduce_bus_bytes_per_s is None
        and set(measured.matmul_flops) == set(calibrate.DTYPES)
    )
    assert (
        1e12 < measured.achievable_flops("bf16") < 1e16
        and measured.memory_bandwidth_bytes_per_s > 1e11
    )
    assert (
        spec.intra_node == base.intra_node
        and spec.inter_node == base.inter_node
        and spec.device.peak_flops == base.device.peak_flops
    )
    for fraction in (
        spec.device.matmul_efficiency,
        spec.device.attention_efficiency,
        spec.device.memory_efficiency,
    ):
        assert 0 < fraction <= 1
    assert (
        hp.plan(
            hp.models.build("gpt-tiny", device="meta"),
            spec,
            global_batch=8,
            seq_len=64,
            dtype="bf16",
        ).world_size
        <= spec.num_gpus
    )


def _render(table) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(table)
    return console.file.getvalue()


def test_the_collective_latency_is_solved_from_two_all_reduce_sizes():
    # Note [a collective's latency]: t = 2(n-1) a + 2(n-1)/n B / b at two sizes gives back a and b.
    world, latency, bandwidth = 4, 1e-3, 2e9

    def seconds(num_bytes: float) -> float:
        return 2 * (world - 1) * latency + 2 * (world - 1) / world * num_bytes / bandwidth

    solved_bandwidth, solved_latency = calibrate.collective_link(
        world, 2**22, seconds(2**22), 2**16, seconds(2**16)
    )
    assert solved_bandwidth == pytest.approx(bandwidth) and solved_latency == pytest.approx(latency)
    # The small one no faster per byte: the large one's rate, no step latency of its own.
    assert calibrate.collective_link(2, 2**22, 1e-3, 2**16, 1e-3) == (2**22 / 1e-3, None)
    link = hp.spec.cluster.LinkSpec(
        name="t", bandwidth_bytes_per_s=1e9, latency_s=1e-5, collective_latency_s=1e-3
    )
    assert (
        link.step_latency_s == 1e-3
        and link.model_copy(update={"collective_latency_s": None}).step_latency_s == 1e-5
    )
