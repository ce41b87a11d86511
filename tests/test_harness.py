"""The multi-process tests' harness (tests/distributed/harness.py).

A case failing on one rank ends the launch at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import hyparallel as hp

from .conftest import LAUNCH_PREFIXES, LAUNCH_VARIABLES, assert_every_parameter_compared
from .distributed.harness import GROUP_TIMEOUT_S, parameter_groups


# conftest.torchrun's: Note [forked workers]
@pytest.mark.parametrize("launcher", ["torchrun", "forked"])
def test_a_rank_that_fails_stops_its_peers_waiting_in_a_collective(tmp_path, repo, launcher):
    out = tmp_path / "results.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    run = {
        "torchrun": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
        "forked": [str(repo / "tests" / "distributed" / "forked_torchrun.py"), "2"],
    }[launcher]
    # A hang detector, not a speed check: without the harness rank 0 waits GROUP_TIMEOUT_S in its
    # all-reduce.
    proc = subprocess.run(
        [sys.executable, *run, str(repo / "tests" / "distributed" / "abort_worker.py"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=GROUP_TIMEOUT_S // 2,
    )
    # no results: the launch ended before the last case
    assert proc.returncode != 0 and not out.exists()
    report = json.loads((tmp_path / "results.jsonl.rank1").read_text())
    assert report["case"] == "fails-on-rank-1" and report["rank"] == 1
    assert (
        report["error"] == "ValueError: rank 1 gives up before the all-reduce"
        and "Traceback" in report["traceback"]
    )
    # rank 0 was stopped, or its all-reduce saw the peer go (gloo)
    peer = tmp_path / "results.jsonl.rank0"
    assert not peer.exists() or json.loads(peer.read_text())["case"] == "fails-on-rank-1"


def test_every_parameter_is_compared_by_name_on_every_replica():
    # a tied head: output.weight is tok_embeddings.weight
    model = hp.models.build("gpt-tiny", num_layers=2)
    groups = parameter_groups(model)
    names = {name for name, _ in model.named_parameters()}  # one name per tensor
    assert ["tok_embeddings.weight", "output.weight"] in groups
    assert_every_parameter_compared(
        groups, {0: names, 1: names - {"tok_embeddings.weight"} | {"output.weight"}}
    )
    dropped = sorted(names)[3]
    with pytest.raises(AssertionError, match=f"replica 1 never compared .*{dropped}"):
        assert_every_parameter_compared(groups, {0: names, 1: names - {dropped}})
    with pytest.raises(AssertionError, match="names the model does not have: \\['layers.9.w'\\]"):
        assert_every_parameter_compared(groups, {0: names | {"layers.9.w"}})


def test_the_suite_runs_the_same_inside_an_exported_launch(repo):
    # Note [the suite's environment]: torchrun's variables (this rank 1 of 2 would wait for a rank 0
    # that is not there), a Triton interpreter switch and hyparallel's kernel switch, as a user's
    # shell may export them.
    launch = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29533",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "user",
        "TRITON_INTERPRET": "1",
        "HYPARALLEL_TRITON": "0",
    }
    probe = (
        "tests/test_metrics.py::test_parallel_model_measures_its_steps_against_the_plans_prediction"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            probe,
            "tests/test_harness.py::test_no_launch_variable_reaches_a_test",
        ],
        capture_output=True,
        text=True,
        cwd=repo,
        env={**os.environ, **launch},
        timeout=GROUP_TIMEOUT_S,
    )
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:]


def test_no_launch_variable_reaches_a_test():
    left = [
        name
        for name in os.environ
        if (name in LAUNCH_VARIABLES or name.startswith(LAUNCH_PREFIXES))
        # the suite's own: each test's graph cache (conftest.own_graph_cache)
        and name != "HYPARALLEL_CACHE_DIR"
    ]
    assert not left


def test_without_triton_the_kernel_tests_skip_and_say_why(repo, tmp_path):
    # pyproject installs triton on Linux x86-64 only: elsewhere the kernel checks skip and the rest
    # still runs.
    (tmp_path / "sitecustomize.py").write_text(
        'import sys\nsys.modules["triton"] = None  # as if not installed\n'
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "tests/test_kernels.py",
            "tests/test_tensor_layers.py",
            # not the CLI's subprocesses
            "tests/test_layering.py::test_package_imports_without_triton_or_cuda",
        ],
        capture_output=True,
        text=True,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{repo}"},
        timeout=GROUP_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert (
        "SKIPPED [1] tests/test_kernels.py" in proc.stdout
        and "triton is not installed" in proc.stdout
    )
    assert " 1 skipped" in proc.stdout and "failed" not in proc.stdout
