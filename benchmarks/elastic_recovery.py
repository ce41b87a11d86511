"""What a failure costs: checkpoint blocking time (memory vs disk) and kill-to-first-resumed-step
time.

Run: OMP_NUM_THREADS=1 python benchmarks/elastic_recovery.py [--quick] --json FILE

1. Save blocking time. The script runs itself under torchrun (2 gloo processes, dp 2): after a
   training step it times ``hp.checkpoint.save(..., storage="disk")`` and ``storage="memory"``
   alternately, the same model in the same run, each until the call returns on every rank (the
   slowest rank's time); the background writer of a memory save is waited out, untimed, before the
   next save, so no save shares the disk with another.
2. Recovery. examples/train_gpt.py (gpt-tiny, 4 processes, a checkpoint every 4 steps on disk, or
   every step in memory) under torchrun and under hyparallel-dlrover-run --standalone; one worker is
   SIGKILLed after the second checkpoint. Measured: seconds from the kill to the first step the
   restarted group completes (its line in --log-json), and the steps lost (the last step completed
   before the kill minus the step resumed from).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(model_name: str, reps: int, out: Path) -> None:
    """Under torchrun: time disk and memory saves of one model, alternating."""
    import torch
    import torch.distributed as dist

    import hyparallel as hp

    model = hp.models.load(model_name).module
    world = int(os.environ["WORLD_SIZE"])
    plan = hp.plan(
        model,
        hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=world),
        global_batch=2 * world,
        seq_len=32,
        dtype="fp32",
    )
    pmodel = hp.parallelize(model, plan, seed=0)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (plan.training.global_batch, 33))
    pmodel.train_step(pmodel.shard(tokens[:, :-1]), pmodel.shard(tokens[:, 1:]))
    optimizer.step()
    times: dict[str, list[float]] = {"disk": [], "memory": []}
    with tempfile.TemporaryDirectory(dir=REPO / "benchmarks") as folder:
        folder_list = [folder]
        dist.broadcast_object_list(folder_list)  # every rank writes where rank 0 made the folder
        directory = Path(folder_list[0])
        for rep in range(reps):
            for storage in ("disk", "memory"):
                dist.barrier()
                start = time.perf_counter()
                hp.checkpoint.save(
                    pmodel, optimizer, directory / storage, step=rep + 1, storage=storage
                )
                took = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                times[storage].append(took.item())
                writer = getattr(pmodel, "_checkpoint_writer", None)
                if writer is not None:
                    writer.wait_idle()  # untimed: the next save gets the disk to itself
        hp.checkpoint.finish(pmodel, directory / "memory")
        state = sum(t.numel() * t.element_size() for t in pmodel.state_dict().values())
        moments = sum(
            v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
        )
        dist.barrier()
    if dist.get_rank() == 0:
        out.write_text(
            json.dumps({"model": model_name, "bytes_per_rank": state + moments, "times": times})
        )
    dist.destroy_process_group()


def save_times(model_name: str, reps: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "times.json"
        run = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
        ]
        proc = subprocess.run(
            [*run, __file__, "--worker", model_name, "--reps", str(reps), "--out", str(out)],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=1200,
        )
        if proc.returncode != 0:
            raise SystemExit(f"save timing failed:\n{proc.stderr[-3000:]}")
        figures = json.loads(out.read_text())
    disk, memory = (statistics.median(figures["times"][k]) for k in ("disk", "memory"))
    return {**figures, "disk_s": disk, "memory_s": memory, "ratio": memory / disk}


def _env() -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "PYTHONWARNINGS": "ignore",
    }
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return env


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _workers(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            todo.append(child)
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"train_gpt.py" in cmdline and b"dlrover" not in cmdline:
                found.append(child)
    return sorted(found)


def recovery(launcher: str, storage: str, steps: int) -> dict:
    """Kill one worker of examples/train_gpt.py after its second checkpoint; time until a resumed
    step completes."""
    processes, every = 4, (4 if storage == "disk" else 1)
    with tempfile.TemporaryDirectory() as folder:
        directory, log = Path(folder) / "ckpt", Path(folder) / "log.jsonl"
        example = [
            str(REPO / "examples" / "train_gpt.py"),
            "--steps",
            str(steps),
            "--checkpoint-dir",
            str(directory),
        ]
        example += [
            "--checkpoint-every",
            str(every),
            "--checkpoint-storage",
            storage,
            "--log-json",
            str(log),
        ]
        if launcher == "torchrun":
            head = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        else:
            head = [str(Path(sys.executable).with_name("hyparallel-dlrover-run")), "--standalone"]
        head += ["--nproc_per_node", str(processes), "--max-restarts", "1"]
        proc = subprocess.Popen(
            [*head, *example],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            start_new_session=True,
        )
        try:
            deadline = time.time() + 300
            while not (log.exists() and len(log.read_text().splitlines()) >= 8 + every):
                if proc.poll() is not None or time.time() > deadline:
                    raise SystemExit(
                        f"{launcher}/{storage}: the run ended early:\n{proc.stderr.read()[-3000:]}"
                    )
                time.sleep(0.01)
            while len(_workers(proc.pid)) < processes:
                time.sleep(0.01)
            os.kill(_workers(proc.pid)[-1], signal.SIGKILL)
            killed = time.time()
            done_before = max(json.loads(line)["step"] for line in log.read_text().splitlines())
            first_resumed = None
            while first_resumed is None:
                records = [json.loads(line) for line in log.read_text().splitlines()]
                if any(r["restart"] > 0 for r in records):
                    first_resumed = time.time()
                elif proc.poll() is not None or time.time() > killed + 600:
                    raise SystemExit(
                        f"{launcher}/{storage}: no resumed step:\n{proc.stderr.read()[-3000:]}"
                    )
                time.sleep(0.005)
            stdout, stderr = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode != 0:
            raise SystemExit(f"{launcher}/{storage}: exit {proc.returncode}:\n{stderr[-3000:]}")
        resumed = re.search(r"resumed after step (\d+) from (\w+)", stdout)
        return {
            "launcher": launcher,
            "storage": storage,
            "every": every,
            "kill_to_first_step_s": first_resumed - killed,
            "resumed_after": int(resumed[1]),
            "loaded_from": resumed[2],
            "steps_lost": done_before - int(resumed[1]),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer repetitions")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.reps, args.out)
    model = "gpt-mini" if args.quick else "gpt-125m"
    saves = save_times(model, 2 if args.quick else 5)
    print(
        f"{model}: save blocks {saves['memory_s']:.3f} s in memory, {saves['disk_s']:.3f} s on"
        " disk",
        flush=True,
    )
    launchers = ["torchrun"]
    try:
        import dlrover.trainer.torch.elastic_run  # noqa: F401

        launchers.append("dlrover-run")
    except ImportError:
        print("dlrover is not installed: recovery under dlrover-run not measured", flush=True)
    runs = []
    for launcher in launchers:
        for storage in ("disk", "memory"):
            runs.append(recovery(launcher, storage, steps=16 if args.quick else 24))
            r = runs[-1]
            print(
                f"{launcher} {storage}: {r['kill_to_first_step_s']:.1f} s, {r['steps_lost']} steps"
                " lost",
                flush=True,
            )
    figures = {"saves": saves, "recovery": runs}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
