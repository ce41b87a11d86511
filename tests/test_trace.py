"""hyparallel.trace: counts checked against closed forms, graph structure, fallbacks and errors."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from torch import nn

import hyparallel as hp
from hyparallel.spec.errors import TraceError

from .conftest import HF_GPT2_TINY, HF_LLAMA_TINY, HF_T5_TINY

B, S = 2, 32


def gpt_flops(cfg, batch, seq):
    """Megatron-LM's forward model FLOPs: per layer 24*B*s*h^2 + 4*B*s^2*h, plus 2*B*s*h*V for the
    head."""
    h = cfg.hidden_size
    return (
        cfg.num_layers * (24 * batch * seq * h * h + 4 * batch * seq * seq * h)
        + 2 * batch * seq * h * cfg.vocab_size
    )


def llama_layer_flops(hidden, heads, kv_heads, ffn, batch, seq):
    head_dim = hidden // heads
    # q, o and the smaller k, v
    projections = 2 * batch * seq * hidden * (2 * hidden + 2 * kv_heads * head_dim)
    mlp = 3 * 2 * batch * seq * hidden * ffn  # gate, up, down
    return projections + mlp + 4 * batch * seq * seq * hidden


def check_counts(model, graph):
    assert graph.num_params == sum(p.numel() for p in model.parameters())
    assert graph.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    owners = [p for op in graph.ops for p in op.params if op.param_count]
    assert sorted(set(owners)) == sorted(name for name, _ in model.named_parameters())


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-125m", "gpt-1.3b", "gpt-175b"])
def test_zoo_gpt_matches_closed_forms(name):
    model = hp.models.build(name)
    seq = 2048 if name == "gpt-175b" else S
    graph = hp.trace(model, model.example_inputs(1 if name == "gpt-175b" else B, seq))
    batch = 1 if name == "gpt-175b" else B
    cfg = model.config
    assert graph.method == "fx"
    check_counts(model, graph)
    assert graph.flops == gpt_flops(cfg, batch, seq)
    assert len(graph.blocks) == cfg.num_layers == graph.num_layers
    per_layer = 24 * batch * seq * cfg.hidden_size**2 + 4 * batch * seq * seq * cfg.hidden_size
    assert {block.flops for block in graph.blocks} == {per_layer}


@pytest.mark.parametrize("name", ["llama-tiny", "llama-7b", "llama-70b"])
def test_zoo_llama_matches_closed_forms(name):
    model = hp.models.build(name)
    cfg = model.config
    graph = hp.trace(model, model.example_inputs(B, S))
    check_counts(model, graph)
    layer = llama_layer_flops(
        cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.ffn_hidden_size, B, S
    )
    assert {block.flops for block in graph.blocks} == {layer}
    assert graph.flops == cfg.num_layers * layer + 2 * B * S * cfg.hidden_size * cfg.vocab_size


def test_hf_gpt2_traced_with_export():
    model = hp.models.load(HF_GPT2_TINY).module
    graph = hp.trace(model, hp.models.example_inputs(model, B, S))
    assert graph.method == "export"
    check_counts(model, graph)
    cfg = model.config
    assert (
        graph.flops
        == cfg.n_layer * (24 * B * S * cfg.n_embd**2 + 4 * B * S * S * cfg.n_embd)
        + 2 * B * S * cfg.n_embd * cfg.vocab_size
    )
    assert [b.path for b in graph.blocks] == ["transformer.h.0", "transformer.h.1"]
    c_attn = graph.op("transformer.h.0.attn.c_attn")  # transformers' Conv1D: a transposed Linear
    assert c_attn.kind == "linear" and c_attn.target == "Conv1D"
    assert c_attn.params == (
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.attn.c_attn.bias",
    )
    assert c_attn.output_shapes == ((B, S, 3 * cfg.n_embd),)
    head = graph.op("lm_head")  # tied to the token embedding: read, not owned
    assert head.params == ("transformer.wte.weight",) and head.param_count == 0


def test_hf_gpt2_default_config_on_meta():
    model = hp.models.load("hf:GPT2LMHeadModel").module  # the 124M GPT-2
    graph = hp.trace(model, hp.models.example_inputs(model, 1, 1024))
    assert graph.num_params == sum(p.numel() for p in model.parameters()) == 124_439_808
    assert graph.flops == gpt_flops(
        hp.models.GPTConfig(num_layers=12, hidden_size=768, num_heads=12, vocab_size=50257), 1, 1024
    )


def test_hf_llama_with_grouped_query_attention():
    model = hp.models.load(HF_LLAMA_TINY).module
    graph = hp.trace(model, hp.models.example_inputs(model, B, S))
    assert graph.method == "export"
    check_counts(model, graph)
    cfg = model.config
    layer = llama_layer_flops(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
        B,
        S,
    )
    assert (
        graph.flops == cfg.num_hidden_layers * layer + 2 * B * S * cfg.hidden_size * cfg.vocab_size
    )
    # LlamaRMSNorm, grouped from its ATen ops
    assert graph.op("model.layers.0.input_layernorm").kind == "norm"
    assert graph.op("model.layers.1.self_attn.k_proj").output_shapes == ((B, S, 2 * 16),)


def test_hf_llama_at_7b_shapes_on_meta():
    # LlamaConfig defaults are Llama-7B's shapes
    model = hp.models.load("hf:llama num_hidden_layers=4").module
    graph = hp.trace(model, hp.models.example_inputs(model, 1, 512))
    check_counts(model, graph)
    assert len(graph.blocks) == 4


def test_sequential_mlp():
    mlp = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    ).to("meta")
    graph = hp.trace(mlp, torch.zeros(8, 32))
    check_counts(mlp, graph)
    assert graph.flops == 2 * 8 * (32 * 64 + 64 * 64 + 64 * 10)
    assert [op.kind for op in graph.compute_ops()] == [
        "linear",
        "activation",
        "linear",
        "activation",
        "linear",
    ]
    assert graph.blocks == () and graph.num_layers == 3
    assert [cut.after for cut in graph.cut_points] == ["0", "2"]
    assert [cut.bytes for cut in graph.cut_points] == [8 * 64 * 4, 8 * 64 * 4]


class _Activations(nn.Module):
    """Activations as modules and as functions, GELU's approximation in each form."""

    def __init__(self):
        super().__init__()
        self.exact, self.tanh, self.silu = nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU()

    def forward(self, x):
        x = self.silu(self.tanh(self.exact(x)))
        return torch.nn.functional.gelu(torch.nn.functional.gelu(x, approximate="tanh"))


@pytest.mark.parametrize("method", ["fx", "export"])
def test_activations_are_named_with_their_variant(method):
    # What a CPU's per-element activation costs are keyed by (Note [activations a CPU computes] in
    # cluster.py).
    graph = hp.trace(_Activations(), torch.zeros(2, 8), method=method)
    functions = [op.function for op in graph.compute_ops() if op.kind == "activation"]
    assert functions == ["gelu", "gelu_tanh", "silu", "gelu_tanh", "gelu"], functions


def test_graph_is_a_dag_in_execution_order(gpt_tiny_graph):
    _, graph = gpt_tiny_graph
    g = graph.graph
    assert isinstance(g, nx.DiGraph) and nx.is_directed_acyclic_graph(g)
    assert [op.index for op in graph.ops] == list(range(len(graph.ops)))
    for u, v, data in g.edges(data=True):
        assert g.nodes[u]["index"] < g.nodes[v]["index"]
        assert data["bytes"] >= 0 and data["tensors"]
    qkv = g.nodes["layers.0.attn.qkv"]
    assert qkv["kind"] == "linear" and qkv["module"] == "layers.0.attn.qkv"
    assert qkv["param_count"] == 64 * 192 + 192 and qkv["flops"] == 2 * B * 16 * 64 * 192
    # the owned parameters' shapes, in params order
    assert qkv["param_shapes"] == ((192, 64), (192,))
    # The tied head reads the embedding's weight and owns nothing: the embedding holds its shape.
    assert (
        graph.op("output").params == ("tok_embeddings.weight",)
        and graph.op("output").param_shapes == ()
    )
    assert graph.op("tok_embeddings").param_shapes == ((256, 64),)
    assert qkv["output_shapes"] == ((B, 16, 192),) and qkv["output_bytes"] == B * 16 * 192 * 4
    assert g.edges["layers.0.attn.qkv", "chunk"]["bytes"] == B * 16 * 192 * 4
    assert g.nodes["scaled_dot_product_attention"]["kind"] == "attention"
    assert g.nodes["scaled_dot_product_attention"]["module"] == "layers.0.attn"
    assert graph.op("tokens").kind == "input" and graph.ops[-1].kind == "output"


def test_cut_points_between_layers_carry_the_hidden_state():
    gpt = hp.models.build("gpt-mini")
    graph = hp.trace(gpt, gpt.example_inputs(B, S))
    h = gpt.config.hidden_size
    between = [cut for cut in graph.cut_points if graph.op(cut.before).module.startswith("layers.")]
    assert len(between) == gpt.config.num_layers  # before each layer
    assert all(len(cut.tensors) == 1 and cut.bytes == B * S * h * 4 for cut in between)
    # Llama also passes the rotary cos/sin tables (S x head_dim each) between layers.
    llama = hp.models.build("llama-tiny")
    graph = hp.trace(llama, llama.example_inputs(B, S))
    cfg = llama.config
    inner = [
        c
        for c in graph.cut_points
        if graph.op(c.after).module.startswith("layers.")
        and graph.op(c.before).module.startswith("layers.")
    ]
    assert len(inner) == cfg.num_layers - 1
    assert all(
        c.bytes == (B * S * cfg.hidden_size + 2 * S * cfg.head_dim) * 4 and len(c.tensors) == 3
        for c in inner
    )


@pytest.mark.parametrize("spec", ["gpt-tiny", "llama-tiny", HF_GPT2_TINY, HF_LLAMA_TINY])
def test_segments_partition_the_ops(spec):
    model = hp.models.load(spec).module
    graph = hp.trace(model, hp.models.example_inputs(model, B, S))
    segments = graph.segments()
    assert [name for s in segments for name in s.ops] == [op.name for op in graph.compute_ops()]
    assert sum(s.flops for s in segments) == graph.flops
    assert sum(s.param_count for s in segments) == graph.num_params
    assert [s.modules[0] for s in segments if s.is_block] == [b.path for b in graph.blocks]
    assert len(segments) == len(graph.cut_points) + 1


def test_real_model_is_traced_on_meta_and_left_untouched():
    torch.manual_seed(0)
    model = hp.models.build("gpt-tiny", device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    graph = hp.trace(model, model.example_inputs(B, S, device="cpu"))
    assert all(not p.is_meta for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    meta_model = hp.models.build("gpt-tiny")
    assert (
        graph.flops
        == hp.trace(meta_model, meta_model.example_inputs(B, S)).flops
        == gpt_flops(model.config, B, S)
    )


class ShapeBranch(nn.Module):
    """Python control flow on a shape: symbolic tracing fails, torch.export specialises it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        if x.size(1) > 4:
            return self.proj(x).relu()
        return self.proj(x)


class ValueBranch(nn.Module):
    """Control flow on tensor values: no tracer can follow it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.proj(x)
        return -x


class OptionalTargets(nn.Module):
    """A forward with an optional argument the example inputs leave out."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, targets=None):
        y = self.proj(x)
        if targets is not None:
            return ((y - targets) ** 2).mean()
        return y


def test_falls_back_to_export_when_symbolic_tracing_fails():
    model = ShapeBranch().to("meta")
    graph = hp.trace(model, torch.zeros(2, 6, 8))
    assert graph.method == "export"
    assert graph.flops == 2 * 2 * 6 * 8 * 8 and graph.num_params == 72


def test_untraceable_model_names_the_construct_the_module_and_the_line():
    model = nn.Sequential(nn.Linear(8, 8), ValueBranch()).to("meta")
    with pytest.raises(TraceError) as info:
        hp.trace(model, torch.zeros(2, 8))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "cannot trace Sequential: torch.fx: TraceError: symbolically traced variables cannot be"
        " used as inputs to control flow (in module '1', test_trace.py:"
    )
    assert "torch.export: " in message and message.count("in module '1'") == 2
    assert "if x.sum() > 0:" in message and "torch.where or torch.cond" in message
    assert "data-dependent" in message and "shape mismatch" not in message


class WrongReshape(nn.Module):
    """Splits 64 features into heads of the wrong size: a shape error, no control flow anywhere."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x):
        y = self.proj(x)
        return y.view(2, 16, 4, 16)  # (2, 8, 64) holds 1024 elements, not 2048


class TooNarrow(nn.Module):
    """Feeds 16 features to a Linear that takes 32."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 8)

    def forward(self, x):
        return self.proj(x)  # 16 features in, 32 expected


class NeedsMask(nn.Module):
    """A forward with a second required input."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask):
        return self.proj(x) * mask


def line_of(code: str) -> str:
    """``test_trace.py:N:`` for the line of this file holding ``code``."""
    lines = open(__file__).read().splitlines()
    return f"test_trace.py:{next(i for i, line in enumerate(lines, 1) if code in line)}:"


@pytest.mark.parametrize(
    ("model", "example", "error", "line"),
    [
        (
            WrongReshape,
            torch.zeros(2, 8, 64),
            "shape '[2, 16, 4, 16]' is invalid for input of size 1024",
            "y.view(2,",
        ),
        (TooNarrow, torch.zeros(2, 16), "[2, 16] X [32, 8]", "# 16 features in"),
    ],
)
def test_a_shape_error_is_called_a_shape_mismatch_at_the_users_line(model, example, error, line):
    with pytest.raises(TraceError) as info:
        hp.trace(model().to("meta"), example)
    message = str(info.value)
    assert "\n" not in message and error in message and "shape mismatch" in message
    assert "control flow that depends" not in message and "torch.where" not in message
    # both tracers: fx from the graph node's recorded source line
    assert message.count(line_of(line)) == 2
    assert "<string>" not in message and "<eval_with_key>" not in message


def test_a_missing_required_input_is_named_with_how_to_pass_it():
    with pytest.raises(TraceError) as info:
        hp.trace(NeedsMask().to("meta"), torch.zeros(2, 8))
    message = str(info.value)
    assert "\n" not in message and "torch.where" not in message
    assert "NeedsMask.forward needs mask, which the example inputs (giving x) leave out" in message
    assert "example_inputs=" in message and "--example-inputs package.module:make_inputs" in message


def test_an_encoder_decoder_traces_and_plans_and_without_decoder_inputs_is_told_so():
    model = hp.models.load(HF_T5_TINY).module
    inputs = hp.models.example_inputs(model, B, S)
    assert set(inputs) == {"input_ids", "decoder_input_ids"}
    graph = hp.trace(model, inputs)
    check_counts(model, graph)
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=1)
    plan = hp.plan(model, cluster, global_batch=4, seq_len=S, dtype="fp32")
    assert (plan.parallel.tp, plan.parallel.pp) == (1, 1)
    with pytest.raises(TraceError) as info:
        hp.trace(model, {"input_ids": inputs["input_ids"]})
    message = str(info.value)
    assert "\n" not in message and "<string>" not in message and "torch.where" not in message
    assert "(in module 'decoder', modeling_t5.py:" in message
    assert (
        "forward needs decoder_input_ids or decoder_inputs_embeds, which the example inputs (giving"
        " input_ids)" in (message)
    )


def test_forcing_fx_on_a_hugging_face_model_fails_clearly():
    model = hp.models.load(HF_GPT2_TINY).module
    with pytest.raises(TraceError, match=r"^cannot trace GPT2LMHeadModel: torch\.fx: "):
        hp.trace(model, hp.models.example_inputs(model, B, S), method="fx")


def test_keyword_and_optional_inputs():
    model = OptionalTargets().to("meta")
    graph = hp.trace(model, {"x": torch.zeros(4, 8)})
    assert graph.method == "fx" and graph.flops == 2 * 4 * 8 * 8
    assert [op.name for op in graph.ops if op.kind == "input"] == ["x"]
    gpt = hp.models.build("gpt-tiny")
    assert hp.trace(gpt, {"tokens": torch.zeros(B, S, dtype=torch.long)}).flops == gpt_flops(
        gpt.config, B, S
    )


@pytest.mark.parametrize(
    ("exc", "cause"),
    [
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x16 and 32x8)"), "shape"),
        (
            RuntimeError(
                "The size of tensor a (8) must match the size of tensor b (4) at non-singleton"
                " dimension 1"
            ),
            "shape",
        ),
        (
            ValueError("You have to specify either decoder_input_ids or decoder_inputs_embeds"),
            "missing_input",
        ),
        (TypeError("forward() missing 1 required positional argument: 'mask'"), "missing_input"),
        (
            NotImplementedError("aten::bincount: attempted to run this operator with Meta tensors"),
            "unsupported_op",
        ),
        (RuntimeError("Could not guard on data-dependent expression u0 > 3"), "data_dependent"),
        (KeyError("weight"), "other"),
    ],
)
def test_trace_failures_are_classified_by_type_and_message(exc, cause):
    from hyparallel.graph.trace_errors import classify

    assert classify(exc) == cause


class Unsupported(nn.Module):
    """Calls an op that has no meta kernel."""

    def forward(self, x):
        return torch.bincount(x.flatten())


def test_an_op_without_a_meta_kernel_is_called_unsupported():
    with pytest.raises(TraceError) as info:
        hp.trace(Unsupported(), torch.zeros(2, 8, dtype=torch.long))
    message = str(info.value)
    assert (
        "aten::bincount" in message
        and "torch.library.register_fake" in message
        and "torch.where" not in message
    )


# ---- mixture-of-experts: grouped matrix products (Note [grouped matmul FLOPs]) -------------------


class GroupedExperts(nn.Module):
    """Expert weights (experts, hidden, ffn) applied to rows grouped by expert, as MoE layers run
    them."""

    def __init__(self, experts: int = 4, hidden: int = 16, ffn: int = 32):
        super().__init__()
        self.up = nn.Parameter(torch.empty(experts, hidden, ffn, dtype=torch.bfloat16))
        # 2 rows an expert
        self.register_buffer("offs", torch.arange(2, 2 * experts + 1, 2, dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(x, self.up, offs=self.offs)


def test_a_grouped_expert_matmul_counts_2mnk():
    with torch.device("meta"):
        model = GroupedExperts()
    graph = hp.trace(model, torch.zeros(8, 16, dtype=torch.bfloat16, device="meta"))
    assert graph.flops == 2 * 8 * 16 * 32  # each of the 8 rows times its expert's (16, 32) matrix


def test_hf_mixture_of_experts_counts_its_expert_matmuls():
    hidden, ffn, experts, top_k, tokens = 64, 128, 4, 2, 16
    model = hp.models.load(
        f"hf:MixtralForCausalLM num_hidden_layers=1 hidden_size={hidden} num_attention_heads=4"
        f" num_key_value_heads=2 intermediate_size={ffn} vocab_size=128 max_position_embeddings=64"
        f" num_local_experts={experts} num_experts_per_tok={top_k} bos_token_id=0 eos_token_id=0"
    ).module
    graph = hp.trace(model, {"input_ids": torch.zeros(1, tokens, dtype=torch.long, device="meta")})
    # every token runs through top_k experts: gate and up (hidden -> 2 ffn), down
    routed = tokens * top_k
    assert graph.flops_by_kind()["matmul"] == routed * (2 * hidden * 2 * ffn + 2 * ffn * hidden)


def test_a_hand_written_where_dispatch_traces_at_its_expected_routing():
    # Note [a size the data decides]: torch.where(chosen == e) has no meta kernel (issue 38: the
    # trace was refused); each expert is profiled on tokens * top_k / experts rows (balanced
    # routing), so the experts' matmuls cost what every token's top_k experts cost.
    hidden, experts, top_k, tokens = 32, 4, 2, 16
    model = hp.models.load(
        f"tests.tiny_lms:where_moe_lm hidden={hidden} experts={experts} top_k={top_k} layers=1"
    ).module
    graph = hp.trace(model, hp.models.example_inputs(model, 1, tokens))
    assert graph.method == "export"
    expert_flops = sum(op.flops for op in graph.ops if ".moe.experts." in op.module)
    # up (hidden -> 2 hidden) and down, on the routed rows
    assert expert_flops == tokens * top_k * (2 * hidden * 2 * hidden * 2)
    rows = {op.module: op for op in graph.ops if op.module == "layers.0.moe.experts.0.0"}
    assert rows and all(
        o.flops == 2 * (tokens * top_k // experts) * hidden * 2 * hidden for o in rows.values()
    )


def test_a_selection_by_any_other_mask_is_taken_whole():
    # Note [a size the data decides]: only a routed choice's share is known; any other mask is
    # profiled at its bound (every element), never less than what runs.
    class Positive(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            rows, _ = torch.where(x > 0)
            return self.linear(x.index_select(0, rows))

    graph = hp.trace(Positive(), torch.zeros(6, 8))
    (linear,) = [op for op in graph.ops if op.module == "linear"]
    assert linear.flops == 2 * (6 * 8) * 8 * 8


def test_a_failed_trace_leaves_the_grad_mode_as_it_was():
    # A trace that fails midway with autograd switched off (torch.export failing inside its no-grad
    # regions did, for CpmAnt) left it off for the process: every later backward failed ("element 0
    # of tensors does not require grad"). Here the model's own forward switches it off and then
    # fails, under both tracers.
    class OffThenFails(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            torch._C._set_grad_enabled(False)
            raise RuntimeError("no")

    with pytest.raises(hp.TraceError):
        hp.trace(OffThenFails().to("meta"), torch.zeros(2, 4, device="meta"))
    assert torch.is_grad_enabled()


def test_parameters_whose_ops_never_reach_the_output_are_unused():
    # BigBird's causal-LM head drops its pooler's output: DDP must ignore those parameters (no
    # gradient ever).
    class Dropped(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.pooler = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            pooled = self.pooler(x[:, 0])  # computed, never returned
            del pooled
            return self.used(x)

    graph = hp.trace(Dropped().to("meta"), torch.zeros(2, 4, 8, device="meta"))
    assert set(graph.unused_params) == {"pooler.weight", "pooler.bias"}


@pytest.mark.parametrize("method", ["fx", "export"])
def test_parameters_read_without_a_gradient_path_are_unused(method):
    # Mra's attention without its kernels returns zeros_like(query).requires_grad_(): its
    # projections run, but no loss reaches them; DDP waited for their gradients ("Expected to have
    # finished reduction" at the second step). Exactly the parameters one eager backward leaves
    # without a gradient, by name.
    from tests.tiny_lms import detached_lm

    model = detached_lm()
    tokens = torch.randint(0, 64, (2, 8))
    model(tokens).sum().backward()
    no_grad = {name for name, p in model.named_parameters() if p.grad is None}
    assert no_grad == {
        f"layers.{i}.attn.{p}_proj.{w}" for i in (0, 1) for p in "kv" for w in ("weight", "bias")
    }
    graph = hp.trace(
        detached_lm().to("meta"), torch.zeros(2, 8, dtype=torch.long, device="meta"), method=method
    )
    assert set(graph.unused_params) == no_grad
    assert graph.params_outside_logits == ()


class WritesInPlace(nn.Module):
    """Projections written into a zero tensor in place (``out[:, :4] = proj(x)``,
    ``out.add_(proj2(x))``): the head reads the tensor by its producer, the zeros, which carry no
    gradient."""

    def __init__(self, setitem: bool):
        super().__init__()
        self.setitem = setitem
        self.proj, self.proj2, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        out = torch.zeros_like(x)
        if self.setitem:  # torch.fx cannot record an item assignment
            out[:, :4] = self.proj(x[:, :4])
        out.add_(self.proj2(x))
        return self.head(out)


@pytest.mark.parametrize(
    ("method", "setitem"), [("fx", False), ("export", False), ("export", True)]
)
def test_parameters_written_in_place_into_what_reaches_the_output_are_used(method, setitem):
    # Listed unused, DDP would ignore them: their gradients never averaged, each rank training its
    # own, no error.
    graph = hp.trace(
        WritesInPlace(setitem).to("meta"), torch.zeros(2, 6, 8, device="meta"), method=method
    )
    assert graph.unused_params == ()


@pytest.mark.parametrize("method", ["fx", "export"])
def test_parameters_only_other_outputs_reach_are_outside_the_logits(method):
    # EncoderDecoderModel without cross-attention: the encoder's states are returned, the logits
    # never read them. No gradient under the default loss, one under a loss of the encoder's output:
    # not ignorable, found per step.
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder, self.dead = (
                nn.Linear(8, 8),
                nn.Linear(8, 8),
                nn.Linear(8, 8),
            )

        def forward(self, x):
            torch.zeros_like(self.dead(x))
            return {"logits": self.decoder(x), "encoder_last_hidden_state": self.encoder(x)}

    graph = hp.trace(TwoHeads().to("meta"), torch.zeros(2, 4, 8, device="meta"), method=method)
    assert set(graph.unused_params) == {"dead.weight", "dead.bias"}
    assert set(graph.params_outside_logits) == {"encoder.weight", "encoder.bias"}


def test_blocks_of_nested_module_lists_are_the_layers_and_do_not_overlap():
    # Funnel keeps its layers in a ModuleList of ModuleLists: both levels repeat, and counting both
    # as blocks counted each layer's work twice and made FSDP wrap a ModuleList, which has no
    # forward.
    model = hp.models.load("tests.tiny_lms:nested_lm").module
    graph = hp.trace(model, hp.models.example_inputs(model, 1, 16))
    assert [b.path for b in graph.blocks] == [
        "layers.0.0",
        "layers.0.1",
        "layers.1.0",
        "layers.1.1",
    ]
    ops = [name for block in graph.blocks for name in block.ops]
    assert len(ops) == len(set(ops))
    # one layer per group: the groups (ModuleLists, no forward of their own) are the repeated blocks
    model = hp.models.load("tests.tiny_lms:nested_lm per_group=1").module
    graph = hp.trace(model, hp.models.example_inputs(model, 1, 16))
    assert [b.path for b in graph.blocks] == ["layers.0", "layers.1"]


def test_a_no_grad_region_is_left_to_torch_export_which_records_it():
    # torch.fx records the ops inside `with torch.no_grad():` as ordinary ones; torch.export keeps
    # the region.
    model = hp.models.load("tests.tiny_lms:no_grad_lm").module
    graph = hp.trace(model, hp.models.example_inputs(model, 1, 16))
    assert graph.method == "export"
    regions = [
        n for n in graph.program.graph.nodes if "wrap_with_set_grad_enabled" in str(n.target)
    ]
    assert len(regions) == 1 and regions[0].args[0] is False
    assert torch.is_grad_enabled()


class VmapMasked(nn.Module):
    """Each block builds its sliding-window mask with torch.vmap, as Hugging Face's mask functions
    do (a window of its own width and index type: the same vmap entry, other ops inside)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            seq = torch.arange(x.shape[1], device=x.device, dtype=(torch.int64, torch.int32)[i % 2])
            window = torch.vmap(lambda q, seq=seq, i=i: ((seq <= q) & (seq > q - 2 - i)).float())(
                seq
            )
            x = window @ layer(x)
        return x


def test_a_vmap_in_every_block_is_profiled_as_it_runs():
    # The profiler replayed the second block's vmap entry from the first's (same op, same shapes):
    # it never entered the vmap, and what ran inside failed (T5Gemma2: "batched == nullptr INTERNAL
    # ASSERT FAILED").
    graph = hp.trace(VmapMasked().to("meta"), torch.zeros(2, 4, 8, device="meta"))
    assert graph.method == "export"
    assert [op.output_shapes for op in graph.compute_ops() if op.kind == "linear"] == [
        ((2, 4, 8),)
    ] * 2
    assert torch._C._functorch.get_dynamic_layer_stack_depth() == 0


def test_a_trace_failing_inside_a_vmap_leaves_torch_as_it_was():
    # T5Gemma2's failed export left a vmap level pushed: every later random op of the process raised
    # "vmap: called random operation while in randomness error mode", the next model could not even
    # be initialised.
    from hyparallel.graph.tracer import kept_torch_state

    with pytest.raises(RuntimeError, match="midway"), kept_torch_state():
        torch._C._functorch._vmap_increment_nesting(4, "error")
        torch.set_grad_enabled(False)
        raise RuntimeError("failed midway")
    assert torch._C._functorch.get_dynamic_layer_stack_depth() == 0 and torch.is_grad_enabled()
    assert torch.randn(3).shape == (3,)


def test_a_kv_cache_a_nested_config_asks_for_is_off_while_tracing():
    # VibeVoiceAsr and MossTranscribe take use_cache only through **kwargs, their text_config on:
    # the output held a DynamicCache, which torch.export refuses ("not a known type"); every layout
    # was refused as untraceable.
    from transformers import DynamicCache, PretrainedConfig

    class WithCache(nn.Module):
        def __init__(self):
            super().__init__()
            self.config, text = PretrainedConfig(), PretrainedConfig()
            self.config.use_cache, text.use_cache, self.config.text_config = False, True, text
            self.proj = nn.Linear(8, 8)

        def forward(self, x, **kwargs):
            out = {"logits": self.proj(x)}
            if self.config.text_config.use_cache:
                out["past_key_values"] = DynamicCache()
            return out

    model = WithCache().to("meta")
    graph = hp.trace(model, torch.zeros(2, 4, 8, device="meta"), method="export")
    assert [op.module for op in graph.compute_ops()] == ["proj"]
    assert model.config.text_config.use_cache  # the user's config as it was


class WritesIntoItsScores(nn.Module):
    """Each block writes into a tensor it computed (a gated delta rule's chunk loop: ``attn[..., i,
    :i] = ...``)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            h = layer(x)
            scores = h @ h.transpose(-1, -2)
            for i in range(1, 3):
                scores[..., i, :i] = scores[..., i, :i] * 0.5
            x = scores @ h
        return x


def test_a_write_into_a_repeated_blocks_output_is_profiled():
    # The profiler replays a repeated block's outputs as fresh tensors: requiring grad, they were
    # leaves, and the block's in-place write into them raised "a leaf Variable that requires grad is
    # being used in an in-place operation" (KimiLinear, OlmoHybrid, RecurrentGemma: untraceable).
    graph = hp.trace(
        WritesIntoItsScores().to("meta"), torch.zeros(2, 4, 8, device="meta"), method="export"
    )
    assert [op.module for op in graph.compute_ops() if op.kind == "linear"] == [
        "layers.0",
        "layers.1",
    ]
    assert graph.unused_params == ()


class ScanLayer(nn.Module):
    """RecurrentGemma's RG-LRU: a leaf module that writes each step's state into a zero tensor it
    returns."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x):
        out, state = torch.zeros_like(x), torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            state = self.gate * state + x[:, t]
            out[:, t] = state
        return out


class ScanLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"proj": nn.Linear(8, 8), "scan": ScanLayer()}) for _ in range(2)
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer["scan"](layer["proj"](x))
        return x


def test_a_leaf_module_returning_what_it_wrote_into_carries_a_gradient():
    # Exported, the leaf module's ops are one op whose output is the zeros it wrote into: recorded
    # as requiring no grad when created, the op cut every gradient path through it, and DDP ignored
    # the projections and gates (RecurrentGemma dp 2: their gradients each rank's own, 1.3 relative
    # off, no error).
    model = ScanLM()
    model(torch.randn(2, 4, 8)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    graph = hp.trace(ScanLM().to("meta"), torch.zeros(2, 4, 8, device="meta"), method="export")
    assert graph.unused_params == ()
