"""Tensor-parallel styles found from dataflow, for fused and separate QKV, GQA, Conv1D, tied
heads."""

from __future__ import annotations

import pytest

import hyparallel as hp
from hyparallel.graph.structure import analyze
from hyparallel.planner.api import _tp_map
from hyparallel.planner.profile import ModelProfile

from .conftest import HF_GPT2_TINY, HF_LLAMA_TINY


def traced(spec):
    model = hp.models.load(spec).module
    return hp.trace(model, hp.models.example_inputs(model, 1, 16))


EXPECTED = {
    "gpt-tiny": {
        "layers.*.attn.qkv": "column",
        "layers.*.attn.proj": "row",
        "layers.*.mlp.fc": "column",
        "layers.*.mlp.proj": "row",
        "tok_embeddings": "vocab",
        "output": "vocab",
    },
    "llama-tiny": {
        "layers.*.attn.q_proj": "column",
        "layers.*.attn.k_proj": "column",
        "layers.*.attn.v_proj": "column",
        "layers.*.attn.o_proj": "row",
        "layers.*.mlp.gate_proj": "column",
        "layers.*.mlp.up_proj": "column",
        "layers.*.mlp.down_proj": "row",
        "tok_embeddings": "vocab",
        "output": "vocab",
    },
    HF_GPT2_TINY: {
        "transformer.h.*.attn.c_attn": "column",
        "transformer.h.*.attn.c_proj": "row",
        "transformer.h.*.mlp.c_fc": "column",
        "transformer.h.*.mlp.c_proj": "row",
        "transformer.wte": "vocab",
        "lm_head": "vocab",
    },
    HF_LLAMA_TINY: {
        "model.layers.*.self_attn.q_proj": "column",
        "model.layers.*.self_attn.k_proj": "column",
        "model.layers.*.self_attn.v_proj": "column",
        "model.layers.*.self_attn.o_proj": "row",
        "model.layers.*.mlp.gate_proj": "column",
        "model.layers.*.mlp.up_proj": "column",
        "model.layers.*.mlp.down_proj": "row",
        "model.embed_tokens": "vocab",
        "lm_head": "vocab",
    },
}


@pytest.mark.parametrize("spec", list(EXPECTED))
def test_megatron_pairs_are_found_from_dataflow(spec):
    graph = traced(spec)
    profile = ModelProfile(graph, hp.ClusterSpec.preset("cpu"), "fp32", 16)
    assert _tp_map(graph, profile) == dict(sorted(EXPECTED[spec].items()))


@pytest.mark.parametrize(
    "spec",
    [
        (
            "hf:mistral num_hidden_layers=2 hidden_size=128 num_attention_heads=4"
            " num_key_value_heads=2 intermediate_size=256 vocab_size=1000"
        ),
        (
            "hf:qwen2 num_hidden_layers=2 hidden_size=128 num_attention_heads=4"
            " num_key_value_heads=2 intermediate_size=256 vocab_size=1000"
        ),
        (
            "hf:gpt_neox num_hidden_layers=2 hidden_size=128 num_attention_heads=4"
            " intermediate_size=256 vocab_size=1000"
        ),
        (
            "hf:opt num_hidden_layers=2 hidden_size=128 num_attention_heads=4 ffn_dim=256"
            " vocab_size=1000 word_embed_proj_dim=128"
        ),
    ],  # Falcon's FalconLinear has its own forward: replicated (tests/test_tp_classes.py)
)
def test_architectures_not_in_the_zoo(spec):
    # Every block of these decoders splits into attention and MLP Megatron pairs, whatever the
    # module names.
    graph = traced(spec)
    assert graph.num_params == sum(p.numel() for p in hp.models.load(spec).module.parameters())
    analysis = analyze(graph)
    for block in graph.blocks:
        styles = [analysis.styles[n] for n in block.ops if n in analysis.styles]
        assert styles.count("row") == 2 and styles.count("column") >= 2, (block.path, styles)
    assert sorted(analysis.styles[n] for n in (analysis.vocab_embedding, analysis.vocab_head)) == [
        "vocab",
        "vocab",
    ]
    assert set(analysis.attention_heads.values()) == {4}


def test_heads_of_attention_written_with_batched_matmuls():
    # Bloom computes attention with baddbmm/bmm on (batch * heads, seq, head_dim): no fused
    # attention op.
    graph = traced("hf:bloom n_layer=2 hidden_size=128 n_head=4 vocab_size=1000")
    analysis = analyze(graph)
    assert set(analysis.attention_heads.values()) == {4}
    # fused q, k, v of 4 heads
    assert analysis.head_groups["transformer.h.0.self_attention.query_key_value"] == 12
    assert (
        analysis.check(8, graph)
        == "tp 8 does not divide the 4 attention heads of transformer.h.0.self_attention"
    )
    assert analysis.styles["transformer.h.0.self_attention.dense"] == "row"


def test_head_counts_decide_valid_degrees():
    graph = traced("llama-tiny")  # 4 query heads, 2 key/value heads
    analysis = analyze(graph)
    assert set(analysis.attention_heads.values()) == {4}
    assert (
        analysis.head_groups["layers.0.attn.k_proj"] == 2
        and analysis.head_groups["layers.0.attn.q_proj"] == 4
    )
    assert analysis.check(2, graph) is None and analysis.check(4, graph) is None
    assert analysis.check(3, graph) == "tp 3 does not divide the 4 attention heads of layers.0.attn"
    # At tp=4 the 2 kv heads are replicated: each rank holds the kv head its query head needs.
    k_proj = graph.op("layers.0.attn.k_proj")
    assert analysis.params_per_rank(k_proj, 4) == k_proj.param_count / 2
    assert (
        analysis.params_per_rank(graph.op("layers.0.attn.q_proj"), 4)
        == graph.op("layers.0.attn.q_proj").param_count / 4
    )


def test_vocab_is_padded_to_a_multiple_of_tp():
    graph = traced("gpt-tiny vocab_size=250")
    analysis = analyze(graph)
    embedding = graph.op("tok_embeddings")
    assert analysis.vocab_size == 250
    assert analysis.params_per_rank(embedding, 4) == 63 * 64  # ceil(250 / 4) rows of 64


def test_row_bias_is_not_split():
    graph = traced("gpt-tiny")
    analysis = analyze(graph)
    proj = graph.op("layers.0.mlp.proj")  # 256 -> 64 with a bias
    assert analysis.params_per_rank(proj, 2) == 256 * 64 / 2 + 64


def test_a_norm_over_the_split_dimension_keeps_the_pair_replicated():
    import torch
    from torch import nn

    class NormedMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.up = nn.Linear(8, 32)
            self.mid_norm = nn.LayerNorm(32)  # normalises the whole hidden width: not shardable
            self.down = nn.Linear(32, 8)

        def forward(self, x):
            return x + self.down(self.mid_norm(self.up(self.norm(x))))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(NormedMLP() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    graph = hp.trace(Stack().to("meta"), torch.zeros(2, 4, 8))
    assert analyze(graph).styles == {
        n: "replicate" for n in ("layers.0.up", "layers.0.down", "layers.1.up", "layers.1.down")
    }


def test_fused_qkv_with_grouped_query_attention_is_checked_part_by_part():
    # Phi-3 fuses q, k, v in one projection; with 12 query and 4 key/value heads, tp=12 holds one
    # query head and a replicated key/value head per rank (valid), tp=8 does not divide the 12 query
    # heads.
    spec = (
        "hf:phi3 num_hidden_layers=2 hidden_size=96 num_attention_heads=12 num_key_value_heads=4 "
        "intermediate_size=144 vocab_size=1000 pad_token_id=0 bos_token_id=0 eos_token_id=0"
    )
    graph = traced(spec)
    analysis = analyze(graph)
    qkv = next(n for n in analysis.styles if n.endswith("qkv_proj"))
    assert analysis.parts[qkv] == [96, 32, 32]
    assert analysis.check(12, graph) is None and analysis.check(4, graph) is None
    assert "does not divide the 12 attention heads" in analysis.check(8, graph)
