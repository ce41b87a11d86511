"""examples/train_loop.py end to end: a user's own loop, resumed under another plan, reads the same
numbers.

Four processes train 4 optimizer steps of 2 accumulated batches each (label-smoothed (total, count)
loss, warm-up, clipping, evaluation after every step, TensorBoard, a checkpoint every 2 steps); two
processes (another plan) then resume from the step-2 checkpoint. Steps 3 and 4 must print the same
training and evaluation losses: the weights, the optimizer's moments and learning rate, the
scheduler and the data position all come back, resharded.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest


def run(repo, processes: int, folder, *extra: str) -> dict[int, tuple[float, float]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    launcher = repo / "tests" / "distributed" / "forked_torchrun.py"  # Note [forked workers]
    proc = subprocess.run(
        [sys.executable, str(launcher), str(processes)]
        + ["examples/train_loop.py", "--steps", "4", "--accumulate", "2", "--eval-every", "1"]
        + ["--checkpoint-every", "2", "--checkpoint-dir", str(folder / "ckpt"), *extra],
        capture_output=True,
        text=True,
        env=env,
        cwd=repo,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sample: 'Pipeline " in proc.stdout  # greedy generation under the plan
    found = re.findall(r"step +(\d+) +loss ([\d.]+) +eval loss ([\d.]+)", proc.stdout)
    return {int(step): (float(loss), float(held)) for step, loss, held in found}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, repo):
    folder = tmp_path_factory.mktemp("train-loop")
    first = run(repo, 4, folder, "--tensorboard", str(folder / "tb"))
    shutil.rmtree(folder / "ckpt" / "step-00000004")  # resume from step 2
    resumed = run(repo, 2, folder)
    return folder, first, resumed


def test_a_run_resumed_under_another_plan_reads_the_same_losses(runs):
    _, first, resumed = runs
    assert sorted(first) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    # printed to 6 decimals; 4 ranks against 2 sum in another order: rounding only
    for step in (3, 4):
        for got, want in zip(resumed[step], first[step]):
            assert got == pytest.approx(want, rel=1e-5, abs=2e-6), step
    assert first[4][1] < first[1][1]  # the held-out loss falls


def test_rank_zero_logged_the_loss_and_eval_loss_to_tensorboard(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, first, _ = runs
    events = EventAccumulator(str(folder / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "eval_loss", "lr"} <= tags
    held = {event.step: event.value for event in events.Scalars("eval_loss")}
    assert held[4] == pytest.approx(first[4][1], abs=1e-6)
