"""Context parallelism's attention (issue 39, Note [context-parallel attention] in
hyparallel/tensor/context.py; Note [ring attention]): keys and values all-gathered or passed round a
ring, exact against one process, each rank the same share of the work."""

from __future__ import annotations

import re

import pytest
import torch

from hyparallel.tensor.context import positions, shard_sequence, unshard_sequence

from .conftest import REPO, assert_every_parameter_compared, torchrun


def test_the_shards_are_two_chunks_each_and_make_the_sequence_again():
    x = torch.arange(2 * 16).reshape(2, 16)
    shards = [shard_sequence(x, 1, 4, rank) for rank in range(4)]
    # rank 0: chunks 0 and 7 of 8; rank 3: chunks 3 and 4
    assert shards[0][0].tolist() == [0, 1, 14, 15] and shards[3][0].tolist() == [6, 7, 8, 9]
    # exact: integer ids only cut and concatenated, no arithmetic on them
    assert torch.equal(unshard_sequence(shards, 1), x)
    assert positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    with pytest.raises(ValueError, match="does not split into 8 equal chunks"):
        shard_sequence(torch.zeros(1, 12), 1, 4, 0)


def test_context_parallel_attention_is_one_processes_and_balanced_also_in_a_llama(tmp_path):
    results = torchrun(REPO, "tests/distributed/context_worker.py", tmp_path / "out.jsonl", 4)
    attention = {
        f"{kind}-cp{cp}-{mask}"
        for kind in ("gather", "ring")
        for cp in (2, 4)
        for mask in ("causal", "full")
    }
    attention |= {"gather-cp2-gqa", "ring-cp2-gqa"}  # grouped-query heads, as few on the way
    assert set(results) == attention | {"llama-gather-cp2", "llama-ring-cp4"}
    # a tiny Llama (grouped-query attention, rotary embeddings at global positions): each rank's
    # logits, and every weight's gradient (by name) summed over its cp ranks, one process's
    for case in ("llama-gather-cp2", "llama-ring-cp4"):
        for rank in results[case]:
            assert rank["logits"] <= 1e-5 and rank["grads"] <= 1e-5, (case, rank)
            assert sorted(rank["checked"]) == rank["names"]
            # grouped-query keys and values (and their gradients) travel as few as the model
            # makes them (Note [grouped-query keys as they travel]): the ring sent them repeated
            heads, kv_heads = rank["heads"]
            assert kv_heads < heads and rank["sent_heads"] == [kv_heads], (case, rank)
    for case in attention:
        ranks = results[case]
        for rank in ranks:  # fp32: a softmax over 32 keys in another order
            for name in ("out", "q", "k", "v"):
                assert rank[name] <= 1e-5, (case, rank["rank"], name, rank[name])
        # every rank computes as many (query, key) pairs as the others, causal or not
        pairs = [rank["pairs"] for rank in ranks]
        assert max(pairs) <= 1.05 * min(pairs), (case, pairs)


def test_what_the_split_attention_cannot_split_is_refused_naming_the_module():
    from hyparallel.tensor import context

    q = k = v = torch.zeros(1, 2, 4, 8)
    layer = torch.nn.Linear(1, 1)
    with pytest.raises(RuntimeError, match="Linear: context-parallel attention called outside"):
        context._transformers_attention(layer, q, k, v, None)
    with context.split_attention(object()):
        with pytest.raises(ValueError, match="Linear: context parallelism cannot split a mask"):
            context._transformers_attention(layer, q, k, v, torch.ones(1, 1, 4, 4))
        with pytest.raises(ValueError, match="cannot split dropout 0.1 in training"):
            context._transformers_attention(layer, q, k, v, None, dropout=0.1)
        with pytest.raises(ValueError, match="cannot split attention that is not causal"):
            context._transformers_attention(layer, q, k, v, None, is_causal=False)
    with pytest.raises(ValueError, match="'gather' or 'ring'"):
        with context.split_attention(object(), "flash"):
            pass


# ---- parallel.cp: training under context parallelism (Note [context parallelism],
# hyparallel/runtime/context.py) ---------------------------------------------------------------

CP_CASES = [
    "gpt-cp4",
    "gpt-dp2-cp2-ring-zero1",
    "gpt-cp2-tp2-sp",
    "llama-dp2-cp2",
    "qwen2-cp4-ring",
    "own-llama-dp2-cp2-recompute",
]


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    """Every cp case and the checkpoint case, in one launch of 4 processes."""
    return torchrun(
        REPO, "tests/distributed/cp_worker.py", tmp_path_factory.mktemp("cp") / "out.jsonl", 4
    )


@pytest.mark.parametrize("case", CP_CASES)
def test_training_under_context_parallelism_is_one_devices(cp_results, case):
    # the worker asserted each loss, gradient and parameter with parallel_worker's tolerances
    # (fp32: gradients rtol 1e-5, parameters after 3 steps 2e-5); here every parameter was
    # compared, by name, on every (dp, cp) replica, each holding whole sequences' worth of tokens
    ranks = cp_results[case]
    plan = ranks[0]["plan"]
    assert len(ranks) == plan["dp"] * plan["cp"] * plan["tp"] == 4
    assert {(r["dp_rank"], r["cp_rank"]) for r in ranks} == {
        (d, c) for d in range(plan["dp"]) for c in range(plan["cp"])
    }
    groups = ranks[0]["parameter_groups"]
    for key in ("grads_checked", "checked"):
        compared: dict = {}
        for rank in ranks:
            compared.setdefault((rank["dp_rank"], rank["cp_rank"]), set()).update(rank[key])
        assert_every_parameter_compared(groups, compared)
    for rank in ranks:
        assert rank["grad_worst_rel"] <= 1e-5 and rank["worst_rel"] <= 2e-5, (case, rank["rank"])
        # train steps and eval_step: one device's, on every rank
        for got, want in zip(rank["losses"], rank["ref_losses"], strict=True):
            assert got == pytest.approx(want, rel=1e-5)
        # a (total, count) loss of one's own: the same held-out loss; a mean is refused
        assert rank["own_eval_loss"] == pytest.approx(rank["ref_losses"][-1], rel=1e-5)
        assert "must return (total, count)" in rank["mean_refused"]
        # a call of the model gathers whole sequences: 16 tokens, this dp rank's 8 / dp rows
        assert rank["called_logits"][:2] == [8 // plan["dp"], 16]
        # a length that does not cut (7 tokens) runs whole on every rank: one device's logits
        # (asserted in the worker); greedy decoding from 6 tokens by one token at a time
        assert rank["odd_logits"][:2] == [8 // plan["dp"], 7]
        assert rank["generated_shape"] == [8 // plan["dp"], 8]
        assert rank["generated_compared"] >= 1 and rank["generated_equal"], (case, rank["rank"])


def test_a_checkpoint_saved_under_cp_2_loads_at_cp_1(cp_results):
    for rank in cp_results["checkpoint-cp2-to-dp4"]:
        saved, loaded = (p["cp"] for p in rank["plans"])
        assert (saved, loaded) == (2, 1) and rank["resumed_step"] == 1
        # two steps at cp 2, the third at dp 4 after the load: one device's losses and parameters
        assert rank["losses"] == pytest.approx(rank["ref_losses"], rel=1e-5)
        assert rank["worst_rel"] <= 2e-5 and len(rank["checked"]) == 27


def test_a_transformers_models_padding_mask_is_split_with_its_keys(cp_results):
    # rows padded on the right and on the left (the worker checked the loss, every gradient and a
    # call's logits against one process given the same attention_mask, fp32 rtol 1e-5); without
    # the mask the left-padded rows' tokens would see the padding's keys (measured: the loss off
    # by 9e-4)
    ranks = cp_results["llama-padded-dp2-cp2"]
    groups = ranks[0]["parameter_groups"]
    for kind in ("gather", "ring"):
        compared: dict = {}
        for rank in ranks:
            compared.setdefault((rank["dp_rank"], rank["cp_rank"]), set()).update(
                rank[kind]["checked"]
            )
            assert rank[kind]["loss"] == pytest.approx(rank[kind]["ref_loss"], rel=1e-5)
            assert rank[kind]["worst"] <= 1e-5
        assert len(compared) == 4
        assert_every_parameter_compared(groups, compared)


def _plan(**parallel) -> dict:
    return {"training": {"global_batch": 4, "micro_batch": 1, "seq_len": 16}, "parallel": parallel}


@pytest.mark.parametrize(
    "parallel, message",
    [
        (dict(cp=2, pp=2), "parallel.cp 2 beside pp 2: pipeline stages with context parallelism"),
        (dict(dp=2, cp=2, ep=2), "beside ep 2: expert parallelism"),
        (dict(cp=3), r"seq_len \(16\) must be a multiple of 2 x cp \(6\)"),
    ],
)
def test_plans_cp_cannot_run_are_refused_in_one_line(parallel, message):
    from hyparallel.spec.errors import ConfigError
    from hyparallel.spec.schema import Plan

    with pytest.raises(ConfigError, match=message):
        Plan.from_dict(_plan(**parallel))
    # the world counts the cp ranks, and says so
    with pytest.raises(ConfigError, match=r"dp\(1\) \* cp\(2\) \* tp\(1\) \* pp\(1\) = 2 GPUs"):
        Plan.from_dict({**_plan(cp=2), "cluster": {"name": "cpu", "gpus_per_node": 4}})


def test_cp_ranks_sit_inside_dp_and_share_its_rows():
    from hyparallel.spec.schema import Plan

    plan = Plan.from_dict(_plan(dp=2, cp=2, tp=2))
    assert plan.world_size == 8 and list(plan.mesh_shape()) == ["pp", "dp", "cp", "tp"]
    # tp innermost, then cp: a cp group's ranks are tp apart, a dp group's tp x cp
    assert plan.group_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert plan.group_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert plan.coords(6) == {"pp": 0, "dp": 1, "cp": 1, "tp": 0}
    assert plan.rank_of(pp=0, dp=1, tp=0, cp=1) == 6


class _NoPositions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.qkv = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 48)

    def attend(self, tokens):
        q, k, v = self.qkv(self.embed(tokens)).view(*tokens.shape, 3, 2, 8).unbind(2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, tokens):
        q, k, v = self.attend(tokens)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class _ByHand(_NoPositions):
    def forward(self, tokens, position_ids=None):
        q, k, v = self.attend(tokens)
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


class _Mha(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.attn = torch.nn.Embedding(32, 16), torch.nn.MultiheadAttention(16, 2)

    def forward(self, tokens, position_ids=None):
        x = self.embed(tokens)
        return self.attn(x, x, x, need_weights=False)[0]


class _NoAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)

    def forward(self, tokens, position_ids=None):
        return self.head(self.embed(tokens))


@pytest.mark.parametrize(
    "model, message",
    [
        (_NoPositions, "_NoPositions.forward takes no position_ids: context parallelism 2 gives"),
        (_ByHand, r"_ByHand: attention computed by hand \(softmax over 16 x 16 scores\)"),
        (_Mha, "attn: context parallelism 2 splits scaled_dot_product_attention, not"),
        (_NoAttention, "_NoAttention makes no scaled_dot_product_attention call"),
    ],
)
def test_models_cp_cannot_split_are_refused_naming_the_module(model, message):
    import hyparallel as hp
    from hyparallel.runtime.context import check_context_parallel
    from hyparallel.spec.errors import ConfigError
    from hyparallel.spec.schema import Plan

    module = model()
    graph = hp.trace(module, torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(ConfigError, match=message):
        check_context_parallel(module, Plan.from_dict(_plan(cp=2)), graph)


def test_sequence_parallelism_must_divide_each_ranks_tokens():
    import hyparallel as hp
    from hyparallel.runtime.context import check_context_parallel
    from hyparallel.spec.errors import ConfigError
    from hyparallel.spec.schema import Plan

    module = hp.models.load("gpt-tiny num_layers=1").module
    graph = hp.trace(module, torch.zeros(2, 16, dtype=torch.long))
    plan = Plan.from_dict(
        {
            "training": {"global_batch": 4, "micro_batch": 1, "seq_len": 24},
            "parallel": {"cp": 2, "tp": 8, "sequence_parallel": True},
        }
    )
    with pytest.raises(ConfigError, match=r"each rank's 12 tokens .* over tp 8"):
        check_context_parallel(module, plan, graph)
    # selective recomputation would keep what none keeps: refused, and never planned
    selective = Plan.from_dict({**_plan(cp=2), "parallel": {"cp": 2, "recompute": "selective"}})
    with pytest.raises(ConfigError, match="recompute selective beside context parallelism 2"):
        check_context_parallel(module, selective, graph)
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=2)
    result = hp.search(module, cluster, 4, 16, "fp32", cp=2, top=50)
    assert {e.config.recompute for e in result.best} <= {"none", "full"}
    # a plain SDPA model passes, its one attention site per block named
    ok = Plan.from_dict(_plan(cp=2))
    assert check_context_parallel(module, ok, graph) == ["layers.0.attn"]


def test_each_rank_gets_its_chunks_and_their_global_positions():
    from hyparallel.runtime.context import KEY_PADDING, SequenceCut
    from hyparallel.spec.errors import ConfigError

    ids, targets = torch.arange(16).repeat(2, 1), torch.arange(100, 116).repeat(2, 1)
    cut = SequenceCut(cp=2, rank=1, params=["input_ids", "attention_mask", "position_ids"], hf=True)
    inputs, goal, length = cut.cut({"input_ids": ids, "attention_mask": torch.ones(2, 16)}, targets)
    assert length == 16
    # rank 1 of 2: chunks 1 and 2 of 4; transformers' mask of ones left out (it would drop it)
    assert inputs["input_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert inputs["position_ids"][1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert goal[0].tolist() == [104, 105, 106, 107, 108, 109, 110, 111]
    assert "attention_mask" not in inputs
    # a tensor argument: bound by name; the user's positions are cut like the rest
    inputs, _, _ = SequenceCut(2, 0, ["tokens", "position_ids"]).cut((ids, ids + 50))
    assert inputs["position_ids"][0].tolist() == [50, 51, 52, 53, 62, 63, 64, 65]
    # a transformers model's padding mask: taken off the call whole, for every rank's keys
    padded = (ids < 12).long()
    inputs, _, _ = cut.cut({"input_ids": ids, "attention_mask": padded})
    assert "attention_mask" not in inputs and inputs[KEY_PADDING].shape == (2, 16)
    assert inputs[KEY_PADDING][0].tolist() == [True] * 12 + [False] * 4
    with pytest.raises(ConfigError, match="a padding attention_mask of a transformers model only"):
        SequenceCut(2, 0, ["tokens", "attention_mask"]).cut((ids, padded))
    refusals = [
        ({"input_ids": ids, "labels": ids}, "cannot split Hugging Face labels"),
        ({"input_ids": ids, "attention_mask": padded[:, None]}, "not one of shape"),
        ({"input_ids": ids[:, :12]}, "12 tokens does not split into 8 equal chunks"),
        ({"pixel_values": torch.zeros(2, 3, 8, 8)}, "these inputs have none"),
    ]
    for inputs, message in refusals:
        with pytest.raises(ConfigError, match=message):
            SequenceCut(4 if "12" in message else 2, 0, ["input_ids"], hf=True).cut(inputs)


def test_a_forward_that_split_fewer_attentions_than_its_trace_is_refused():
    from hyparallel.runtime.context import _Counted
    from hyparallel.tensor import context

    with context.split_attention(object()) as split:
        split.calls = 1
        counted = _Counted(split, ["layers.0.attn", "layers.1.attn"])
        with pytest.raises(RuntimeError, match=r"split 1 attention call\(s\) in a forward whose"):
            counted.checked()
        split.calls = 2
        counted.checked()
        assert split.calls == 0  # counted afresh for the next forward
    with pytest.raises(RuntimeError, match="already in force"):
        with context.split_attention(object()), context.split_attention(object()):
            pass


def test_show_names_the_cp_groups_and_each_ranks_cp_coordinate(capsys, tmp_path):
    from .test_cli import run

    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "cluster: {name: cpu, gpus_per_node: 8}\n"
        "training: {global_batch: 8, micro_batch: 1, seq_len: 64}\n"
        "parallel: {dp: 2, cp: 2, tp: 2}\n"
    )
    code, out, _ = run(capsys, "show", str(plan))
    assert code == 0 and "pp 1 x dp 2 x cp 2 x tp 2 = 8 processes" in out
    assert re.search(r"│ cp\s+│ 4\s+│ \[0, 2\]", out)  # 4 groups of 2, tp apart
    assert "pp0 dp1 cp1 tp0" in out  # rank 6


# ---- the planner: cp searched and priced (Note [context parallelism's costs] in
# hyparallel/planner/costs.py) ------------------------------------------------------------------


def test_the_planner_picks_cp_for_an_8b_llama_at_128k_tokens_on_8_h100s():
    import hyparallel as hp

    model = hp.models.load("llama3-8b").module
    cluster = hp.ClusterSpec.preset("h100-sxm", num_nodes=1)
    result = hp.search(model, cluster, 8, 131072, "bf16", top=3, alternatives=True)
    plan = result.plan()
    par = plan.parallel
    # each sequence over cp ranks, and what it needs fits the GPU (torchtitan ran FSDP 2 x CP 4)
    assert par.cp > 1 and par.world_size == 8 and par.pp == 1
    assert max(plan.predicted.memory_gib) <= cluster.device.memory_bytes / 2**30
    assert plan.predicted.comm_s.cp is not None and plan.predicted.step_time_s > 0
    # the written plan states it; the runtime's mesh has the cp axis
    assert "cp" in plan.mesh_shape() and "cp: " in plan.to_yaml()
    # --top: the best plan without cp, and why it lost
    (alternative,) = [a for a in result.alternatives if a.label == "no context parallelism"]
    assert alternative.evaluation.config.cp == 1 and alternative.why


def test_ring_holds_one_block_where_gather_holds_the_whole_sequence():
    import hyparallel as hp

    model = hp.models.load("llama3-8b").module
    node = hp.ClusterSpec.preset("h100-sxm", num_nodes=1)
    # timed and sized whatever they need (as benchmarks/published.py's _unbounded)
    device = node.device.model_copy(update={"memory_bytes": 2**50})
    cluster = node.model_copy(update={"device": device})
    peaks, traffic = {}, {}
    for kind in ("gather", "ring"):
        result = hp.search(
            model, cluster, 1, 65536, "bf16", dp=1, tp=1, pp=1, cp=8, zero=3,
            recompute="none", micro_batch=1, cp_attention=kind,
        )  # fmt: skip
        evaluation = result.best[0]
        peaks[kind], traffic[kind] = evaluation.peak_memory_bytes, evaluation.comm_s["cp"]
    # gather saves every other rank's keys and values of each layer for its backward: 7/8 of the
    # whole sequence's per layer more than ring; and exposes its gathers, where NVLink's ring
    # steps hide under each block's attention
    assert peaks["gather"] > peaks["ring"] * 1.05
    assert traffic["gather"] > traffic["ring"]


def test_the_planner_prices_grouped_query_keys_as_the_split_receives_them():
    # Note [grouped-query keys as they travel]: 4 query heads over 2 key/value heads. transformers'
    # attention interface hands the split the 2 heads (their repeat is in transformers' own sdpa
    # function, which the trace shows): half the sdpa inputs travel. A model calling F.sdpa with
    # keys it repeated itself (the zoo's Llama) sends what it passes.
    import hyparallel as hp
    from hyparallel.graph.context import attention_interface, kv_elements
    from hyparallel.planner.profile import ModelProfile

    hf = hp.models.load(
        "hf:LlamaForCausalLM hidden_size=64 intermediate_size=128 num_hidden_layers=2"
        " num_attention_heads=4 num_key_value_heads=2 vocab_size=128"
    ).module
    zoo = hp.models.load("llama-tiny").module  # 4 query heads, 2 key/value heads
    ids = torch.zeros(2, 16, dtype=torch.long)
    for module, fraction in ((hf, 0.5), (zoo, 1.0)):
        graph = hp.trace(module, (ids,))
        attentions = [op for op in graph.ops if op.kind == "attention"]
        assert len(attentions) == 2
        for op in attentions:
            inputs = sum(torch.Size(s).numel() for s in op.input_shapes[1:3])
            moved = kv_elements(graph, op, attention_interface(module))
            assert moved == inputs * fraction, (type(module).__name__, op.name)
    # the profile the planner costs cp by (its keys and values per sequence): half of them
    cluster = hp.ClusterSpec.preset("h100-sxm", num_nodes=1, gpus_per_node=2)
    graph, moved = hp.trace(hf, (ids,)), {}
    for interface in (True, False):
        profile = ModelProfile(
            graph, cluster, "bf16", 16, traced_rows=2, takes_positions=True,
            attention_interface=interface,
        )  # fmt: skip
        moved[interface] = sum(c.kv_bytes for raw in profile.raw for c in raw.ops)
    assert moved[False] > 0 and moved[True] == pytest.approx(moved[False] / 2)


def test_the_planner_never_splits_a_sequence_the_runtime_cannot():
    import hyparallel as hp
    from hyparallel.spec.errors import PlanError

    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=4)
    module, ids = _NoPositions(), torch.zeros(2, 16, dtype=torch.long)
    result = hp.search(module, cluster, 8, 16, "fp32", top=50, example_inputs=ids)
    assert result.best and all(e.config.cp == 1 for e in result.best)
    with pytest.raises(PlanError, match="_NoPositions.forward takes no position_ids"):
        hp.search(module, cluster, 8, 16, "fp32", cp=2, example_inputs=ids)
    # a sequence that does not cut into 2 cp chunks: no such plan either
    gpt = hp.models.load("gpt-tiny").module
    assert all(e.config.cp in (1, 2) for e in hp.search(gpt, cluster, 8, 12, "fp32", top=50).best)


def test_plans_the_planner_writes_with_cp_train_as_one_device():
    # gpt-tiny at cp 2 (gather: the planner's choice between the two is its own), transformers'
    # Llama at tp 2 x cp 2 over a ring: the planner plans them, parallelize runs them, every
    # parameter group equal to one process (fp32)
    from hyparallel.tools.parity import check_layouts

    layouts = [
        {"dp": 1, "tp": 1, "pp": 1, "cp": 2, "cp_attention": "gather"},
        {"dp": 1, "tp": 2, "pp": 1, "cp": 2, "cp_attention": "ring"},
    ]
    for spec, layout in zip(("gpt-tiny", "hf:LlamaForCausalLM"), layouts):
        (report,) = check_layouts(spec, [layout], timeout=300)
        assert report.verdict == "equal", report.summary()
        assert report.layout["cp"] == 2 and report.groups
