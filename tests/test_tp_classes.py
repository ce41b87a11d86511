"""Issue 16: classes of tensor parallelism that were silently wrong, now split correctly or left
replicated.

* A layer replaced by type that has its own forward (Note [a module replaced by type],
  hyparallel/graph/kinds.py): a scaled embedding, a Linear subclass, Falcon's FalconLinear stay
  replicated, and a plan splitting one is refused.
* A fused projection interleaving q, k, v by groups of heads (CodeGen's mp_num groups): its layout
  is read from the graph (Note [fused layouts read from the graph], hyparallel/graph/structure.py);
  per head it splits by heads, by groups of several heads it stays replicated with its row partner,
  and a plan splitting it is refused.
* Multi-query attention (one key/value head): the fused [q | k | v] split is found behind a view
  (Note [fused parts behind a view], hyparallel/graph/structure.py), so the key/value head is
  replicated, not cut in half.

The parity cases run tp = 2 under parallelize in 2 gloo processes
(tests/distributed/tp_classes_worker.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hyparallel as hp
from hyparallel.graph.checks import check_plan
from hyparallel.graph.structure import fused_parts, interleave
from hyparallel.spec.errors import ConfigError
from hyparallel.tools.parity import small_spec

from .conftest import assert_every_parameter_compared, torchrun
from .tiny_lms import with_attention

SCALED = "tests.tiny_lms:scaled_embedding_lm"
GPT_BIGCODE_MQA = (
    "hf:GPTBigCodeForCausalLM n_layer=2 n_embd=32 n_head=4 multi_query=true vocab_size=64"
    " n_positions=32 bos_token_id=0 eos_token_id=0"
)
CODEGEN = (  # 8 heads in CodeGen's 4 (mp_num) groups, each group q | v | k of 2 heads
    "hf:CodeGenForCausalLM n_layer=2 n_embd=64 n_head=8 rotary_dim=4 vocab_size=64 n_positions=32 "
    "bos_token_id=0 eos_token_id=0"
)
CASES = (
    "scaled-embedding",
    "mqa-separate",
    "mqa-fused",
    "hf-gpt-bigcode-mqa",
    "interleaved-per-head",
    "shared-arguments",
    "shared-arguments-nosp",
    "qk-norm",
    "qk-norm-nosp",
    "interleaved-grouped",
    "fourier-mixer",
    "cumsum-mixer",
    "residual-mlp",
    "residual-mlp-nosp",
    "moshi-like",
    "moshi-like-nosp",
    "list-output",
    "hf-gpt-neox",
    "hf-codegen",
)


def traced(spec: str):
    model = hp.models.load(spec).module
    return hp.trace(model, hp.models.example_inputs(model, 1, 16))


def tp_plan(tensor_parallel: dict | None = None) -> hp.Plan:
    data = {
        "training": {"global_batch": 4, "micro_batch": 4, "seq_len": 16, "dtype": "fp32"},
        "parallel": {"tp": 2},
    }
    if tensor_parallel is not None:
        data["tensor_parallel"] = tensor_parallel
    return hp.Plan.from_dict(data)


def test_the_planner_replicates_layers_with_their_own_forward():
    graph = traced(SCALED)
    plan = hp.plan(graph, hp.ClusterSpec.preset("cpu", gpus_per_node=2), 4, 16, "fp32", tp=2, pp=1)
    styles = plan.tensor_parallel
    # ScaledEmbedding multiplies by its scale
    assert "embed" not in styles or styles["embed"] == "replicate"
    assert styles["head"] == "replicate"  # the vocabulary is split with its embedding or not at all
    # ScaledLinear and its row partner
    assert styles["layers.0.up"] == styles["layers.0.down"] == "replicate"
    # plain Linears still split
    assert styles["layers.1.up"] == "column" and styles["layers.1.down"] == "row"
    assert (
        "ScaledEmbedding does not run the forward of nn.Linear"
        in graph.structure.unsplittable["embed"]
    )


@pytest.mark.parametrize(
    ("tensor_parallel", "module"),
    [
        ({"embed": "vocab"}, "ScaledEmbedding"),
        ({"layers.0.up": "column", "layers.0.down": "row"}, "ScaledLinear"),
    ],
)
def test_a_hand_written_split_of_a_layer_with_its_own_forward_is_refused(tensor_parallel, module):
    path = next(iter(tensor_parallel))
    with pytest.raises(
        ConfigError, match=rf"cannot split {path} \(\w+; {module} does not run the forward"
    ) as error:
        check_plan(tp_plan(tensor_parallel), traced(SCALED), 2)
    assert "\n" not in str(error.value)
    assert not dist.is_initialized()


def test_falcon_linear_has_its_own_forward_so_falcon_blocks_stay_replicated():
    # FalconLinear computes input @ weight.T + bias in its own forward: not provably nn.Linear's, so
    # not swapped.
    graph = traced(
        "hf:falcon num_hidden_layers=2 hidden_size=64 num_attention_heads=4 vocab_size=128"
    )
    analysis = graph.structure
    qkv = "transformer.h.0.self_attention.query_key_value"
    assert analysis.styles[qkv] == "replicate" and "FalconLinear" in analysis.unsplittable[qkv]
    # Its multi-query [q | k | v] is still read right: viewed as (..., 4 + 2 heads, 16), the head
    # dim sliced.
    assert fused_parts(graph, qkv) == [64, 16, 16]


def test_a_multi_query_key_value_head_is_found_behind_a_view():
    # GPTBigCode: c_attn(x).unsqueeze(1).split((embed_dim, kv_dim, kv_dim), dim=3): one key/value
    # head of 8.
    graph = traced(GPT_BIGCODE_MQA)
    c_attn = "transformer.h.0.attn.c_attn"
    assert graph.structure.parts[c_attn] == [32, 8, 8]
    assert graph.structure.check(2, graph) is None and graph.structure.check(4, graph) is None


class HeadsViewAttention(nn.Module):
    """transformers 5.25's Falcon: the fused projection viewed as (..., heads + 2 or 3 * heads,
    head_dim), then cut along those heads by one split (multi-query), or regrouped into (heads, 3)
    and unbound (q, k, v per head)."""

    def __init__(self, hidden: int, heads: int, multi_query: bool):
        super().__init__()
        self.heads, self.head_dim, self.multi_query = heads, hidden // heads, multi_query
        self.qkv = nn.Linear(hidden, hidden + 2 * self.head_dim if multi_query else 3 * hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        # (B, T, parts of heads, head_dim)
        fused = self.qkv(x).view(*x.shape[:-1], -1, self.head_dim)
        if self.multi_query:
            q, k, v = fused.split([fused.size(-2) - 2, 1, 1], dim=-2)
            k, v = k.expand_as(q), v.expand_as(q)
        else:
            q, k, v = fused.unflatten(-2, (-1, 3)).unbind(-2)  # (B, T, heads, 3, head_dim) unbound
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))


@pytest.mark.parametrize(
    "multi_query", [True, False], ids=["multi-query-split", "per-head-unflatten"]
)
def test_a_fused_projection_cut_along_its_heads_is_read_through_every_view(multi_query):
    # Note [fused parts behind a view] and Note [fused layouts read from the graph]: the [q | k | v]
    # heads cut by one split along the heads dim, and a per-head interleave read from the last of
    # two reshapes.
    model = with_attention(lambda: HeadsViewAttention(32, 4, multi_query), 32, 4, 2, 64)
    graph = hp.trace(model, hp.models.example_inputs(model, 1, 16))
    analysis, qkv = graph.structure, "layers.0.attn.qkv"
    assert analysis.styles[qkv] == "column" and analysis.styles["layers.0.attn.o_proj"] == "row"
    assert qkv not in analysis.unsplittable
    if multi_query:  # the one key/value head is kept whole, not cut in half
        assert fused_parts(graph, qkv) == analysis.parts[qkv] == [32, 8, 8]
    else:  # heads groups of (q, k, v): a contiguous range of rows is a range of whole heads
        assert fused_parts(graph, qkv) == [96] and interleave(graph, qkv) == (4, [3, 8])


@pytest.fixture(scope="module")
def results(tmp_path_factory, repo):
    out = tmp_path_factory.mktemp("tp-classes") / "results.jsonl"
    return torchrun(repo, "tests/distributed/tp_classes_worker.py", out, 2, *CASES, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_tp2_matches_single_device(results, case):
    ranks = results[case]  # each rank compared the loss and every gradient slice it holds, by name
    assert_every_parameter_compared(
        ranks[0]["parameter_groups"], {r["rank"]: set(r["checked_params"]) for r in ranks}
    )
    types = ranks[0]["types"]
    if case == "scaled-embedding":
        assert types["embed"] == "ScaledEmbedding" and types["layers.0.up"] == "ScaledLinear"
    elif case == "hf-gpt-neox":
        assert types["gpt_neox.layers.0.attention.query_key_value"] == "ColumnParallelLinear"
    elif case.startswith("qk-norm"):  # the attention split, its norms replicated
        assert (
            types["layers.0.attn.q_proj"] == "ColumnParallelLinear"
            and types["layers.0.attn.q_norm"] == "LayerNorm"
        )
        assert ranks[0]["sequence_parallel"] == (case == "qk-norm")
    # q, k and v split, each entering from its own argument
    elif case.startswith("shared-arguments"):
        assert types["layers.0.attn.k_proj"] == "ColumnParallelLinear"
        assert ranks[0]["sequence_parallel"] == (case == "shared-arguments")
    # split by heads, each rank's heads whole with their q, k and v
    elif case == "interleaved-per-head":
        assert (
            types["layers.0.attn.qkv"] == "ColumnParallelLinear"
            and types["layers.0.attn.o_proj"] == "RowParallelLinear"
        )
    # the MLP split; without sequence parallelism its residual's gradient
    elif case.startswith("residual-mlp"):
        # was summed over the ranks (x2), with it the residual read the gathered sequence (a shape
        # error)
        assert (
            types["layers.0.mlp.up"] == "ColumnParallelLinear"
            and types["layers.0.mlp.down"] == "RowParallelLinear"
        )
        assert ranks[0]["sequence_parallel"] == (case == "residual-mlp")
    elif case == "list-output":
        assert ranks[0]["sequence_parallel"] and types["layers.0.up"] == "ColumnParallelLinear"
    # Moshi: the gated MLP's [gate | up] halves each split, not one per rank
    elif case.startswith("moshi-like"):
        # (silently wrong: rank 0 held the whole gate); sequence parallelism enters at the wrapped
        # projections' attention, which views by its input's (batch, seq) (was a shape error)
        assert (
            types["layers.0.mlp.fc1"] == "ColumnParallelLinear"
            and types["layers.0.attn.q_proj.linear"] == "ColumnParallelLinear"
        )
        assert ranks[0]["sequence_parallel"] == (case == "moshi-like")
    # Note [what acts on each token on its own]: the MLP split, no sequence parallelism
    elif case.endswith("-mixer"):
        assert types["layers.0.up"] == "ColumnParallelLinear" and not ranks[0]["sequence_parallel"]
    elif case in ("interleaved-grouped", "hf-codegen"):  # attention replicated, the MLP still split
        pair = ("layers.0.attn.qkv", "layers.0.attn.o_proj")
        pair = (
            pair
            if case == "interleaved-grouped"
            else ("transformer.h.0.attn.qkv_proj", "transformer.h.0.attn.out_proj")
        )
        assert {types[path] for path in pair} == {"Linear"}
        assert "ColumnParallelLinear" in types.values() and "RowParallelLinear" in types.values()
    else:  # the key/value heads are split (replicated on both ranks), not left whole by accident
        assert "ColumnParallelLinear" in types.values() and "RowParallelLinear" in types.values()


@pytest.mark.parametrize(("mixer", "op"), [("fft", "fft_fft"), ("cumsum", "cumsum")])
def test_sequence_parallelism_is_refused_around_a_token_mixer_that_is_no_attention(mixer, op):
    # FNet mixes tokens with an FFT over the sequence; seen as an elementwise op, sequence
    # parallelism ran it on each rank's part of the sequence: losses 5e-3 off under tp 2, no error.
    # Only ops proved to act per token may run outside the split regions (Note [what acts on each
    # token on its own]).
    graph = traced(f"tests.tiny_lms:mixer_lm mixer={mixer}")
    assert (
        f"layers.0 ({op}) computes {op}, not proved to act per token"
        in graph.structure.whole_sequence(graph)
    )
    plan = hp.plan(graph, hp.ClusterSpec.preset("cpu", gpus_per_node=2), 4, 16, "fp32", tp=2, pp=1)
    assert plan.parallel.tp == 2 and not plan.parallel.sequence_parallel
    data = plan.to_dict()
    data["parallel"]["sequence_parallel"] = True
    with pytest.raises(ConfigError, match=rf"sequence_parallel: layers.0 \({op}\) computes"):
        check_plan(hp.Plan.from_dict(data), graph, 2)
    # A transformer block's ops outside its split regions (norms, residual adds, dropout) all act
    # per token.
    gpt2 = traced("hf:GPT2LMHeadModel n_layer=1 n_embd=32 n_head=4 vocab_size=64 n_positions=32")
    assert gpt2.structure.whole_sequence(gpt2) is None


def test_the_trace_records_which_layers_run_their_base_forward():
    graph = traced(SCALED)
    assert graph.op("embed").base_forward == "" and graph.op("layers.0.up").base_forward == ""
    assert graph.op("layers.1.up").base_forward == "Linear" and graph.op("norm").base_forward == ""
    gpt2 = traced("hf:GPT2LMHeadModel n_layer=1 n_embd=32 n_head=4 vocab_size=64 n_positions=32")
    assert gpt2.op("transformer.h.0.attn.c_attn").base_forward == "Conv1D"
    assert gpt2.op("transformer.wte").base_forward == "Embedding"


PHI3 = (
    "hf:phi3 num_hidden_layers=2 hidden_size=96 num_attention_heads=12 num_key_value_heads=4 "
    "intermediate_size=144 vocab_size=128 pad_token_id=0 bos_token_id=0 eos_token_id=0"
)


@pytest.mark.parametrize(
    ("spec", "module", "construct", "attention"),
    [
        # nanoGPT's qkv.split(self.n_embd, dim=2): three full-width pieces of a half-width rank
        # output
        (
            "tests.tiny_lms:config_split_lm",
            "layers.0.attn",
            "not enough values to unpack",
            "layers.*.attn",
        ),
        # Phi-3 slices its fused qkv at config.num_attention_heads * head_dim: every column reaches
        # the query
        (PHI3, "model.layers.0.self_attn.o_proj", "same reduction dim", "model.layers.*.self_attn"),
    ],
)
def test_a_hand_split_of_a_module_sized_by_its_config_is_refused_before_any_collective(
    world_of_one, spec, module, construct, attention
):
    # Note [one rank's sizes, run on meta]: one line naming the module, from a pretend rank 0 of 2,
    # no group made. The planner replicates such an attention (tests/test_local_shapes.py); a
    # hand-written map splitting it is refused.
    world_of_one.setenv("WORLD_SIZE", "2")
    world_of_one.setenv("RANK", "0")
    model = hp.models.load(spec).module
    planned = hp.plan(
        model,
        hp.ClusterSpec.preset("cpu", gpus_per_node=2),
        4,
        16,
        "fp32",
        tp=2,
        pp=1,
        micro_batch=4,
    )
    data = planned.to_dict()
    column, row = ("qkv", "o_proj") if spec.startswith("tests.") else ("qkv_proj", "o_proj")
    data["tensor_parallel"].update({f"{attention}.{column}": "column", f"{attention}.{row}": "row"})
    plan = hp.Plan.from_dict(data)
    with pytest.raises(
        ConfigError, match=rf"tensor_parallel: {module}\S* does not run at one rank's sizes"
    ) as error:
        hp.parallelize(model, plan, device="cpu")
    assert construct in str(error.value) and "\n" not in str(error.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("spec", "attn", "column", "row"),
    [
        (CODEGEN, "transformer.h.0.attn", "qkv_proj", "out_proj"),
        ("tests.tiny_lms:interleaved_lm groups=2", "layers.0.attn", "qkv", "o_proj"),
    ],
)
def test_a_fused_projection_interleaved_by_groups_of_heads_is_replicated(spec, attn, column, row):
    # Note [fused layouts read from the graph]: q | v | k of several heads per group, cut inside
    # each group.
    analysis = traced(spec).structure
    qkv, out = f"{attn}.{column}", f"{attn}.{row}"
    assert analysis.styles[qkv] == analysis.styles[out] == "replicate"
    assert analysis.unsplittable[qkv].startswith(
        "fused layout not recognised: its output is viewed as"
    )
    assert f"its column partner {qkv}: fused layout not recognised" in analysis.unsplittable[out]
    assert any(style == "column" for style in analysis.styles.values())  # the MLP still splits


def test_a_fused_projection_interleaved_per_head_splits_by_heads():
    # (..., heads, 3, head_dim) unbound
    analysis = traced("tests.tiny_lms:interleaved_lm").structure
    assert (
        analysis.styles["layers.0.attn.qkv"] == "column"
        and analysis.styles["layers.0.attn.o_proj"] == "row"
    )
    assert not analysis.unsplittable


def test_a_hand_written_split_of_an_unrecognised_fused_layout_is_refused():
    styles = {"transformer.h.*.attn.qkv_proj": "column", "transformer.h.*.attn.out_proj": "row"}
    with pytest.raises(
        ConfigError, match=r"cannot split transformer.h.0.attn.qkv_proj \(column; fused layout not"
    ) as error:
        check_plan(tp_plan(styles), traced(CODEGEN), 2)
    message = str(error.value)
    assert (
        "transformer.h.0.attn.out_proj (row; its column partner transformer.h.0.attn.qkv_proj:"
        " fused" in message
    )
    assert "\n" not in message
    assert not dist.is_initialized()


def test_sequence_parallel_is_refused_around_a_replicated_attention():
    # Under sequence parallelism a replicated attention would attend within its rank's part of the
    # sequence.
    graph = traced(CODEGEN)
    plan = hp.plan(graph, hp.ClusterSpec.preset("cpu", gpus_per_node=2), 4, 16, "fp32", tp=2, pp=1)
    assert not plan.parallel.sequence_parallel
    data = plan.to_dict()
    data["parallel"]["sequence_parallel"] = True
    with pytest.raises(
        ConfigError, match=r"sequence_parallel: transformer.h.0.attn mixes the whole sequence"
    ):
        check_plan(hp.Plan.from_dict(data), graph, 2)


def test_groups_sized_by_the_config_at_one_ranks_sizes_are_refused(world_of_one):
    # CodeGen with as many heads as mp_num groups looks per head, but its view sizes each group from
    # embed_dim, which tp divides: at one rank's sizes the groups are regrouped. Refused before any
    # collective.
    world_of_one.setenv("WORLD_SIZE", "2")
    world_of_one.setenv("RANK", "0")
    model = hp.models.load(CODEGEN.replace("n_head=8", "n_head=4")).module
    plan = hp.plan(
        model,
        hp.ClusterSpec.preset("cpu", gpus_per_node=2),
        4,
        16,
        "fp32",
        tp=2,
        pp=1,
        micro_batch=4,
    )
    # The planner runs the same dry run and keeps that attention replicated (Note [the planner
    # replicates what fails at one rank's sizes]); a hand-written map splitting it, as its graph
    # alone would allow, is refused.
    assert plan.tensor_parallel["transformer.h.*.attn.qkv_proj"] == "replicate"
    data = plan.to_dict()
    data["tensor_parallel"].update(
        {"transformer.h.*.attn.qkv_proj": "column", "transformer.h.*.attn.out_proj": "row"}
    )
    plan = hp.Plan.from_dict(data)
    with pytest.raises(
        ConfigError, match=r"cannot split transformer.h.0.attn.qkv_proj \(column; fused layout not"
    ) as e:
        hp.parallelize(model, plan, device="cpu")
    assert (
        "viewed as 4 groups of (48,), but at one rank's sizes under tp = 2 as 4 groups of (24,)"
        in str(e.value)
    )
    assert "\n" not in str(e.value) and not dist.is_initialized()


def test_a_learned_value_entering_the_split_heads_without_a_column_keeps_the_attention_whole():
    # Note [a learned value entering a split region] (hyparallel/graph/structure.py): DeepSeek's
    # rotary key part k_rot comes from the replicated kv_a_proj_with_mqa into every head; split, its
    # gradient was one rank's share (kv_a_proj_with_mqa's gradient 6e-3 off at tp 2, no error). The
    # attention stays whole, the MLP splits.
    from hyparallel.tools.parity import small_spec

    analysis = traced(small_spec("hf:DeepseekV3ForCausalLM")).structure
    attn = "model.layers.0.self_attn"
    for name in ("q_b_proj", "kv_b_proj", "o_proj"):
        assert analysis.styles[f"{attn}.{name}"] == "replicate", name
    assert (
        "feeds its split region without a column Linear"
        in analysis.unsplittable[f"{attn}.kv_b_proj"]
    )
    assert f"its row partner {attn}.o_proj stays whole" in analysis.unsplittable[f"{attn}.q_b_proj"]
    # its MLP: the shared experts beside the routed ones (a small copy routes in every layer)
    assert analysis.styles["model.layers.0.mlp.shared_experts.gate_proj"] == "column"
    assert analysis.styles["model.layers.0.mlp.shared_experts.down_proj"] == "row"


def test_a_single_head_mixer_stays_whole_and_the_rest_splits():
    # Lfm3's and BailingHybrid's convolution / linear-attention mixers look like one-head attention:
    # tp 2 was refused for the whole model ("tp 2 does not divide the 1 attention heads"); now that
    # mixer stays replicated.
    model = hp.models.load("tests.tiny_lms:mqa_lm heads=1").module
    analysis = hp.trace(model, hp.models.example_inputs(model, 1, 16)).structure
    assert "single head" in analysis.unsplittable["layers.0.attn.q_proj"]
    assert analysis.styles["layers.0.up"] == "column" and analysis.styles["layers.0.down"] == "row"
    plan = hp.plan(model, hp.ClusterSpec.preset("cpu", gpus_per_node=2), 4, 16, "fp32", tp=2, pp=1)
    assert plan.tensor_parallel["layers.*.attn.q_proj"] == "replicate"


def test_sequence_parallelism_is_refused_for_columns_reading_flattened_tokens():
    # Llama 4's shared expert reads (tokens, hidden): gathering "the sequence" along dim 1 doubled
    # its width (mat1 and mat2 shapes cannot be multiplied, inside torch, at tp 2 with sequence
    # parallelism).
    import torch
    from torch import nn

    class FlatMLP(nn.Module):
        def __init__(self, hidden: int = 32):
            super().__init__()
            self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            return self.down(self.up(x.reshape(-1, x.size(-1))).relu()).view_as(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.layers = (
                nn.Embedding(64, 32),
                nn.ModuleList(FlatMLP() for _ in range(2)),
            )

        def forward(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = x + layer(x)
            return x

    graph = hp.trace(Net().to("meta"), torch.zeros(1, 16, dtype=torch.long, device="meta"))
    assert "reads a 2-d input" in graph.structure.whole_sequence(graph)
    plan = hp.plan(graph, hp.ClusterSpec.preset("cpu", gpus_per_node=2), 4, 16, "fp32", tp=2, pp=1)
    assert not plan.parallel.sequence_parallel


def test_sequence_parallelism_is_refused_for_a_second_stack_of_blocks():
    # An encoder-decoder's decoder reads a token stream computed afresh from its own inputs:
    # sequence parallelism split the sequence at the encoder's first block only, so the decoder's
    # split regions gathered a whole sequence again (BART tp 2: a shape error in the
    # cross-attention).
    graph = traced(small_spec("hf:BartForConditionalGeneration"))
    reason = graph.structure.whole_sequence(graph)
    assert (
        reason.startswith("sequence_parallel: model.decoder.layers.0 reads") and "\n" not in reason
    )
    assert "does not come through the blocks before it" in reason
    plan = hp.plan(graph, hp.ClusterSpec.preset("cpu", gpus_per_node=2), 4, 16, "fp32", tp=2, pp=1)
    assert plan.parallel.tp == 2 and not plan.parallel.sequence_parallel
    # one stack: sequence parallelism as before
    decoder_only = traced(small_spec("hf:BartForCausalLM"))
    assert decoder_only.structure.whole_sequence(decoder_only) is None


class _ScaledOwnLinear(torch.nn.Module):
    """F.linear and a scale: not the plain layer."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 4))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight) * 2.0


class _PaddedOwnEmbedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 4))

    def forward(self, ids):
        return torch.nn.functional.embedding(ids, self.weight, padding_idx=0)


def test_a_layer_computing_exactly_linear_or_embedding_is_split_as_one():
    # Note [a layer that computes a standard one]: read from its forward, traced on its own
    from hyparallel.graph.kinds import base_forward
    from tests.tiny_lms import OwnEmbedding, OwnLinear

    assert (
        base_forward(OwnLinear(4, 4)) == "Linear"
        and base_forward(OwnLinear(4, 4, bias=True)) == "Linear"
    )
    assert base_forward(OwnEmbedding(8, 4)) == "Embedding"
    assert base_forward(_ScaledOwnLinear()) == "" and base_forward(_PaddedOwnEmbedding()) == ""
    graph = traced("tests.tiny_lms:dict_layers_lm n=2")
    # a ModuleDict's layers are blocks
    assert [b.path for b in graph.blocks] == ["layers.0", "layers.1"]
    styles = graph.structure.styles
    assert (
        styles["layers.0.attention.wq"] == "column" and styles["layers.0.feed_forward.w2"] == "row"
    )


def test_torchs_transformer_encoder_is_traced_into_and_its_feed_forward_split():
    # Note [torch's own layers with children are traced into]: nn.TransformerEncoder was one opaque
    # op (tp split only the embedding and head; no pipeline cut between its layers). Now its layers
    # are blocks, linear1 / linear2 a column / row pair, and nn.MultiheadAttention (out_proj read,
    # not called) one attention op kept whole.
    graph = traced("tests.tiny_lms:torch_encoder_lm layers=2")
    assert [b.path for b in graph.blocks] == ["encoder.layers.0", "encoder.layers.1"]
    attention = [op for op in graph.ops if op.kind == "attention"]
    assert [op.module for op in attention] == [
        "encoder.layers.0.self_attn",
        "encoder.layers.1.self_attn",
    ]
    assert "encoder.layers.0.self_attn.in_proj_weight" in attention[0].params
    styles = graph.structure.styles
    assert (
        styles["encoder.layers.0.linear1"] == "column"
        and styles["encoder.layers.1.linear2"] == "row"
    )
    assert not any(path.startswith("encoder.layers.0.self_attn") for path in styles)
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=2)
    with pytest.raises(
        hp.PlanError, match=r"^sequence_parallel: encoder\.layers\.0\.self_attn mixes the whole"
    ):
        hp.plan(graph, cluster, 4, 16, "fp32", tp=2, sequence_parallel=True)
