"""Mixture-of-experts layers read from the trace (Note [an MoE layer read from the trace],
hyparallel/graph/moe.py): router, experts, top-k and shared experts, for hand-written and
transformers' MoEs, and what cannot be read."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hyparallel as hp
from hyparallel.tools.parity import small_spec


def traced(spec: str) -> tuple[nn.Module, hp.ModelGraph]:
    model = hp.models.load(small_spec(spec) if spec.startswith("hf:") else spec).module
    return model, hp.trace(model, hp.models.example_inputs(model, 1, 16))


def under(model: nn.Module, module: str) -> set[str]:
    return {name for name, _ in model.named_parameters() if name.startswith(module + ".")}


def test_a_hand_written_where_dispatch_is_read_as_routed_experts_in_a_list():
    model, graph = traced("tests.tiny_lms:where_moe_lm")
    layers = graph.moe.layers
    assert [layer.path for layer in layers] == ["layers.0.moe", "layers.1.moe"]
    assert not graph.moe.refused
    for i, layer in enumerate(layers):
        assert (layer.router, layer.experts) == (
            f"layers.{i}.moe.router",
            f"layers.{i}.moe.experts",
        )
        assert (layer.layout, layer.dispatch, layer.num_experts, layer.top_k) == (
            "list",
            "routed",
            4,
            2,
        )
        assert set(layer.expert_params) == under(model, layer.experts) and layer.shared == ()
    # the experts are parts of their layer: a pipeline cuts between layers only
    assert [block.path for block in graph.blocks] == ["layers.0", "layers.1"]


def test_experts_that_run_on_every_token_are_a_dense_dispatch():
    # benchmarks/sweep_models.moe_lm weights every expert's output by its (zeroed unless chosen)
    # score: top-2 routing computed densely
    _, graph = traced("benchmarks.sweep_models:moe_lm")
    assert {layer.dispatch for layer in graph.moe.layers} == {"dense"} and graph.moe.layers


@pytest.mark.parametrize(
    ("spec", "shared"),
    [
        ("hf:MixtralForCausalLM", ()),
        ("hf:Qwen3MoeForCausalLM", ()),
        ("hf:OlmoeForCausalLM", ()),
        ("hf:DeepseekV3ForCausalLM", ("shared_experts",)),
        ("hf:Qwen2MoeForCausalLM", ("shared_expert", "shared_expert_gate")),
        ("hf:GptOssForCausalLM", ()),  # stacked biases beside the weights
    ],
)
def test_transformers_moes_are_read_as_grouped_experts(spec, shared):
    model, graph = traced(spec)
    assert graph.moe.layers and not graph.moe.refused
    for layer in graph.moe.layers:
        assert (layer.layout, layer.dispatch, layer.num_experts, layer.top_k) == (
            "grouped",
            "routed",
            4,
            2,
        )
        # every parameter of the experts' module, each stacked by expert
        assert set(layer.expert_params) == under(model, layer.experts)
        params = dict(model.named_parameters())
        assert all(params[name].shape[0] == 4 for name in layer.expert_params)
        assert layer.shared == tuple(f"{layer.path}.{name}" for name in shared)
        assert layer.router.startswith(layer.path + ".")
    moe_layers = {
        path.rpartition(".")[0] for path, m in model.named_modules() if path.endswith(".experts")
    }
    assert {layer.path for layer in graph.moe.layers} == moe_layers


def test_stacked_experts_without_a_top_k_router_are_named_not_guessed():
    # Phi-MoE's sparsemixer picks its experts without a top-k
    _, graph = traced("hf:PhimoeForCausalLM")
    assert not graph.moe.layers
    assert set(graph.moe.refused) == {
        "model.layers.0.mlp.experts",
        "model.layers.1.mlp.experts",
    }
    why = graph.moe.refused["model.layers.0.mlp.experts"]
    assert "4 experts' stacked weights" in why and "no top-k router" in why and "\n" not in why
    assert "not read: model.layers.0.mlp.experts" in graph.summary()


def test_a_top_k_of_the_vocabulary_is_no_router():
    class TopTokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)

        def forward(self, tokens):
            logits = self.head(self.embed(tokens))
            return logits + logits.topk(5, dim=-1).values.sum(-1, keepdim=True)

    graph = hp.trace(TopTokens(), torch.zeros(1, 8, dtype=torch.long))
    assert not graph.moe.layers and not graph.moe.refused
    assert "MoE" not in graph.summary()
