"""Surviving a killed worker: examples/train_gpt.py under torchrun with restarts, checkpoints and
re-planning.

An uninterrupted 4-process run is the reference. The same run has one worker killed with SIGKILL
after a checkpoint: torchrun restarts the group, the script resumes from the newest complete
checkpoint, and trains on the reference's batches with the reference's losses (to rounding: Note
[how close a resumed run stays]). A run continued with 2 processes from the reference's mid-run
checkpoint re-plans for 2, loads the checkpoint resharded and goes on from the loss the reference
had there. Losses are read at full precision from the example's --log-json (one JSON object per
step, appended across restarts).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hyparallel import checkpoint

STEPS, EVERY = 24, 4  # 40 when the Note's figures were measured; 24 keeps every case (suite time)
FIRST_RTOL, LATER_RTOL = 1e-6, 1e-2  # Note [how close a resumed run stays]
WEIGHT_RTOL, WEIGHT_ATOL = 0.0, 0.05  # Note [how close a resumed run stays]
TIMEOUT_S = 5  # HYPARALLEL_TIMEOUT for the stopped-worker test

# Note [how close a resumed run stays]
#     A resumed run trains on the same batches from bit-exact weights and optimizer state, but it is
#     not bitwise the uninterrupted run: a restarted DDP group's first step sums gradients in other
#     buckets (DDP rebuilds them after each process's first step), and 2 processes sum in another
#     order than 4. The first losses after the resume therefore agree to rounding: measured (full
#     precision, resuming the reference's checkpoints at steps 8, 12 and 16 with 4 processes, and at
#     20 with 2) at most 7.2e-8 relative over the first EVERY steps: FIRST_RTOL = 1e-6. Later, AdamW
#     turns rounding in near-zero gradients into +-lr updates and the difference grows chaotically:
#     measured at most 1.9e-3 over steps 13-40 after resuming at 8 (5.0e-6 after 12, 1.4e-7 after 16
#     and with 2 processes after 20): LATER_RTOL = 1e-2 for every later step. Training on other
#     batches (another data seed, as a lost, repeated or shifted step would) moved the first resumed
#     losses by 5.7e-3 to 3.6e-2 and the later ones by up to 0.11, so each bound fails then; the
#     final step alone (8.5e-3) would not. The first resumed step's difference is DDP's bucket
#     rebuild alone: DDP reduces its first step in one bucket in parameter order and later steps in
#     buckets rebuilt in gradient-ready order, so a restarted group's first step puts each gradient
#     at another offset of gloo's ring all-reduce than the uninterrupted run's step does.
#     Measured: with DDP kept from rebuilding (find_unused_parameters=True), resuming at step 8 gave
#     bitwise the uninterrupted run's losses for steps 9-16. The final weights therefore differ by
#     AdamW's amplified rounding: measured at most 0.016 absolute (weights up to 0.16) after
#     resuming at step 8 of 40: WEIGHT_ATOL = 0.05, a check that every tensor is there, shaped and
#     trained alike; the losses above are the sharp check. The runs now have 24 steps: that drops
#     later steps from each measured maximum and changes no resume point but the 2-process run's
#     (12, the middle), whose first steps sum in the same other order as at 20.


# Note [a stop between checkpoints]
#     The stopped-worker test once ran past its bounds (an intermittent suite stall under load): the
#     test's poll, slowed by busy cores, stopped a worker after the group had entered the next
#     checkpoint's save. A save's collectives are bounded by HYPARALLEL_INIT_TIMEOUT (600 s), not
#     HYPARALLEL_TIMEOUT, so the peers waited up to ten minutes, and the failed test left the whole
#     group running (torchrun starts each worker in its own session) while the suite went on. What
#     this test checks is detection between saves: the checkpoints are 2 * EVERY apart, the stop
#     comes right after one, and the test asserts it landed before the next (a slower machine fails
#     clearly instead of waiting); every run's process tree is killed on the way out (``launched``).
#     A stop inside a save is a case of its own: the heartbeat finds it (the test after this one).


def assert_same_training(ours: dict[int, float], reference: dict[int, float], start: int) -> None:
    """Steps ``start + 1 .. STEPS`` of a resumed run against the reference's (Note [how close a
    resumed run stays])."""
    assert sorted(ours) == list(range(start + 1, STEPS + 1))
    for step in ours:
        tolerance = FIRST_RTOL if step <= start + EVERY else LATER_RTOL
        assert ours[step] == pytest.approx(reference[step], rel=tolerance), (
            step,
            ours[step],
            reference[step],
        )


def command(
    repo: Path,
    processes: int,
    directory: Path,
    restarts: int = 0,
    every: int = EVERY,
    storage: str = "disk",
    keep: int = 0,
) -> list[str]:
    """The example under torchrun, checkpointing into ``directory``, logging each step to
    ``log_of(directory)``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
        "--max-restarts",
        str(restarts),
        *example(repo, directory, every, storage),
        *(["--checkpoint-keep", str(keep)] if keep else []),
    ]


def example(
    repo: Path, directory: Path, every: int = EVERY, storage: str = "disk", steps: int = STEPS
) -> list[str]:
    """examples/train_gpt.py and its arguments: checkpoints every ``every`` steps, each step's loss
    logged."""
    return [
        str(repo / "examples" / "train_gpt.py"),
        "--steps",
        str(steps),
        "--checkpoint-dir",
        str(directory),
        "--checkpoint-every",
        str(every),
        "--checkpoint-storage",
        storage,
        "--log-every",
        "1",
        "--log-json",
        str(log_of(directory)),
    ]


def log_of(directory: Path) -> Path:
    return directory.parent / f"{directory.name}.jsonl"


def environ(repo: Path) -> dict:
    # torchrun's defaults, as a user has them: the rendezvous store shared with the workers (no
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: hyparallel.runtime.launch keeps each round's keys apart).
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(repo),
        "PYTHONWARNINGS": "ignore",
    }
    for name in (
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "HYPARALLEL_TIMEOUT",
        "HYPARALLEL_INIT_TIMEOUT",
        "HYPARALLEL_HEARTBEAT_TIMEOUT",
    ):
        env.pop(name, None)  # the defaults, whatever the shell running the tests exported
    return env


def losses(directory: Path, stdout: str, restart: int | None = None) -> dict[int, float]:
    """Each step's loss from the run's JSON log: of restart round ``restart``, or of the last round
    that ran the step.

    Checked to be the figures stdout prints, unrounded: each prints as stdout's 4-decimal loss of
    that step (the last print of a step a restarted round redid is that round's), and none is a
    4-decimal number (a float32 loss can be one only as a multiple of 1/16: odds of ~2^-19 a step).
    """
    records = [json.loads(line) for line in log_of(directory).read_text().splitlines()]
    last_round = {r["step"]: r["restart"] for r in records}  # later lines win
    logged = {r["step"]: r["loss"] for r in records if restart is None or r["restart"] == restart}
    printed = {
        int(step): text for step, text in re.findall(r"step\s+(\d+)\s+loss ([\d.]+)", stdout)
    }
    comparable = [
        step
        for step in printed
        if step in logged and (restart is None or last_round[step] == restart)
    ]
    assert (
        logged and comparable and all(f"{logged[step]:.4f}" == printed[step] for step in comparable)
    )
    assert all(round(loss, 4) != loss for loss in logged.values()), "the log holds rounded losses"
    return logged


def workers_of(pid: int) -> list[int]:
    """Child processes of ``pid`` (torchrun's agent: its workers), from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return sorted(children)


def training_workers(pid: int) -> list[int]:
    """The processes under ``pid`` (an agent: torchrun's, dlrover-run's) that run
    examples/train_gpt.py."""
    found, todo = [], [pid]
    while todo:
        for child in workers_of(todo.pop()):
            todo.append(child)
            try:
                if b"train_gpt.py" in Path(
                    f"/proc/{child}/cmdline"
                ).read_bytes() and b"dlrover" not in (Path(f"/proc/{child}/cmdline").read_bytes()):
                    found.append(child)
            except OSError:
                pass
    return sorted(found)


def descendants(pid: int) -> list[int]:
    """Every process under ``pid``: torchrun starts each worker in a session of its own, out of its
    group's reach."""
    found, todo = [], [pid]
    while todo:
        children = workers_of(todo.pop())
        found += children
        todo += children
    return found


@contextlib.contextmanager
def launched(argv: list[str], env: dict) -> Iterator[subprocess.Popen]:
    """A run under torchrun whose whole tree is SIGKILLed on the way out (a stopped worker too),
    pass or fail: a failed wait must not leave a group of workers waiting in a collective while the
    rest of the suite runs."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        yield proc
    finally:
        for pid in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def wait_for(condition, proc: subprocess.Popen, what: str, seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"no {what} after {seconds} s"
        time.sleep(0.02)


def final_weights_match(directory: Path, reference: Path, tmp_path: Path) -> None:
    """The final checkpoint's weights against the uninterrupted run's (Note [how close a resumed run
    stays])."""
    ours, theirs = (
        consolidated(directory, tmp_path / "a.pt"),
        consolidated(reference, tmp_path / "b.pt"),
    )
    assert ours.keys() == theirs.keys()
    worst = {}
    for name in theirs:
        assert ours[name].shape == theirs[name].shape, name
        worst[name] = (
            (ours[name] - theirs[name]).abs().max().item(),
            theirs[name].abs().max().item(),
        )
    for name in theirs:
        torch.testing.assert_close(
            ours[name],
            theirs[name],
            rtol=WEIGHT_RTOL,
            atol=WEIGHT_ATOL,
            msg=f"{name}; all: {worst}",
        )


@pytest.fixture(scope="module")
def reference(tmp_path_factory, repo):
    directory = tmp_path_factory.mktemp("elastic") / "reference"
    proc = subprocess.run(
        command(repo, 4, directory), capture_output=True, text=True, env=environ(repo), timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return directory, losses(directory, proc.stdout)


def consolidated(directory: Path, out: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint.export(directory, out))


def test_a_killed_worker_costs_only_the_steps_since_the_checkpoint(reference, tmp_path, repo):
    ref_dir, ref_losses = reference
    directory = tmp_path / "faulty"
    with launched(command(repo, 4, directory, restarts=1), environ(repo)) as proc:
        second = directory / f"step-{2 * EVERY:08d}" / checkpoint.MARKER
        wait_for(second.exists, proc, "a second checkpoint")
        os.kill(workers_of(proc.pid)[-1], signal.SIGKILL)  # mid-training, after a checkpoint
        stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    resumed = re.search(r"resumed after step (\d+) from disk", stdout)
    assert resumed, "the group was not restarted from a checkpoint:\n" + stdout[-2000:]
    assert int(resumed[1]) % EVERY == 0 and int(resumed[1]) >= 2 * EVERY
    final_weights_match(directory, ref_dir, tmp_path)
    start = int(resumed[1])
    # the same run as the reference until the kill
    before_kill = losses(directory, stdout, restart=0)
    assert before_kill and all(
        loss == pytest.approx(ref_losses[step], rel=FIRST_RTOL)
        for step, loss in before_kill.items()
    )
    assert_same_training(losses(directory, stdout, restart=1), ref_losses, start)


def test_a_stopped_worker_is_detected_within_the_timeout(reference, tmp_path, repo):
    """SIGSTOP: the others' collectives time out after HYPARALLEL_TIMEOUT, they exit, torchrun
    restarts the group."""
    ref_dir, ref_losses = reference
    directory = tmp_path / "stopped"
    env = {**environ(repo), "HYPARALLEL_TIMEOUT": str(TIMEOUT_S)}
    # Note [a stop between checkpoints]: checkpoints 2 * EVERY steps apart here, the stop right
    # after the first
    every = 2 * EVERY
    with launched(command(repo, 4, directory, restarts=1, every=every), env) as proc:
        wait_for((directory / f"step-{every:08d}" / checkpoint.MARKER).exists, proc, "a checkpoint")
        workers = workers_of(proc.pid)
        os.kill(workers[-1], signal.SIGSTOP)
        stopped = time.time()
        # rank 0 logs the last step every rank ended (none logs a step the stopped rank did not)
        time.sleep(0.5)
        last = len(log_of(directory).read_text().splitlines())
        assert last < 2 * every, (
            f"stopped at step {last}, in the next checkpoint's save (test too slow to stop)"
        )
        peers_gone = lambda: not set(workers[:-1]) & set(workers_of(proc.pid))  # noqa: E731
        wait_for(peers_gone, proc, "exit of the stopped rank's peers", 120)
        detected = time.time() - stopped
        print(
            f"the stopped rank's peers exited {detected:.1f} s after SIGSTOP, after logging step"
            f" {last}"
        )
        # The bound: the collective timeout, plus the step in flight and the process's exit
        # (measured 6.5 s in all with TIMEOUT_S = 5 on 2 busy cores; 25 s of slack for a slower
        # machine); torch's default gloo: 30 minutes.
        assert detected < TIMEOUT_S + 25, f"the peers of a stopped rank ran on for {detected:.1f} s"
        # What this test checks ends here: the peers noticed the stopped rank and exited. Left
        # alone, torchrun stops the group with SIGTERM, which a stopped process never handles, and
        # SIGKILLs it only after its 30 s grace (measured: 55 s for this test, 27 s when killed
        # here). A hung rank's fate is no part of hyparallel.
        with contextlib.suppress(ProcessLookupError):  # torchrun may have got there first
            os.kill(workers[-1], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    resumed = re.search(r"resumed after step (\d+) from disk", stdout)
    assert resumed, "the group was not restarted from a checkpoint:\n" + stdout[-2000:]
    final_weights_match(directory, ref_dir, tmp_path)
    assert_same_training(losses(directory, stdout, restart=1), ref_losses, int(resumed[1]))


def rank_of(pid: int) -> int:
    """A worker's rank, from its environment (torchrun sets RANK)."""
    environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(item for item in environment if item.startswith(b"RANK="))[5:])


def stop_inside_a_save(
    proc: subprocess.Popen, directory: Path, storage: str
) -> tuple[int, float, int]:
    """SIGSTOP rank 3 while its group saves a checkpoint; returns (its pid, when, the step being
    saved).

    Disk (a checkpoint every EVERY steps): rank 3 is stopped once rank 0 logged a step that is saved
    next, and counts as stopped inside that save when the checkpoint is still incomplete a second
    later (its peers wait in the save's collectives). Memory (one every step): stopped while its own
    snapshot is being written (the snapshot's temporary folder still there a second later). A stop
    that missed is undone (SIGCONT) and tried again later.
    """
    memory = checkpoint.memory_dir(directory) / "rank-3"
    wait_for(lambda: len(training_workers(proc.pid)) == 4, proc, "4 workers")
    worker = next(pid for pid in training_workers(proc.pid) if rank_of(pid) == 3)
    # after a complete checkpoint
    for step in range(2 * EVERY, STEPS - EVERY, EVERY if storage == "disk" else 1):
        if storage == "disk":

            def logged(at: int = step) -> bool:
                return (
                    log_of(directory).exists()
                    and len(log_of(directory).read_text().splitlines()) >= at
                )

            wait_for(logged, proc, f"step {step} logged")
            os.kill(worker, signal.SIGSTOP)
            stopped = time.time()
            time.sleep(1.0)
            inside = not (directory / f"step-{step:08d}" / checkpoint.MARKER).exists()
        else:

            def writing(at=step):
                return any(int(p.name[6:14]) >= at for p in memory.glob(".step-*.tmp"))

            wait_for(writing, proc, "a memory snapshot being written", 120)
            os.kill(worker, signal.SIGSTOP)
            stopped = time.time()
            snapshots = [int(p.name[6:14]) for p in memory.glob(".step-*.tmp")]
            time.sleep(1.0)
            inside = bool(snapshots) and all(
                (memory / f".step-{s:08d}.tmp").exists() for s in snapshots
            )
            step = max(snapshots, default=-1)
        if inside:
            return worker, stopped, step
        os.kill(worker, signal.SIGCONT)
    raise AssertionError(
        f"no stop landed inside a {storage} save (the saves were too quick to catch)"
    )


@pytest.mark.parametrize("storage", ["disk", "memory"])
def test_a_worker_stopped_inside_a_save_is_found_by_its_heartbeat(
    reference, tmp_path, repo, storage
):
    """Issue 41: the peers waiting in a save's collectives find the stopped rank by its silent
    heartbeat (Note [a heartbeat no stopped process can send]), name it, exit; the group restarts.
    HYPARALLEL_HEARTBEAT_TIMEOUT=6 in both: 14 s a case less than the default (20 s), which
    tests/test_launch.py reads; a live rank beats every second."""
    ref_dir, ref_losses = reference
    directory = tmp_path / f"stopped-in-{storage}"
    every = EVERY if storage == "disk" else 1
    heartbeat_s = 6.0
    env = {**environ(repo), "HYPARALLEL_HEARTBEAT_TIMEOUT": "6"}
    with launched(
        command(repo, 4, directory, restarts=1, every=every, storage=storage, keep=2), env
    ) as proc:
        worker, stopped, step = stop_inside_a_save(proc, directory, storage)
        peers = [pid for pid in training_workers(proc.pid) if pid != worker]
        peers_gone = lambda: not set(peers) & set(training_workers(proc.pid))  # noqa: E731
        wait_for(peers_gone, proc, "exit of the stopped rank's peers", 120)
        detected = time.time() - stopped
        print(
            f"{storage}: rank 3 stopped inside the save of step {step}; its peers exited"
            f" {detected:.1f} s later"
        )
        # The bound: the heartbeat timeout and a beat, plus the peers' exit; 15 s of slack for a
        # busy machine. Without the heartbeat the peers waited HYPARALLEL_INIT_TIMEOUT (600 s).
        assert detected < heartbeat_s + 15, f"the peers ran on for {detected:.1f} s"
        # as in the test above: torchrun's 30 s grace is not ours
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "went silent" in line]
    # one line on each surviving rank, naming rank 3 and the save
    assert len(lines) == 3, stderr[-3000:]
    assert all(
        "rank 3 went silent" in line and "checkpoint save of step" in line for line in lines
    ), lines
    resumed = re.search(rf"resumed after step (\d+) from {storage}", stdout)
    assert resumed, "the group was not restarted from a checkpoint:\n" + stdout[-2000:]
    start = int(resumed[1])
    # The save cut off was of `step`: every rank keeps the checkpoint before until all hold the new
    # one (a memory checkpoint a step, Note [memory checkpoints]; on disk the previous complete
    # one). No other step is lost.
    assert start == step - every, (start, step)
    before = losses(directory, stdout, restart=0)
    # the first round logged every step up to the one whose save was cut off
    assert max(before) == step
    assert all(loss == pytest.approx(ref_losses[s], rel=FIRST_RTOL) for s, loss in before.items())
    assert_same_training(losses(directory, stdout, restart=1), ref_losses, start)
    final_weights_match(directory, ref_dir, tmp_path)  # memory: finish() persisted the last step
    assert not checkpoint.memory_dir(directory).exists(), (
        "finish() left the memory checkpoints behind"
    )
    assert len(list(directory.glob("step-*"))) <= 2, "--checkpoint-keep 2 kept more"


def test_fewer_workers_continue_from_the_checkpoint(reference, tmp_path, repo):
    ref_dir, ref_losses = reference
    directory = tmp_path / "smaller"
    middle = STEPS // 2
    shutil.copytree(ref_dir / f"step-{middle:08d}", directory / f"step-{middle:08d}")
    proc = subprocess.run(
        command(repo, 2, directory), capture_output=True, text=True, env=environ(repo), timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed after step {middle}" in proc.stdout and "dp 2" in proc.stdout
    assert {
        r["world_size"] for r in map(json.loads, log_of(directory).read_text().splitlines())
    } == {2}
    # another plan: another order of sums
    assert_same_training(losses(directory, proc.stdout), ref_losses, middle)
