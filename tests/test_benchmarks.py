"""benchmarks/run_all.py: RESULTS.md from canned results (figures, failures, missing scripts, GPU
results), and one real quick run of the planner benchmark."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load_run_all():
    """benchmarks/ is not a package: load run_all.py by path."""
    spec = importlib.util.spec_from_file_location(
        "benchmarks_run_all", REPO / "benchmarks" / "run_all.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


run_all = _load_run_all()
BENCHMARKS = {b.name: b for b in run_all.BENCHMARKS}
PLANNER = {
    "cases": [
        {
            "group": "target",
            "model": "gpt-175b",
            "layers": 96,
            "gpus": 1024,
            "global_batch": 1536,
            "trace_s": 0.6,
            "search_s": 0.8,
            "configs": 12000,
            "costed": 245,
            "plan": "tp 4 pp 8 dp 32",
            "mfu": 0.559,
            "target_s": 1.0,
        },
        {
            "group": "target",
            "model": "gpt-1t",
            "layers": 128,
            "gpus": 3072,
            "global_batch": 3072,
            "trace_s": 0.9,
            "search_s": 6.0,
            "configs": 15616,
            "costed": 23,
            "plan": "tp 8 pp 32 dp 12",
            "mfu": 0.586,
            "target_s": 5.0,
        },
        {
            "group": "growth with GPUs",
            "model": "gpt-175b",
            "layers": 96,
            "gpus": 64,
            "global_batch": 1536,
            "trace_s": 0.6,
            "search_s": 1.2,
            "configs": 20384,
            "costed": 70,
            "plan": "tp 4 pp 16 dp 1",
            "mfu": 0.599,
        },
    ]
}
DDP = {
    "peer": "torch DistributedDataParallel",
    "config": {"seq": 64, "json": "/tmp/x.json", "dp": 2},
    "cases": [
        {
            "case": "dp=2",
            "hyparallel_ms": 20.0,
            "torch_ms": 16.0,
            "ratio": 1.25,
            "target": 1.05,
            "check": "OK: max abs parameter diff 0.0e+00 after one step",
        }
    ],
}


def markdown(*outcomes) -> str:
    """RESULTS.md for canned outcomes, on a canned machine."""
    sections = [(o.name, *run_all.section(BENCHMARKS[o.name], o)) for o in outcomes]
    return run_all.results_markdown(sections, ["- CPU: canned"], quick=False, only=None, total_s=90)


def test_figures_are_rendered_with_peer_ratio_and_targets():
    text = markdown(
        run_all.Outcome(
            "planner_speed", "python benchmarks/planner_speed.py --json FILE", "ok", 12, PLANNER
        ),
        run_all.Outcome("dp_vs_ddp", "python -m torch.distributed.run ...", "ok", 30, DDP),
    )
    assert "- CPU: canned" in text and "in 1.5 min" in text
    assert (
        "gpt-175b on 1,024: 0.80 s / 1 s = 0.80 (met); gpt-1t on 3,072: 6.00 s / 5 s = 1.20"
        " (MISSED)" in text
    )
    assert "| growth with GPUs | gpt-175b | 96 | 64 | 1,536 | 0.60 | 1.20 |  |  |" in text
    assert "| dp=2 | 20.0 | 16.0 | **1.25** | <= 1.05 |" in text
    assert "dp=2 1.25 (target <= 1.05: MISSED) (hyparallel / peer)" in text
    assert "Peer: torch DistributedDataParallel, measured in the same run." in text
    assert "Config: seq 64, dp 2." in text  # the JSON path is not a figure
    assert "(12 s here)" in text and "hyparallel / peer < 1 means hyparallel is faster" in text


def test_the_whole_command_is_rendered_against_its_target():
    command = {
        "group": "command",
        "model": "gpt-175b",
        "gpus": 1024,
        "global_batch": 1536,
        "runs": 3,
        "command": "hyparallel plan --model gpt-175b --gpus 1024",
        "wall_s": 3.6,
        "cpu_s": 2.9,
        "wall_runs": [3.5, 3.6, 4.0],
        "cpu_runs": [2.8, 2.9, 3.0],
        "target_s": 3.0,
    }
    outcome = run_all.Outcome(
        "planner_speed",
        "python benchmarks/planner_speed.py --json FILE",
        "ok",
        12,
        {
            **PLANNER,
            "commands": [command, {**command, "model": "gpt-1t", "wall_s": 4.5, "target_s": 5.0}],
        },
    )
    summary, lines = run_all.render_planner(outcome)
    assert summary.endswith(
        "gpt-175b command (first) 3.60 s / 3 s (MISSED); gpt-1t command (first) 4.50 s / 5 s (met)"
    )
    text = "\n".join(lines)
    assert (
        "| `hyparallel plan --model gpt-175b --gpus 1024` | first run (--no-cache) | 3 | 3.60 |"
        " 2.90 | 3 | 1.20 (MISSED) |" in text
    )
    assert "| 3 | 4.50 | 2.90 | 5 | 0.90 (met) |" in text
    cached = run_all.render_planner(
        run_all.Outcome(
            "planner_speed",
            "python benchmarks/planner_speed.py --json FILE",
            "ok",
            12,
            {**PLANNER, "commands": [{**command, "cached": True, "wall_s": 2.5}]},
        )
    )
    assert cached[0].endswith("gpt-175b command (cached) 2.50 s / 3 s (met)")
    assert "| cached | 3 | 2.50 |" in "\n".join(cached[1])
    assert "commands" not in PLANNER and "whole command" not in "\n".join(
        run_all.render_planner(
            run_all.Outcome(
                "planner_speed", "python benchmarks/planner_speed.py", "ok", 12, PLANNER
            )
        )[1]
    )


def test_failed_benchmark_shows_its_failure_and_stderr():
    failure = (
        "exit 1 after 3 s; end of stderr:\nTraceback (most recent call last):\nRuntimeError: gloo"
        " boom"
    )
    text = markdown(
        run_all.Outcome(
            "tp_vs_dtensor", "python -m torch.distributed.run ...", "failed", 3, failure=failure
        )
    )
    assert "| `tp_vs_dtensor` | failed | exit 1 after 3 s |" in text
    assert "**FAILED**: exit 1 after 3 s; end of stderr:" in text
    assert "```text\nTraceback (most recent call last):\nRuntimeError: gloo boom\n```" in text


def test_missing_script_gets_a_line(monkeypatch, tmp_path):
    monkeypatch.setattr(run_all, "REPO", tmp_path)  # no benchmarks/ there
    outcome = run_all.run(BENCHMARKS["prediction"], quick=True, folder=tmp_path)
    assert outcome.status == "missing" and outcome.command.endswith(
        "benchmarks/prediction.py --quick --worlds 2 --json FILE"
    )
    assert "**NOT RUN**: benchmarks/prediction.py was not found." in markdown(outcome)


def test_run_reports_a_crash_and_kills_a_hung_benchmark(monkeypatch, tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "boom.py").write_text(
        "import sys\nprint('partial', file=sys.stderr)\nraise SystemExit(3)\n"
    )
    (tmp_path / "benchmarks" / "hang.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.setattr(run_all, "REPO", tmp_path)
    crashed = run_all.run(
        run_all.Benchmark("boom", "Boom", "", run_all.render_peer), quick=False, folder=tmp_path
    )
    assert (
        crashed.status == "failed"
        and crashed.failure.startswith("exit 3 after")
        and "partial" in crashed.failure
    )
    hung = run_all.run(
        run_all.Benchmark("hang", "Hang", "", run_all.render_peer, timeout_s=1),
        quick=False,
        folder=tmp_path,
    )
    # killed, not waited for
    assert hung.status == "failed" and hung.failure.startswith("timed out after 1 s")


def test_unexpected_json_is_a_failure_not_a_crash():
    text = markdown(
        run_all.Outcome(
            "pp_vs_torch", "python -m torch.distributed.run ...", "ok", 9, {"cases": [{}]}
        )
    )
    assert "| `pp_vs_torch` | failed | its JSON could not be rendered (KeyError: 'case') |" in text


def test_prediction_markdown_is_embedded_as_printed():
    stdout = (
        "## Step time: predicted vs measured\n\n| N | plan |\n|---|---|\n| 2 | dp 2 |\n\n"
        "Spearman rank correlation, predicted vs measured, all 5 runs: 0.90\n"
    )
    text = markdown(
        run_all.Outcome(
            "prediction",
            "python benchmarks/prediction.py --json FILE",
            "ok",
            600,
            {"steps": [], "step_report": [], "memory_report": []},
            stdout,
        )
    )
    assert "### Step time: predicted vs measured\n\n| N | plan |\n|---|---|\n| 2 | dp 2 |" in text
    assert (
        "| `prediction` | ok | Spearman rank correlation, predicted vs measured, all 5 runs: 0.90 |"
        in text
    )


def test_committed_gpu_results_are_folded_in(monkeypatch, tmp_path):
    monkeypatch.setattr(run_all, "GPU_RESULTS", tmp_path)
    assert run_all.gpu_section(run_here=False)[0] == "missing"
    (tmp_path / "device.txt").write_text(
        "NVIDIA H200, 143771 MiB, 570.1\ntorch 2.13.0 triton 3.5.0\n"
    )
    row = {
        "config": "micro-batch 2 x 8, recompute none",
        "measured_step_s": 1.1,
        "predicted_step_s": 1.0,
        "measured_mfu": 0.40,
        "predicted_mfu": 0.44,
        "peak_allocated_gib": 30.0,
        "predicted_peak_gib": 33.0,
        "predicted_peak_without_reserved_gib": 31.0,
    }
    (tmp_path / "step.json").write_text(json.dumps({"planner's pick": row}))
    kernels = (
        "  rmsnorm (4096, 2048)\ntimes in ms (median)\nrmsnorm 0.1 0.2 2.0\nall checks passed\n"
    )
    (tmp_path / "kernels.txt").write_text(kernels)
    (tmp_path / "profile.txt").write_text(
        "CUDA torch\nprofile: 1885 kernel launches in the step\n| kernel table |\n"
        "\n== planner's pick: micro-batch 16 x 1 (loss 10.8)\nstep  measured 566.4 ms\n"
    )
    (tmp_path / "activations.txt").write_text(
        "[transformers] a warning\n## Activations: bytes\n\n| model |\n|---|\n"
    )
    status, summary, lines = run_all.gpu_section(run_here=False)
    text = "\n".join(lines)
    assert status == "not re-run" and summary.endswith(
        ": planner's pick measured / predicted 1.10 (h200 preset)"
    )
    assert "Measured on a lent GPU (NVIDIA H200) on " in text and "not re-run" in text
    assert (
        "| planner's pick | micro-batch 2 x 8, recompute none | 1100.0 | 1000.0 | **1.10** |"
        in text
    )
    assert "```text\ntimes in ms (median)\nrmsnorm 0.1 0.2 2.0\nall checks passed\n```" in text
    assert (
        "- planner's pick: micro-batch 16 x 1 (loss 10.8): 1885 kernel launches in the step" in text
    )
    assert "### Activations: bytes\n\n| model |" in text and "[transformers]" not in text


def test_quick_planner_run_writes_results(tmp_path):
    out = tmp_path / "RESULTS.md"
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/run_all.py",
            "--quick",
            "--only",
            "planner_speed",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,  # the quick search cases and one run of each whole `hyparallel plan` command
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "- CPU: " in text and "- Python " in text and "hyparallel at git commit " in text
    assert (
        "## Planner search time (`planner_speed`)" in text
        and "| target | gpt-175b | 96 | 1,024 | 1,536 |" in text
    )
    assert (
        "| `hyparallel plan --model gpt-175b --cluster a100-80g --gpus 1024 --global-batch 1536"
        in text
    )
    assert "Run with `--only planner_speed`: the other benchmarks were not run." in text
    assert run_all.sealed(text)


def test_the_committed_page_is_written_whole_by_run_all():
    """benchmarks/RESULTS.md is one full `make bench` run: no section added, edited or left out."""
    page = (REPO / "benchmarks" / "RESULTS.md").read_text()
    assert run_all.sealed(page), (
        "benchmarks/RESULTS.md differs from what run_all wrote: run make bench"
    )
    head = page.split("## Summary")[0]
    assert "Run with `--only" not in head and "--quick" not in head
    assert not run_all.sealed(page.replace("## Summary", "## Summary\n\nAdded by hand.", 1))
    assert run_all.sealed(markdown())


def test_the_recovery_section_shows_both_saves_and_every_restart():
    figures = {
        "saves": {
            "model": "gpt-125m",
            "bytes_per_rank": 800 * 2**20,
            "times": {"disk": [4.0], "memory": [1.0]},
            "disk_s": 4.0,
            "memory_s": 1.0,
            "ratio": 0.25,
        },
        "recovery": [
            {
                "launcher": "torchrun",
                "storage": "disk",
                "every": 4,
                "kill_to_first_step_s": 8.5,
                "resumed_after": 8,
                "loaded_from": "disk",
                "steps_lost": 3,
            },
            {
                "launcher": "dlrover-run",
                "storage": "memory",
                "every": 1,
                "kill_to_first_step_s": 7.0,
                "resumed_after": 11,
                "loaded_from": "memory",
                "steps_lost": 0,
            },
        ],
    }
    outcome = run_all.Outcome(
        "elastic_recovery", "python benchmarks/elastic_recovery.py --json FILE", "ok", 1, figures
    )
    summary, lines = run_all.render_recovery(outcome)
    assert summary == "memory / disk save 0.25; torchrun disk 8.5 s, dlrover-run memory 7.0 s"
    text = "\n".join(lines)
    assert "| memory | 1.000 | **0.25** |" in text and "800 MiB" in text
    assert "| dlrover-run | memory, every 1 | 7.0 | memory | 0 |" in text


def _load_published():
    # published.py imports megatron_gpt.py from beside it
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "benchmarks_published", REPO / "benchmarks" / "published.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


CONFIG_FIELDS = (
    "source",
    "url",
    "config_source",
    "layers",
    "hidden",
    "heads",
    "vocab",
    "model_vocab",
    "seq_len",
    "ffn",
    "tp",
    "pp",
    "dp",
    "gpus",
    "micro_batch",
    "global_batch",
    "schedule",
    "virtual_stages",
    "recompute",
    "sequence_parallel",
    "precision",
    "grad_compression",
    "gpu",
    "preset",
    "measured_s",
    "predicted_s",
    "error",
)


def test_quick_published_run_records_every_configuration_and_its_error(tmp_path):
    out = tmp_path / "published.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/published.py", "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    published = _load_published()
    assert [r["id"] for r in figures["rows"]] == list(published.QUICK)
    for r in figures["rows"]:
        assert all(r[name] is not None for name in CONFIG_FIELDS), r
        assert r["tp"] * r["pp"] * r["dp"] == r["gpus"] and r["ffn"] == 4 * r["hidden"]
        assert r["error"] == r["predicted_s"] / r["measured_s"] - 1 and r["predicted_s"] > 0
        if r["published_s"] is None:  # converted from TFLOP/s per GPU with Narayanan et al.'s eq. 3
            b, s, layers, h, v = (
                r["global_batch"],
                r["seq_len"],
                r["layers"],
                r["hidden"],
                r["vocab"],
            )
            flops = 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
            assert (
                abs(r["measured_s"] * r["measured_tflops_per_gpu"] * 1e12 * r["gpus"] / flops - 1)
                < 1e-9
            )
        else:
            assert r["measured_s"] == r["published_s"]
    narayanan = figures["rows"][0]  # 1.7B: 1.52e16 FLOPs per iteration at 137 TFLOP/s on 32 GPUs
    assert (
        narayanan["measured_tflops_per_gpu"] == 137 and abs(narayanan["measured_s"] - 3.528) < 0.01
    )
    errors = sorted(abs(r["error"]) for r in figures["rows"])
    assert (
        figures["summary"]["median_abs_error"] == errors[1]
        and figures["summary"]["max_abs_error"] == errors[-1]
    )
    assert figures["left_out"] and all(
        item["source"] and item["reason"] for item in figures["left_out"]
    )
    assert (
        "median |error|" in proc.stdout
        and "Left out:" in proc.stdout
        and "Targets (issue 19):" in proc.stdout
    )
    assert [c["id"] for c in figures["cross_checks"]] == ["korthikanti-22b-sp-selective"]
    assert "\n".join(figures["markdown"]) in proc.stdout  # what run_all embeds is what it printed
    assert (
        "| narayanan-1.7b | Narayanan et al. 2021 (arXiv 2104.04473), Table 1 | GPT 1.7B |"
        in proc.stdout
    )


def test_the_transcribed_korthikanti_times_agree_with_the_readme_mfu():
    checks = _load_published().cross_checks(_load_published().ROWS)
    # 22B, 175B, 530B, 1T with sequence parallelism and selective recomputation
    assert len(checks) == 4
    assert all(abs(c["difference"]) < 0.005 for c in checks), checks


def test_a_configuration_the_planner_says_does_not_fit_is_still_timed_and_flagged():
    published = _load_published()
    base = published.ROWS[0]
    import dataclasses

    row = dataclasses.replace(
        base,
        id="too-big",
        layers=2,
        hidden=16384,
        heads=128,
        tp=1,
        pp=1,
        dp=1,
        global_batch=1,
        micro_batch=1,
    )
    records, refused = published.evaluate([row])
    assert not refused and records[0]["planner_oom"]
    assert records[0]["memory_gib"] > records[0]["usable_gib"] and 0 < records[0][
        "predicted_s"
    ] < float("inf")


def test_the_published_section_embeds_the_printed_markdown_under_its_summary():
    stats = {
        "rows": 2,
        "median_abs_error": 0.179,
        "max_abs_error": 0.257,
        "mean_signed_error": -0.0785,
        "over": 1,
        "under": 1,
        "targets": {
            "median_abs_error <= 5%": False,
            "max_abs_error <= 15%": False,
            "errors of both signs": True,
        },
    }
    lines = [
        "| id | source |",
        "| --- | --- |",
        "| narayanan-1.7b | Narayanan et al. 2021 |",
        "",
        "Left out:",
    ]
    figures = {"rows": [], "left_out": [], "summary": stats, "cross_checks": [], "markdown": lines}
    outcome = run_all.Outcome(
        "published", "python benchmarks/published.py --json FILE", "ok", 20, figures
    )
    summary, body = run_all.render_published(outcome)
    assert (
        summary
        == "2 rows: median abs error 17.9%, max 25.7%, 1 over / 1 under (targets <= 5% and <= 15%,"
        " both signs: MISSED)"
    )
    assert "|" not in summary  # it sits in RESULTS.md's summary table
    assert body[2:] == lines and body[0].startswith("Peer: the published measurement")
    text = markdown(outcome)
    assert "## The cost model against published large-scale measurements (`published`)" in text
    # its row of the summary table
    assert "| `published` | ok | 2 rows: median abs error 17.9%, max 25.7%" in text
    assert "| narayanan-1.7b | Narayanan et al. 2021 |" in text


def _megatron_gpt():
    _load_published()  # puts benchmarks/ on sys.path
    return importlib.import_module("megatron_gpt")


def _tiny_megatron_and_zoo(device: str, dropout: float = 0.1):
    import torch

    from hyparallel.models.gpt import GPT, GPTConfig

    megatron_gpt = _megatron_gpt()
    config = GPTConfig(
        num_layers=2, hidden_size=64, num_heads=8, vocab_size=256, max_seq_len=32, dropout=dropout
    )
    with torch.device(device):
        return megatron_gpt.MegatronGPT(config), GPT(config)


def test_megatrons_gpt_computes_the_zoo_gpt_with_its_qkv_laid_out_per_head():
    import torch

    torch.manual_seed(0)
    megatron, zoo = _tiny_megatron_and_zoo("cpu", dropout=0.0)
    state = zoo.state_dict()
    heads, head_dim = 8, 8
    for name, value in list(state.items()):  # [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
        if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
            state[name] = value.unflatten(0, (3, heads, head_dim)).transpose(0, 1).flatten(0, 2)
    megatron.load_state_dict(state)
    tokens = torch.randint(0, 256, (2, 32))
    # float32 sums reordered
    torch.testing.assert_close(megatron(tokens), zoo(tokens), rtol=1e-5, atol=1e-5)


def test_megatrons_gpt_splits_as_the_zoo_gpt_and_selective_recomputes_its_scores():
    import hyparallel as hp
    from hyparallel.planner.profile import ModelProfile

    megatron, zoo = _tiny_megatron_and_zoo("meta")
    graphs = [hp.trace(m, m.example_inputs(1, 32)) for m in (megatron, zoo)]
    analyses = [g.structure for g in graphs]
    assert (
        analyses[0].styles == analyses[1].styles
        and analyses[0].head_groups == analyses[1].head_groups
    )
    assert (
        sorted(analyses[0].attention_heads.values())
        == sorted(analyses[1].attention_heads.values())
        == [8, 8]
    )
    assert all(
        a.check(8, g) is None and a.whole_sequence(g) is None for a, g in zip(analyses, graphs)
    )
    assert (
        analyses[0].styles["layers.0.attn.qkv"] == "column"
        and analyses[0].styles["layers.0.attn.proj"] == "row"
    )
    cluster = hp.ClusterSpec.preset("a100-80g", num_nodes=1)
    quadratic = ModelProfile(graphs[0], cluster, "fp16", 32).quadratic
    assert sorted(graphs[0].op(n).target for n in quadratic) == [
        "Dropout",
        "Dropout",
        "baddbmm",
        "baddbmm",
        "softmax",
        "softmax",
    ]
    assert not ModelProfile(graphs[1], cluster, "fp16", 32).quadratic  # fused: no scores held

    def costed(recompute):
        best = hp.search(
            graphs[0],
            cluster,
            8,
            32,
            "fp16",
            tp=8,
            pp=1,
            dp=1,
            micro_batch=8,
            recompute=recompute,
            zero=0,
            sequence_parallel=True,
        ).best[0]
        return best.step_time_s, best.peak_memory_bytes

    (none_s, none_bytes), (selective_s, selective_bytes) = costed("none"), costed("selective")
    assert selective_s > none_s and selective_bytes < none_bytes


def test_megatrons_vocabulary_padding_per_tensor_parallel_degree():
    megatron_gpt = _megatron_gpt()
    assert [megatron_gpt.padded_vocab(tp) for tp in (1, 2, 4, 8)] == [50304, 50432, 50688, 51200]


def _prediction_module():
    spec = importlib.util.spec_from_file_location(
        "benchmarks_prediction", REPO / "benchmarks" / "prediction.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prediction_runs_a_world_sizes_plans_in_turns_and_pools_their_steps(monkeypatch, tmp_path):
    # Note [rounds of runs]: A B A B, not A A B B; a plan's figure is the median of its steps over
    # both rounds, each rank's peak the largest of its runs.
    import argparse

    import hyparallel as hp

    prediction = _prediction_module()
    order, steps = [], iter([[0.10, 0.12], [0.30, 0.31], [0.14, 0.16], [0.33, 0.35]])

    def measure(n, plan, args, folder):
        order.append(prediction.describe(plan))
        peak = 100 + len(order)  # grows run by run: the merged peak is the last run's
        return next(steps), [
            {"rank": 0, "coords": plan.coords(0), "peak_bytes": peak, "predicted_bytes": 1e9}
        ]

    monkeypatch.setattr(prediction, "measure", measure)
    calibrations = []

    def calibrated(n, folder, quick):
        calibrations.append(len(order))  # how many runs had run when it calibrated
        return hp.ClusterSpec.preset("cpu")

    monkeypatch.setattr(prediction, "calibrated", calibrated)
    monkeypatch.setattr(
        prediction, "predict", lambda plan, cluster, args: 2 * plan.predicted.step_time_s
    )
    monkeypatch.setitem(prediction.GRID, 2, [{"tp": 2}])
    args = argparse.Namespace(
        worlds=[2], model="gpt-tiny", global_batch=8, seq_len=32, quick=True, rounds=2
    )
    rows = prediction.step_times(args, tmp_path)
    assert len(rows) == 2 and len(order) == 4
    assert order[0] == order[2] and order[1] == order[3] and order[0] != order[1]  # taking turns
    first, second = rows
    assert first["measured_s"] == pytest.approx(0.13) and first["round_medians_s"] == pytest.approx(
        [0.11, 0.15]
    )
    assert second["measured_s"] == pytest.approx(0.32) and second[
        "round_medians_s"
    ] == pytest.approx([0.305, 0.34])
    assert [p["peak_bytes"] for p in first["peaks"]] == [103] and [
        p["peak_bytes"] for p in second["peaks"]
    ] == [104]
    # calibrated again before the second round; the prediction the mean of both rounds' (here: the
    # first's, doubled)
    assert calibrations == [0, 2]
    for row in rows:
        once = row["round_predicted_s"][0]
        assert row["round_predicted_s"] == pytest.approx([once, 2 * once]) and row[
            "predicted_s"
        ] == pytest.approx(1.5 * once)


def test_the_sweeps_build_check_trains_a_small_copy_and_names_what_fails():
    # benchmarks/sweep.py's first step for every architecture: it imported a parity helper renamed
    # away, and `make sweep` died at its first row with nothing in the suite to notice
    spec = importlib.util.spec_from_file_location(
        "benchmarks_sweep", REPO / "benchmarks" / "sweep.py"
    )
    sweep = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sweep
    spec.loader.exec_module(sweep)
    assert sweep.builds("tests.tiny_lms:where_moe_lm", None) is None
    why = sweep.builds("tests.tiny_lms:where_moe_lm vocab_size=zero", None)
    assert why and "\n" not in why


def test_the_expert_parallel_benchmarks_render_their_ratio_and_error():
    # issue 38: ep against expert tensor parallelism (a ratio from one run), and the published MoE
    # row's signed error
    experts = run_all.Outcome(
        "ep_vs_etp",
        "python -m torch.distributed.run ... benchmarks/ep_vs_etp.py",
        "ok",
        40,
        {
            "median_step_s": {"ep": 0.2, "etp": 0.25},
            "ep_over_etp": 0.8,
            "loss": {"ep": 5.6, "etp": 5.6},
            "single_device_loss": 5.6,
            "args": {"hidden": 256},
        },
    )
    summary, lines = run_all.render_experts(experts)
    assert summary.startswith("ep / etp 0.80") and "| ep | 200.0 | 5.600000 |" in "\n".join(lines)
    row = {
        "id": "qwen3-235b-ep8",
        "source": "Megatron-MoE-ModelZoo",
        "config": "tp 2 pp 1 dp 128 (ep 8)",
        "measured_s": 17.6,
        "predicted_s": 22.0,
        "error": 0.25,
        "comm_s": {"tp": 0.5, "ep": 3.0},
    }
    piped = {**row, "id": "qwen3-235b-pp8-ep8", "measured_s": 29.0, "predicted_s": 24.8}
    piped["error"] = 24.8 / 29.0 - 1
    published = run_all.Outcome(
        "published_moe", "python benchmarks/published_moe.py", "ok", 60, {"rows": [row, piped]}
    )
    summary, lines = run_all.render_published_moe(published)
    assert summary == (
        "qwen3-235b-ep8: measured 17.6 s, predicted 22.0 s, error +25%;"
        " qwen3-235b-pp8-ep8: measured 29.0 s, predicted 24.8 s, error -14%"
    )
    assert "| 17.60 | 22.00 | +25.0% | tp 0.50, ep 3.00 |" in "\n".join(lines)
    assert "| 29.00 | 24.80 | -14.5% |" in "\n".join(lines)
    # a result written before the pipelined row: one record
    old = run_all.Outcome("published_moe", "python benchmarks/published_moe.py", "ok", 60, row)
    assert run_all.render_published_moe(old)[0].startswith("qwen3-235b-ep8: measured 17.6 s")
    # torchtitan's context-parallel table: each length's ring prediction in the summary (a row
    # without cp has only its gather one), both in the table beside the planner's pick
    pick = {"parallel": "dp 1 x cp 8 (ring) x tp 1 x pp 1", "tps_per_gpu": 1500.0, "memory_gib": 60}
    cp_rows = [
        {
            "id": "llama3-8b-fsdp8-cp1-32768",
            "seq_len": 32768,
            "measured_tps_per_gpu": 3890,
            "measured_gib": 83.9,
            "predicted": {
                "gather": {"tps_per_gpu": 4279.0, "error": 0.1, "memory_gib": 90.0, "comm_s": {}}
            },
            "pick": pick,
        },
        {
            "id": "llama3-8b-fsdp2-cp4-131072",
            "seq_len": 131072,
            "measured_tps_per_gpu": 1071,
            "measured_gib": 84.0,
            "predicted": {
                kind: {"tps_per_gpu": 1600.0, "error": e, "memory_gib": 90.0, "comm_s": {"cp": c}}
                for kind, e, c in (("gather", 0.45, 0.4), ("ring", 0.5, 0.1))
            },
            "pick": pick,
        },
    ]
    cp = run_all.Outcome(
        "published_cp", "python benchmarks/published_cp.py", "ok", 9, {"rows": cp_rows}
    )
    summary, lines = run_all.render_published_cp(cp)
    assert summary == "TPS/GPU predicted / measured - 1 by length: 32k: +10%; 128k: +50%"
    text = "\n".join(lines)
    assert (
        "| llama3-8b-fsdp2-cp4-131072 | 1,071 | 84.0 | 1,600 (gather) | +45.0% | 90.0 | 0.40 |"
        in (text)
    )
    assert "1,600 (ring) | +50.0% | 90.0 | 0.10 | dp 1 x cp 8 (ring)" in text
    sides = {
        "one process": {"step_s": 2.5, "peak_gib_per_rank": [0.16], "time_ratio": 1.0},
        "cp 2 (gather)": {"step_s": 3.4, "peak_gib_per_rank": [0.1, 0.11], "time_ratio": 1.36},
        "cp 2 (ring)": {"step_s": 3.3, "peak_gib_per_rank": [0.1, 0.1], "time_ratio": 1.32},
    }
    for side, ratio in zip(sides.values(), (1.0, 0.69, 0.63)):
        side |= {"peak_ratio": ratio, "loss": 5.569044}
    summary, lines = run_all.render_cp_vs_one(
        run_all.Outcome(
            "cp_vs_one", "torchrun benchmarks/cp_vs_one.py", "ok", 40, {"sides": sides, "args": {}}
        )
    )
    # the side with the smallest peak per rank in the summary
    assert summary == "cp 2 (ring): peak per rank x0.63, step x1.32 of one process's (losses equal)"
    assert "| cp 2 (gather) | 3400.0 | 1.36 | 102.4, 112.6 | 0.69 | 5.569044 |" in "\n".join(lines)
