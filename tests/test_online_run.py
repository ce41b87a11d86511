"""Online calibration in a real run: 2 gloo processes train gpt-tiny under the stock `cpu` preset's
plan.

The run fits its cluster after the default warm-up and measured steps, and the re-plan it reports is
the plan `hyparallel plan` makes with the file it wrote, by the command it printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import hyparallel as hp
from hyparallel.cli import main
from hyparallel.planner import online


def test_a_run_on_the_stock_cpu_preset_corrects_its_cluster_and_replans(repo, tmp_path, capsys):
    corrected, record = tmp_path / "cpu-corrected.yaml", tmp_path / "metrics.json"
    # the fit runs in the step after them
    steps = online.DEFAULT_WARMUP_STEPS + online.DEFAULT_MEASURED_STEPS + 1
    args = ["--steps", str(steps), "--log-every", str(steps), "--metrics-out", str(record)]
    # threshold 0: fit whatever the error, so the test does not depend on how loaded this machine is
    args += ["--calibrate-online", str(corrected), "--calibrate-threshold", "0"]
    launcher = repo / "tests" / "distributed" / "forked_torchrun.py"  # Note [forked workers]
    proc = subprocess.run(
        [sys.executable, str(launcher), "2", str(repo / "examples" / "train_gpt.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)},
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("online calibration:")]
    assert len(lines) == 1 and f"wrote {corrected}" in lines[0]  # rank 0 alone, once

    written = json.loads(record.read_text())
    fit = written["calibration"]
    plan = hp.Plan.from_dict(written["plan"])
    assert plan.cluster.name == "cpu" and fit["cluster_file"] == str(corrected)
    measured = online.measured_step(
        written["step_times_s"], online.DEFAULT_WARMUP_STEPS, online.DEFAULT_MEASURED_STEPS
    )
    assert fit["measured_step_s"] == pytest.approx(measured)
    # Corrected: the plan's own configuration, re-evaluated under the file from disk, takes the
    # measured step.
    cluster = hp.ClusterSpec.load(corrected)
    assert online.Planner("gpt-tiny", plan).evaluate(cluster) == pytest.approx(measured, rel=1e-3)
    assert fit["predicted_step_s"] == plan.predicted.step_time_s

    command = fit["command"].split()
    assert command[:2] == ["hyparallel", "plan"] and command[-2:] == ["-o", "plan.yaml"]
    assert main([*command[1:-2], "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["parallel"] == fit["replanned"]["parallel"]
    assert planned["training"] == fit["replanned"]["training"]
