"""Expert parallelism (issue 38, Note [expert parallelism] in hyparallel/runtime/experts.py): each
MoE layer's experts split over ep of the dp ranks, equal to one device in loss and every gradient,
checkpoints that reshard when ep changes, and what is refused."""

from __future__ import annotations

import pytest
import torch

import hyparallel as hp
from hyparallel.spec.errors import ConfigError
from hyparallel.tools.parity import check_layouts, small_spec

from .conftest import REPO, assert_every_parameter_compared, torchrun
from .test_parity import names_of

WHERE = "tests.tiny_lms:where_moe_lm"


def assert_equal_everywhere(spec: str, layouts: list[dict]) -> None:
    reports = check_layouts(spec, layouts, timeout=300)
    assert [r.verdict for r in reports] == ["equal"] * len(layouts), [r.summary() for r in reports]
    for report in reports:  # every parameter, by name: the experts no rank held would show
        assert names_of(spec) == {name for g in report.groups for name in g.names}
        assert all(g.verdict == "equal" for g in report.groups), report.table()


def test_a_hand_written_where_dispatch_moe_is_equal_under_ep():
    # a ModuleList of experts called one at a time: one exchange per expert; ep 2, experts
    # replicated over 2 of 4 dp ranks under ZeRO 3, and beside tp (experts split column/row too:
    # Note [what a remote expert keeps])
    assert_equal_everywhere(
        WHERE,
        [
            {"dp": 2, "tp": 1, "pp": 1, "ep": 2},
            {"dp": 4, "tp": 1, "pp": 1, "ep": 2, "zero": 3},
            # ZeRO 2: every expert's gradient reduce-scattered over its replicas each micro-batch
            {"dp": 2, "tp": 1, "pp": 1, "ep": 2, "zero": 2},
            {"dp": 2, "tp": 2, "pp": 1, "ep": 2},
            # inside pipeline stages: each expert's call kept whole in the stage graph (Note [a
            # module call a trace keeps], hyparallel/graph/opaque.py)
            {"dp": 2, "tp": 1, "pp": 2, "ep": 2},
        ],
    )


def test_mixtral_stacked_experts_are_equal_under_ep():
    # transformers' grouped experts ([E, ...] weights, experts(hidden, top_k_index, top_k_weights)):
    # one exchange each way per layer; tp folded in (Note [tp folded into the experts' ranks]),
    # without ZeRO and under ZeRO 1 (the experts sharded over replicas spanning tp); ZeRO 3. dp 4
    # x ep 2 under ZeRO 1: the checkpoint test below
    assert_equal_everywhere(
        "hf:MixtralForCausalLM",
        [
            {"dp": 2, "tp": 2, "pp": 1, "ep": 2},
            {"dp": 2, "tp": 2, "pp": 1, "ep": 2, "zero": 1},
            # ep = dp: the experts a unit over a one-rank mesh (Note [experts under ZeRO])
            {"dp": 2, "tp": 1, "pp": 1, "ep": 2, "zero": 3},
            # inside 1F1B pipeline stages, each stage's graph recomputed, the experts an FSDP2 unit
            # inside a stage's
            {
                "dp": 2,
                "tp": 1,
                "pp": 2,
                "ep": 2,
                "zero": 1,
                "schedule": "1f1b",
                "recompute": "full",
            },
        ],
    )


@pytest.mark.sweep
@pytest.mark.parametrize("spec", [WHERE, "hf:MixtralForCausalLM"])
def test_tp_pp_and_ep_together_are_equal(spec):
    # `make sweep` only (8 processes; suite time, issue 36): tp folded into stacked experts inside
    # pipeline stages, a ModuleList's experts split by tp there
    assert_equal_everywhere(spec, [{"dp": 2, "tp": 2, "pp": 2, "ep": 2, "zero": 1}])


MOES = ["hf:Qwen3MoeForCausalLM", "hf:OlmoeForCausalLM", "hf:DeepseekV3ForCausalLM"]


@pytest.mark.sweep
@pytest.mark.parametrize("spec", [WHERE, "hf:MixtralForCausalLM", *MOES])
def test_four_ranks_of_experts_are_equal(spec):
    # `make sweep` only (suite time, issue 36): the suite trains ep 4 in the checkpoint test below,
    # against one device, for both layouts of experts
    assert_equal_everywhere(spec, [{"dp": 4, "tp": 1, "pp": 1, "ep": 4}])


@pytest.mark.sweep
@pytest.mark.parametrize("spec", MOES)
def test_transformers_moes_are_equal_inside_pipeline_stages(spec):
    # `make sweep` only: the suite runs Mixtral's stacked experts inside pipeline stages
    assert_equal_everywhere(spec, [{"dp": 2, "tp": 1, "pp": 2, "ep": 2}])


# DeepSeek-V3: shared experts beside the routed ones, group-limited top-k
@pytest.mark.parametrize("spec", MOES)
def test_transformers_moes_are_equal_under_ep_2(spec):
    assert_equal_everywhere(spec, [{"dp": 2, "tp": 1, "pp": 1, "ep": 2}])


def test_a_checkpoint_saved_at_ep_4_loads_at_ep_2_and_at_ep_1(tmp_path):
    # the CPU's compile backend (tests/test_compile_and_data.py) for the compiled case
    environ = {"HYPARALLEL_COMPILE_BACKEND": "aot_eager"}
    results = torchrun(
        REPO,
        "tests/distributed/experts_worker.py",
        tmp_path / "out.jsonl",
        4,
        str(tmp_path),
        env=environ,
    )
    for case in ("mixtral", "where"):
        ranks = results[case]
        # weights and momentum buffers, ||parallel - single|| / ||single||, after 2 and 3 steps:
        # test_checkpoint's bound
        for rank in ranks:
            for key in ("saved_error", "ep2-zero1_error", "ep2-zero1_continued"):
                assert rank[key] <= 2e-5, (
                    case,
                    key,
                    rank[key],
                    rank.get(key.replace("error", "worst")),
                )
            assert rank["ep1_error"] <= 2e-5 and rank["ep1_continued"] <= 2e-5, (case, rank)
        # the busiest ep rank's routed pairs over the mean (pmodel.expert_imbalance), as one
        # device's routing of the same batches gives it (stacked experts only): ratios of whole
        # counts, the same routes (fp32 scores far apart next to their rounding)
        for rank in ranks:  # fp32 rounding of a sum over every gradient element
            want = pytest.approx(rank["ref_grad_norm"], rel=1e-5)
            assert rank["first_grad_norm"] == want
            if case == "mixtral":  # 15-token sequences: tp 2 splits the rows unevenly
                assert rank["odd_grad_norm"] == pytest.approx(rank["ref_odd_grad_norm"], rel=1e-5)
        if case == "mixtral":
            want = pytest.approx(ranks[0]["expected_imbalance"], rel=1e-9)
            assert [r["imbalance"] for r in ranks] == [want] * 4
            assert ranks[0]["imbalance"] > 1.0
            assert [r["recorded_imbalance"] for r in ranks] == [r["imbalance"] for r in ranks]
            assert [r["local_imbalance"] for r in ranks] == [want] * 4
        else:
            assert [r["imbalance"] for r in ranks] == [None] * 4
            assert [r["recorded_imbalance"] for r in ranks] == [None] * 4
        groups = ranks[0]["parameter_groups"]
        for plan, ep in (("saved", 4), ("ep2-zero1", 2), ("ep1", 1)):
            # the ranks of one ep group hold every expert between them
            compared = {r["rank"] // ep: set() for r in ranks}
            for r in ranks:
                compared[r["rank"] // ep] |= set(r[f"{plan}_checked"])
            assert_every_parameter_compared(groups, compared)

    # Note [the router's auxiliary loss over dp]: cross-entropy plus the load-balancing loss, dp 4
    # x ep 2 (a loss of the model's own: its inputs gathered) and dp 2 x pp 2 x ep 2 (transformers':
    # its sums all-reduced in the last stage's graph), against one device running each micro-batch
    # of every dp rank at once (the per-rank loss's pp case: 0.68 off)
    for case, holders, gathers in (("router-loss", 2, True), ("router-loss-pp", 4, False)):
        ranks = results[case]
        for rank in ranks:
            assert rank["gathers"] is gathers, case
            assert rank["error"] <= 2e-5, (case, rank["error"], rank["worst"])
            assert rank["loss"] == pytest.approx(rank["ref_loss"], rel=1e-5)
            # a forward of 3 x 11 tokens after the step (pp: stages traced again for it)
            assert rank["logits_error"] <= 1e-5, (case, rank["logits_error"])
            assert rank["aux_loss"] == pytest.approx(rank["ref_aux_loss"], rel=1e-5)
        # the ranks holding every parameter between them: an ep group; with pp, both stages too
        compared = {r["rank"] // holders: set() for r in ranks}
        for r in ranks:
            compared[r["rank"] // holders] |= set(r["checked"])
        assert_every_parameter_compared(ranks[0]["parameter_groups"], compared)

    # gradient compression beside ep: the first step's gradients reduced in bf16 (DDP's hook; the
    # bucketed all-reduce after a pipeline), the experts' over their replicas in fp32; within
    # tests/test_grad_compression.py's Note [how close a 16-bit reduction comes] (measured 3.3e-3
    # and 2.9e-3)
    for case, dp, holders in (("bf16-ep2", 4, 2), ("bf16-pp2-ep2", 2, 4)):
        ranks = results[case]
        for rank in ranks:
            assert rank["compressor"]
            assert 2**-8 / 20 <= rank["worst_rel"] <= dp * 2**-8, (case, rank["worst_rel"])
        compared = {r["rank"] // holders: set() for r in ranks}
        for r in ranks:
            compared[r["rank"] // holders] |= set(r["checked"])
        assert_every_parameter_compared(ranks[0]["parameter_groups"], compared)

    # Note [experts under torch.compile]: every block compiled, the experts' call eager; compiled
    # with it, the gradients above the experts were 0.5 off
    ranks = results["compile-ep2"]
    for rank in ranks:
        assert rank["worst_rel"] <= 1e-5, rank["worst_rel"]
    compared = {r["rank"] // 2: set() for r in ranks}
    for r in ranks:
        compared[r["rank"] // 2] |= set(r["checked"])
    assert_every_parameter_compared(ranks[0]["parameter_groups"], compared)


def plan_for(spec: str, **fixed) -> tuple:
    model = hp.models.load(small_spec(spec) if spec.startswith("hf:") else spec).module
    return model, hp.Plan.from_dict(
        {
            "training": {"global_batch": 4, "micro_batch": 1, "seq_len": 16, "dtype": "fp32"},
            "parallel": {"tp": 1, "pp": 1, **fixed},
        }
    )


def test_ep_must_divide_dp():
    with pytest.raises(ConfigError, match=r"parallel.ep \(4\) must divide dp \(2\)"):
        plan_for(WHERE, dp=2, ep=4)


@pytest.mark.parametrize(
    ("spec", "fixed", "message"),
    [
        (
            WHERE + " experts=6",
            {"dp": 4, "ep": 4},
            r"parallel.ep 4 does not divide the 6 experts of layers.0.moe.experts",
        ),
        ("gpt-tiny", {"dp": 2, "ep": 2}, r"parallel.ep 2: GPT has no mixture-of-experts layer"),
    ],
)
def test_what_ep_cannot_split_is_refused_before_any_collective(spec, fixed, message):
    from hyparallel.graph.checks import check_plan

    model, plan = plan_for(spec, **fixed)
    graph = hp.trace(model, hp.models.example_inputs(model, 1, 16))
    with pytest.raises(ConfigError, match=message):
        check_plan(plan, graph)


def test_hyparallel_check_takes_ep(capsys):
    from hyparallel.cli import main

    # trained on cross-entropy plus the router's load-balancing loss: the reference runs the
    # layout's micro-batches (Note [the loss a check trains]); over the whole batch at once it read
    # "differs" (Mixtral: the gates' gradients 0.54 off)
    model = "hf:OlmoeForCausalLM output_router_logits=true"
    loss = ["--loss", "tests.tiny_lms:ce_plus_router_loss"]
    argv = ["check", model, "--tp", "1", "--pp", "1", "--dp", "2", *loss]
    assert main([*argv, "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "dp 2 x ep 2: equal" in out and "mlp.experts.gate_up_proj" in out
    # ep must divide dp: one line, exit 2
    assert main([*argv, "--ep", "4"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "ep (4) must divide dp (2)" in captured.err


def best_with_and_without_ep(spec: str, nodes: int, global_batch: int):
    from hyparallel.planner.api import search

    model = hp.models.load(spec).module
    cluster = hp.ClusterSpec.preset("h100-sxm", num_nodes=nodes, gpus_per_node=8)
    result = search(model, cluster, global_batch, 4096, "bf16", top=1, alternatives=True)
    (without,) = [a for a in result.alternatives if a.label == "no expert parallelism"]
    return result.best[0], without


def test_the_planner_picks_ep_for_mixtral_8x7b_on_64_h100s():
    # Note [expert parallelism's costs]: 8 experts of 14336-wide SwiGLU over ep 8 inside a node
    # (all-to-alls on NVLink); without ep the experts' weights and state push the best plan into a
    # pipeline. 4 of its 32 layers (the same layer, the search in seconds: the best without ep 35%
    # slower; 8 layers: 11%; all 32: the pick tp 2 x pp 4 x dp 8 with ep 8, the best without ep 17%
    # slower, the best without a pipeline the same ep 8 at dp 64, 10% slower)
    best, without = best_with_and_without_ep("mixtral-8x7b num_hidden_layers=4", 8, 512)
    assert best.config.ep == 8 and best.config.pp == 1 and best.comm_s["ep"] > 0
    assert without.evaluation.config.ep == 1
    assert without.evaluation.step_time_s > 1.1 * best.step_time_s
    assert "slower" in without.why


def test_the_planner_picks_ep_for_a_deepseek_v3_shape_on_64_h100s():
    # 256 routed experts of 2048 and a shared one, top-8 (4 of its 61 layers: the same layer, the
    # search in seconds): without ep no plan fits
    best, without = best_with_and_without_ep("deepseek-v3 num_hidden_layers=4", 8, 512)
    assert best.config.ep > 1 and best.comm_s["ep"] > 0
    assert not without.evaluation.feasible and "out of memory" in without.why


def test_show_names_the_ep_groups_and_their_link(tmp_path, capsys):
    from hyparallel.cli import main

    plan = tmp_path / "ep.yaml"
    plan.write_text(
        "version: 1\ncluster: {name: h100-sxm, num_nodes: 2}\n"
        "training: {global_batch: 16, micro_batch: 1, seq_len: 128, dtype: bf16}\n"
        "parallel: {dp: 8, tp: 2, pp: 1, ep: 4}\n"
    )
    assert main(["show", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "(experts over ep 4 of the dp ranks)" in out
    # a ModuleList's experts (split by tp): 4 consecutive dp ranks, tp 2 inside them: ranks 0, 2,
    # 4, 6, one node's NVLink
    (row,) = [line for line in out.splitlines() if line.startswith("│ ep, a ModuleList")]
    assert "0..6 step 2 (4)" in row and "NVLink" in row
    # stacked experts: tp folded in, 4 consecutive ranks (Note [tp folded into the experts' ranks])
    (row,) = [line for line in out.splitlines() if line.startswith("│ ep, stacked")]
    assert "0..3 (4)" in row and "NVLink" in row


def moe_profile(spec: str, **options):
    from hyparallel.graph.tracer import trace
    from hyparallel.planner.profile import ModelProfile

    model = hp.models.load(spec).module
    graph = trace(model, torch.randint(0, 64, (1, 16)))
    cluster = hp.ClusterSpec.preset("h100-sxm", num_nodes=2, gpus_per_node=8)
    return ModelProfile(graph, cluster, "bf16", 16, **options)


def test_the_expert_imbalance_a_run_measured_is_what_the_planner_charges(capsys):
    from hyparallel.cli import main
    from hyparallel.planner.profile import _op_times

    link = hp.ClusterSpec.preset("h100-sxm").intra_node
    spec = small_spec("hf:MixtralForCausalLM")
    costs = {}
    for imbalance in (1.0, 2.5):
        profile = moe_profile(spec, expert_imbalance=imbalance)
        (moe, index), *_ = [(m, i) for i, m in enumerate(profile.experts) if m is not None]
        costs[imbalance] = profile.segment_costs(1, False, 1, "none", link, 2, (link, link))[index]
    device = profile.cluster.device
    work = sum(
        _op_times(profile.raw[index].ops[i], 1, False, 1, device.peak_flops.bf16, device, False)[0]
        for i in moe.ops
    )
    # the busiest rank's share of the experts' work, which the step waits for
    assert costs[2.5].forward_s - costs[1.0].forward_s == pytest.approx(1.5 * work, rel=1e-9)
    # the API and the CLI refuse what is no imbalance, in one line
    with pytest.raises(hp.PlanError, match="expert_imbalance must be a number from 1 to 64"):
        hp.plan("gpt-tiny", "cpu", 8, 16, expert_imbalance=0.5)
    assert main(["plan", "--model", "gpt-tiny", "--gpus", "2", "--expert-imbalance", "0.9"]) == 2
    assert "--expert-imbalance: expected a number" in capsys.readouterr().err


def test_the_planner_folds_tp_into_stacked_experts_and_serialises_a_module_lists():
    from hyparallel.planner.profile import _op_times

    # Note [expert parallelism's costs]; Note [tp folded into the experts' ranks]
    link = hp.ClusterSpec.preset("h100-sxm").intra_node
    profile = moe_profile(small_spec("hf:MixtralForCausalLM"))
    (moe, index), *_ = [(m, i) for i, m in enumerate(profile.experts) if m is not None]
    # the expert work is every op inside the experts (the grouped matmuls, the dispatch), not only
    # the transposes that read their weights
    assert moe.stacked == frozenset(moe.ops) and sum(
        profile.raw[index].ops[i].flops for i in moe.ops
    )

    def costs(tp: int, ep: int):
        return profile.segment_costs(tp, False, 1, "none", link, ep, (link, link))[index]

    plain, folded, alone = costs(2, 1), costs(2, 2), costs(1, 2)
    # tp 2 ranks each exchange half the tokens
    exchange = hp.planner.costs.all_to_all_s
    assert folded.ep_comm_s == pytest.approx(4 * exchange(moe.token_bytes / 2, 2, link), rel=1e-9)
    assert alone.ep_comm_s == pytest.approx(4 * exchange(moe.token_bytes, 2, link), rel=1e-9)
    assert folded.folded_expert_params == folded.expert_params > 0 == alone.folded_expert_params
    # the experts' work on half the tokens at the busiest rank's share: cheaper than every tp
    # rank running all of them
    assert folded.forward_s < plain.forward_s and folded.tp_comm_s > plain.tp_comm_s

    # a ModuleList's experts: one at a time across the ep group, ep times a rank's own work
    profile = moe_profile("tests.tiny_lms:where_moe_lm")
    (moe, index), *_ = [(m, i) for i, m in enumerate(profile.experts) if m is not None]
    assert not moe.stacked
    one, two = (profile.segment_costs(1, False, 1, "none", link, ep, (link, link)) for ep in (1, 2))
    device = profile.cluster.device
    work = sum(
        _op_times(profile.raw[index].ops[i], 1, False, 1, device.peak_flops.bf16, device, False)[0]
        for i in moe.ops
    )
    assert two[index].forward_s == pytest.approx(one[index].forward_s + work, rel=1e-9)
    # and one exchange per expert, each after a header all-gather
    calls, gather = moe.listed_experts, hp.planner.costs.ring_allgather_s
    assert calls == 4  # where_moe_lm's experts in the block
    want = 4 * calls * exchange(moe.token_bytes / calls, 2, link) + calls * gather(48.0, 2, link)
    assert two[index].ep_comm_s == pytest.approx(want, rel=1e-9)


def test_ep_links_of_stacked_experts_stay_in_a_node_under_tp():
    from hyparallel.planner.search import Config, ep_links

    cluster = hp.ClusterSpec.preset("h100-sxm", num_nodes=32, gpus_per_node=8)
    config = Config(2, 1, 128, 4, 4, "1f1b", 1, "full", 3, False, ("pp", "dp", "tp"), ep=8)
    listed, stacked = ep_links(config, cluster)
    # a ModuleList's: 8 dp ranks with tp 2 inside them, 16 GPUs; stacked: 8 consecutive GPUs
    assert listed == cluster.inter_node and stacked == cluster.intra_node


def test_the_planner_prices_ep_inside_pipeline_stages():
    from hyparallel.planner.api import search
    from hyparallel.planner.search import Config, Search

    # ep inside pipeline stages (Note [a module call a trace keeps]): with pp fixed the planner
    # still weighs ep, and each stage is charged the state of its own experts only
    model = hp.models.load("mixtral-8x7b num_hidden_layers=4").module
    cluster = hp.ClusterSpec.preset("h100-sxm", num_nodes=8, gpus_per_node=8)
    result = search(model, cluster, 512, 4096, "bf16", top=1, alternatives=True, pp=2)
    best = result.best[0]
    assert best.config.pp == 2 and best.config.ep > 1 and best.comm_s["ep"] > 0
    (without,) = [a for a in result.alternatives if a.label == "no expert parallelism"]
    assert without.evaluation.step_time_s > best.step_time_s

    engine = Search(result.profile, cluster, 512, "bf16")
    c = Config(1, 2, 32, 1, 16, "1f1b", 1, "full", 1, False, ("pp", "dp", "tp"), ep=8)
    evaluation = engine.evaluate(c)
    tables = engine._tables(c, engine._links(c))
    whole = sum(engine._expert_state(c, tables.segments))
    per_stage = [tables.range(*stage)[9] for stage in evaluation.stages]
    # ZeRO 1 shards the experts' state over their 4 replicas, not the 32 dp ranks: more bytes, split
    # between the stages as their experts are (2 blocks each)
    assert whole > 0 and sum(per_stage) == pytest.approx(whole, rel=1e-9)
    assert per_stage == pytest.approx([whole / 2] * 2, rel=0.01)


def test_the_planner_prices_the_experts_gradients_and_the_router_loss_over_their_own_groups():
    from hyparallel.planner import costs
    from hyparallel.planner.api import search
    from hyparallel.planner.search import Config, Search

    # Note [expert parallelism's costs]: Mixtral trained with its load-balancing loss
    model = hp.models.load("mixtral-8x7b num_hidden_layers=2 output_router_logits=true").module
    cluster = hp.ClusterSpec.preset("h100-sxm", num_nodes=4, gpus_per_node=8)
    result = search(model, cluster, 256, 4096, "bf16", top=1, tp=1, pp=1, dp=32, ep=8)
    profile = result.profile
    # the router scores read outside their layers: 2 layers x 4096 tokens x 8 experts a sequence
    assert profile.router_logit_elements == 2 * 4096 * 8
    engine = Search(profile, cluster, 256, "bf16")

    def config(dp: int, ep: int, zero: int) -> Config:
        order = ("pp", "dp", "tp")
        return Config(1, 1, dp, 1, 256 // dp, "1f1b", 1, "full", zero, False, order, ep=ep)

    for dp, ep, zero in ((8, 8, 0), (32, 8, 0), (32, 8, 1)):
        c = config(dp, ep, zero)
        links = engine._links(c)
        tables = engine._tables(c, links)
        whole = list(tables.range(0, tables.n))
        experts = whole[10]
        assert (
            experts > 0 and whole[11] == 0
        )  # a ModuleList's experts are split over ep, not folded
        # the same stage with its experts taken out: what is left is only what the experts' own
        # replicas (dp / ep of them) do, not a reduction over dp
        dense = list(whole)
        dense[2], dense[10] = whole[2] - experts, 0.0
        _, tail, _ = engine._stage_time(c, links, *whole)
        _, dense_tail, _ = engine._stage_time(c, links, *dense)
        replicas, device = dp // ep, cluster.device
        step_bytes = costs.adam_step_bytes_per_param("bf16") * experts / replicas ** (zero > 0)
        optimizer = step_bytes / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)
        if zero == 0:  # one fp32 all-reduce over the replicas after the backward
            reduced = costs.ring_allreduce_s(experts * 4, replicas, links["dp"])
            assert tail - dense_tail == pytest.approx(optimizer + reduced, rel=1e-6)
        else:  # their own FSDP unit: gathered once, scattered in the last backward (hidden in part)
            reduced = costs.ring_allgather_s(experts * 4, replicas, links["dp"])
            assert optimizer + reduced < tail - dense_tail < optimizer + 2 * reduced
        if replicas == 1:  # each expert held once: its gradient is never communicated
            assert reduced == 0
    # the load-balancing loss: transformers' 2 E + 1 sums all-reduced forward and backward; a
    # model's own function's inputs, every dp rank's router scores, gathered forward and their
    # gradients scattered backward; on each micro-batch of the stage computing the loss
    c = config(32, 8, 0)
    links = engine._links(c)
    n = len(engine._tables(c, links).segments)
    sums = 2 * costs.ring_allreduce_s((2 * 8 + 1) * 4, 32, links["dp"])
    gathered = 2 * costs.ring_allgather_s(2 * 4096 * 8 * c.micro_batch * 32 * 2, 32, links["dp"])
    for gathers, per_micro_batch in ((False, sums), (True, gathered)):
        profile.router_loss_gathered = gathers
        loss_s = engine._router_loss_s(c, links, n)
        assert loss_s[:-1] == [0.0] * (n - 1)
        assert loss_s[-1] == pytest.approx(per_micro_batch, rel=1e-9)
        priced = engine.evaluate(c).step_time_s
        elements = profile.__dict__.pop("router_logit_elements")
        profile.__dict__["router_logit_elements"] = 0.0  # as the same model without the loss
        unpriced = engine.evaluate(c).step_time_s
        profile.__dict__["router_logit_elements"] = elements
        assert priced - unpriced == pytest.approx(c.num_microbatches * per_micro_batch, rel=1e-6)
    # PowerSGD compresses the other weights' gradients only
    plain, split = profile.powersgd_work(1, 4), profile.powersgd_work(1, 4, 8)
    assert sum(g.elements for g in split) < sum(g.elements for g in plain)


def test_only_transformers_load_balancing_loss_is_reduced_to_its_sums():
    from hyparallel.graph import router_loss

    # Note [the router's auxiliary loss over dp]: read from the code, never from a name
    reference = router_loss.transformers_load_balancing_loss
    assert router_loss.reduces(reference)

    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        return reference(gate_logits, num_experts, top_k, attention_mask)

    assert not router_loss.reduces(load_balancing_loss_func)
    assert not router_loss.gathers(torch.nn.Linear(2, 2))  # no router loss at all


def test_the_all_reduced_load_balancing_loss_is_transformers_with_and_without_padding(world_of_one):
    import torch.distributed as dist

    from hyparallel.graph.router_loss import transformers_load_balancing_loss
    from hyparallel.runtime.router_loss import _global_load_balancing_loss

    # one rank: the sums all-reduced over a group of one are its own, so the loss and its gradient
    # are the reference's (fp32 sums in another order: rtol 1e-6)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    logits = tuple(torch.randn(12, 8, requires_grad=True) for _ in range(3))
    padded = torch.tensor([[1] * 5 + [0], [1] * 6])
    for mask in (None, padded):
        want = transformers_load_balancing_loss(logits, 8, 2, mask)
        got = _global_load_balancing_loss(logits, 8, 2, mask, dist.group.WORLD)
        assert got.item() == pytest.approx(want.item(), rel=1e-6)
        for a, b in zip(torch.autograd.grad(got, logits), torch.autograd.grad(want, logits)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
