"""hp.check / `hyparallel check` (Note [a parity check], hyparallel/tools/parity.py) and a slice of
the architecture sweep.

The check trains a small copy under a layout in local gloo processes and in one, and compares every
gradient and loss by parameter name: it must say equal for a correct split, differs when one rank
computes something else (a model wrong on purpose), and refused, in one line, for a layout
hyparallel does not run. The sweep slice runs one architecture of each class issue 16 found wrong or
crashing, under the layouts that class broke: each must be equal (`make sweep` runs all of
benchmarks/sweep.py's layouts for every architecture; docs/supported-models.md).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import hyparallel as hp
from hyparallel.models.tiny import tiny_overrides
from hyparallel.tools.parity import check_layouts, small_spec

from .conftest import REPO


def names_of(spec: str) -> set[str]:
    """The model's parameter names (a tied tensor by its first name, as the check groups it)."""
    return {n for n, _ in hp.models.load(small_spec(spec)).module.named_parameters()}


def test_a_correct_split_is_equal_group_by_group():
    report = hp.check("hf:LlamaForCausalLM", tp=2, pp=1)
    assert report.verdict == "equal", report.table()
    assert len(report.losses) == len(report.ref_losses) == 3
    assert {g.verdict for g in report.groups} == {"equal"}
    # layer indices folded
    assert "model.layers.*.self_attn.q_proj.weight" in {g.group for g in report.groups}
    # by name, each
    assert {name for g in report.groups for name in g.names} == names_of("hf:LlamaForCausalLM")
    assert all(g.compared == len(g.names) for g in report.groups)


def test_a_rank_that_computes_something_else_differs():
    report = hp.check("tests.tiny_lms:rank_skewed_lm", tp=1, pp=1, dp=2)
    assert report.verdict == "differs", report.table()
    differing = [g for g in report.groups if g.verdict == "differs"]
    assert differing and "head.weight" in {g.group for g in differing}, report.table()


def test_a_layout_hyparallel_does_not_run_is_refused_in_one_line():
    report = hp.check("benchmarks.sweep_models:cnn", tp=2, pp=1)
    assert report.verdict == "refused"
    assert "splits nothing" in report.reason and "\n" not in report.reason


def test_the_cli_exits_2_with_one_line_for_a_refusal():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hyparallel",
            "check",
            "benchmarks.sweep_models:cnn",
            "--tp",
            "2",
            "--pp",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hyparallel")]
    assert len(lines) == 1 and "refused" in lines[0] and "Traceback" not in proc.stderr


def test_an_output_without_logits_needs_the_users_loss_and_trains_with_it():
    # Note [the loss a check trains]: diffusers' UNet2DOutput has no logits; the check crashed in
    # token cross-entropy and called it a bug. Without a loss it is refused in one line before any
    # launch; with the user's loss (MSE of the sample against float targets shaped like it) tp 2 x
    # pp 2 trains as one process.
    refused = hp.check("tests.tiny_lms:sample_lm", tp=2, pp=1)
    assert refused.verdict == "refused" and "\n" not in refused.reason
    assert (
        "SampleOutput without logits" in refused.reason
        and "--loss package.module:fn" in refused.reason
    )
    report = hp.check("tests.tiny_lms:sample_lm", tp=2, pp=2, loss="tests.tiny_lms:sample_mse")
    assert report.verdict == "equal", report.summary()


def test_torchtitans_layout_splits_and_trains_as_one_device():
    # Note [a layer that computes a standard one] (hyparallel/graph/kinds.py): its own Linear and
    # Embedding classes (F.linear / F.embedding on their own weights) and layers in a ModuleDict:
    # "tp 2 splits nothing" before
    report = hp.check("tests.tiny_lms:dict_layers_lm", tp=2, pp=2)
    assert report.verdict == "equal", report.summary()


def test_the_cli_takes_the_users_loss(capsys):
    from hyparallel.cli import main

    argv = [
        "check",
        "tests.tiny_lms:sample_lm",
        "--tp",
        "2",
        "--pp",
        "1",
        "--dp",
        "1",
        "--steps",
        "1",
    ]
    assert main([*argv, "--loss", "tests.tiny_lms:sample_mse"]) == 0, capsys.readouterr().err
    assert main([*argv, "--loss", "tests.tiny_lms:no_such_loss"]) == 2
    assert "has no callable 'no_such_loss'" in capsys.readouterr().err


def test_tiny_configs_keep_the_structure():
    import transformers

    def tiny(config_cls):
        return config_cls(**tiny_overrides(config_cls))

    llama = tiny(transformers.LlamaConfig)
    assert (llama.num_hidden_layers, llama.hidden_size, llama.num_attention_heads) == (2, 64, 4)
    # Llama's default has as many key/value heads as query heads
    assert llama.num_key_value_heads == 4
    # grouped-query (8 of 32) stays grouped
    assert tiny(transformers.MistralConfig).num_key_value_heads == 2
    assert tiny(transformers.FalconConfig).multi_query  # multi-query kept
    assert tiny(transformers.GPTBigCodeConfig).multi_query
    mixtral = tiny(transformers.MixtralConfig)
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (4, 2)
    # DeepSeek-V3's 3 dense layers first left the 2 kept without an MoE; its 8 groups of experts
    # did not divide 4 experts
    deepseek = tiny(transformers.DeepseekV3Config)
    assert (deepseek.first_k_dense_replace, deepseek.n_group, deepseek.topk_group) == (0, 2, 1)
    gpt2 = tiny(transformers.GPT2Config)
    # no dropout: two runs draw alike
    assert gpt2.resid_pdrop == gpt2.attn_pdrop == gpt2.embd_pdrop == 0.0
    # GPT-2 ties, and still does
    assert gpt2.bos_token_id < gpt2.vocab_size and gpt2.tie_word_embeddings
    # no use_cache
    assert hp.models.load("hf:OpenAIGPTLMHeadModel n_layer=2 n_embd=32 n_head=2").module is not None
    # Sub-configs are shrunk too, and reach the builder through the spec (JSON values, quoted for
    # its split).
    gemma3 = hp.models.load(small_spec("hf:Gemma3ForConditionalGeneration")).module
    assert (
        gemma3.config.text_config.hidden_size == 64
        and gemma3.config.vision_config.hidden_size == 64
    )
    assert sum(p.numel() for p in gemma3.parameters()) < 2_000_000  # the default is 4B
    # side vocabularies shrink (500k entities took 3 GB), small ones stay
    luke = tiny(transformers.LukeConfig)
    assert (luke.entity_vocab_size, luke.type_vocab_size) == (128, 2)


# One architecture per class of issue 16, under the layouts its class broke (`make sweep` runs every
# layout of every architecture: benchmarks/sweep.py, docs/supported-models.md). TP_PP covers a split
# and a pipeline in one launch. The suite runs SLICE; the classes in SWEEP_SLICE (each 6-12 s here)
# run with `make sweep` before the sweep itself (`pytest -m sweep`), their constructs also met by a
# case the suite keeps: multi-query attention by Falcon, parameters without a gradient by the test
# below, a scaled embedding subclass by tests/test_tp_classes.py's scaled-embedding, buffers
# computed in __init__ by every rotary model here, an attention whose head size the split cannot
# keep (replicated, its MLP split) by the test below of a head count in an unknown attribute.
TP, TP_PP, DP = {"tp": 2, "pp": 1}, {"tp": 2, "pp": 2}, {"dp": 2, "tp": 1, "pp": 1}
SLICE = {  # spec -> (what it is, the layouts run here)
    "hf:MixtralForCausalLM": (
        "MoE experts as 3-d parameters, a device branch (histc) in the pipeline",
        [TP_PP],
    ),
    "hf:FalconForCausalLM": (
        "multi-query attention, tensor constants made in forward, its own Linear",
        [TP_PP],
    ),
    "hf:DeepseekV3ForCausalLM": (
        "latent attention: a learned key part enters the split heads without a column",
        [TP],
    ),
}
SWEEP_SLICE = {
    "hf:GemmaForCausalLM": ("a scaled embedding subclass, buffers computed in __init__", [TP_PP]),
    "hf:Phi3ForCausalLM": (
        "a fused qkv sliced with config constants: attention replicated, MLP split",
        [TP],
    ),
    "hf:GPTBigCodeForCausalLM": ("multi-query attention behind a view", [TP]),
    "hf:BartForCausalLM": (
        "parameters the forward never reads (cross-attention without an encoder)",
        [DP],
    ),
    "hf:BigBirdForCausalLM": (
        "a pooler computed and dropped (DDP ignores it), attention sized by config",
        [DP, TP],
    ),
    "hf:CTRLLMHeadModel": ("an attention called as attn(x, x, x)", [TP]),
}


@pytest.mark.parametrize(
    "spec", [*SLICE, *(pytest.param(spec, marks=pytest.mark.sweep) for spec in SWEEP_SLICE)]
)
def test_the_sweep_slice_is_equal_under_the_layouts_its_class_broke(spec):
    what, layouts = {**SLICE, **SWEEP_SLICE}[spec]
    reports = check_layouts(spec, layouts, timeout=300)
    bad = [r.summary() for r in reports if r.verdict != "equal"]
    assert not bad, f"{spec} ({what}): {bad}"


def test_a_hand_written_where_dispatch_moe_trains_as_one_device():
    # Issue 38: torch.where(chosen == e) and index_select / index_add per expert, refused at trace
    # before (no meta kernel for nonzero). Its experts split by tp (column, row), in a pipeline.
    reports = check_layouts("tests.tiny_lms:where_moe_lm", [TP_PP], timeout=300)
    assert [r.verdict for r in reports] == ["equal"], [r.summary() for r in reports]
    assert names_of("tests.tiny_lms:where_moe_lm") == {
        name for g in reports[0].groups for name in g.names
    }


def test_blocks_that_are_module_lists_train_under_every_layout():
    # Funnel's layers sit in a ModuleList per group; with one layer per group the groups are the
    # blocks. A ModuleList has no forward: FSDP refused to wrap one (ValueError at the first step),
    # and sequence parallelism's scatter and gather hooks on it never fired (tp 2: 8.9e-4 off in
    # losses, no error). Both go on the modules that run the block
    # (hyparallel.graph.local_shapes.block_modules).
    layouts = [{"dp": 2, "tp": 1, "pp": 1, "zero": 3}]  # ZeRO 1 wraps the same units
    layouts += [
        {"tp": 2, "pp": 1, "sequence_parallel": True},
        {"tp": 2, "pp": 2},
        {"dp": 2, "recompute": "full"},
    ]
    reports = check_layouts("tests.tiny_lms:nested_lm per_group=1", layouts, timeout=300)
    assert [r.verdict for r in reports] == ["equal"] * len(layouts), [r.summary() for r in reports]


def test_a_no_grad_region_in_forward_trains_as_on_one_device():
    # HRM runs earlier recurrence cycles under torch.no_grad(). torch.fx traced through the region
    # without recording it, and a failed first export left the grad mode off for the next, which
    # then did not see it either: the pipeline's stages built gradients the single device does not
    # (pp 2: 1.1e-4 off in losses). The region's body (a higher-order op's subgraph) also needs its
    # baked-in devices moved as the graph's.
    report = hp.check("tests.tiny_lms:no_grad_lm", tp=2, pp=2)  # stages of split layers
    assert report.verdict == "equal", report.summary()


def test_an_attention_holding_its_head_count_in_an_unknown_attribute_trains_as_one_device():
    # diffusers' Attention keeps its head count in `heads` and reads its head size off the split
    # projection: split by heads, each rank ran 4 heads of half the size (q_proj's gradient 81% off,
    # no error). The dry run at one rank's sizes now sees the heads regrouped and the planner
    # replicates that attention (Note [a split keeps each head whole]); the MLP stays split.
    report = hp.check("tests.tiny_lms:heads_attribute_lm", tp=2, pp=1)
    assert report.verdict == "equal", report.summary()


def test_a_model_that_samples_in_training_is_compared_in_eval_mode():
    # Phi-MoE samples its routing in training: every run differs, on one process too, and the sweep
    # called that "differs" under every layout, dp 2 included. Its draws are found and the check
    # runs in eval mode, saying so.
    report = hp.check("tests.tiny_lms:sampling_lm", tp=2, pp=2)
    assert report.verdict == "equal" and report.mode == "eval", report.summary()
    assert "uniform_" in report.mode_reason and "compared in eval mode" in report.table()
    # no draws: as it trains
    assert hp.check("tests.tiny_lms:qk_norm_lm", tp=2, pp=1).mode == "train"
    # Swin's drop path (drop_path_rate 0.1) draws too: the draws were looked for with meta images
    # run by a CPU model, which failed and read as "no draws", so Swin, BEiT, Data2VecVision and
    # FocalNet "differed" under dp 2
    swin = (
        "hf:SwinForImageClassification image_size=32 embed_dim=32 depths=[2,2] num_heads=[2,4]"
        " window_size=4"
    )
    report = hp.check(swin, tp=1, pp=1, dp=2)
    assert report.verdict == "equal" and report.mode == "eval" and "rand" in report.mode_reason, (
        report.summary()
    )


def test_a_check_past_its_timeout_is_ended_and_the_next_check_runs():
    # The ranks of every check come from one launcher (Note [one launcher for every check]): a
    # launch that hangs is killed at its timeout, reported, and the launcher serves the next check.
    # 3 s: the launch is ended wherever it is by then (in its startup on a loaded machine, or in the
    # hang), which is what this checks
    report = hp.check("tests.tiny_lms:hanging_lm", tp=1, pp=1, dp=2, timeout=3)
    assert report.verdict == "failed" and "ran past 3 s" in report.reason, report.summary()
    assert hp.check("tests.tiny_lms:qk_norm_lm", tp=1, pp=1, dp=2).verdict == "equal"


def test_a_model_of_images_trains_on_its_own_inputs():
    # The ranks traced the CNN with token ids (parallelize's default) instead of its images, so
    # every layout was refused with "Input type (long int) and bias type (float)": the micro-batch
    # is passed as example_inputs.
    report = hp.check("benchmarks.sweep_models:cnn", tp=1, pp=2)
    assert report.verdict == "equal", report.summary()


def test_a_stage_that_writes_its_received_value_in_place_trains():
    # A pipeline stage receives its input as a leaf that needs a gradient; writing it in place
    # (RoCBert's `embedding_in += ...` just after a stage boundary) stopped pp 2 with "a leaf
    # Variable that requires grad is being used in an in-place operation". The stage writes on a
    # copy.
    report = hp.check("tests.tiny_lms:in_place_lm", tp=2, pp=2)
    assert report.verdict == "equal", report.summary()


def test_rounding_is_judged_against_float64_and_a_wrong_gradient_still_differs():
    from hyparallel.tools.parity import _close

    exact = torch.tensor([0.045985955744981766, 0.6, -0.3], dtype=torch.float64)
    # the single device
    want = torch.tensor([0.045985929667949677, 0.6 + 8.3e-6, -0.3], dtype=torch.float32)
    # Gemma 4, pp 2: 1.7e-6 off
    got = torch.tensor([0.04598767310380936, 0.6, -0.3], dtype=torch.float32)
    assert not torch.allclose(got, want, rtol=1e-5, atol=1e-6)  # past the plain tolerance...
    # ...but closer to exact than the single device's own worst element
    assert _close(got, want, exact)
    assert not _close(got, want, None)  # without float64, the plain tolerance alone
    wrong = got.clone()
    wrong[2] *= 1.001  # a split off by 1e-3 relative (every bug of issue 16 was larger)
    assert not _close(wrong, want, exact)


def test_a_view_the_cpu_kernels_strides_allow_traces_and_trains_in_stages():
    # Afmoe views its attention output as the CPU flash kernel lays it out; meta kernels use other
    # strides, so the program exported for the CPU failed when profiled on meta (the pipeline then
    # took the plain meta export, which baked in a branch the CPU cannot run), and a tp x pp stage
    # failed the view at its rank's sizes. Note [a view the run device's strides allow].
    report = hp.check("tests.tiny_lms:strided_view_lm", tp=2, pp=2)
    assert report.verdict == "equal", report.summary()


def test_an_unused_tied_parameter_is_ignored_by_every_name():
    # DDP collects each module's own parameters by name: a tied pair the forward never reads (Luke's
    # entity embedding and decoder) was ignored under its first name only, and DDP waited for the
    # other's gradient ("Expected to have finished reduction in the prior iteration" at the second
    # step).
    report = hp.check("tests.tiny_lms:unused_tied_lm", tp=1, pp=1, dp=2, zero=0)
    assert report.verdict == "equal", report.summary()
    # tied: once
    assert {g.group for g in report.groups if g.group.startswith("entity_")} == {
        "entity_embed.weight"
    }


def test_parameters_without_a_gradient_path_train_under_data_parallel():
    # Mra without its kernels (projections read for their shapes) and EncoderDecoderModel without
    # cross-attention (an encoder only returned): DDP waited for gradients no loss gives ("Expected
    # to have finished reduction").
    report = hp.check("tests.tiny_lms:detached_lm", tp=1, pp=1, dp=2, zero=0)
    assert report.verdict == "equal", report.summary()
    assert {g.group for g in report.groups} >= {
        "layers.*.attn.k_proj.weight",
        "layers.*.attn.q_proj.weight",
    }
    report = hp.check("tests.tiny_lms:side_output_lm", tp=1, pp=1, dp=2, zero=0)
    assert report.verdict == "equal", report.summary()
    assert "side.weight" in {g.group for g in report.groups}
    # RecurrentGemma: a recurrence written into zeros inside a leaf module looked like no gradient
    # path (1.3 off)
    report = hp.check("tests.tiny_lms:scan_lm", tp=1, pp=1, dp=2, zero=0)
    assert report.verdict == "equal", report.summary()
    assert {"layers.*.scan.gate", "layers.*.proj.weight"} <= {g.group for g in report.groups}


def test_experts_in_a_module_list_reading_one_input_enter_the_split_region():
    # Dense-dispatch MoE: every expert's column reads the block's normed input, so the region was
    # entered at the experts' ModuleList, which is never called: its hook never fired, and the
    # experts' input gradients were not summed over the ranks (tp 2: norm2.bias 0.77 relative off
    # from step 2, no error).
    report = hp.check("benchmarks.sweep_models:moe_lm", tp=2, pp=1)
    assert report.verdict == "equal", report.summary()
    assert "layers.*.norm2.bias" in {g.group for g in report.groups}
