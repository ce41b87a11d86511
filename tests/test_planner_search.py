"""The search: exact against brute force, constraints, realistic answers at scale, and clear
failures."""

from __future__ import annotations

import itertools
import math

import pytest

import hyparallel as hp
from hyparallel.planner import Constraints, PlanError, search
from hyparallel.planner.profile import ModelProfile
from hyparallel.planner.search import Search, enumerate_configs, lone_microbatch

from .conftest import HF_GPT2_TINY


def brute_force(engine: Search, fixed: dict | None = None) -> tuple[float, int, int]:
    """Best step time over every configuration (that ``fixed`` allows) and every contiguous stage
    split; and the counts of (in)feasible.

    A pipeline fed one micro-batch is the best only when no other configuration fits (Note [one
    micro-batch through a pipeline] in hyparallel.planner.search).
    """
    configs = enumerate_configs(engine.ctx, fixed or {})
    preferred, feasible, infeasible = _brute_force(
        engine, [c for c in configs if not lone_microbatch(c)]
    )
    if preferred < math.inf:
        return preferred, feasible, infeasible
    lone, more_feasible, more_infeasible = _brute_force(
        engine, [c for c in configs if lone_microbatch(c)]
    )
    return lone, feasible + more_feasible, infeasible + more_infeasible


def _brute_force(engine: Search, configs) -> tuple[float, int, int]:
    best, feasible, infeasible = math.inf, 0, 0
    for config in configs:
        links = engine._links(config)
        tables = engine._tables(config, links)
        if config.schedule == "interleaved-1f1b":
            evaluations = [engine.evaluate(config)]
        else:
            evaluations = []
            for cuts in itertools.combinations(range(1, tables.n), config.pp - 1):
                bounds = [0, *cuts, tables.n]
                chunks = list(zip(bounds[:-1], bounds[1:]))
                evaluations.append(
                    engine._finish(config, links, tables, chunks, [[r] for r in chunks])
                )
        for evaluation in evaluations:
            if evaluation.feasible:
                feasible += 1
                best = min(best, evaluation.step_time_s)
            else:
                infeasible += 1
    return best, feasible, infeasible


def small_cluster(
    preset: str, nodes: int, per_node: int, memory_bytes: int | None = None
) -> hp.ClusterSpec:
    spec = hp.ClusterSpec.preset(preset, num_nodes=nodes, gpus_per_node=per_node).model_dump()
    if memory_bytes is not None:
        spec["device"].update(memory_bytes=memory_bytes, reserved_bytes=0)
    return hp.ClusterSpec.model_validate(spec)


@pytest.mark.parametrize(
    ("model_name", "preset", "nodes", "per_node", "global_batch", "memory_fraction", "fixed"),
    [
        ("gpt-mini", "cpu", 1, 8, 16, None, {}),
        ("gpt-mini", "a100-80g", 2, 8, 32, 0.25, {}),  # tight memory: many plans do not fit
        ("llama-tiny", "h100-sxm", 2, 4, 16, 0.3, {}),
        ("gpt-tiny", "cpu", 1, 4, 8, 0.3, {}),
        # every gradient compression, PowerSGD at rank 1 (Gram-Schmidt) and 8
        ("gpt-mini", "cpu", 1, 8, 16, None, {"grad_compression": "any"}),
        ("gpt-mini", "a100-80g", 2, 8, 32, 0.25, {"grad_compression": "any", "powersgd_rank": 1}),
        ("llama-tiny", "h100-sxm", 2, 4, 16, 0.3, {"grad_compression": "any", "powersgd_rank": 8}),
        ("gpt-tiny", "cpu", 1, 4, 8, 0.3, {"grad_compression": "powersgd"}),
    ],
)
def test_search_matches_brute_force(
    model_name, preset, nodes, per_node, global_batch, memory_fraction, fixed
):
    model = (
        hp.models.build(model_name, num_layers=4)
        if model_name != "gpt-mini"
        else hp.models.build(model_name)
    )
    seq = 32
    graph = hp.trace(model, model.example_inputs(1, seq))
    memory = None
    if memory_fraction is not None:  # a fraction of what one unsplit replica needs: forces sharding
        memory = int(memory_fraction * graph.num_params * 18 + 8 * 2**20 * memory_fraction)
    cluster = small_cluster(preset, nodes, per_node, memory)
    profile = ModelProfile(graph, cluster, "bf16", seq)
    engine = Search(profile, cluster, global_batch, "bf16")
    found, _ = engine.best(fixed, top=1)
    expected, feasible, infeasible = brute_force(
        Search(profile, cluster, global_batch, "bf16"), fixed
    )
    assert feasible > 0
    if memory_fraction is not None:
        assert infeasible > 0  # the memory limit really binds
    assert found[0].step_time_s == pytest.approx(expected, rel=1e-12)
    # the bound pruned something
    assert engine.evaluated < len(enumerate_configs(engine.ctx, fixed))
    modes = {c.grad_compression for c in enumerate_configs(engine.ctx, fixed)}
    # none: dp = 1
    expected_modes = {"any": {"none", "bf16", "fp16", "powersgd"}, "powersgd": {"none", "powersgd"}}
    assert modes == expected_modes.get(fixed.get("grad_compression"), {"none"})


def test_top_k_is_sorted_and_distinct():
    model = hp.models.build("gpt-mini")
    graph = hp.trace(model, model.example_inputs(1, 32))
    result = search(graph, small_cluster("cpu", 1, 8), 16, 32, "fp32", top=5)
    times = [e.step_time_s for e in result.best]
    assert len(times) == 5 and times == sorted(times)
    assert len({e.config for e in result.best}) == 5


@pytest.fixture(scope="module")
def gpt175b_result():
    model = hp.models.build("gpt-175b")
    graph = hp.trace(model, model.example_inputs(1, 2048), name="gpt-175b")
    cluster = hp.ClusterSpec.preset("a100-80g", num_nodes=128)
    return search(graph, cluster, 1536, 2048, "bf16", top=1, alternatives=True)


def test_gpt175b_on_1024_a100s_is_realistic(gpt175b_result):
    plan = gpt175b_result.plan()
    par, predicted = plan.parallel, plan.predicted
    assert par.dp * par.tp * par.pp == 1024
    # tp inside a node
    assert par.tp <= 8 and all(len({r // 8 for r in g}) == 1 for g in plan.group_ranks("tp"))
    assert max(predicted.memory_gib) <= 80
    assert 0.35 <= predicted.mfu <= 0.60  # large GPT runs on A100 clusters reach roughly 35-55% MFU
    # 6 digits written
    assert predicted.tokens_per_s == pytest.approx(1536 * 2048 / predicted.step_time_s, rel=1e-5)
    assert len(plan.stages) == par.pp * par.virtual_stages
    modules = [m for stage in plan.stages for m in stage.modules]
    assert modules[0] == "tok_embeddings" and modules[-1] == "output"
    assert [m for m in modules if m.startswith("layers.")] == [f"layers.{i}" for i in range(96)]
    assert plan.tensor_parallel["layers.*.attn.qkv"] == "column"
    assert plan.model.num_params == 174_604_836_864 and plan.model.fingerprint.startswith("sha256:")


def test_alternatives_explain_themselves(gpt175b_result):
    labels = {alt.label: alt for alt in gpt175b_result.alternatives}
    assert set(labels) == {"pure data parallel", "most tensor parallel", "most pipeline parallel"}
    assert labels["pure data parallel"].why == "global batch 1536 is not divisible by dp 1024"
    assert (
        "slower" in labels["most tensor parallel"].why
        or "out of memory" in labels["most tensor parallel"].why
    )
    winner = gpt175b_result.best[0].step_time_s
    for alt in labels.values():
        if alt.evaluation is not None and alt.evaluation.feasible:
            assert alt.evaluation.step_time_s >= winner


def test_plan_round_trips_and_respects_constraints(tmp_path):
    model = hp.models.build("gpt-mini")
    cluster = small_cluster("cpu", 1, 8)
    plan = hp.plan(
        model,
        cluster,
        global_batch=16,
        seq_len=32,
        dtype="fp32",
        tp=2,
        pp=2,
        schedule="1f1b",
        zero=1,
    )
    assert (plan.parallel.tp, plan.parallel.pp, plan.parallel.dp) == (2, 2, 2)
    assert plan.parallel.schedule == "1f1b" and plan.parallel.zero == 1
    plan.save(tmp_path / "plan.yaml")
    assert hp.Plan.load(tmp_path / "plan.yaml") == plan
    assert plan.model.fingerprint == hp.models.fingerprint(model)


def test_hugging_face_model_plans():
    model = hp.models.load(HF_GPT2_TINY).module
    plan = hp.plan(
        model, small_cluster("cpu", 1, 4), global_batch=8, seq_len=32, dtype="fp32", tp=2
    )
    assert plan.tensor_parallel["transformer.h.*.attn.c_attn"] == "column"
    assert plan.model.name == "GPT2LMHeadModel"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 3}, "tp(3) = 3 does not divide the 8 GPUs"),
        ({"tp": 2, "pp": 2, "dp": 4}, "dp(4) * tp(2) * pp(2) = 16 != 8 GPUs"),
        ({"dp": 8, "global_batch": 12}, "global batch 12 is not divisible by dp 8"),
        ({"pipeline": 2}, "unknown constraint pipeline"),
        ({"tp": 0}, "tp must be a positive integer, got 0"),
        ({"dp": -2}, "dp must be a positive integer, got -2"),
        ({"pp": 2.0}, "pp must be a positive integer, got 2.0"),
        ({"global_batch": 0}, "global_batch must be a positive integer, got 0"),
        ({"global_batch": True}, "global_batch must be a positive integer, got True"),
        ({"seq_len": 0}, "seq_len must be a positive integer, got 0"),
        (
            {"seq_len": 2**40},
            "seq_len must be a positive integer up to 16,777,216, got 1,099,511,627,776",
        ),
        (
            {"tp": 10**100},
            "tp must be a positive integer up to 1,048,576, got an integer of more than 60 digits",
        ),
        ({"virtual_stages": 0}, "virtual_stages must be a positive integer, got 0"),
    ],
)
def test_impossible_requests_fail_clearly(kwargs, message):
    model = hp.models.build("gpt-mini")
    args = {"global_batch": 16, "seq_len": 32, "dtype": "fp32", **kwargs}
    with pytest.raises(
        PlanError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")
    ) as info:
        hp.plan(model, small_cluster("cpu", 1, 8), **args)
    # one line, and a HyparallelError (PlanError), never a ZeroDivisionError
    assert "\n" not in str(info.value)


def test_constraints_model_plans_as_the_keywords_do():
    model = hp.models.build("gpt-mini")
    cluster = small_cluster("cpu", 1, 8)
    fixed = {"tp": 2, "pp": 2, "schedule": "1f1b", "zero": 1, "order": ["pp", "dp", "tp"]}
    by_model = hp.plan(model, cluster, 16, 32, "fp32", constraints=Constraints(**fixed))
    assert by_model == hp.plan(model, cluster, 16, 32, "fp32", **fixed)
    assert Constraints(**fixed).given() == {**fixed, "order": ("pp", "dp", "tp")}
    assert Constraints(tp=None).given() == {}  # None: searched
    with pytest.raises(PlanError, match="both constraints= and keyword constraints"):
        hp.plan(model, cluster, 16, 32, "fp32", constraints=Constraints(tp=2), pp=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, "tp must be a positive integer, got 0"),
        (
            {"pipeline": 2, "tensor": 1},
            "unknown constraint pipeline, tensor; the planner takes tp, pp, dp,",
        ),
        (
            {"schedule": "zb-v"},
            "schedule must be one of 'gpipe', '1f1b' or 'interleaved-1f1b', got 'zb-v'",
        ),
        ({"zero": 4}, "zero must be one of 0, 1, 2 or 3, got 4"),
        (
            {"recompute": "some"},
            "recompute must be one of 'none', 'selective' or 'full', got 'some'",
        ),
        ({"sequence_parallel": "maybe"}, "sequence_parallel must be True or False, got 'maybe'"),
        ({"order": ["pp", "pp", "tp"]}, "order must name pp, dp and tp once each, outermost first"),
        ({"order": "pp,dp,tp"}, "order must name pp, dp and tp once each, outermost first"),
    ],
)
def test_constraints_refuse_bad_values_in_one_line(kwargs, message):
    with pytest.raises(PlanError) as info:
        Constraints(**kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_indivisible_heads_fail_clearly():
    # 8 heads; tp 16 would not divide them
    model = hp.models.build("gpt-mini", num_heads=8, hidden_size=120)
    with pytest.raises(
        PlanError, match="tp 16 does not divide the 8 attention heads of layers.0.attn"
    ):
        hp.plan(model, small_cluster("cpu", 2, 8), global_batch=16, seq_len=32, dtype="fp32", tp=16)


def test_nothing_fits_names_the_smallest_need():
    model = hp.models.build("gpt-175b")
    with pytest.raises(PlanError) as info:
        hp.plan(model, hp.ClusterSpec.preset("a100-80g"), global_batch=64, seq_len=2048)
    message = str(info.value)
    assert (
        message.startswith("nothing fits in 77.0 GiB per GPU")
        and "GiB" in message
        and "more GPUs" in message
    )


# ---- gradient compression (Note [gradient compression is asked for] in hyparallel.planner.constrai


@pytest.fixture(scope="module")
def mini_graph():
    model = hp.models.build("gpt-mini")
    return hp.trace(model, model.example_inputs(1, 32))


def test_compression_is_used_only_when_asked(mini_graph):
    cluster = small_cluster("cpu", 1, 8)
    plain = search(mini_graph, cluster, 16, 32, "fp32", top=20)
    # the default: never compressed
    assert all(e.config.grad_compression == "none" for e in plain.best)
    for mode in ("bf16", "fp16", "powersgd"):
        result = search(mini_graph, cluster, 16, 32, "fp32", grad_compression=mode, top=20)
        for e in result.best:
            assert e.config.grad_compression == (mode if e.config.dp > 1 else "none")
            assert not (e.config.grad_compression == "powersgd" and e.config.zero > 0)
    engine = Search(ModelProfile(mini_graph, cluster, "fp32", 32), cluster, 16, "fp32")
    configs = enumerate_configs(engine.ctx, {"grad_compression": "any"})
    assert {c.grad_compression for c in configs} == {"none", "bf16", "fp16", "powersgd"}
    # ZeRO 1-3: FSDP2, no hook
    assert not any(c.grad_compression == "powersgd" and c.zero > 0 for c in configs)
    assert all(c.grad_compression == "none" for c in configs if c.dp == 1)  # nothing to reduce


def test_bf16_wins_where_the_gradient_reduction_matters(mini_graph):
    # dp 16 across two A100 nodes: the fp32 all-reduce crosses InfiniBand; 16 bits halve it.
    cluster = small_cluster("a100-80g", 2, 8)
    fixed = {"tp": 1, "pp": 1, "zero": 0}
    none = search(mini_graph, cluster, 64, 32, "bf16", **fixed).best[0]
    bf16 = search(mini_graph, cluster, 64, 32, "bf16", grad_compression="bf16", **fixed).best[0]
    assert bf16.step_time_s < none.step_time_s and bf16.comm_s["dp"] < none.comm_s["dp"]
    chosen = search(mini_graph, cluster, 64, 32, "bf16", grad_compression="any", **fixed)
    # never fp16 when bf16 ties it
    assert chosen.best[0].config.grad_compression in ("bf16", "powersgd")
    plan = chosen.plan()
    assert plan.parallel.grad_compression == chosen.best[0].config.grad_compression
    assert plan.predicted.uncompressed.step_time_s == pytest.approx(none.step_time_s, rel=1e-5)
    assert plan.predicted.uncompressed.dp_comm_s == pytest.approx(none.comm_s["dp"], rel=1e-5)
    assert plan.predicted.step_time_s < plan.predicted.uncompressed.step_time_s


def test_16_bit_zero_gathers_save_memory_and_time(mini_graph):
    cluster = small_cluster("a100-80g", 2, 8)
    fixed = {"tp": 1, "pp": 1, "zero": 3, "micro_batch": 1}
    none = search(mini_graph, cluster, 64, 32, "bf16", **fixed).best[0]
    bf16 = search(mini_graph, cluster, 64, 32, "bf16", grad_compression="bf16", **fixed).best[0]
    # 16-bit gathered weights and gradients, no copy
    assert bf16.peak_memory_bytes < none.peak_memory_bytes
    # ZeRO 3 gathers and scatters every micro-batch, in half the bytes
    assert bf16.step_time_s < none.step_time_s


def test_a_compressed_plan_round_trips_with_its_settings(tmp_path, mini_graph):
    cluster = small_cluster("cpu", 1, 8)
    plan = hp.plan(
        mini_graph,
        cluster,
        16,
        32,
        "fp32",
        dp=8,
        grad_compression="powersgd",
        powersgd_rank=2,
        powersgd_start_step=50,
    )
    par = plan.parallel
    assert (par.grad_compression, par.powersgd_rank, par.powersgd_start_step, par.zero) == (
        "powersgd",
        2,
        50,
        0,
    )
    assert plan.predicted.uncompressed is not None
    plan.save(tmp_path / "plan.yaml")
    assert hp.Plan.load(tmp_path / "plan.yaml") == plan
    default = hp.plan(mini_graph, cluster, 16, 32, "fp32", dp=8)
    assert default.parallel.grad_compression == "none" and default.predicted.uncompressed is None


def test_a_hand_plan_keeps_its_compression_when_completed(mini_graph):
    from hyparallel.planner import complete

    cluster = small_cluster("cpu", 1, 8)
    hand = hp.Plan.from_dict(
        {
            "cluster": cluster.model_dump(),
            "training": {"global_batch": 16, "micro_batch": 2, "seq_len": 32, "dtype": "fp32"},
            "parallel": {"dp": 4, "pp": 2, "grad_compression": "bf16"},
        }
    )
    done = complete(hand, mini_graph)
    assert done.parallel.grad_compression == "bf16" and done.predicted.uncompressed is not None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"grad_compression": "zip"},
            "grad_compression must be one of 'none', 'bf16', 'fp16', 'powersgd' or 'any'",
        ),
        (
            {"grad_compression": "powersgd", "zero": 1},
            "grad_compression powersgd needs zero 0: ZeRO 1 runs on FSDP2",
        ),
        ({"powersgd_rank": 8}, "powersgd_rank shapes PowerSGD, and grad_compression is none; pass"),
        (
            {"grad_compression": "bf16", "powersgd_start_step": 9},
            "powersgd_start_step shapes PowerSGD, and",
        ),
        (
            {"grad_compression": "any", "powersgd_rank": 0},
            "powersgd_rank must be a positive integer, got 0",
        ),
        (
            {"grad_compression": "any", "powersgd_start_step": 1},
            "powersgd_start_step must be an integer from 2 to",
        ),
    ],
)
def test_compression_constraints_refuse_bad_values_in_one_line(kwargs, message):
    with pytest.raises(PlanError) as info:
        Constraints(**kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_compression_defaults_are_not_listed_as_given():
    assert Constraints(grad_compression="none", tp=2).given() == {"tp": 2}
    assert Constraints(grad_compression="any", powersgd_rank=4).given() == {
        "grad_compression": "any"
    }
    assert Constraints(grad_compression="powersgd", powersgd_rank=8).given() == {
        "grad_compression": "powersgd",
        "powersgd_rank": 8,
    }


def test_a_tied_weight_on_two_stages_is_reduced_apart_uncompressed():
    # Note [a weight several stages hold] in hyparallel/runtime/data_parallel.py: under compression,
    # each stage's copy of gpt-tiny's tied embedding and head is all-reduced on its own, in fp32;
    # PowerSGD compresses the rest.
    model = hp.models.build("gpt-tiny")
    graph = hp.trace(model, model.example_inputs(1, 16))
    cluster = small_cluster("cpu", 1, 4)
    engine = Search(ModelProfile(graph, cluster, "fp32", 16), cluster, 8, "fp32")
    fixed = {"pp": 2, "dp": 2, "zero": 0, "grad_compression": "powersgd"}
    c = next(c for c in enumerate_configs(engine.ctx, fixed) if c.schedule == "1f1b")
    tables = engine._tables(c, engine._links(c))
    n, embedding = tables.n, 256 * 64
    whole, first, last = tables.range(0, n), tables.range(0, 2), tables.range(2, n)
    # (index 7: the shared weights' params)
    assert whole[7] == 0 and first[7] == last[7] == embedding
    # the embedding's P and Q (1,280 elements) only when not shared
    assert whole[4] == first[4] + last[4] + 1280
    # the last stage holds a copy
    assert last[2] - (tables.params[n] - tables.params[2]) == embedding
    arrays = tables.ranges()  # the vectorised tables say the same for every range
    for start in range(n):
        for end in range(start + 1, n + 1):
            assert [a[start, end] for a in arrays] == pytest.approx(list(tables.range(start, end)))


def test_a_cluster_is_also_taken_by_preset_name_or_file(tmp_path):
    # hp.plan(model, "cpu", ...) ended in a raw AttributeError ('str' object has no attribute
    # 'num_gpus')
    from hyparallel.spec.cluster import preset_dir

    model = hp.models.build("gpt-tiny", device="meta")
    path = tmp_path / "cluster.yaml"
    path.write_text((preset_dir() / "cpu.yaml").read_text())
    plans = [
        hp.plan(model, cluster, 8, 64, "fp32")
        for cluster in ("cpu", path, hp.ClusterSpec.preset("cpu"))
    ]
    assert plans[0].parallel == plans[1].parallel == plans[2].parallel
    with pytest.raises(hp.ConfigError, match="unknown cluster preset 'cpux'"):
        hp.plan(model, "cpux", 8, 64, "fp32")
