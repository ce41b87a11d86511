"""A plan the planner writes always runs: its candidates pass the runtime's own check_plan
(hyparallel.graph.checks).

Each test is one class of plan the planner used to write and the runtime refused: sequence
parallelism without repeated blocks, a tied parameter split two ways, a module listed in two stages,
a tp that splits nothing; and a pipeline fed one micro-batch chosen while something else fits.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hyparallel as hp
from hyparallel.graph.checks import check_plan
from hyparallel.planner import PlanError, search
from hyparallel.spec.errors import ConfigError

BERT_TINY = (
    "hf:BertForMaskedLM num_hidden_layers=2 hidden_size=64 num_attention_heads=4"
    " intermediate_size=128 vocab_size=128 max_position_embeddings=64"
)
T5_TINY = (
    "hf:T5ForConditionalGeneration num_layers=2 num_decoder_layers=2 d_model=64 d_kv=16 num_heads=4"
    " d_ff=128 vocab_size=128"
)


class ConvNet(nn.Module):
    """No repeated blocks, nothing tensor parallelism splits."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2, self.fc = (
            nn.Conv2d(3, 16, 3),
            nn.Conv2d(16, 16, 3),
            nn.Linear(16, 10),
        )

    def forward(self, x):
        return self.fc(self.conv2(self.conv1(x)).mean((2, 3)))


class EmbedHead(nn.Module):
    """No repeated blocks, but a vocab-parallel embedding and head: tp splits it, sequence
    parallelism cannot."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(128, 32), nn.Linear(32, 128)

    def forward(self, ids):
        return self.head(torch.relu(self.embed(ids)))


def cpus(n: int) -> hp.ClusterSpec:
    return hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=n)


def hand_plan(**parallel) -> hp.Plan:
    data = {
        "training": {"global_batch": 8, "micro_batch": 2, "seq_len": 16, "dtype": "fp32"},
        "parallel": parallel,
    }
    if (stages := parallel.pop("stages", None)) is not None:
        data["stages"] = [{"index": i, "modules": m} for i, m in enumerate(stages)]
    if (tensor_parallel := parallel.pop("tensor_parallel", None)) is not None:
        data["tensor_parallel"] = tensor_parallel
    return hp.Plan.from_dict(data)


@pytest.fixture(scope="module")
def bert():
    model = hp.models.load(BERT_TINY).module
    return model, hp.trace(model, hp.models.example_inputs(model, 1, 16))


@pytest.fixture(scope="module")
def t5():
    model = hp.models.load(T5_TINY).module
    ids = torch.zeros(1, 16, dtype=torch.long)
    return model, hp.trace(model, {"input_ids": ids, "decoder_input_ids": ids})


def lone_microbatch(config) -> bool:
    """A pipeline fed one micro-batch (its bubble is (pp - 1) times the compute)."""
    return config.pp > 1 and config.num_microbatches == 1


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


# ---- (a) what needs repeated blocks --------------------------------------------------------------


def test_no_sequence_parallel_or_recompute_without_blocks():
    graph = hp.trace(EmbedHead(), torch.zeros(1, 16, dtype=torch.long))
    result = search(graph, cpus(4), 8, 16, "fp32", top=20)
    assert result.best and not any(e.config.sequence_parallel for e in result.best)
    assert not any(e.config.recompute != "none" and e.config.pp == 1 for e in result.best)
    for rank in range(len(result.best)):
        check_plan(result.plan(rank), graph)  # every ranked plan runs
    with pytest.raises(PlanError) as info:
        hp.plan(graph, cpus(4), 8, 16, "fp32", tp=2, sequence_parallel=True)
    assert "sequence_parallel needs repeated blocks" in one_line(info)
    with pytest.raises(ConfigError, match="sequence_parallel needs repeated blocks"):
        check_plan(hand_plan(tp=2, dp=2, sequence_parallel=True), graph)


# ---- (d) a tp with nothing split -----------------------------------------------------------------


def test_nothing_splittable_is_never_planned_with_tp():
    graph = hp.trace(ConvNet(), torch.randn(1, 3, 8, 8))
    result = search(graph, cpus(4), 8, 16, "fp32", top=10)
    assert all(e.config.tp == 1 for e in result.best)
    with pytest.raises(PlanError) as info:
        hp.plan(graph, cpus(4), 8, 16, "fp32", tp=2)
    assert one_line(info).startswith("tp 2 splits nothing of ConvNet")
    with pytest.raises(ConfigError, match="tp 2 splits nothing of ConvNet"):
        check_plan(hand_plan(tp=2, dp=2, tensor_parallel={"fc": "replicate"}), graph)


# ---- (d) one micro-batch through a pipeline ------------------------------------------------------


def test_a_pipeline_of_one_micro_batch_only_when_nothing_else_fits(bert):
    _, graph = bert
    best = search(graph, cpus(4), 8, 16, "fp32", top=5).best
    # it was pp 2 x 1 micro-batch, bubble 100%
    assert not any(lone_microbatch(e.config) for e in best)
    # 2 sequences over dp 2: one micro-batch each
    only = search(graph, cpus(4), 2, 16, "fp32", pp=2, dp=2).best
    assert [lone_microbatch(e.config) for e in only] == [True]


# ---- (b) a tied parameter split one way ----------------------------------------------------------


def test_a_tied_bias_is_never_split_two_ways(bert):
    # cls.predictions.bias is cls.predictions.decoder.bias; the decoder weight is the embedding
    _, graph = bert
    plan = hp.plan(graph, cpus(4), 8, 16, "fp32", tp=2)
    styles = check_plan(plan, graph).styles
    assert (
        "cls.predictions.decoder" not in styles and "bert.embeddings.word_embeddings" not in styles
    )
    assert styles["bert.encoder.layer.0.attention.self.query"] == "column"  # the blocks still split
    vocab = {"bert.embeddings.word_embeddings": "vocab", "cls.predictions.decoder": "vocab"}
    with pytest.raises(ConfigError) as info:
        check_plan(hand_plan(tp=2, dp=2, tensor_parallel=vocab), graph)
    message = one_line(info)
    assert (
        "cls.predictions (replicate) and cls.predictions.decoder (vocab) hold one tied parameter"
        in message
    )


def test_a_tied_embedding_and_head_still_split_together():
    model = hp.models.build("gpt-tiny")
    graph = hp.trace(model, model.example_inputs(1, 16))
    assert graph.ties and graph.structure.styles[graph.structure.vocab_head] == "vocab"
    assert graph.structure.vocab_embedding is not None


def test_a_shared_embedding_read_twice_is_not_split_one_way(t5):
    # shared.weight is encoder.embed_tokens.weight, decoder.embed_tokens.weight and lm_head.weight
    _, graph = t5
    assert not any(style == "vocab" for style in graph.structure.styles.values())
    with pytest.raises(PlanError) as info:
        hp.plan(graph, cpus(4), 8, 16, "fp32", tp=2)
    assert "splits nothing" in one_line(info)


def test_a_function_of_the_roots_own_forward_is_not_written_as_a_module():
    # NeoMME's factorised head multiplies by a parameter in the root's forward: the plan named it ''
    # (the root), which its own runtime refused ("'' matches no module"): every tp plan of the model
    # was refused.
    from tests.tiny_lms import root_matmul_lm

    model = root_matmul_lm()
    plan = hp.plan(model, cpus(2), 4, 16, "fp32", tp=2, pp=1, micro_batch=2)
    assert "" not in plan.tensor_parallel
    assert plan.tensor_parallel["layers.*.up"] == "column"
    check_plan(plan, hp.trace(model, model.example_inputs(2, 16)))


class StraightThrough(torch.autograd.Function):
    """Rounds forward, passes the gradient through unchanged: its backward is not its forward's
    derivative."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class Quantised(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + StraightThrough.apply(layer(x))
        return self.head(x)


def test_a_custom_autograd_function_keeps_the_model_out_of_a_pipeline():
    # A traced stage records the Function's forward ops and autograd differentiates those, not its
    # own backward (Yoso's LSH cumulation, pp 2: query and key gradients 25% off, no error).
    model = Quantised()
    graph = hp.trace(model, torch.zeros(1, 8, dtype=torch.long))
    assert {f for _, f in graph.custom_backwards} == {
        f"{StraightThrough.__module__}.StraightThrough"
    }
    with pytest.raises(PlanError) as info:
        hp.plan(graph, cpus(2), 4, 8, "fp32", pp=2, micro_batch=1)
    assert "custom autograd function" in one_line(info) and "StraightThrough" in one_line(info)
    with pytest.raises(ConfigError, match="use pp: 1"):
        check_plan(
            hand_plan(
                pp=2, stages=[["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"]]
            ),
            graph,
        )
    assert hp.plan(graph, cpus(2), 4, 8, "fp32", micro_batch=1).parallel.pp == 1


# ---- (c) a module in one stage -------------------------------------------------------------------


def test_a_module_called_in_two_stages_is_listed_in_none(t5):
    _, graph = t5  # decoder.dropout runs before the decoder's first block and after its last
    plan = hp.plan(graph, cpus(4), 8, 16, "fp32", pp=2)
    listed = [m for stage in plan.stages for m in stage.modules]
    assert len(listed) == len(set(listed))
    check_plan(plan, graph)
    stages = [stage.modules for stage in plan.stages]
    stages[1] = [*stages[1], stages[0][0]]
    with pytest.raises(ConfigError) as info:
        hand_plan(pp=2, dp=2, stages=stages)
    assert f"module '{stages[0][0]}' is in stages 0 and 1" in one_line(info)


# ---- the filter itself ---------------------------------------------------------------------------


def test_a_candidate_the_runtime_refuses_is_infeasible_never_a_plan(monkeypatch):
    """The search ranks only candidates check_plan accepts; a refusal is kept as the candidate's
    reason."""
    import hyparallel.planner.api as api

    real = api.check_plan

    def no_tp(plan, graph, world_size=None):
        if plan.parallel.tp > 1:
            raise ConfigError("tensor parallelism refused here")
        return real(plan, graph, world_size)

    monkeypatch.setattr(api, "check_plan", no_tp)
    model = hp.models.build("gpt-tiny")
    graph = hp.trace(model, model.example_inputs(1, 16))
    result = search(graph, cpus(4), 8, 16, "fp32", top=5)
    assert all(e.config.tp == 1 for e in result.best)
    assert result.refused and all(e.config.tp > 1 and not e.feasible for e in result.refused)
    assert result.refused[0].reason == "the runtime refuses it: tensor parallelism refused here"
    with pytest.raises(PlanError) as info:
        hp.plan(graph, cpus(4), 8, 16, "fp32", tp=2)
    assert "the runtime refuses it: tensor parallelism refused here" in one_line(info)
