"""check_plan: every plan error from the trace alone, before a process group exists
(hyparallel.graph.checks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hyparallel as hp
from hyparallel.graph.checks import check_plan
from hyparallel.spec.errors import ConfigError

GPT_STAGES = [["tok_embeddings", "pos_embeddings", "layers.0"], ["layers.1", "norm", "output"]]


def gpt_graph():
    model = hp.models.build("gpt-tiny")
    return hp.trace(model, torch.zeros(2, 16, dtype=torch.long, device="meta"))


def plan(**parallel) -> hp.Plan:
    data = {
        "training": {"global_batch": 8, "micro_batch": 2, "seq_len": 16, "dtype": "fp32"},
        "parallel": parallel,
    }
    stages = parallel.pop("stages", None)
    tensor_parallel = parallel.pop("tensor_parallel", None)
    if stages is not None:
        data["stages"] = [{"index": i, "modules": m} for i, m in enumerate(stages)]
    if tensor_parallel is not None:
        data["tensor_parallel"] = tensor_parallel
    return hp.Plan.from_dict(data)


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (
            {
                "pp": 2,
                "stages": [
                    ["layers.1", "norm", "output"],
                    ["tok_embeddings", "pos_embeddings", "layers.0"],
                ],
            },
            r"module 'layers.1' \(stage 0\) runs after 'layers.0' \(stage 1\)",
        ),
        (
            {"pp": 2, "stages": [GPT_STAGES[0], ["layers.7"]]},
            r"stages\[1\]: 'layers.7' is not a module of GPT",
        ),
        (
            {"tp": 2, "tensor_parallel": {"layers.*.attn.qkv": "row"}},
            r"cannot split layers.0.attn.qkv \(row",
        ),
        (
            {"tp": 2, "tensor_parallel": {"layers.*.attn.qkv": "column"}},
            r"layers.0.attn.proj must be split too",
        ),
        (
            {"tp": 2, "tensor_parallel": {"layers.*.nope": "column"}},
            r"'layers.\*.nope' matches no module of GPT",
        ),
        ({"tp": 3}, r"tp = 3 does not fit GPT: tp 3 does not divide the 4 attention heads"),
    ],
)
def test_plan_errors_come_from_the_trace_alone(parallel, message):
    with pytest.raises(ConfigError, match=message):
        check_plan(plan(**parallel), gpt_graph(), plan(**parallel).world_size)
    assert not dist.is_initialized()


def test_a_vocab_parallel_loss_needs_a_head_split_by_vocabulary():
    gpt, pairs = gpt_graph(), {"layers.*.attn.qkv": "column", "layers.*.attn.proj": "row"}
    with pytest.raises(
        ConfigError, match=r"keeps the output head output replicate, not vocab; split it"
    ):
        check_plan(plan(tp=2, vocab_parallel_loss=True, tensor_parallel=pairs), gpt)
    # tied: both split by vocabulary
    vocab = {**pairs, "output": "vocab", "tok_embeddings": "vocab"}
    checked = check_plan(plan(tp=2, vocab_parallel_loss=True, tensor_parallel=vocab), gpt)
    assert checked.styles["output"] == "vocab"
    check_plan(plan(tp=2, vocab_parallel_loss=True), gpt)  # no map yet: the planner splits the head
    bert = hp.models.load(
        "hf:BertForSequenceClassification num_hidden_layers=2 hidden_size=32 num_attention_heads=4 "
        "intermediate_size=64 vocab_size=64"
    ).module  # its classifier's logits are no vocabulary's
    graph = hp.trace(bert, hp.models.example_inputs(bert, 1, 16))
    with pytest.raises(
        ConfigError, match=r"has no output head tensor parallelism can split by vocabulary"
    ) as error:
        check_plan(plan(tp=2, vocab_parallel_loss=True), graph)
    assert "\n" not in str(error.value)
    check_plan(plan(tp=2), graph)  # the same plan without it runs
    assert not dist.is_initialized()


def test_a_checked_plan_has_its_styles_expanded_and_its_stages_mapped():
    checked = check_plan(
        plan(
            tp=2,
            pp=2,
            stages=GPT_STAGES,
            tensor_parallel={"layers.*.attn.qkv": "column", "layers.*.attn.proj": "row"},
        ),
        gpt_graph(),
    )
    assert checked.styles == {
        "layers.0.attn.qkv": "column",
        "layers.1.attn.qkv": "column",
        "layers.0.attn.proj": "row",
        "layers.1.attn.proj": "row",
    }
    assert checked.stage_of == {
        "tok_embeddings": 0,
        "pos_embeddings": 0,
        "layers.0": 0,
        "layers.1": 1,
        "norm": 1,
        "output": 1,
    }


def test_the_launch_size_and_the_model_are_checked():
    with pytest.raises(ConfigError, match=r"dp\(2\) \* tp\(1\) \* pp\(1\) = 2 != WORLD_SIZE\(1\)"):
        check_plan(plan(dp=2), gpt_graph(), 1)
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=1)
    made_for_llama = hp.plan(hp.models.build("llama-tiny"), cluster, 8, 16, "fp32")
    with pytest.raises(ConfigError, match="the plan was made for model 'Llama'"):
        check_plan(made_for_llama, gpt_graph())
