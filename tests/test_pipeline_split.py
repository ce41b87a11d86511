"""Stage splitting in one process: stages chained in order compute exactly what the model computes.

Every model is cut with the planner's stage map (the plan's `stages`), so the mechanism is tested on
the maps it will be given: zoo models through torch.fx, Hugging Face ones through torch.export. The
runtime itself runs here with one pipeline rank (pp = 1, virtual stages handed over in memory); the
multi-process runs are in test_pipeline.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hyparallel as hp
from hyparallel.pipeline import split_model
from hyparallel.pipeline.executor import PipelineRuntime
from hyparallel.spec.errors import ConfigError
from hyparallel.tensor.init import materialize_

from .conftest import assert_every_parameter_compared
from .distributed.harness import parameter_groups

logging.getLogger("transformers").setLevel(logging.ERROR)
SEED, BATCH, SEQ = 5, 2, 12
HF_COMMON = "bos_token_id=0 eos_token_id=0 vocab_size=96"
MODELS = {
    "gpt": "gpt-tiny num_layers=4",  # fused qkv, tied head, fx
    "llama": "llama-tiny num_layers=4",  # GQA, rotary buffers, untied head, fx
    "hf-gpt2": (
        f"hf:GPT2LMHeadModel n_layer=4 n_embd=32 n_head=4 n_positions=32 {HF_COMMON} "
        "resid_pdrop=0 embd_pdrop=0 attn_pdrop=0"
    ),
    "hf-llama": (
        "hf:LlamaForCausalLM num_hidden_layers=4 hidden_size=32 num_attention_heads=4"
        f" num_key_value_heads=2 intermediate_size=64 max_position_embeddings=32 {HF_COMMON}"
    ),
    "hf-qwen2": (  # qkv biases
        "hf:Qwen2ForCausalLM num_hidden_layers=4 hidden_size=32 num_attention_heads=4"
        " num_key_value_heads=2 intermediate_size=64 max_position_embeddings=32"
        f" tie_word_embeddings=true {HF_COMMON}"
    ),
    "hf-neox": (  # parallel residual
        "hf:GPTNeoXForCausalLM num_hidden_layers=4 hidden_size=32 num_attention_heads=4"
        " intermediate_size=64 max_position_embeddings=32 attention_dropout=0 hidden_dropout=0"
        f" {HF_COMMON}"
    ),
}


def vocab(model: nn.Module) -> int:
    return (
        model.get_input_embeddings().num_embeddings
        if hasattr(model, "get_input_embeddings")
        else model.config.vocab_size
    )


def logits_of(output):
    return output.logits if hasattr(output, "logits") else output


def loss_fn(output, targets):
    return F.cross_entropy(logits_of(output).flatten(0, 1), targets.flatten())


def planned_stages(model: nn.Module, pp: int, **constraints) -> list[list[str]]:
    """The planner's stages for ``pp`` ranks; one per rank unless the constraints ask for virtual
    stages."""
    constraints.setdefault("schedule", "1f1b")
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=pp)
    plan = hp.plan(
        model,
        cluster,
        global_batch=BATCH * 2,
        seq_len=SEQ,
        dtype="fp32",
        pp=pp,
        tp=1,
        dp=1,
        micro_batch=BATCH,
        **constraints,
    )
    return [stage.modules for stage in plan.stages]


def batch(model: nn.Module, rows: int = BATCH):
    torch.manual_seed(0)
    tokens = torch.randint(0, vocab(model), (rows, SEQ + 1))
    return tokens[:, :-1], tokens[:, 1:]


def reference(spec: str):
    return materialize_(hp.models.load(spec).module, "cpu", seed=SEED)


@pytest.mark.parametrize("name", MODELS)
def test_chained_stages_equal_the_model_forward_and_backward(name):
    spec = MODELS[name]
    model = hp.models.load(spec).module
    stages = planned_stages(model, pp=3)
    inputs, targets = batch(model)
    split = split_model(model, stages, inputs.to("meta"))
    assert split.method == ("fx" if name in ("gpt", "llama") else "export")
    materialize_(model, "cpu", seed=SEED, only=split.state_names(range(3)))
    modules = [split.stage_module(k) for k in range(3)]
    flat, received = split.flatten_inputs(inputs), ()
    for module in modules:
        received = module(flat, received)
    loss = loss_fn(received, targets)
    loss.backward()

    ref = reference(spec)
    ref_loss = loss_fn(ref(inputs), targets)
    ref_loss.backward()
    # The same operations on the same values, but not always the same kernels: torch.export's
    # decomposed ops and the CPU's vector width choose other kernels for some of them (Hugging Face
    # Llama and Qwen2 gradients differ by 1.5e-7 relative on an AMD EPYC, not at all on an Intel
    # Xeon). So fp32 rounding: rtol 1e-5 / atol 1e-6.
    torch.testing.assert_close(logits_of(received), logits_of(ref(inputs)), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    ref_grads = dict(ref.named_parameters(remove_duplicate=False))
    compared = set()
    for module in modules:
        for pname, param in module.body.named_parameters():
            torch.testing.assert_close(
                param.grad,
                ref_grads[pname].grad,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, pname=pname: f"{pname}: {m}",
            )
            compared.add(pname)
    assert_every_parameter_compared(parameter_groups(ref), {"the stages": compared})


def test_boundaries_relay_values_a_later_stage_reads():
    model = hp.models.load(MODELS["hf-gpt2"]).module
    blocks = [f"transformer.h.{i}" for i in range(4)]
    split = split_model(
        model,
        [["transformer.wte", "transformer.wpe", blocks[0]], blocks[1:3], [blocks[3], "lm_head"]],
        torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta"),
    )
    first, middle, last = split.io
    assert first.inputs == () and last.outputs == ()
    assert first.outputs == middle.inputs and middle.outputs == last.inputs
    # the attention mask, made in stage 0, read in every stage
    relayed = set(first.outputs) & set(middle.outputs)
    assert len(relayed) == 1 and len(middle.outputs) == 2
    assert split.shared_state() == {"transformer.wte.weight": (0, 2)}  # tied embedding and head


def test_a_rank_materialises_only_its_stages_with_the_full_models_values():
    model = hp.models.load(MODELS["gpt"]).module
    split = split_model(
        model, planned_stages(model, pp=2), torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    )
    names = split.state_names(1)
    materialize_(model, "cpu", seed=SEED, only=names)
    ref = dict(reference(MODELS["gpt"]).named_parameters(remove_duplicate=False))
    real = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.is_meta}
    assert "layers.3.mlp.fc.weight" in real and "layers.0.mlp.fc.weight" not in real
    # the tied head is the embedding: one tensor
    assert {"output.weight", "tok_embeddings.weight"} <= real
    assert model.output.weight is model.tok_embeddings.weight
    # the same random stream, the same values: initialisation is exact (tests/test_tensor_init.py)
    for pname in real:
        assert torch.equal(model.get_parameter(pname), ref[pname]), pname


@pytest.mark.parametrize("name", ["gpt", "hf-llama"])
def test_runtime_with_one_rank_and_virtual_stages_matches_the_model(name):
    spec = MODELS[name]
    model = hp.models.load(spec).module
    stages = planned_stages(model, pp=1)
    # one device plans one stage; split it in two for two virtual stages on one rank
    if len(stages) == 1:
        modules = stages[0]
        cut = next(i for i, m in enumerate(modules) if "layers.2" in m)
        stages = [modules[:cut], modules[cut:]]
    inputs, targets = batch(model, rows=2 * BATCH)
    split = split_model(model, stages, inputs[:BATCH].to("meta"))
    runtime = one_rank_runtime(model, split, num_microbatches=2)
    loss = runtime.train_step(inputs, targets, loss_fn)
    # Both virtual stages on the one rank: the outputs of stage 0 go to stage 1 in memory, no send
    # or receive.
    assert runtime.last_order == ["0F0", "1F0", "1B0", "0F1", "0B0", "1F1", "1B1", "0B1"]
    ref = reference(spec)
    ref_loss = loss_fn(ref(inputs), targets)
    ref_loss.backward()
    ref_grads = dict(ref.named_parameters(remove_duplicate=False))
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
    compared = set()
    # micro-batch sums vs one whole-batch reduction: rounding only
    for pname, param in runtime.named_parameters():
        torch.testing.assert_close(
            param.grad,
            ref_grads[pname].grad,
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, pname=pname: f"{pname}: {m}",
        )
        compared.add(pname)
    assert_every_parameter_compared(parameter_groups(ref), {"the runtime": compared})


def test_stage_map_errors_name_the_module_and_the_fix():
    model = hp.models.load(MODELS["gpt"]).module
    example = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    head = ["tok_embeddings", "pos_embeddings", "layers.0", "layers.1"]
    tail = ["layers.2", "layers.3", "norm", "output"]
    with pytest.raises(ConfigError, match=r"stages\[1\]: 'layers.9' is not a module of GPT"):
        split_model(model, [head, ["layers.9"]], example)
    with pytest.raises(ConfigError, match="module 'layers.1' is in stages 0 and 1"):
        split_model(model, [head, ["layers.1", *tail]], example)
    with pytest.raises(
        ConfigError, match=r"module 'layers.1' \(stage 0\) runs after 'layers.0' \(stage 1\)"
    ):
        split_model(model, [[*head[:2], "layers.1"], ["layers.0", *tail]], example)
    with pytest.raises(ConfigError, match=r"stages\[1\] lists no modules"):
        split_model(model, [head + tail, []], example)


def test_a_listed_module_that_never_runs_leaves_its_stage_empty():
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.spare = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    with pytest.raises(ConfigError, match=r"stages\[1\] \(spare\) runs no operation"):
        split_model(Unused(), [["used"], ["spare"]], torch.zeros(2, 4))


def test_batches_that_do_not_split_or_do_not_match_the_export_trace_are_refused():
    spec = MODELS["hf-gpt2"]
    model = hp.models.load(spec).module
    split = split_model(
        model, planned_stages(model, pp=1), torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    )
    materialize_(model, "cpu", seed=SEED, only=split.state_names(0))
    runtime = PipelineRuntime(
        split, {0: split.stage_module(0)}, None, schedule_kind="1f1b", num_microbatches=2
    )
    inputs, targets = batch(model, rows=3)
    with pytest.raises(ConfigError, match="3 rows, which do not split into 2 equal micro-batches"):
        runtime.train_step(inputs, targets, loss_fn)
    inputs, targets = batch(model, rows=4 * BATCH)
    with pytest.raises(
        ConfigError,
        match=r"micro-batch input 0 has shape \(4, 12\) but the model was traced by torch.export",
    ):
        runtime.train_step(inputs, targets, loss_fn)
    with pytest.raises(TypeError, match="loss_fn must return a scalar tensor"):
        runtime.train_step(*batch(model, rows=2 * BATCH), lambda out, y: logits_of(out))
    with pytest.raises(ConfigError, match=r"pipeline rank 0 runs stages \[0\] but was given \[1\]"):
        PipelineRuntime(
            split, {1: split.stage_module(0)}, None, schedule_kind="1f1b", num_microbatches=2
        )


def test_from_plan_needs_stages_and_a_group_of_pp_ranks(repo):
    model = hp.models.load(MODELS["gpt"]).module
    # training + parallel only
    hand_written = hp.Plan.load(repo / "configs" / "plans" / "cpu-dp2-tp2-pp2.yaml")
    with pytest.raises(ConfigError, match="the plan lists no stages"):
        PipelineRuntime.from_plan(model, hand_written, None)
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=2)
    plan = hp.plan(model, cluster, global_batch=8, seq_len=SEQ, dtype="fp32", pp=2, tp=1, dp=1)
    with pytest.raises(
        ConfigError,
        match=r"the plan has pp = 2 but the pipeline group has 1 ranks; pass a group of 2 ranks",
    ):
        PipelineRuntime.from_plan(model, plan, None)
    assert all(p.is_meta for p in model.parameters())  # refused before anything was allocated


def test_a_split_cuts_the_callers_trace_without_tracing_again(monkeypatch):
    # Note [one trace] (hyparallel.runtime.parallel): with nothing swapped since, the split cuts a
    # copy of the ModelGraph's own trace. The stages are the same as a fresh trace's, and the
    # ModelGraph's trace is untouched.
    import hyparallel.pipeline.split as split_module

    model = hp.models.load(MODELS["gpt"]).module
    stages = planned_stages(model, pp=2)
    inputs, targets = batch(model)
    example = inputs.to("meta")
    graph = hp.trace(model, example)
    nodes_before = [(n.op, n.name) for n in graph.traced.gm.graph.nodes]
    fresh = split_model(model, stages, example)

    def no_trace(*args, **kwargs):
        raise AssertionError("traced again")

    monkeypatch.setattr(split_module, "first_program", no_trace)
    reused = split_model(model, stages, example, traced=graph)
    assert reused.io == fresh.io and reused.stage_of == fresh.stage_of
    assert [(n.op, n.name) for n in graph.traced.gm.graph.nodes] == nodes_before
    materialize_(model, "cpu", seed=SEED)
    outputs = []
    for split in (fresh, reused):
        received = ()
        for k in range(split.num_stages):
            received = split.stage_module(k)(split.flatten_inputs(inputs), received)
        outputs.append(loss_fn(received, targets))
    # the same graph: same ops
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)


class NoGradScaled(nn.Module):
    """A block that computes a scale under torch.no_grad(): torch.export keeps that region as a
    subgraph (``wrap_with_set_grad_enabled(False, submod_1, ...)``), an attribute of the exported
    module, not the model."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = x.detach().abs().mean() + 1.0
        return torch.relu(self.linear(x)) / scale


class NoGradNet(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(32, width)
        self.layers = nn.ModuleList(NoGradScaled(width) for _ in range(depth))
        self.head = nn.Linear(width, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_stage_reads_the_subgraphs_torch_export_keeps_beside_the_graph():
    # Before, the stage module resolved get_attr submod_1 in the model: AttributeError (AXK2 at pp
    # 2).
    model = NoGradNet().to("meta")
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    split = split_model(
        model, [["embed", "layers.0"], ["layers.1", "head"]], ids.to("meta"), method="export"
    )
    assert split.subgraphs  # the no_grad region, kept by the export as a submodule
    materialize_(model, "cpu", seed=SEED)
    flat, received = split.flatten_inputs(ids), ()
    for k in range(2):
        received = split.stage_module(k)(flat, received)
    reference = NoGradNet().to("meta")
    materialize_(reference, "cpu", seed=SEED)
    # The same ops on the same values through the exported graph: fp32 rounding at most.
    torch.testing.assert_close(logits_of(received), reference(ids), rtol=1e-5, atol=1e-6)


def test_stages_exported_with_symbolic_sizes_run_other_lengths_and_refuse_what_they_cannot():
    # Note [one export for every length] (hyparallel/graph/tracer.py): one export serves every
    # sequence length and batch its input constraints admit; sizes the model fixes, sizes below the
    # range and inputs that must share a size but do not are refused before anything runs
    spec = MODELS["hf-llama"]
    model = hp.models.load(spec).module
    example = {
        "input_ids": torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta"),
        "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long, device="meta"),
    }
    split = split_model(model, planned_stages(model, pp=2), example, dynamic=True)
    runtime = one_rank_runtime(model, split, num_microbatches=1)
    ref = reference(spec)
    for rows, length in ((BATCH, SEQ), (3, 5), (BATCH, 2 * SEQ - 1)):
        tokens = torch.randint(0, vocab(model), (rows, length))
        mask = torch.ones_like(tokens)
        mask[0, -2:] = 0  # padding on one row
        inputs = {"input_ids": tokens, "attention_mask": mask}
        assert split.mismatch(split.flatten_inputs(inputs)) is None, (rows, length)
        (out,) = runtime.forward(inputs)
        # the same ops as one device's forward, at the same shapes: rounding only
        torch.testing.assert_close(
            logits_of(out), ref(**inputs).logits, rtol=1e-5, atol=1e-6, msg=str((rows, length))
        )
    # torch.export fixes sizes 0 and 1: one token is not the symbolic length
    one = {"input_ids": torch.zeros(BATCH, 1, dtype=torch.long)}
    one["attention_mask"] = torch.ones_like(one["input_ids"])
    assert split.mismatch(split.flatten_inputs(one)) is not None
    # the mask's length is the tokens' length in the trace: a mask of another length is refused
    unequal = {
        "input_ids": torch.zeros(BATCH, SEQ, dtype=torch.long),
        "attention_mask": torch.ones(BATCH, SEQ + 1, dtype=torch.long),
    }
    position, shape, traced = split.mismatch(split.flatten_inputs(unequal))
    assert (position, shape) == (1, (BATCH, SEQ + 1)) and ".." in traced
    with pytest.raises(ConfigError, match=r"micro-batch input 1 has shape \(2, 13\)"):
        runtime.forward(unequal)


def one_rank_runtime(model, split, num_microbatches: int) -> PipelineRuntime:
    """Both stages of ``split`` on this process, as two virtual stages of interleaved 1F1B, their
    weights from SEED."""
    materialize_(model, "cpu", seed=SEED, only=split.state_names([0, 1]))
    return PipelineRuntime(
        split,
        {0: split.stage_module(0), 1: split.stage_module(1)},
        None,
        schedule_kind="interleaved-1f1b",
        num_microbatches=num_microbatches,
        virtual_stages=2,
    )
