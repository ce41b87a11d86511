"""examples/launch/: each file is valid, runs examples/train_gpt.py with flags it and its launcher
accept, and runs exactly the command docs/elastic.md shows, so that the files and the docs cannot
drift apart. Nothing is launched: the scripts are only checked with `bash -n`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "examples" / "launch"
ELASTIC_DOC = ROOT / "docs" / "elastic.md"
README = ROOT / "README.md"
TRAIN = "examples/train_gpt.py"
SCRIPTS = [LAUNCH / "torchrun.sh", LAUNCH / "dlrover_standalone.sh", LAUNCH / "slurm.sbatch"]
MANIFEST = LAUNCH / "elasticjob.yaml"
FILES = [*SCRIPTS, MANIFEST]
LAUNCHERS = ("torchrun", "srun", "dlrover-run", "hyparallel-dlrover-run")
# Variables a command reads that no script default gives: set by Slurm, by the sbatch script itself,
# or by DLRover in each Pod of an ElasticJob.
EXTERNAL = {"SLURM_NNODES", "SLURM_JOB_ID", "head_node", "NODE_NUM"}
# split: this file is no launch file and mentions it freely
STALE_VARIABLE = "TORCH_DISABLE_SHARE_" + "RDZV_TCP_STORE"

_DEFAULT = re.compile(r'^(\w+)="\$\{\1:-([^}]*)\}"', re.M)  # NPROC="${NPROC:-4}"
_VARIABLE = re.compile(r"\$\{?(\w+)\}?")


def _logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined and runs of whitespace made one space."""
    return [" ".join(line.split()) for line in text.replace("\\\n", " ").splitlines()]


def _container(manifest: dict) -> dict:
    return manifest["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["containers"][0]


def _defaults(path: Path) -> dict[str, str]:
    return {} if path == MANIFEST else dict(_DEFAULT.findall(path.read_text()))


def _command(path: Path) -> list[str]:
    """The launch a file runs, as argv: the one line running examples/train_gpt.py, each script
    variable replaced by its default, without `exec` and without the "$@" that passes a script's own
    arguments on to train_gpt.py."""
    if path == MANIFEST:
        shell, flag, line = _container(yaml.safe_load(path.read_text()))["command"]
        assert (shell, flag) == (
            "/bin/bash",
            "-c",
        ), "the container runs its command line with /bin/bash -c"
        lines = _logical_lines(line)
    else:
        lines = [
            line
            for line in _logical_lines(path.read_text())
            if TRAIN in line and not line.startswith("#")
        ]
    assert len(lines) == 1, f"{path.name}: expected one line running {TRAIN}, found {lines}"
    argv = shlex.split(lines[0])
    argv = argv[1:] if argv[0] == "exec" else argv
    defaults = _defaults(path)
    return [
        _VARIABLE.sub(lambda m: defaults.get(m[1], f"${m[1]}"), arg) for arg in argv if arg != "$@"
    ]


def _doc_commands(text: str) -> list[list[str]]:
    """Every line of the fenced code blocks in a Markdown text, as argv (lines that are no shell
    words skipped)."""
    commands = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S):
        for line in _logical_lines(block):
            try:
                commands.append(shlex.split(line, comments=True))
            except ValueError:  # an unbalanced quote: prose in a comment, no command
                continue
    return commands


def _readme_section() -> str:
    text = README.read_text()
    start = text.index("## Launching on a cluster\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _train_args(argv: list[str]) -> list[str]:
    return argv[argv.index(TRAIN) + 1 :]


def _load_train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parse(parse, argv: list[str], capsys, what: str):
    """``parse(argv)``, an argparse error (SystemExit) turned into a failure that shows argparse's
    message."""
    try:
        return parse(argv)
    except SystemExit:
        pytest.fail(f"{what} refuses {shlex.join(argv)}:\n{capsys.readouterr().err}")


ids = [path.name for path in FILES]


# ---- each file on its own ------------------------------------------------------------------------


@pytest.mark.parametrize("path", SCRIPTS, ids=[path.name for path in SCRIPTS])
def test_script_is_strict_executable_bash(path):
    lines = path.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    commands = [line for line in lines if line.strip() and not line.startswith("#")]
    assert commands[0] == "set -euo pipefail", (
        "the first command (after any #SBATCH directives) is the strict mode"
    )
    assert os.access(path, os.X_OK), f"chmod +x {path.relative_to(ROOT)}"
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_slurm_directives_precede_the_first_command():
    """sbatch reads #SBATCH lines only until the first command."""
    lines = (LAUNCH / "slurm.sbatch").read_text().splitlines()
    first_command = next(
        i for i, line in enumerate(lines) if line.strip() and not line.startswith("#")
    )
    directives = [i for i, line in enumerate(lines) if line.startswith("#SBATCH")]
    assert directives and max(directives) < first_command
    assert {"--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8"} <= {
        lines[i].split()[1] for i in directives
    }


def test_manifest_is_a_dlrover_elasticjob():
    manifest = yaml.safe_load(MANIFEST.read_text())
    assert manifest["apiVersion"] == "elastic.iml.github.io/v1alpha1"
    assert manifest["kind"] == "ElasticJob"
    assert manifest["metadata"]["name"]
    spec = manifest["spec"]
    assert spec["distributionStrategy"] == "AllreduceStrategy"
    assert spec["optimizeMode"] == "single-job"
    replicas = spec["replicaSpecs"]["worker"]["replicas"]
    assert isinstance(replicas, int) and replicas >= 1
    container = _container(manifest)
    assert container["name"] == "main" and container["image"]
    assert _command(MANIFEST)[0] == "dlrover-run", (
        "on Kubernetes the operator starts the master: plain dlrover-run"
    )


@pytest.mark.parametrize("path", FILES, ids=ids)
def test_command_reads_only_defaulted_or_provided_variables(path):
    """A variable the command reads has a default in the script, or Slurm, the script or DLRover
    sets it."""
    unset = {name for arg in _command(path) for name in _VARIABLE.findall(arg)} - EXTERNAL
    assert not unset, f"{path.name} reads {sorted(unset)} without a default"


@pytest.mark.parametrize("path", FILES, ids=ids)
def test_no_file_needs_the_shared_store_workaround(path):
    """hyparallel isolates each restart round in the process-group store itself: no environment
    variable for it."""
    assert STALE_VARIABLE not in path.read_text()


def test_elastic_doc_does_not_mention_the_shared_store_workaround():
    assert STALE_VARIABLE not in ELASTIC_DOC.read_text()


# ---- the flags each file passes ------------------------------------------------------------------


@pytest.mark.parametrize("path", FILES, ids=ids)
def test_train_gpt_accepts_the_flags(path, monkeypatch, capsys):
    train_gpt = _load_train_gpt()
    train_args = _train_args(_command(path))

    def parse(argv):
        monkeypatch.setattr(sys, "argv", [TRAIN, *argv])
        return train_gpt.parse_args()

    args = _parse(parse, train_args, capsys, TRAIN)
    assert args.checkpoint_dir and args.checkpoint_every > 0, (
        "an elastic launch saves checkpoints to resume from"
    )
    assert args.plan is None, "without --plan every start plans for the WORLD_SIZE it has"


@pytest.mark.parametrize("path", FILES, ids=ids)
def test_launcher_accepts_the_flags(path, capsys):
    """torchrun's own parser, or DLRover's (hyparallel-dlrover-run takes dlrover-run's
    arguments)."""
    argv = _command(path)
    argv = argv[1:] if argv[0] == "srun" else argv
    assert argv[0] in LAUNCHERS and argv[0] != "srun", argv
    if argv[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        parse = get_args_parser().parse_args
    else:
        pytest.importorskip(
            "dlrover", reason='DLRover is the optional extra: pip install -e ".[elastic]"'
        )
        from dlrover.trainer.torch.elastic_run import parse_args as parse

    args = _parse(parse, argv[1:], capsys, argv[0])
    assert args.training_script == TRAIN and args.max_restarts >= 1
    assert args.training_script_args == _train_args(argv)


# ---- the docs show what the files run ------------------------------------------------------------


@pytest.mark.parametrize("path", FILES, ids=ids)
def test_elastic_doc_shows_the_command(path):
    command = _command(path)
    assert command in _doc_commands(ELASTIC_DOC.read_text()), (
        f"docs/elastic.md does not show the command {path.name} runs (with its"
        f" defaults):\n{shlex.join(command)}"
    )


@pytest.mark.parametrize("path", SCRIPTS, ids=[path.name for path in SCRIPTS])
def test_elastic_doc_names_every_setting(path):
    text = ELASTIC_DOC.read_text()
    missing = [name for name in _defaults(path) if f"`{name}`" not in text]
    assert not missing, f"docs/elastic.md does not name {path.name}'s settings {missing}"


def test_readme_section_shows_only_commands_the_files_run():
    section = _readme_section()
    assert "docs/elastic.md" in section and "examples/launch/" in section
    shown = [argv for argv in _doc_commands(section) if argv and argv[0] in LAUNCHERS]
    assert shown, "the README's launch section shows a launch command"
    runs = [_command(path) for path in FILES]
    for argv in shown:
        assert argv in runs, (
            f"README.md shows a command no file in examples/launch/ runs:\n{shlex.join(argv)}"
        )
