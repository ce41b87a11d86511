"""The planner keeps replicated what cannot run at one rank's sizes, and a replicated attention
keeps its heads.

Note [the planner replicates what fails at one rank's sizes] (hyparallel/graph/local_shapes.py): a
module that slices a split output with the model's constants (nanoGPT's ``split(self.n_embd)``,
Phi-3's qkv slices) made the planner write a plan its own runtime then refused; now the planner
replicates that attention (every block's) and still splits the MLPs. A hand-written map that
replicates an attention must leave its head counts whole: dividing them (as for a split attention)
broke the replicated projections' views.
"""

from __future__ import annotations

import sys

import pytest
from torch import nn

import hyparallel as hp
from hyparallel.graph.checks import check_plan
from hyparallel.graph.local_shapes import (
    keeps_groups,
    local_shape_failure,
    local_shapes_copy,
    meta_copy,
)
from hyparallel.tensor.apply import check_local_shapes
from hyparallel.tools.parity import small_spec

LLAMA = small_spec("hf:LlamaForCausalLM")


def planned(spec: str, tp: int = 2) -> tuple:
    model = hp.models.load(spec).module
    plan = hp.plan(
        model,
        hp.ClusterSpec.preset("cpu", gpus_per_node=tp),
        4,
        16,
        "fp32",
        tp=tp,
        pp=1,
        micro_batch=2,
    )
    return model, plan


@pytest.mark.parametrize(
    ("spec", "attention", "mlp"),
    [
        (
            "tests.tiny_lms:config_split_lm",
            ("layers.*.attn.qkv", "layers.*.attn.o_proj"),
            ("layers.*.up",),
        ),
        # Nystromformer: a depthwise convolution over the value heads (no split op of its own) fails
        (
            "tests.tiny_lms:grouped_conv_lm",
            tuple(f"layers.*.attn.{p}_proj" for p in "qkvo"),
            ("layers.*.up",),
        ),
        (
            small_spec("hf:Phi3ForCausalLM"),
            ("model.layers.*.self_attn.qkv_proj", "model.layers.*.self_attn.o_proj"),
            ("model.layers.*.mlp.gate_up_proj",),
        ),
        # diffusers: runs at one rank's sizes, but as 4 heads of half the size (Note [a split keeps
        # each head whole])
        (
            "tests.tiny_lms:heads_attribute_lm",
            tuple(f"layers.*.attn.{p}_proj" for p in "qkvo"),
            ("layers.*.up",),
        ),
    ],
)
def test_the_planner_replicates_an_attention_sliced_with_the_models_constants(spec, attention, mlp):
    model, plan = planned(spec)
    styles = plan.tensor_parallel
    assert all(styles[path] == "replicate" for path in attention), styles
    assert all(styles[path] == "column" for path in mlp), styles  # the MLPs still split
    example = hp.models.example_inputs(model, 2, 16)
    graph = hp.trace(model, example)
    # what parallelize runs: passes
    check_local_shapes(model, graph, check_plan(plan, graph).styles, 2, example)


def test_a_split_that_would_cut_heads_in_two_is_refused_in_one_line():
    # Note [a split keeps each head whole]: diffusers' attention reads its head count from `heads`,
    # which tp leaves whole, and its head size from the split width: every shape fits at one rank's
    # sizes, the heads do not.
    model = hp.models.load("tests.tiny_lms:heads_attribute_lm").module
    example = hp.models.example_inputs(model, 2, 16)
    graph = hp.trace(model, example)
    styles = {f"layers.{i}.attn.{p}_proj": "column" for i in range(2) for p in "qkv"}
    styles |= {f"layers.{i}.attn.o_proj": "row" for i in range(2)}
    where, why = local_shape_failure(model, graph, styles, 2, example)
    assert where == "layers.0.attn.q_proj" and "\n" not in why
    assert "viewed as 4x8 (heads x head size), but at one rank's sizes under tp = 2 as 4x4" in why


@pytest.mark.parametrize(
    ("rows", "full", "local", "keeps"),
    [
        ([(0, 16)], [4, 8], [2, 8], True),  # two whole heads of four
        ([(0, 16)], [4, 8], [4, 4], False),  # the same rows read as four half heads
        # a fused [gate | up] viewed as (2, I): half of each part
        ([(0, 8), (16, 24)], [2, 16], [2, 8], True),
        ([(0, 8), (16, 24)], [2, 16], [1, 16], False),  # ... read as one group
        ([(0, 48)], [4, 3, 8], [2, 3, 8], True),  # (heads, q/k/v, head size) of two whole heads
        ([(0, 48)], [4, 3, 8], [2, 6, 4], False),
        ([(0, 16)], [4, 8], [16], False),  # another number of levels
    ],
)
def test_keeps_groups_compares_the_grouping_level_by_level(rows, full, local, keeps):
    assert keeps_groups(rows, full, local) is keeps


def test_a_module_that_runs_at_one_ranks_sizes_stays_split():
    _, plan = planned(LLAMA)
    assert plan.tensor_parallel["model.layers.*.self_attn.q_proj"] == "column"
    assert plan.tensor_parallel["model.layers.*.self_attn.o_proj"] == "row"


def test_a_replicated_attention_keeps_its_head_counts():
    # its attention slices qkv with self.num_key_value_heads * head_dim
    spec = small_spec("hf:Phi3ForCausalLM")
    model = hp.models.load(spec).module
    example = hp.models.example_inputs(model, 2, 16)
    graph = hp.trace(model, example)
    styles = {
        path: "replicate" if ".self_attn." in path else style
        for path, style in check_plan(hand_plan(graph), graph).styles.items()
    }
    assert any(style == "column" for style in styles.values())
    local = local_shapes_copy(model, graph, styles, 2)
    counts = {k: v for k, v in vars(model.model.layers[0].self_attn).items() if isinstance(v, int)}
    assert counts and {k: getattr(local.model.layers[0].self_attn, k) for k in counts} == counts
    assert local_shape_failure(model, graph, styles, 2, example) is None


def hand_plan(graph) -> hp.Plan:
    """tp 2 with Phi-3's MLPs split and its attention replicated, written by hand."""
    return hp.Plan.from_dict(
        {
            "training": {"global_batch": 4, "micro_batch": 2, "seq_len": 16, "dtype": "fp32"},
            "parallel": {"tp": 2, "sequence_parallel": False},
            "tensor_parallel": {
                "model.layers.*.mlp.gate_up_proj": "column",
                "model.layers.*.mlp.down_proj": "row",
            },
        }
    )


def test_the_unsplit_model_runs_once_for_every_degree(monkeypatch):
    from hyparallel.graph import local_shapes

    model = hp.models.load("tests.tiny_lms:config_split_lm").module
    example = hp.models.example_inputs(model, 1, 16)
    graph = hp.trace(model, example)
    runs: list[str] = []
    original = local_shapes.first_failure

    def counted(module, inputs, method):
        runs.append(method)
        return original(module, inputs, method)

    monkeypatch.setattr(local_shapes, "first_failure", counted)
    reasons = local_shapes.replicate_what_fails(model, graph, [2, 4], example)
    assert reasons  # its attention fails at one rank's sizes, and is replicated
    # the unsplit run once, then per degree one rank's sizes until the rest runs: never the unsplit
    # run again
    assert len(runs) == 1 + len(reasons) + 2


def test_the_meta_copy_is_the_models_when_a_freed_state_comes_back_at_its_address(monkeypatch):
    # Note [the memo keeps what it copied alive] (hyparallel/graph/local_shapes.py): CPython may
    # give a dict freed a moment ago (a module's __getstate__, once copied) to the next dict made,
    # at the same address. This __getstate__ always does: it hands its one dict out again whenever
    # nothing else holds it. A memo that let the copied states go gave a module another's attributes
    # (seen in CI: "CausalSelfAttention has no attribute `qkv`", now and then).
    plain, pool = nn.Module.__getstate__, [{}]

    def reused_state(module):
        # held by more than the pool and getrefcount's argument: make another
        if sys.getrefcount(pool[0]) > 2:
            pool[0] = {}
        pool[0].clear()
        pool[0].update(plain(module))
        return pool[0]

    model = hp.models.load("gpt-tiny num_layers=2").module
    monkeypatch.setattr(nn.Module, "__getstate__", reused_state)
    copied = meta_copy(model)
    monkeypatch.undo()

    def layout(module):
        return [
            (name, type(m).__name__, list(m._modules), list(m._parameters))
            for name, m in module.named_modules()
        ]

    assert layout(copied) == layout(model)
    assert all(p.is_meta for p in copied.parameters())
