"""hp.plan, hp.search and `hyparallel plan --example-inputs` on a user's own GPT (tests/user_gpt.py:
forward(idx)).

example_inputs are one micro-batch, as parallelize takes them (Note [example inputs] in
hyparallel/planner/api.py): the planner traces with them, divides the graph's figures by their rows,
fixes micro_batch to them and reads seq_len from the token ids; a function (batch_size, seq_len) ->
inputs is used as a model's example_inputs method is. A plan made so runs under parallelize with the
same inputs, loss and gradients those of the model.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hyparallel as hp
from hyparallel.cli import main
from hyparallel.planner import PlanError, inputs
from hyparallel.planner.profile import ModelProfile
from hyparallel.spec.errors import ConfigError, ModelSpecError
from hyparallel.tensor.init import materialize_

from .user_gpt import VOCAB, make_inputs, make_model

SEQ = 16


def user_gpt() -> torch.nn.Module:
    with torch.device("meta"):
        return make_model()


def cpu(gpus: int = 1) -> hp.ClusterSpec:
    return hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=gpus)


def tokens(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))


# ---- what example_inputs say ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("example", "rows", "seq_len", "fallback"),
    [
        (torch.zeros(3, 7, dtype=torch.long), 3, 7, 1),
        ((torch.zeros(2, 5, dtype=torch.long), None, 0.5), 2, 5, 1),  # non-tensor leaves
        (
            {
                "mask": torch.ones(4, 9, dtype=torch.bool),
                "idx": torch.zeros(4, 9, dtype=torch.int32),
                "flag": True,
            },
            4,
            9,
            1,
        ),
        # no token ids: a length only when none is given
        ({"embeds": torch.zeros(2, 6, 8)}, 2, None, 6),
        # images: dim 1 is channels, the figures per sample
        (torch.zeros(2, 3, 32, 32), 2, None, 1),
        ((torch.zeros(5),), 5, None, 1),  # no sequence dim
    ],
)
def test_inputs_give_rows_and_sequence_length(example, rows, seq_len, fallback):
    batch = inputs.read(example)
    assert (batch.rows, batch.seq_len, batch.fallback_seq_len) == (rows, seq_len, fallback)


@pytest.mark.parametrize(
    ("example", "message"),
    [
        ("tokens", r"example_inputs is a str; give one micro-batch: a tensor, a tuple"),
        ((None, 3), r"example_inputs hold no tensor with a batch dim"),
        ({"idx": torch.tensor(1)}, r"example_inputs hold no tensor with a batch dim"),
    ],
)
def test_inputs_without_a_batch_are_refused(example, message):
    with pytest.raises(ConfigError, match=message):
        inputs.read(example)


def test_a_graph_traced_with_b_rows_costs_one_sequence_as_at_batch_one():
    model = hp.models.build("gpt-tiny")
    one, three = (
        hp.trace(model, model.example_inputs(1, SEQ)),
        hp.trace(model, model.example_inputs(3, SEQ)),
    )
    cluster = hp.ClusterSpec.preset("a100-80g", num_nodes=1)
    reference = ModelProfile(one, cluster, "bf16", SEQ)
    profile = ModelProfile(three, cluster, "bf16", SEQ, traced_rows=3)
    undivided = ModelProfile(three, cluster, "bf16", SEQ)  # as if traced at batch 1

    def figures(p: ModelProfile) -> list[float]:
        costs = p.segment_costs(2, True, 3, "selective", cluster.intra_node)
        fields = ("tp_comm_s", "activation_bytes", "params")
        return [
            p.forward_flops,
            sum(op.flops for raw in p.raw for op in raw.ops),
            p.cut_bytes,
            *(sum(getattr(s, f) for s in costs) for f in fields),
        ]

    assert figures(profile) == pytest.approx(figures(reference), rel=1e-9)
    # what dividing corrects
    assert figures(undivided)[:2] == pytest.approx([3 * x for x in figures(reference)[:2]])
    # Bytes ops read and write: the position ids and embeddings, (seq,) and (seq, hidden), have no
    # batch dim, so one sequence's share of them is a third at 3 rows. Only those differ: the saved
    # activations above agree.
    moved = [
        sum(op.in_bytes + op.out_bytes for raw in p.raw for op in raw.ops)
        for p in (profile, reference)
    ]
    assert moved[0] == pytest.approx(moved[1], rel=0.02) and moved[0] < moved[1]
    # The backward's transient (Note [backward's own] in profile.py) counts the largest op's input
    # gradients, the position embeddings' among them: the same third, so the 3-row trace's figure is
    # a little lower, never higher (2.0% here: the activation gradients are counted whole across tp
    # ranks, Note [what sequence parallelism shards]).
    working = [
        sum(s.working_bytes for s in p.segment_costs(2, True, 3, "selective", cluster.intra_node))
        for p in (profile, reference)
    ]
    assert working[0] == pytest.approx(working[1], rel=0.03) and working[0] <= working[1]


# ---- hp.plan and hp.search -----------------------------------------------------------------------


def test_a_module_without_inputs_names_example_inputs_in_one_line():
    expected = (
        r"cannot tell what inputs UserGPT takes; pass example_inputs= .*--example-inputs "
        r"package.module:make_inputs.*example_inputs\(batch_size, seq_len, device\)"
    )
    with pytest.raises(ModelSpecError, match=expected) as info:
        hp.plan(user_gpt(), cpu(), 8, SEQ, "fp32")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "example",
    [
        torch.zeros(2, SEQ, dtype=torch.long),
        (torch.zeros(2, SEQ, dtype=torch.long),),
        {"idx": torch.zeros(2, SEQ, dtype=torch.long, device="meta")},
    ],
    ids=["tensor", "tuple", "kwargs"],
)
def test_example_inputs_fix_the_micro_batch_and_give_seq_len(example):
    plan = hp.plan(user_gpt(), cpu(4), 8, dtype="fp32", example_inputs=example)
    assert plan.training.micro_batch == 2 and plan.training.seq_len == SEQ
    assert plan.model.name == "UserGPT" and plan.model.num_params == sum(
        p.numel() for p in user_gpt().parameters()
    )


def test_search_takes_example_inputs_and_keeps_their_micro_batch():
    assert hp.search is hp.planner.search
    result = hp.search(
        user_gpt(),
        cpu(4),
        16,
        SEQ,
        "fp32",
        example_inputs=torch.zeros(4, SEQ, dtype=torch.long),
        top=3,
        alternatives=True,
    )
    assert len(result.best) > 1 and {e.config.micro_batch for e in result.best} == {4}
    assert all(
        alt.evaluation is None or alt.evaluation.config.micro_batch == 4
        for alt in result.alternatives
    )


def test_a_function_of_batch_and_length_lets_the_search_pick_the_micro_batch():
    result = hp.search(user_gpt(), cpu(2), 16, SEQ, "fp32", example_inputs=make_inputs, top=20)
    assert len({e.config.micro_batch for e in result.best}) > 1
    fixed = hp.plan(
        user_gpt(), cpu(2), 16, SEQ, "fp32", example_inputs=make_inputs, micro_batch=2, dp=2
    )
    traced_at_two = hp.plan(
        user_gpt(), cpu(2), 16, dtype="fp32", example_inputs=make_inputs(2, SEQ), dp=2
    )
    # Traced at 1 and scaled, or traced at 2 and divided: the position embedding alone does not
    # scale with the batch.
    assert traced_at_two.predicted.step_time_s == pytest.approx(
        fixed.predicted.step_time_s, rel=0.01
    )
    # per GPU
    flops = [p.predicted.tflops_per_gpu * p.predicted.step_time_s for p in (traced_at_two, fixed)]
    assert flops[0] == pytest.approx(flops[1], rel=1e-5)  # the figures are rounded to 6 digits


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"seq_len": 32},
            ConfigError,
            r"seq_len=32 but example_inputs hold sequences of 16 tokens; make them agree",
        ),
        (
            {"micro_batch": 4},
            ConfigError,
            (
                r"micro_batch=4 but example_inputs are one micro-batch of 2 rows; pass"
                r" example_inputs of 4 rows, or leave"
            ),
        ),
        (
            {"global_batch": 7},
            PlanError,
            r"global batch 7 is not a multiple of the micro-batch of example_inputs \(2 rows",
        ),
        ({"example_inputs": make_inputs}, PlanError, r"seq_len is not given"),
        ({"example_inputs": "idx"}, ConfigError, r"example_inputs is a str"),
    ],
)
def test_example_inputs_that_disagree_fail_in_one_line(kwargs, error, message):
    request = {
        "global_batch": 8,
        "dtype": "fp32",
        "example_inputs": torch.zeros(2, SEQ, dtype=torch.long),
        **kwargs,
    }
    with pytest.raises(error, match=message) as info:
        hp.plan(user_gpt(), cpu(), **request)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (
            lambda batch_size: torch.zeros(batch_size, SEQ),
            r"example inputs .*<lambda> must take \(batch_size, seq_len\)",
        ),
        (
            lambda batch_size, seq_len: [1, 2],
            r"example inputs .*<lambda>\(1, 16\) hold no tensor with a batch dim",
        ),
        (
            lambda batch_size, seq_len: torch.zeros(4, seq_len, dtype=torch.long),
            (
                r"<lambda>\(1, 16\) returned 4 rows of 16 tokens; it must return batch_size rows of"
                r" seq_len tokens"
            ),
        ),
    ],
)
def test_a_bad_inputs_function_fails_in_one_line(factory, message):
    with pytest.raises(ConfigError, match=message):
        hp.plan(user_gpt(), cpu(), 8, SEQ, "fp32", example_inputs=factory)


def test_a_model_graph_is_planned_as_one_sequence():
    model = hp.models.build("gpt-tiny")
    graph = hp.trace(model, model.example_inputs(2, SEQ))
    with pytest.raises(
        PlanError, match=r"the ModelGraph was traced with 2 rows.*trace it at batch 1"
    ):
        hp.plan(graph, cpu(), 8, SEQ, "fp32")
    with pytest.raises(
        PlanError, match=r"this ModelGraph is traced already; pass the module itself"
    ):
        hp.plan(graph, cpu(), 8, SEQ, "fp32", example_inputs=model.example_inputs(2, SEQ))


# ---- the command line ----------------------------------------------------------------------------


def test_cli_plans_a_factory_model_with_its_inputs_function(capsys, tmp_path):
    out = tmp_path / "plan.yaml"
    code = main(
        [
            "plan",
            "--model",
            "tests.user_gpt:make_model",
            "n_layer=3",
            "--example-inputs",
            "tests.user_gpt:make_inputs",
            "--gpus",
            "2",
            "--cluster",
            "cpu",
            "--global-batch",
            "8",
            "--seq-len",
            str(SEQ),
            "--dtype",
            "fp32",
            "-o",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    plan = hp.Plan.load(out)
    assert plan.model.name == "tests.user_gpt:make_model n_layer=3" and plan.training.seq_len == SEQ
    assert plan.model.num_layers == 3


def test_cli_help_explains_example_inputs(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "--example-inputs package.module:make_inputs" in text
        and "make_inputs(batch_size, seq_len)" in text
    )
    assert (
        "hyparallel plan --model mypkg.gpt:make_model --example-inputs mypkg.gpt:make_inputs"
        in text
    )


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            "tests.no_such_module:make_inputs",
            "example inputs 'tests.no_such_module:make_inputs': cannot import",
        ),
        (
            "tests.user_gpt:NOT_CALLABLE",
            "example inputs 'tests.user_gpt:NOT_CALLABLE': 'tests.user_gpt' has no callable",
        ),
        ("tests.user_gpt", "example inputs 'tests.user_gpt' is not package.module:name"),
        (
            "tests.user_gpt:make_words",
            "example inputs tests.user_gpt:make_words(1, 16) is a str; give one micro-batch",
        ),
        (
            "tests.user_gpt:make_fixed",
            "make_fixed(1, 16) returned 4 rows of 8 tokens; it must return batch_size rows",
        ),
    ],
)
def test_cli_bad_example_inputs_exit_2_in_one_line(capsys, spec, expected):
    code = main(
        [
            "plan",
            "--model",
            "tests.user_gpt:make_model",
            "--example-inputs",
            spec,
            "--gpus",
            "1",
            "--cluster",
            "cpu",
            "--seq-len",
            str(SEQ),
        ]
    )
    captured = capsys.readouterr()
    assert (
        code == 2
        and captured.out == ""
        and captured.err.count("\n") == 1
        and expected in captured.err
    )


# ---- the plan runs under parallelize with the same inputs ----------------------------------------


def _plan(how: str, micro_batch: int, tmp_path) -> tuple[hp.Plan, object]:
    """A plan for 1 process and global batch 4, and the example inputs parallelize gets: made as
    ``how`` says."""
    ids = torch.zeros(micro_batch, SEQ, dtype=torch.long)
    if how == "plan":
        return hp.plan(user_gpt(), cpu(), 4, dtype="fp32", example_inputs=ids), ids
    if how == "plan-kwargs":
        return hp.plan(user_gpt(), cpu(), 4, SEQ, "fp32", example_inputs={"idx": ids}), {"idx": ids}
    if how == "search":
        return hp.search(user_gpt(), cpu(), 4, dtype="fp32", example_inputs=(ids,), top=2).plan(), (
            ids,
        )
    out = tmp_path / "plan.yaml"
    assert (
        main(
            [
                "plan",
                "--model",
                "tests.user_gpt:make_model",
                "--example-inputs",
                "tests.user_gpt:make_inputs",
                "--gpus",
                "1",
                "--cluster",
                "cpu",
                "--global-batch",
                "4",
                "--seq-len",
                str(SEQ),
                "--dtype",
                "fp32",
                "--json",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    plan = hp.Plan.load(out)
    return plan, make_inputs(plan.training.micro_batch, plan.training.seq_len)


@pytest.fixture
def one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("how", ["plan", "plan-kwargs", "search", "cli"])
def test_the_plan_runs_under_parallelize_with_the_same_inputs(one_process, tmp_path, capsys, how):
    plan, example = _plan(how, 2, tmp_path)
    if how != "cli":
        assert plan.training.micro_batch == 2 and plan.num_microbatches == 2
    reference = materialize_(user_gpt(), "cpu", seed=3)
    pmodel = hp.parallelize(user_gpt(), plan, example_inputs=example, seed=3, device="cpu")
    batch = tokens(4)
    ids, targets = batch[:, :-1], batch[:, 1:]
    wrapped = (
        {"idx": ids} if isinstance(example, dict) else (ids,) if isinstance(example, tuple) else ids
    )
    loss = pmodel.train_step(wrapped, targets)
    expected = F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten())
    expected.backward()
    # fp32, one process: the same sums, grouped by micro-batch (the mean of per-micro-batch means)
    # instead of once.
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    grads = {name: p.grad for name, p in pmodel.named_parameters()}
    want = {name: p.grad for name, p in reference.named_parameters()}
    assert set(grads) == set(want) and all(g is not None for g in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_parallelize_completes_a_hand_plan_with_its_example_inputs(one_process):
    hand = hp.Plan.from_dict(
        {
            "cluster": {"name": "cpu", "gpus_per_node": 1},
            "training": {"global_batch": 4, "micro_batch": 2, "seq_len": SEQ, "dtype": "fp32"},
            "parallel": {"dp": 1, "tp": 1, "pp": 1},
        }
    )
    assert hand.predicted is None
    pmodel = hp.parallelize(
        user_gpt(), hand, example_inputs=torch.zeros(2, SEQ, dtype=torch.long), device="cpu"
    )
    # planned with those inputs
    assert pmodel.plan.predicted is not None and pmodel.plan.model.name == "UserGPT"


VIT = (
    "hf:ViTForImageClassification hidden_size=64 num_hidden_layers=2 num_attention_heads=4"
    " intermediate_size=128 image_size=32 patch_size=8"
)
WHISPER = (
    "hf:WhisperForConditionalGeneration d_model=64 encoder_layers=2 decoder_layers=2"
    " encoder_attention_heads=4 decoder_attention_heads=4 encoder_ffn_dim=128 decoder_ffn_dim=128"
    " num_mel_bins=16 max_source_positions=32 max_target_positions=64 vocab_size=128 pad_token_id=0"
    " bos_token_id=1 eos_token_id=2 decoder_start_token_id=1"
)


def test_cli_plans_an_image_model_from_an_inputs_function_whatever_the_seq_len(capsys, tmp_path):
    # Dim 1 of pixels is their channels, not a length: only token ids are checked against --seq-len
    out = tmp_path / "plan.yaml"
    argv = [
        "plan",
        "--model",
        VIT.split()[0],
        *VIT.split()[1:],
        "--example-inputs",
        "tests.user_gpt:make_pixels",
    ]
    code = main(
        [
            *argv,
            "--gpus",
            "2",
            "--cluster",
            "cpu",
            "--global-batch",
            "8",
            "--dtype",
            "fp32",
            "-o",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert hp.Plan.load(out).parallel.world_size == 2


@pytest.mark.parametrize(
    ("spec", "shapes"), [(VIT, {"pixel_values": (2, 3, 32, 32)}), (WHISPER, None)]
)
def test_hugging_face_image_and_audio_models_get_their_own_inputs(spec, shapes):
    model = hp.models.load(spec).module
    example = hp.models.example_inputs(model, 2, 16)
    shapes = shapes or {"input_features": (2, 16, 64), "decoder_input_ids": (2, 16)}
    assert {name: tuple(t.shape) for name, t in example.items()} == shapes
    plan = hp.plan(model, cpu(2), 4, None, "fp32", tp=2, pp=1, example_inputs=example)
    # per sample for images
    assert plan.training.seq_len == (16 if "decoder_input_ids" in shapes else 1)
    assert any(style == "column" for style in plan.tensor_parallel.values())


def test_a_sequence_tp_does_not_divide_is_planned_without_sequence_parallelism():
    # ViT's blocks read 16 patches and the class token: 17 positions. The planner chose sequence
    # parallelism at tp 2 and the run refused it ("sequence length 17 is not divisible by tp 2");
    # Dinov2's 257 too.
    model = hp.models.load(VIT).module
    example = hp.models.example_inputs(model, 2, 16)
    plan = hp.plan(model, cpu(2), 4, None, "fp32", tp=2, pp=1, example_inputs=example)
    assert not plan.parallel.sequence_parallel
    uneven = (
        r"^sequence_parallel: vit\.layers\.0 reads a sequence of 17 positions, which tp 2 does not"
        r" divide"
    )
    with pytest.raises(hp.PlanError, match=uneven):
        hp.plan(
            model,
            cpu(2),
            4,
            None,
            "fp32",
            tp=2,
            pp=1,
            sequence_parallel=True,
            example_inputs=example,
        )
