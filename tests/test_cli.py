"""The hyparallel command line: listings, plan checks, tracing, and one-line errors with exit 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hyparallel.cli import main

from .conftest import HF_LLAMA_TINY


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_models_lists_the_zoo(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0
    for name in ("gpt-tiny", "gpt-175b", "llama-70b"):
        assert name in out
    assert "175B" in out and "64 (8)" in out  # parameter count; llama-70b's query (kv) heads
    code, out, _ = run(capsys, "models", "--json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["llama-7b"]["num_params"] == 6_738_415_616 and rows["gpt-175b"]["num_layers"] == 96


def test_clusters_lists_presets(capsys):
    code, out, _ = run(capsys, "clusters")
    assert code == 0
    for name in ("a100-80g", "h100-sxm", "h200", "cpu"):
        assert name in out
    assert "312.0" in out  # A100 bf16 TFLOP/s
    code, out, _ = run(capsys, "clusters", "--json")
    assert {c["name"] for c in json.loads(out)} >= {"a100-80g", "h100-sxm", "h200", "cpu"}


def test_show_completes_a_hand_plan(capsys, repo):
    code, out, _ = run(capsys, "show", str(repo / "configs/plans/cpu-dp2-tp2-pp2.yaml"))
    assert code == 0
    assert "pp 2 x dp 2 x tp 2 = 8 processes" in out
    assert "global batch 16 = dp 2 x 4 micro-batches x 2" in out
    code, out, _ = run(capsys, "show", str(repo / "configs/plans/cpu-dp2-tp2-pp2.yaml"), "--yaml")
    assert yaml.safe_load(out)["parallel"]["num_microbatches"] == 4


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            "training: {global_batch: 8, seq_len: 4}\nparallel: {tp: eight}\n",
            "parallel.tp: expected a positive integer, got 'eight'",
        ),
        (
            "training: {global_batch: 8, seq_len: 4}\nparallel: {dp: 3}\n",
            "training.global_batch (8) must be a multiple of dp (3)",
        ),
        ("training: [\n", "invalid YAML"),
    ],
)
def test_show_malformed_plan_exits_2_with_one_line(capsys, tmp_path, content, expected):
    path = tmp_path / "plan.yaml"
    path.write_text(content)
    code, out, err = run(capsys, "show", str(path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"hyparallel: error: {path}") and expected in err


def test_trace_zoo_model(capsys):
    code, out, _ = run(capsys, "trace", "--model", "gpt-tiny", "--seq-len", "32")
    assert code == 0
    assert "traced with torch.fx" in out and "repeated blocks 2" in out and "layers.0" in out
    code, out, _ = run(capsys, "trace", "--model", "gpt-tiny", "num_layers=3", "--json")
    data = json.loads(out)
    assert data["num_layers"] == 3 and data["seq_len"] == 128 and data["method"] == "fx"
    assert sum(s["param_count"] for s in data["segments"]) == data["num_params"]


def test_trace_hugging_face_model(capsys):
    code, out, _ = run(
        capsys, "trace", "--model", *HF_LLAMA_TINY.split(), "--seq-len", "16", "--json"
    )
    assert code == 0 and json.loads(out)["method"] == "export"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["trace", "--model", "gpt-nope"], "unknown model 'gpt-nope'"),
        (["trace", "--model", "gpt-tiny", "layers=2"], "model 'gpt-tiny' has no setting 'layers'"),
        (["trace", "--model", "hf:NoSuchArch"], "unknown Hugging Face architecture 'NoSuchArch'"),
        (["show", "missing.yaml"], "missing.yaml: no such file"),
    ],
)
def test_user_errors_exit_2(capsys, argv, expected):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and expected in err


def test_untraceable_factory_model_is_one_line(tmp_path):
    (tmp_path / "branchy.py").write_text(
        "import torch.nn as nn\n"
        "class Branchy(nn.Linear):\n"
        "    def forward(self, x):\n"
        "        return super().forward(x) if x.sum() > 0 else x\n"
        "    def example_inputs(self, batch_size, seq_len, device):\n"
        "        import torch\n"
        "        return (torch.zeros(batch_size, self.in_features, device=device),)\n"
        "def make():\n"
        "    return Branchy(4, 4)\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "hyparallel", "trace", "--model", "branchy:make"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(
        "hyparallel: error: cannot trace Branchy: torch.fx"
    )
    assert "branchy.py:4:" in result.stderr


def test_console_script_has_no_traceback(tmp_path):
    bad = tmp_path / "plan.yaml"
    bad.write_text("training: {global_batch: 8, seq_len: 4}\nparallel: {tp: eight}\n")
    result = subprocess.run(
        [sys.executable, "-m", "hyparallel", "show", str(bad)], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert (
        result.stderr
        == f"hyparallel: error: {bad}: parallel.tp: expected a positive integer, got 'eight'\n"
    )
    assert "Traceback" not in result.stderr


def test_every_command_has_an_example_in_help(capsys):
    for command in ("models", "clusters", "show", "trace", "plan", "demo"):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        assert "example" in capsys.readouterr().out


def test_demo_prints_the_plan_and_trains(capsys, monkeypatch):
    from hyparallel.tools import demo

    # the run itself: test_example_trains
    monkeypatch.setattr(demo, "train_parallel", lambda log: [5.0, 2.0])
    code, out, _ = run(capsys, "demo")
    assert code == 0
    assert (
        re.search(r"mesh pp \d+ x dp \d+ x tp \d+", out)
        and "pipeline stages (per device" in out
        and "predicted step" in out
    )
    assert "parallel:" in out and "order: [pp, dp, tp]" in out  # the plan file's head
    assert "repeated blocks 96" in out and "loss 5.000 -> 2.000" in out


def test_plan_writes_yaml_and_prints_a_summary(capsys, tmp_path):
    out_file = tmp_path / "plan.yaml"
    code, out, err = run(
        capsys,
        "plan",
        "--model",
        "gpt-mini",
        "--gpus",
        "8",
        "--cluster",
        "cpu",
        "--global-batch",
        "16",
        "--seq-len",
        "32",
        "--dtype",
        "fp32",
        "-o",
        str(out_file),
    )
    assert code == 0, err
    plan = yaml.safe_load(out_file.read_text())
    assert plan["parallel"]["dp"] * plan["parallel"]["tp"] * plan["parallel"]["pp"] == 8
    assert "predicted step" in out and "MFU" in out and f"wrote {out_file}" in out
    from hyparallel.spec.schema import Plan

    assert Plan.load(out_file).model.name == "gpt-mini"


def test_plan_json_is_the_only_stdout(capsys):
    code, out, _ = run(
        capsys,
        "plan",
        "--model",
        "gpt-mini",
        "--gpus",
        "4",
        "--cluster",
        "cpu",
        "--global-batch",
        "8",
        "--seq-len",
        "32",
        "--tp",
        "2",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    assert data["parallel"]["tp"] == 2 and data["version"] == 1
    # the planner's default wherever tp splits the head
    assert data["parallel"]["vocab_parallel_loss"]


def test_plan_gathers_the_logits_when_asked_and_says_so(capsys):
    argv = [
        "plan",
        "--model",
        "gpt-mini",
        "--gpus",
        "2",
        "--cluster",
        "cpu",
        "--global-batch",
        "8",
        "--seq-len",
        "32",
    ]
    code, out, _ = run(capsys, *argv, "--tp", "2", "--no-vocab-parallel-loss")
    assert code == 0 and "loss on gathered logits" in out
    code, out, _ = run(capsys, *argv, "--tp", "2")
    assert code == 0 and "loss vocab-parallel" in out


def test_plan_top_lists_candidates_and_alternatives(capsys):
    code, out, _ = run(
        capsys,
        "plan",
        "--model",
        "gpt-mini",
        "--gpus",
        "8",
        "--cluster",
        "cpu",
        "--global-batch",
        "16",
        "--seq-len",
        "32",
        "--top",
        "3",
    )
    assert code == 0
    assert (
        "the 3 best plans" in out
        and "pure data parallel" in out
        and "most pipeline parallel" in out
    )
    # a why-not for each loser: how much slower, from what
    assert "the pick" in out and out.count("slower (") >= 2


CPU_PLAN = [
    "plan",
    "--model",
    "gpt-mini",
    "--gpus",
    "8",
    "--cluster",
    "cpu",
    "--global-batch",
    "16",
    "--seq-len",
    "32",
]


def test_plan_compresses_gradients_only_when_asked_and_says_what_it_saved(capsys, tmp_path):
    plan_file = tmp_path / "plan.yaml"
    code, out, err = run(
        capsys, *CPU_PLAN, "--dp", "8", "--grad-compression", "bf16", "-o", str(plan_file)
    )
    assert code == 0, err
    data = yaml.safe_load(plan_file.read_text())
    assert data["parallel"]["grad_compression"] == "bf16"
    saved = data["predicted"]["uncompressed"]["step_time_s"] - data["predicted"]["step_time_s"]
    assert (
        "gradient compression bf16: " in out
        and " s uncompressed, " in out
        and "dp sync + optimizer" in out
    )
    code, shown, _ = run(capsys, "show", str(plan_file))
    assert code == 0 and "gradient compression bf16" in shown and f"{abs(saved):.3g} s" in shown
    code, out, err = run(capsys, *CPU_PLAN, "--dp", "8", "--json")  # the default: fp32 gradients
    assert code == 0 and json.loads(out)["parallel"]["grad_compression"] == "none"
    assert "uncompressed" not in json.loads(out)["predicted"]


def test_plan_top_says_each_candidates_compression_and_saving(capsys):
    # dp fixed, so the top candidates differ in how they reduce gradients (not only in layout)
    code, out, err = run(
        capsys,
        *CPU_PLAN,
        "--dp",
        "8",
        "--grad-compression",
        "any",
        "--powersgd-rank",
        "2",
        "--top",
        "4",
    )
    assert code == 0, err
    assert "gradients" in out and "saved s" in out and "bf16" in out


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--powersgd-rank", "8"],
            "--powersgd-rank shapes PowerSGD, which --grad-compression none does not allow",
        ),
        (
            ["--grad-compression", "bf16", "--powersgd-rank", "8", "--powersgd-start-step", "10"],
            (
                "--powersgd-rank and --powersgd-start-step shape PowerSGD, which --grad-compression"
                " bf16 does not allow"
            ),
        ),
    ],
)
def test_powersgd_flags_need_powersgd_allowed(capsys, flags, expected):
    line = one_line_error(capsys, *CPU_PLAN, *flags)
    assert (
        line.startswith("hyparallel: error: " + expected)
        and "add --grad-compression powersgd" in line
    )


def test_why_slower_names_the_part_that_grew():
    import hyparallel as hp
    from hyparallel.planner import search
    from hyparallel.planner.api import step_parts, why_slower

    result = search(
        hp.models.build("gpt-mini"), hp.ClusterSpec.preset("cpu"), 16, 32, "fp32", top=1
    )
    winner = result.best[0]
    gpipe = search(
        hp.models.build("gpt-mini"),
        hp.ClusterSpec.preset("cpu"),
        16,
        32,
        "fp32",
        pp=4,
        micro_batch=2,
        schedule="gpipe",
        top=1,
    ).best[0]
    parts = step_parts(gpipe)
    assert sum(parts.values()) == pytest.approx(gpipe.step_time_s)
    assert parts["bubble"] == pytest.approx(parts["compute"] * gpipe.bubble_fraction)
    line = why_slower(gpipe, winner)
    part = max(parts, key=lambda k: parts[k] - step_parts(winner)[k])
    assert (
        line.startswith(f"{gpipe.step_time_s / winner.step_time_s - 1:.1%} slower")
        and f"mostly {part} +" in line
    )
    assert why_slower(winner, winner) == "as fast as the winner (within 0.1%)"


def test_plan_verbose_logs_the_search_on_stderr(capsys):
    code, out, err = run(
        capsys,
        "plan",
        "--model",
        "gpt-mini",
        "--gpus",
        "4",
        "--cluster",
        "cpu",
        "--global-batch",
        "8",
        "--seq-len",
        "32",
        "--verbose",
        "--json",
    )
    assert code == 0 and json.loads(out)["version"] == 1  # stdout stays the JSON
    assert (
        "configurations" in err
        and "may fit in memory" in err
        and "recompute" in err
        and "stopped:" in err
    )


def test_show_draws_the_device_map_stages_and_time_breakdown(capsys, tmp_path):
    plan_file = tmp_path / "plan.yaml"
    assert (
        run(
            capsys,
            "plan",
            "--model",
            "gpt-mini",
            "--gpus",
            "8",
            "--cluster",
            "cpu",
            "--global-batch",
            "16",
            "--seq-len",
            "32",
            "--pp",
            "2",
            "--tp",
            "2",
            "-o",
            str(plan_file),
        )[0]
        == 0
    )
    code, out, _ = run(capsys, "show", str(plan_file))
    assert code == 0
    # every GPU's coordinates
    assert "device map" in out and "pp1 dp1 tp1" in out and "rank 7" in out
    assert "█" in out and "/ 3 GiB" in out  # memory against the device's 3 GiB (cpu preset)
    assert "taken apart" in out and "pipeline bubble and stage imbalance" in out and "MFU" in out
    assert "link" in out and "gloo over loopback TCP" in out


def test_show_completes_a_hand_plan_for_a_model(capsys, repo):
    code, out, _ = run(
        capsys, "show", str(repo / "configs/plans/cpu-dp2-tp2-pp2.yaml"), "--model", "gpt-tiny"
    )
    assert code == 0
    assert "completed for the model" in out and "tok_embeddings" in out and "taken apart" in out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--model", "gpt-mini", "--gpus", "12", "--cluster", "cpu"],
            "--gpus 12 is not a multiple of --gpus-per-node 8",
        ),
        (
            ["--model", "gpt-mini", "--gpus", "8", "--cluster", "cpu", "--tp", "3"],
            "tp(3) = 3 does not divide the 8 GPUs",
        ),
        (
            ["--model", "gpt-175b", "--gpus", "8", "--global-batch", "64"],
            "nothing fits in 77.0 GiB per GPU",
        ),
        (
            ["--model", "gpt-mini", "--gpus", "8", "--cluster", "tpu-v9"],
            "unknown cluster preset 'tpu-v9'",
        ),
    ],
)
def test_plan_user_errors_exit_2(capsys, argv, expected):
    code, out, err = run(capsys, "plan", *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and expected in err


def test_show_lays_out_a_plan_without_a_cluster_in_rows_of_eight(capsys, tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(
        "training: {global_batch: 64, micro_batch: 1, seq_len: 128}\nparallel: {dp: 4, tp: 2, pp:"
        " 2}\n"
    )
    code, out, _ = run(capsys, "show", str(path))
    assert code == 0 and "rows of 8 ranks" in out and "rank 15" in out and "GPU 8" not in out


# ---- every bad input refused with one line (issue 14) --------------------------------------------


def one_line_error(capsys, *argv) -> str:
    """Run the CLI expecting a user error: exit 2, nothing on stdout, one line on stderr; returns
    that line."""
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    return err.rstrip("\n")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            [],
            (
                "hyparallel: error: the following arguments are required: COMMAND; see hyparallel"
                " --help"
            ),
        ),
        (["bogus"], "hyparallel: error: argument COMMAND: invalid choice: 'bogus'"),
        (
            ["plan", "--gpus", "8"],
            (
                "hyparallel plan: error: the following arguments are required: --model; see"
                " hyparallel plan --help"
            ),
        ),
        (
            ["plan", "--model"],
            "hyparallel plan: error: argument --model: expected at least one argument",
        ),
        (
            ["show", "plan.yaml", "--bogus"],
            "hyparallel show: error: unrecognized arguments: --bogus; see hyparallel show --help",
        ),
        (["simulate"], "hyparallel simulate: error: the following arguments are required: plan"),
        (
            ["checkpoint", "import", "a", "b"],
            "hyparallel checkpoint: error: argument action: invalid choice: 'import'",
        ),
        (
            ["plan", "--model", "gpt-tiny", "--gpus", "8", "--dtype", "fp8"],
            "hyparallel plan: error: argument --dtype: invalid choice",
        ),
        (
            ["plan", "--model", "gpt-tiny", "--gpus", "8", "--grad-compression", "int8"],
            "hyparallel plan: error: argument --grad-compression: invalid choice: 'int8'",
        ),
        (
            ["plan", "--model", "gpt-tiny", "--gpus", "8", "--powersgd-start-step", "1"],
            (
                "hyparallel plan: error: argument --powersgd-start-step: expected an integer from 2"
                " to 1,000,000,000, got"
            ),
        ),
    ],
)
def test_argparse_errors_are_one_line(capsys, argv, expected):
    assert one_line_error(capsys, *argv).startswith(expected)


PLAN = ["plan", "--model", "gpt-tiny", "--gpus", "8", "--cluster", "cpu"]
NUMERIC_FLAGS = [  # (argv before the flag, flag, the bound from hyparallel.spec.limits)
    (["plan", "--model", "gpt-tiny", "--cluster", "cpu"], "--gpus", 2**20),
    (PLAN, "--gpus-per-node", 1024),
    (PLAN, "--global-batch", 2**24),
    (PLAN, "--seq-len", 2**24),
    (PLAN, "--tp", 2**20),
    (PLAN, "--pp", 2**20),
    (PLAN, "--dp", 2**20),
    (PLAN, "--top", 100),
    (PLAN, "--powersgd-rank", 1024),
    (["trace", "--model", "gpt-tiny"], "--batch-size", 2**24),
    (["trace", "--model", "gpt-tiny"], "--seq-len", 2**24),
    (["calibrate"], "--nproc", 1024),
]


@pytest.mark.parametrize(("before", "flag", "bound"), NUMERIC_FLAGS)
@pytest.mark.parametrize("value", ["0", "-3", "bound+1", "10" * 30, "2.5", "eight", "9" * 5000])
def test_every_numeric_flag_refuses_zero_negative_and_absurd(capsys, before, flag, bound, value):
    value = str(bound + 1) if value == "bound+1" else value
    line = one_line_error(capsys, *before, flag, value)
    command = before[0]
    expected = f"argument {flag}: expected a positive integer up to {bound:,}, got "
    assert line.startswith(f"hyparallel {command}: error: {expected}")
    assert line.endswith(f"; see hyparallel {command} --help") and len(line) < 250


def test_bounds_of_flags_are_the_schemas():
    from hyparallel import cli
    from hyparallel.spec import limits

    assert cli.DEVICES(str(limits.MAX_DEVICES)) == limits.MAX_DEVICES
    assert cli.SEQ_LEN(str(limits.MAX_SEQ_LEN)) == limits.MAX_SEQ_LEN
    assert cli.PER_NODE(str(limits.MAX_GPUS_PER_NODE)) == limits.MAX_GPUS_PER_NODE
    from hyparallel.spec.schema import ParallelConfig

    assert ParallelConfig(
        powersgd_rank=limits.MAX_POWERSGD_RANK, powersgd_start_step=limits.MAX_POWERSGD_START_STEP
    )


BAD_FILES = {  # name -> (bytes, what the line says)
    "binary": (b"\x89PNG\r\n\x1a\n\x00\xff", "not UTF-8 text (byte 0x89 at offset 0)"),
    "duplicate key": (
        b"name: a\nname: b\n",
        ":2:1: invalid YAML: duplicate key 'name' (first on line 1)",
    ),
    "deep nesting": (b"[" * 100_000, ":1:65: invalid YAML: nested more than 64 levels deep"),
    "alias bomb": (
        b"a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        + b"".join(
            f"{k}: &{k} [{', '.join([f'*{j}'] * 10)}]\n".encode() for j, k in zip("abcde", "bcdef")
        ),
        "invalid YAML: this value holds more than 1,000,000 values",
    ),
    "a list": (b"- 1\n", "expected a mapping of keys at the top level, got list [1]"),
    "empty": (b"", "expected a mapping of keys at the top level, got an empty file"),
}
READERS = {  # how each command reads a file
    "show": lambda path: ["show", path],
    "simulate": lambda path: ["simulate", path],
    "plan --cluster": lambda path: [*PLAN[:-1], path],
    "calibrate --base": lambda path: ["calibrate", "--quick", "--nproc", "2", "--base", path],
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("bad", list(BAD_FILES))
def test_every_file_the_cli_reads_refuses_bad_contents(capsys, tmp_path, reader, bad):
    content, expected = BAD_FILES[bad]
    path = tmp_path / "input.yaml"
    path.write_bytes(content)
    line = one_line_error(capsys, *READERS[reader](str(path)))
    assert line.startswith(f"hyparallel: error: {path}") and expected in line, line


@pytest.mark.parametrize("reader", list(READERS))
def test_every_file_the_cli_reads_may_be_missing_or_a_folder(capsys, tmp_path, reader):
    assert one_line_error(capsys, *READERS[reader](str(tmp_path / "none.yaml"))).endswith(
        "none.yaml: no such file"
    )
    folder = tmp_path / "folder"
    folder.mkdir()
    assert one_line_error(capsys, *READERS[reader](str(folder))).endswith(
        f"{folder}: is a folder; give a YAML file"
    )


def test_a_failing_plan_leaves_an_existing_plan_file_untouched(capsys, tmp_path):
    target = tmp_path / "plan.yaml"
    target.write_text("my plan\n")
    assert "tp(3) = 3 does not divide" in one_line_error(
        capsys, *PLAN, "--tp", "3", "-o", str(target)
    )
    assert one_line_error(capsys, *PLAN, "--gpus", "0", "-o", str(target))
    assert target.read_text() == "my plan\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "plan.yaml"
    ]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            [*PLAN, "-o", "{tmp}/missing/plan.yaml"],
            "cannot write {tmp}/missing/plan.yaml: no folder {tmp}/missing; create it first",
        ),
        ([*PLAN, "-o", "{tmp}"], "cannot write {tmp}: it is a folder; give a file name"),
        (
            ["simulate", "{plan}", "--out", "{tmp}/t.jpg"],
            "cannot draw '{tmp}/t.jpg': unknown picture extension '.jpg'",
        ),
        (
            ["simulate", "{plan}", "--out", "{tmp}/missing/t.png"],
            "cannot write {tmp}/missing/t.png: no folder",
        ),
        (["checkpoint", "export", "{tmp}", "{tmp}/model.pt"], "{tmp}: no complete checkpoint"),
        (
            ["checkpoint", "export", "{fake}", "{tmp}/model.pt"],
            "{fake}: not a hyparallel checkpoint of format 1",
        ),
        (
            ["checkpoint", "export", "{tmp}", "{tmp}/missing/model.pt"],
            "cannot write {tmp}/missing/model.pt: no folder",
        ),
        (["calibrate", "--out", "{tmp}"], "cannot write {tmp}: it is a folder"),
    ],
)
def test_bad_output_paths_are_one_line_and_write_nothing(capsys, tmp_path, argv, expected):
    plan = tmp_path / "in" / "plan.yaml"
    plan.parent.mkdir()
    plan.write_text("training: {global_batch: 8, seq_len: 4}\nparallel: {pp: 2}\n")
    fake = tmp_path / "in" / "step-00000001"
    fake.mkdir()
    (fake / "hyparallel.json").write_bytes(b"\xff not json")
    names = {"tmp": tmp_path, "plan": plan, "fake": fake}
    before = sorted(tmp_path.rglob("*"))
    line = one_line_error(capsys, *(word.format(**names) for word in argv))
    assert expected.format(**names) in line, line
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, nothing partial


@pytest.mark.parametrize("parallel", ["{dp: 1048576}", "{pp: 1048576}", "{dp: 1024, tp: 1024}"])
def test_show_at_the_largest_world_size_visits_no_rank_by_rank(capsys, tmp_path, parallel):
    # A hang detector, not a timing: at 2^20 ranks, anything rank by rank (or stage by stage) ran
    # for minutes.
    path = tmp_path / "plan.yaml"
    path.write_text(f"training: {{global_batch: 1048576, seq_len: 4}}\nparallel: {parallel}\n")
    code, out, err = run(capsys, "show", str(path))
    assert code == 0, err
    assert "= 1048576 processes" in out and "rank 7" in out
    if "pp" in parallel:
        assert "(1048544 more stages)" in out
        assert "simulate draws one row per pipeline rank, at most 256" in one_line_error(
            capsys, "simulate", str(path)
        )


def test_simulate_refuses_a_schedule_too_long_to_time(capsys, tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("training: {global_batch: 16777216, seq_len: 4}\nparallel: {pp: 4}\n")
    line = one_line_error(capsys, "simulate", str(path))
    assert "= 134,217,728 forwards and backwards, more than the 131,072 simulate times" in line


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (
            ["gpt-tiny", "num_layers=-1"],
            "model 'gpt-tiny': num_layers must be an integer from 1 to 512, got -1",
        ),
        (["gpt-tiny", "num_layers=abc"], "got 'abc'"),
        (["gpt-tiny", "num_layers=10**12"], "got '10**12'"),
        (["gpt-tiny", "num_layers=1000000000000"], "got 1000000000000"),
        (["gpt-tiny", "hidden_size=" + "9" * 5000], "hidden_size must be an integer"),
        (["gpt-tiny", "nmu_layers=2"], "model 'gpt-tiny' has no setting 'nmu_layers'"),
        (
            ["hf:gpt2", "n_layer=-1"],
            "hf:gpt2: num_hidden_layers (n_layer) must be an integer from 1 to 512, got -1",
        ),
        (["hf:gpt2", "n_layr=2"], "hf:gpt2: no transformers config has a setting 'n_layr'"),
    ],
)
def test_bad_model_specs_are_one_line(capsys, model, expected):
    for argv in (["trace", "--model", *model], [*PLAN[:2], *model, *PLAN[3:]]):
        assert expected in one_line_error(capsys, *argv)


def test_seq_len_past_a_zoo_models_positions_is_one_line(capsys):
    line = one_line_error(capsys, *PLAN, "--seq-len", "4096")
    assert (
        line
        == "hyparallel: error: seq_len 4096 is longer than the model's max_seq_len (128); pass a"
        " shorter --seq-len, or build the model with max_seq_len=4096"
    )


def test_paths_the_system_cannot_look_up_are_one_line(capsys, tmp_path):
    long = str(tmp_path / ("a" * 5000))  # ENAMETOOLONG: Path.is_file() and friends raise on it
    plan = tmp_path / "plan.yaml"
    plan.write_text("training: {global_batch: 8, seq_len: 4}\nparallel: {}\n")
    for argv in (
        ["show", long],
        [*PLAN[:-1], long],
        [*PLAN, "-o", long],
        ["simulate", str(plan), "--out", long + ".png"],
        ["checkpoint", "export", long, str(tmp_path / "m.pt")],
        ["calibrate", "--base", long],
    ):
        assert "File name too long" in one_line_error(capsys, *argv)


def test_model_factories_are_checked_before_they_are_called(capsys):
    # never called: it needs an argument
    line = one_line_error(capsys, "trace", "--model", "os:system")
    assert (
        "model factory 'os:system' cannot be called with no arguments: missing a required argument"
        in line
    )
    assert "':make' is not package.module:name" in one_line_error(
        capsys, "trace", "--model", ":make"
    )
    assert "No closing quotation" in one_line_error(
        capsys, "trace", "--model", "gpt-tiny", "num_layers='2"
    )


def test_a_model_too_large_to_trace_is_one_line_on_the_real_stderr():
    # torch's fake tensors log each failing op with a traceback through a handler holding the
    # process's stderr; only a subprocess sees that stream.
    argv = [
        "trace",
        "--model",
        "gpt-tiny",
        "max_seq_len=16777216",
        "--batch-size",
        "16777216",
        "--seq-len",
        "16777216",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "hyparallel", *argv], capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(
        "hyparallel: error: cannot trace GPT: torch.fx: RuntimeError: Storage size"
    )


def test_unreadable_inputs_and_unwritable_outputs_are_one_line(capsys, tmp_path, monkeypatch):
    from hyparallel.spec import files

    locked = tmp_path / "plan.yaml"
    locked.write_text("training: {global_batch: 8, seq_len: 4}\nparallel: {}\n")
    locked.chmod(0)
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    # root reads and writes whatever the mode: the system answers as it would anyone else
    if os.geteuid() == 0:
        real_open, real_access = open, os.access

        def denied_open(path, *args, **kwargs):
            if Path(path) == locked:
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)

        # the module's open, not the builtin
        monkeypatch.setattr(files, "open", denied_open, raising=False)
        monkeypatch.setattr(
            files.os, "access", lambda path, mode: Path(path) != folder and real_access(path, mode)
        )
    assert one_line_error(capsys, "show", str(locked)).endswith(
        "plan.yaml: cannot read: Permission denied"
    )
    assert one_line_error(capsys, *PLAN, "-o", str(folder / "plan.yaml")).endswith(
        "permission denied"
    )
    assert not (folder / "plan.yaml").exists()


def test_show_model_refuses_a_hand_map_naming_modules_the_model_lacks(capsys, tmp_path):
    head = (
        "training: {global_batch: 8, micro_batch: 2, seq_len: 16, dtype: fp32}\n"
        "cluster: {name: cpu, gpus_per_node: 2}\n"
    )
    stages = tmp_path / "stages.yaml"
    stages.write_text(
        head + "parallel: {pp: 2}\nstages:\n  - {index: 0, modules: [tok_embeddings, layers.0]}\n"
        "  - {index: 1, modules: [layers.9, norm, output]}\n"
    )
    line = one_line_error(capsys, "show", str(stages), "--model", "gpt-tiny")
    assert "stages[1]: 'layers.9' is not a module of GPT" in line
    styles = tmp_path / "styles.yaml"
    styles.write_text(head + "parallel: {tp: 2}\ntensor_parallel: {'layers.*.attn.qkvx': column}\n")
    line = one_line_error(capsys, "show", str(styles), "--model", "gpt-tiny")
    assert "tensor_parallel: 'layers.*.attn.qkvx' matches no module of GPT" in line


# ---- a trace failure says its cause (issue 16) ---------------------------------------------------


class _NeedsMask(torch.nn.Linear):
    """forward takes a mask its example_inputs leave out."""

    def forward(self, x, mask):
        return super().forward(x) * mask

    def example_inputs(self, batch_size, seq_len, device):
        return (torch.zeros(batch_size, seq_len, self.in_features, device=device),)


class _WrongHeads(torch.nn.Linear):
    """Splits its features into heads of a size that does not divide them."""

    def forward(self, x):
        return super().forward(x).view(x.shape[0], x.shape[1], 3, -1)  # 8 features are not 3 heads

    def example_inputs(self, batch_size, seq_len, device):
        return (torch.zeros(batch_size, seq_len, self.in_features, device=device),)


def make_needs_mask():
    return _NeedsMask(8, 8)


def make_wrong_heads():
    return _WrongHeads(8, 8)


TRACED = {"trace": ["trace"], "plan": ["plan", "--gpus", "1", "--cluster", "cpu"]}


@pytest.mark.parametrize("command", sorted(TRACED))
def test_a_model_missing_an_input_is_one_line_naming_it(capsys, command):
    line = one_line_error(
        capsys, *TRACED[command], "--model", "tests.test_cli:make_needs_mask", "--seq-len", "4"
    )
    assert line.startswith(
        "hyparallel: error: cannot trace _NeedsMask: torch.fx: TypeError: missing a required"
    )
    assert "_NeedsMask.forward needs mask, which the example inputs (giving x) leave out" in line
    assert "--example-inputs package.module:make_inputs" in line and "torch.where" not in line


def test_a_shape_error_is_one_line_naming_the_users_line(capsys):
    line = one_line_error(
        capsys, *TRACED["plan"], "--model", "tests.test_cli:make_wrong_heads", "--seq-len", "4"
    )
    number = next(
        i
        for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
        if "# 8 features are" in text
    )
    assert f"(in module '(root)', test_cli.py:{number}: return super().forward(x).view(" in line
    assert "shape mismatch" in line and "torch.where" not in line and "<string>" not in line
