"""Where embedding tables go: the parameter-server cost functions, the pick for a recommendation
model, the CLI."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hyparallel as hp
from hyparallel.cli import main
from hyparallel.planner import search, servers, tables
from hyparallel.spec.errors import PlanError
from hyparallel.spec.schema import Plan

A100 = hp.ClusterSpec.preset("a100-80g")
CRITEO = (
    "--model",
    "dlrm-criteo-tb",
    "--gpus",
    "8",
    "--cluster",
    "a100-80g",
    "--global-batch",
    "65536",
)


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


class _NoTables(nn.Module):
    """A model without embedding tables, for the CLI to refuse --ps-servers on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def example_inputs(self, batch_size: int, seq_len: int = 1, device="meta"):
        return (torch.zeros(batch_size, 8, device=device),)


def make_no_tables() -> nn.Module:
    return _NoTables()


@pytest.fixture(scope="module")
def criteo():
    """dlrm-criteo-tb on one DGX A100 node, global batch 65,536: the tables compared (traced once
    per module)."""
    return search(hp.models.build("dlrm-criteo-tb"), A100, 65536)


# ---- the pure cost functions ---------------------------------------------------------------------


def test_unique_ids_are_bounded_and_grow_with_draws():
    assert servers.expected_unique_ids(1, 50) == 1.0
    assert servers.expected_unique_ids(1000, 0) == 0.0
    assert servers.expected_unique_ids(1000, 1) == pytest.approx(1.0)
    assert servers.expected_unique_ids(10**9, 8192) == pytest.approx(
        8192, rel=1e-4
    )  # a huge table: nearly all distinct
    assert servers.expected_unique_ids(100, 10**6) == pytest.approx(100)  # a small table: every row
    counts = [servers.expected_unique_ids(1000, n) for n in (10, 100, 1000, 10_000)]
    assert counts == sorted(counts) and all(c <= 1000 for c in counts)
    assert servers.expected_unique_ids(1000, 1000) == pytest.approx(
        1000 * (1 - (1 - 1 / 1000) ** 1000)
    )


def test_unique_ids_bound_a_zipf_draw():
    """The uniform expectation bounds any distribution's: Zipf(1.2) over 1,000 rows, computed
    exactly."""
    rows, draws = 1000, 500
    weights = [1 / (r + 1) ** 1.2 for r in range(rows)]
    total = sum(weights)
    zipf = sum(1 - (1 - w / total) ** draws for w in weights)
    assert zipf < servers.expected_unique_ids(rows, draws)


def test_transfer_bytes_by_hand():
    # 100 rows of 16 fp32 values and 10 of 8, each with its int64 id, and 1,000 bytes of dense
    # weights.
    assert (
        servers.transfer_bytes([100, 10], [16, 8], 1000)
        == 100 * (16 * 4 + 8) + 10 * (8 * 4 + 8) + 1000
        == 8600
    )


def test_optimizer_state_matches_the_servers_rules():
    assert servers.optimizer_state_bytes("sgd", 1600, 100) == 0
    assert servers.optimizer_state_bytes("adagrad", 1600, 100) == 4 * 1600
    assert (
        servers.optimizer_state_bytes("rowwise-adam", 1600, 100) == 4 * 1600 + 12 * 100
    )  # m per value; v, steps per row
    # the gradient read, the weights read and written, adagrad's sum read and written
    assert servers.update_traffic_bytes("adagrad", 1600, 100) == 3 * 4 * 1600 + 2 * 4 * 1600


def test_server_memory_halves_with_twice_the_servers():
    one = servers.server_table_memory_bytes(1000, 16, "adagrad", 2)
    assert one == 500 * (16 * 4 + 16 * 4)
    assert servers.server_table_memory_bytes(1000, 16, "adagrad", 4) == one / 2
    tables_only = [(1000, 16), (400, 8)]
    assert servers.server_memory_bytes(
        tables_only, 0, 0, "sgd", 4, 0
    ) * 2 == servers.server_memory_bytes(tables_only, 0, 0, "sgd", 2, 0)


def test_dense_tensors_go_largest_first_onto_the_least_loaded():
    # hyparallel/runtime/ps/roles.py's dense_owners: 5 -> 0, 4 -> 1, 3 -> 1, 2 -> 0, 1 -> 0 (a tie:
    # the lower index)
    assert servers.dense_loads_bytes([1, 2, 3, 4, 5], 2) == [8, 7]
    assert servers.dense_loads_bytes([10], 3) == [10, 0, 0]


def test_link_time_takes_the_busier_end_and_each_request():
    link = A100.inter_node
    worker, server = 1e8, 3e8
    # Each request pays an RPC's round trip, far above the link's own latency (microseconds).
    expected = server / link.bandwidth_bytes_per_s + 5 * max(link.latency_s, servers.RPC_REQUEST_S)
    assert servers.ps_link_s(worker, server, 5, link) == pytest.approx(expected)
    assert servers.RPC_REQUEST_S > link.latency_s
    # One round trip per table (its requests to every server go together) and one for the dense
    # weights.
    assert servers.pull_requests([1e5, 2.0, 0.0], 8, 3) == 2 + 1


def test_table_wise_split_spreads_large_tables_and_sizes_the_exchange():
    assignment = servers.table_wise_assignment([100.0, 90.0, 80.0, 1.0, 1.0, 1.0], [4] * 6, 3)
    assert sorted(assignment[:3]) == [0, 1, 2]  # one large table per device
    assert sorted(assignment[3:]) == [0, 1, 2]  # the small ones even out the exchange
    # 2 devices, batch 8: device 0 sends its 4 values for the other 4 samples, receives 12 for its
    # own 4
    assert servers.table_wise_exchange_bytes(4, 16, 8, 2) == max(8 * 0.5 * 4 * 4, 4 * 12 * 4)
    assert servers.all_to_all_s(1e6, 1, A100.intra_node) == 0.0


# ---- the pick ------------------------------------------------------------------------------------


def test_criteo_tables_do_not_fit_replicated_and_ps_is_planned(criteo):
    choice = criteo.tables
    by_kind = {option.kind: option for option in choice.options}
    workers, split, servers = by_kind["workers"], by_kind["split"], by_kind["ps"]
    assert (
        not workers.fits
        and "89.5 GiB of tables" in workers.reason
        and "77.0 GiB usable" in workers.reason
    )
    assert choice.why_not(workers) == workers.reason
    assert split.fits and not split.runnable  # priced, never picked: no plan can say it
    assert "table-wise" in choice.why_not(split) and "ms/step" in choice.why_not(split)
    assert choice.pick is servers and servers.fits and servers.servers >= 1
    assert servers.step_time_s == pytest.approx(sum(servers.parts.values()))
    plan = criteo.plan()
    assert plan.ps is not None and plan.ps.servers == servers.servers and len(plan.ps.tables) == 26
    # Note [servers inside the launch]: a plan for 8 GPUs runs in 8 processes, servers on some of
    # them; 65,536 samples split over 4 workers (not 5, 6 or 7), so 4 servers
    assert (
        (plan.parallel.dp, plan.parallel.tp, plan.parallel.pp)
        == (servers.workers, 1, 1)
        == (4, 1, 1)
    )
    assert plan.launch_size == 8 and plan.ps.servers == 4
    assert plan.training.seq_len == 1  # DLRM's inputs are samples, not sequences
    pred = plan.predicted
    assert len(pred.memory_gib) == 1 and pred.memory_gib[0] < A100.device.memory_bytes / 2**30
    assert pred.step_time_s == pytest.approx(servers.step_time_s, rel=1e-5)
    assert pred.comm_s.dp > 0 and pred.comm_s.tp == pred.comm_s.pp == 0
    assert Plan.from_dict(plan.to_dict()) == plan


def test_more_servers_hold_less_and_update_faster(criteo):
    setting = tables._Setting(criteo.graph, criteo.profile, A100, 65536, "bf16", None)
    worker = tables._ps_worker(setting)
    four, eight = (tables._ps_option(setting, servers, worker) for servers in (4, 8))
    assert eight.server_memory_bytes < four.server_memory_bytes
    assert eight.parts["server update"] < four.parts["server update"]
    assert eight.parts["compute"] == four.parts["compute"]


def test_ps_servers_fixes_the_count_and_host_memory_refuses_too_few():
    model = hp.models.build("dlrm-criteo-tb")
    plan = hp.plan(model, A100, 65536, ps_servers=4)
    assert plan.ps.servers == 4 and plan.ps.optimizer == "adagrad" and plan.ps.staleness == 0
    # servers asked for: beside one worker per GPU
    assert plan.parallel.dp == 8 and plan.launch_size == 12
    small = A100.model_copy(update={"ps_server_memory_bytes": 64 * 2**30})
    with pytest.raises(PlanError, match="per server .* use more servers"):
        hp.plan(model, small, 65536, ps_servers=2)


class LSTMLM(torch.nn.Module):
    """A language model whose repeated layers the planner does not see (an nn.LSTM): it looks like a
    model of one embedding table and a little dense compute, and the ps option used to win with 5
    servers beside 4 workers."""

    def __init__(self, vocab: int = 256, hidden: int = 64):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab)
        self.lstm = torch.nn.LSTM(hidden, hidden, 2, batch_first=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(tokens))[0])


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["lstm", "dlrm-tiny"])
def test_the_planners_pick_for_n_gpus_runs_in_n_processes(name, gpus):
    # Note [servers inside the launch]: whatever wins, servers included, the launch is the GPUs'
    # processes
    cluster = hp.ClusterSpec.preset("cpu", gpus_per_node=gpus)
    if name == "lstm":
        plan = hp.plan(
            LSTMLM(), cluster, 64, 16, "fp32", example_inputs=torch.zeros(1, 16, dtype=torch.long)
        )
    else:
        plan = hp.plan(hp.models.build(name), cluster, 64)
    assert plan.launch_size == gpus, (plan.parallel.dp, plan.ps)


def test_only_a_model_whose_tables_hold_most_of_it_is_offered_parameter_servers():
    # Note [which models compare tables]: "no blocks" alone gave an LSTM LM (a 16k-value embedding
    # beside 66k in the LSTM) 6 servers and server-side Adagrad at lr 0.01 in place of the user's
    # optimizer on the 8-process preset
    cpu = hp.ClusterSpec.preset("cpu")
    lstm = search(LSTMLM(), cpu, 8, 16, "fp32", example_inputs=torch.zeros(1, 16, dtype=torch.long))
    assert not lstm.graph.blocks and lstm.tables is None and lstm.plan().ps is None
    # tables compared: DLRM's dominate
    assert search(hp.models.build("dlrm-tiny"), cpu, 64).tables is not None


def test_a_transformer_keeps_its_plan():
    model = hp.models.build("gpt-tiny")
    result = search(model, A100, 64, 128)
    assert result.tables is None
    assert result.plan().ps is None and result.plan() == hp.planner.to_plan(result, result.best[0])


def test_request_errors_are_one_line():
    model = hp.models.build("dlrm-tiny")
    for bad, words in (
        ({"ps_servers": -1}, "ps_servers must be a positive integer"),
        ({"ps_servers": 2, "tp": 2}, "needs tp 1, not 2"),
        ({"ps_servers": 2, "dp": 4}, "one worker per GPU"),
    ):
        with pytest.raises(PlanError, match=words) as error:
            hp.plan(model, A100, 64, **bad)
        assert "\n" not in str(error.value)
    with pytest.raises(PlanError, match="no nn.Embedding or nn.EmbeddingBag"):
        hp.plan(make_no_tables(), A100, 64, ps_servers=2)


def test_zero_servers_keeps_the_tables_on_the_gpus():
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=2)
    model = hp.models.build("dlrm-mid")
    inputs = model.example_inputs(64)
    # the pick here
    assert hp.plan(model, cluster, 128, dtype="fp32", example_inputs=inputs).ps is not None
    kept = hp.plan(model, cluster, 128, dtype="fp32", example_inputs=inputs, ps_servers=0)
    assert kept.ps is None and kept.predicted.step_time_s > 0


# ---- the command line ----------------------------------------------------------------------------


def test_cli_writes_a_ps_plan(capsys, tmp_path):
    path = tmp_path / "ps.yaml"
    argv = (
        "--model",
        "dlrm-tiny",
        "--gpus",
        "2",
        "--global-batch",
        "64",
        "--ps-servers",
        "3",
        "-o",
        str(path),
    )
    code, out, _ = run(capsys, "plan", *argv)
    assert code == 0 and "parameter servers 3 beside the 2 workers (launch 5 processes)" in out
    plan = Plan.load(path)
    assert plan.ps.servers == 3 and plan.ps.tables == [
        "tables.0",
        "tables.1",
        "tables.2",
        "tables.3",
    ]
    assert plan.launch_size == 5 and plan.predicted.step_time_s > 0


def test_cli_top_shows_why_each_place_lost(capsys):
    code, out, _ = run(capsys, "plan", *CRITEO, "--top", "3")
    assert code == 0
    # the table's cells wrapped: their words in order
    flat = " ".join(out.replace("│", " ").split())
    assert (
        "where the embedding tables go" in flat
        and "parameter servers" in flat
        and "the pick" in flat
    )
    assert (
        "89.5 GiB of tables" in flat
        and "table-wise split over 8 GPUs" in flat
        and "no table-wise" in flat
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("--ps-servers", "-1"), "--ps-servers: expected an integer from 0"),
        (("--ps-servers", "2", "--tp", "2"), "needs tp 1, not 2"),
        (("--ps-servers", "2", "--pp", "2"), "needs pp 1, not 2"),
    ],
)
def test_cli_bad_ps_requests_exit_2(capsys, argv, expected):
    code, out, err = run(capsys, "plan", "--model", "dlrm-tiny", "--gpus", "8", *argv)
    assert code == 2 and out == "" and expected in err and err.count("\n") == 1


def test_cli_refuses_ps_for_a_model_without_tables(capsys):
    model = "tests.test_planner_ps:make_no_tables"
    code, out, err = run(capsys, "plan", "--model", model, "--gpus", "2", "--ps-servers", "1")
    assert (
        code == 2
        and out == ""
        and "no nn.Embedding or nn.EmbeddingBag" in err
        and err.count("\n") == 1
    )


def test_cli_plans_a_model_without_tables_as_before(capsys):
    code, out, _ = run(
        capsys,
        "plan",
        "--model",
        "tests.test_planner_ps:make_no_tables",
        "--gpus",
        "2",
        "--top",
        "2",
    )
    assert (
        code == 0 and "where the embedding tables go" not in out and "parameter servers" not in out
    )
