"""The plan file: validation, completion, one-line errors, round trips and the rank layout."""

from __future__ import annotations

import itertools

import pydantic
import pytest
import torch
import yaml

import hyparallel as hp
from hyparallel.spec.errors import ConfigError

HAND = {"training": {"global_batch": 64, "seq_len": 1024}, "parallel": {"dp": 2, "tp": 4, "pp": 2}}


def write(tmp_path, data, name="plan.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def load_error(tmp_path, data) -> str:
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        hp.Plan.load(path)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(f"{path}: ")
    return message.removeprefix(f"{path}: ")


def test_hand_plan_with_training_and_parallel_only_is_completed(tmp_path):
    plan = hp.Plan.load(write(tmp_path, HAND))
    assert plan.training.micro_batch == 1 and plan.training.dtype == "bf16"
    assert plan.parallel.num_microbatches == 64 // (2 * 1) == plan.num_microbatches
    assert plan.parallel.schedule == "1f1b" and plan.parallel.zero == 0
    assert plan.placement.order == ("pp", "dp", "tp")
    assert plan.world_size == 16


def test_micro_batch_derived_from_num_microbatches(tmp_path):
    data = {
        "training": {"global_batch": 64, "seq_len": 8},
        "parallel": {"dp": 2, "num_microbatches": 8},
    }
    plan = hp.Plan.load(write(tmp_path, data))
    assert plan.training.micro_batch == 4 and plan.num_microbatches == 8


def test_shipped_plans_load(repo):
    for path in sorted((repo / "configs" / "plans").glob("*.yaml")):
        plan = hp.Plan.load(path)
        assert plan.cluster is not None and plan.cluster.num_gpus == plan.world_size


def test_round_trip_is_exact(tmp_path):
    plan = hp.Plan.model_validate(
        {
            **HAND,
            "model": {
                "name": "gpt-tiny",
                "num_params": 124672,
                "num_layers": 2,
                "fingerprint": "sha256:0123",
            },
            "cluster": {"name": "a100-80g", "num_nodes": 2},
            "stages": [
                {"index": 0, "modules": ["tok_embeddings", "layers.0"], "compute_s": 0.1234567891},
                {"index": 1, "modules": ["layers.1", "norm", "output"], "memory_gib": 12.5},
            ],
            "tensor_parallel": {
                "layers.*.attn.qkv": "column",
                "layers.*.attn.proj": "row",
                "tok_embeddings": "vocab",
            },
            "predicted": {
                "step_time_s": 1.5,
                "tokens_per_s": 43690.67,
                "tflops_per_gpu": 150.2,
                "mfu": 0.481,
                "bubble_fraction": 0.03125,
                "memory_gib": [61.2, 58.9],
                "comm_s": {"tp": 0.1, "dp": 1e-5, "pp": 0.0},
                # what gradient compression saved
                "uncompressed": {"step_time_s": 1.75, "dp_comm_s": 0.25},
            },
        }
    )
    path = tmp_path / "out.yaml"
    plan.save(path)
    assert hp.Plan.load(path) == plan
    assert (
        yaml.safe_load(path.read_text())["cluster"]["device"]["peak_flops"]["bf16"] == 312e12
    )  # a float, not a string


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {**HAND, "parallel": {"tp": "eight"}},
            "parallel.tp: expected a positive integer, got 'eight'",
        ),
        ({**HAND, "parallel": {"tp": 0}}, "parallel.tp: expected a positive integer, got 0"),
        ({**HAND, "parallel": {"tp": 2.5}}, "parallel.tp: expected a positive integer, got 2.5"),
        (
            {**HAND, "parallel": {"schedule": "zigzag"}},
            "parallel.schedule: expected one of 'gpipe', '1f1b', 'interleaved-1f1b', got 'zigzag'",
        ),
        ({**HAND, "parallel": {"zero": 4}}, "parallel.zero: expected one of 0, 1, 2, 3, got 4"),
        (
            {**HAND, "parallel": {"sequence_parallel": "maybe"}},
            "parallel.sequence_parallel: expected true or false, got 'maybe'",
        ),
        (
            {**HAND, "training": {"global_batch": 8, "seq_len": 8, "dtype": "fp8"}},
            "training.dtype: expected one of 'bf16', 'fp16', 'fp32', got 'fp8'",
        ),
        (
            {**HAND, "parallel": {"dp": 2, "pipeline": 4}},
            "parallel.pipeline: unknown key 'pipeline'; expected one of: dp, tp, pp",
        ),
        (
            {**HAND, "extra": 1},
            "extra: unknown key 'extra'; expected one of: version, model, cluster",
        ),
        (
            {
                **HAND,
                "predicted": {
                    **{
                        k: 1
                        for k in (
                            "step_time_s",
                            "tokens_per_s",
                            "tflops_per_gpu",
                            "mfu",
                            "bubble_fraction",
                        )
                    },
                    "memory_gib": [1, 1],
                    "comm_s": {"tp": 0, "dp": 0, "pp": 0},
                    "uncompressed": {"step_time_s": 1, "dp_s": 0},
                },
            },
            # a typo: dp_s
            "predicted.uncompressed.dp_comm_s: missing required key (and 1 more error)",
        ),
        ({"parallel": {"dp": 1}}, "training: missing required key"),
        ({**HAND, "version": 2}, "version: expected 1, got 2"),
        (
            {**HAND, "tensor_parallel": {"layers.0.mlp.fc": "diagonal"}},
            (
                "tensor_parallel.layers.0.mlp.fc: expected one of 'column', 'row', 'vocab',"
                " 'replicate', got 'diagonal'"
            ),
        ),
        (
            {**HAND, "placement": {"order": ["tp", "tp", "dp"]}},
            "placement.order: must name pp, dp and tp once each, got ['tp', 'tp', 'dp']",
        ),
    ],
)
def test_malformed_plans_give_one_line(tmp_path, data, expected):
    assert load_error(tmp_path, data).startswith(expected)


@pytest.mark.parametrize(
    ("parallel", "training", "expected"),
    [
        (
            {"dp": 3},
            {"global_batch": 64, "seq_len": 8},
            "training.global_batch (64) must be a multiple of dp (3) x micro_batch (1) = 3",
        ),
        (
            {"dp": 2, "num_microbatches": 5},
            {"global_batch": 64, "micro_batch": 4, "seq_len": 8},
            (
                "parallel.num_microbatches (5) must equal global_batch (64) / (dp (2) x micro_batch"
                " (4)) = 8"
            ),
        ),
        (
            {"pp": 2, "virtual_stages": 2},
            {"global_batch": 8, "seq_len": 8},
            "parallel.virtual_stages is 2 but schedule is '1f1b'",
        ),
        (
            {"pp": 4, "schedule": "interleaved-1f1b", "virtual_stages": 2},
            {"global_batch": 6, "seq_len": 8},
            "interleaved-1f1b needs num_microbatches (6) to be a multiple of pp (4)",
        ),
        (
            {"sequence_parallel": True},
            {"global_batch": 8, "seq_len": 8},
            "parallel.sequence_parallel needs tp > 1",
        ),
        (
            {"vocab_parallel_loss": True},
            {"global_batch": 8, "seq_len": 8},
            "parallel.vocab_parallel_loss needs tp > 1",
        ),
    ],
)
def test_inconsistent_plans_show_the_arithmetic(tmp_path, parallel, training, expected):
    assert expected in load_error(tmp_path, {"training": training, "parallel": parallel})


def test_world_size_must_match_cluster(tmp_path):
    message = load_error(tmp_path, {**HAND, "cluster": {"name": "a100-80g", "num_nodes": 1}})
    assert (
        message == "dp(2) * tp(4) * pp(2) = 16 GPUs, but cluster 'a100-80g' has 1 node(s) x 8 = 8; "
        "change the degrees or cluster.num_nodes"
    )


def test_stage_list_is_checked(tmp_path):
    two = [{"index": 0, "modules": ["a"]}, {"index": 1, "modules": ["b"]}]
    assert "stages lists 1 stage(s) but pp (2)" in load_error(tmp_path, {**HAND, "stages": two[:1]})
    assert "stages[0].index is 1" in load_error(tmp_path, {**HAND, "stages": [two[1], two[0]]})
    dup = [{"index": 0, "modules": ["a"]}, {"index": 1, "modules": ["a"]}]
    assert "module 'a' is in stages 0 and 1" in load_error(tmp_path, {**HAND, "stages": dup})


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    path = write(tmp_path, "training:\n  global_batch: 8\n parallel: [\n")
    with pytest.raises(ConfigError) as info:
        hp.Plan.load(path)
    assert (
        str(info.value)
        == f"{path}:3:2: invalid YAML: expected <block end>, but found '<block mapping start>'"
    )


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: no such file"):
        hp.Plan.load(tmp_path / "nope.yaml")
    with pytest.raises(
        ConfigError, match="expected a mapping of keys at the top level, got an empty file"
    ):
        hp.Plan.load(write(tmp_path, ""))


def test_yaml_is_loaded_safely(tmp_path):
    path = write(tmp_path, "!!python/object/apply:os.system ['echo owned']\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        hp.Plan.load(path)


@pytest.mark.parametrize("order", list(itertools.permutations(("pp", "dp", "tp"))))
def test_rank_layout_matches_device_mesh(order):
    plan = hp.Plan.model_validate({**HAND, "placement": {"order": list(order)}})
    shape = plan.mesh_shape()
    assert list(shape) == list(order)
    # torch's init_device_mesh lays ranks out as arange(world).reshape(mesh_shape) over the named
    # dims.
    mesh = torch.arange(plan.world_size).reshape(*shape.values())
    for index in itertools.product(*(range(n) for n in shape.values())):
        coords = dict(zip(order, index))
        rank = int(mesh[index])
        assert plan.coords(rank) == {a: coords[a] for a in ("pp", "dp", "tp")}
        assert plan.rank_of(**coords) == rank
    for axis in ("pp", "dp", "tp"):
        dim = order.index(axis)
        expected = sorted(mesh.movedim(dim, -1).reshape(-1, shape[axis]).tolist())
        assert plan.group_ranks(axis) == expected


def test_default_order_keeps_tp_inside_a_node():
    plan = hp.Plan.model_validate({**HAND, "cluster": {"name": "a100-80g", "num_nodes": 2}})
    per_node = plan.cluster.gpus_per_node
    for group in plan.group_ranks("tp"):
        assert len({rank // per_node for rank in group}) == 1


def test_cluster_shorthands():
    by_name = hp.Plan.model_validate({**HAND, "parallel": {"dp": 8}, "cluster": "h100-sxm"})
    assert by_name.cluster == hp.ClusterSpec.preset("h100-sxm")
    resized = hp.Plan.model_validate({**HAND, "cluster": {"name": "h100-sxm", "num_nodes": 2}})
    assert resized.cluster.num_gpus == 16


def test_plans_are_frozen():
    plan = hp.Plan.model_validate(HAND)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        plan.parallel.tp = 8  # type: ignore[misc]


# ---- files that are not plans, and numbers out of range: one line each, naming file and place ----


def test_a_binary_file_is_one_line(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_bytes(b"training:\n  seq_len: \xff\xfe\x00\x01")
    with pytest.raises(ConfigError) as info:
        hp.Plan.load(path)
    assert (
        str(info.value) == f"{path}: not UTF-8 text (byte 0xff at offset 21); expected a YAML file"
    )


def test_a_folder_and_an_oversized_file_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=f"^{tmp_path}: is a folder; give a YAML file$"):
        hp.Plan.load(tmp_path)
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (16 * 2**20 + 1))
    with pytest.raises(ConfigError, match="big.yaml: larger than 16 MiB"):
        hp.Plan.load(big)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            (
                "training: {global_batch: 8, seq_len: 4}\nparallel: {dp: 1}\ntraining:"
                " {global_batch: 16, seq_len: 4}\n"
            ),
            ":3:1: invalid YAML: duplicate key 'training' (first on line 1); keep one of them",
        ),
        (
            "training:\n  global_batch: 8\n  seq_len: 4\n  global_batch: 16\nparallel: {}\n",
            ":4:3: invalid YAML: duplicate key 'global_batch' (first on line 2)",
        ),
        (
            (
                "training: {global_batch: 8, seq_len: 4}\nparallel: {}\nstages:\n  - {index: 0,"
                " modules: [a], index: 1}\n"
            ),
            ":4:30: invalid YAML: duplicate key 'index' (first on line 4)",
        ),
        ("[" * 100_000, ":1:65: invalid YAML: nested more than 64 levels deep"),
        (
            "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
            + "".join(
                f"{k}: &{k} [*{j}, *{j}, *{j}, *{j}, *{j}, *{j}, *{j}, *{j}, *{j}, *{j}]\n"
                for j, k in zip("abcde", "bcdef")
            ),
            (
                "invalid YAML: this value holds more than 1,000,000 values once its aliases are"
                " expanded"
            ),
        ),
        ("a: &a [*a]\n", ":1:4: invalid YAML: an alias refers to a value that contains it"),
        (
            "training: {global_batch: " + "9" * 2000 + ", seq_len: 4}\n",
            "invalid YAML: a number written with 2,000 characters",
        ),
        ("- 1\n- 2\n", "expected a mapping of keys at the top level, got list [1, 2]"),
        ("just text\n", "expected a mapping of keys at the top level, got str 'just text'"),
        ("# only a comment\n", "expected a mapping of keys at the top level, got an empty file"),
    ],
)
def test_malformed_yaml_is_one_line(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        hp.Plan.load(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)) and expected in message, message


def test_merge_keys_may_still_be_overridden(tmp_path):
    text = "base: &base {global_batch: 8, seq_len: 4}\n"
    path = write(tmp_path, text + "training:\n  <<: *base\n  global_batch: 16\n")
    merged = text + "training:\n  <<: *base\n  global_batch: 16\nparallel: {}\n"
    # the override itself is no duplicate
    assert "unknown key 'base'" in load_error(tmp_path, merged)
    from hyparallel.spec.yaml_io import read_yaml

    assert read_yaml(path)["training"] == {"global_batch": 16, "seq_len": 4}


TRAIN = {"global_batch": 8, "seq_len": 8}
INF_STEP = {
    "step_time_s": float("inf"),
    "tokens_per_s": 1,
    "tflops_per_gpu": 1,
    "mfu": 0.1,
    "bubble_fraction": 0,
    "memory_gib": [1, 1],
    "comm_s": {"tp": 0, "dp": 0, "pp": 0},
}


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {**HAND, "parallel": {"dp": 10**30}},
            (
                "parallel.dp: expected a positive integer up to 1,048,576, got"
                " 1000000000000000000000000000000"
            ),
        ),
        ({**HAND, "parallel": {"pp": -1}}, "parallel.pp: expected a positive integer, got -1"),
        (
            {**HAND, "parallel": {"dp": 1024, "tp": 1024, "pp": 2}},
            "parallel: dp(1024) * tp(1024) * pp(2) = 2,097,152 processes, more than the 1,048,576",
        ),
        (
            {**HAND, "parallel": {"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 513}},
            "parallel.virtual_stages: expected a positive integer up to 512, got 513",
        ),
        (
            {"training": {**TRAIN, "global_batch": 2**24 + 1}, "parallel": {}},
            "training.global_batch: expected a positive integer up to 16,777,216",
        ),
        (
            {"training": {**TRAIN, "seq_len": 0}, "parallel": {}},
            "training.seq_len: expected a positive integer, got 0",
        ),
        (
            {"training": {**TRAIN, "seq_len": 2**24 + 1}, "parallel": {}},
            "training.seq_len: expected a positive integer up to 16,777,216",
        ),
        (
            {"training": {**TRAIN, "micro_batch": True}, "parallel": {}},
            "training.micro_batch: expected a positive integer, got true",
        ),
        (
            {**HAND, "cluster": {"name": "cpu", "num_nodes": 10**9}},
            "cluster.num_nodes: expected a positive integer up to 1,048,576",
        ),
        (
            {**HAND, "cluster": {"name": "cpu", "gpus_per_node": 0}},
            "cluster.gpus_per_node: expected a positive integer, got 0",
        ),
        (
            {**HAND, "cluster": {"name": "cpu", "num_nodes": 2**20, "gpus_per_node": 2}},
            "num_nodes (1,048,576) x gpus_per_node (2) = 2,097,152 devices",
        ),
        (
            {
                **HAND,
                "model": {"name": "m", "num_params": 2**60, "num_layers": 2, "fingerprint": ""},
            },
            "model.num_params: expected a non-negative integer up to",
        ),
        (
            {**HAND, "predicted": INF_STEP},
            "predicted.step_time_s: expected a finite number, got .inf",
        ),
    ],
)
def test_numbers_out_of_range_give_one_line(tmp_path, data, expected):
    assert expected in load_error(tmp_path, data)


def test_bounds_are_the_ones_in_limits():
    from hyparallel.spec import limits

    def maximum(model, name):
        return max(getattr(m, "le", None) or 0 for m in model.model_fields[name].metadata)

    assert {maximum(hp.spec.schema.ParallelConfig, axis) for axis in ("dp", "tp", "pp")} == {
        limits.MAX_DEVICES
    }
    assert maximum(hp.spec.schema.TrainingConfig, "seq_len") == limits.MAX_SEQ_LEN
    assert maximum(hp.spec.schema.TrainingConfig, "global_batch") == limits.MAX_GLOBAL_BATCH
    assert maximum(hp.ClusterSpec, "gpus_per_node") == limits.MAX_GPUS_PER_NODE


def test_a_failed_save_leaves_the_old_plan_and_nothing_partial(tmp_path):
    plan = hp.Plan.model_validate(HAND)
    with pytest.raises(ConfigError, match=f"cannot write {tmp_path}/missing/plan.yaml: no folder"):
        plan.save(tmp_path / "missing" / "plan.yaml")
    with pytest.raises(ConfigError, match="it is a folder"):
        plan.save(tmp_path)
    target = tmp_path / "plan.yaml"
    target.write_text("old\n")
    plan.save(target)
    assert hp.Plan.load(target) == plan
    # no temporary file left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.yaml"]


def test_a_typo_in_a_preset_cluster_names_the_unknown_key():
    data = {
        "cluster": {"name": "cpu", "num_nodes": 1, "gpus": 8},
        "training": {"global_batch": 8, "seq_len": 16},
        "parallel": {},
    }
    with pytest.raises(
        ConfigError,
        match=r"^plan: cluster: unknown key 'gpus'; a preset takes name, num_nodes and "
        r"gpus_per_node",
    ):
        hp.Plan.from_dict(data)
