"""Weights in and out: ``hp.checkpoint.load_pretrained`` and ``hyparallel checkpoint export CKPT
FOLDER/``.

One launch of 4 gloo processes (tests/distributed/pretrained_worker.py): a tied Llama under tp 2 x
pp 2 and an untied one under dp 2 x tp 2 with ZeRO 1 load Hugging Face folders written by
``save_pretrained`` in small shards; their losses equal ``from_pretrained``'s in one process, each
rank's memory grows by well under the model while loading, and the checkpoint saved after one SGD
step exports to a folder ``from_pretrained`` loads with the parallel run's loss. Loading into a
plain module, and every refusal, run in this process.

Tolerances, fp32: losses rtol 1e-5 (tensor parallelism sums partial products in another order:
rounding only); the exported weights after one SGD step within 1e-5 of the single device's in norm.
"""

from __future__ import annotations

import json
import logging
import re
import sys

import pytest
import torch

import hyparallel as hp
from hyparallel.cli import main as cli
from hyparallel.runtime.parallel import token_cross_entropy
from hyparallel.spec.errors import ConfigError

from .conftest import REPO, torchrun

sys.path.insert(0, str(REPO / "tests" / "distributed"))
from pretrained_worker import CASES, GLOBAL_BATCH, LR, SEQ, SPECS, batch  # noqa: E402

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Hugging Face folders of the worker's two Llamas, in 2 MB shards (an index and several
    files)."""
    root = tmp_path_factory.mktemp("pretrained")
    for index, (name, spec) in enumerate(SPECS.items()):
        torch.manual_seed(index)
        hp.models.load(spec, device="cpu").module.save_pretrained(root / name, max_shard_size="2MB")
    return root


@pytest.fixture(scope="module")
def launched(folders, repo):
    """The worker's results; its plans are made here, once (tracing in each of 4 processes on 2
    cores: 30 s more)."""
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=4)
    # a module's fixture: before conftest's own_graph_cache
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYPARALLEL_CACHE_DIR", str(folders / "graph-cache"))
        for case, (folder, constraints) in CASES.items():
            model = hp.models.load(SPECS[folder]).module
            hp.plan(model, cluster, GLOBAL_BATCH, SEQ, "fp32", **constraints).save(
                folders / f"plan-{case}.yaml"
            )
        return torchrun(
            repo,
            "tests/distributed/pretrained_worker.py",
            folders / "results.json",
            4,
            folders,
            *CASES,
        )


def reference(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder).float()


def loss_of(model, index: int, train: bool = False) -> torch.Tensor:
    inputs, targets = batch(index)
    model.train(train)
    with torch.set_grad_enabled(train):
        return token_cross_entropy(model(inputs), targets)


def model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.data_ptr())


def weights_apart(model, want) -> dict[str, float]:
    """||got - want|| / ||want|| for every parameter name of ``want``."""
    got = dict(model.named_parameters(remove_duplicate=False))
    return {
        # zero biases: the absolute error
        name: ((got[name] - p).norm() / p.norm().clamp_min(1e-12)).item()
        for name, p in want.named_parameters(remove_duplicate=False)
    }


@pytest.mark.parametrize("case", list(CASES))
def test_loaded_model_trains_as_from_pretrained_and_exports_to_a_folder(
    launched, folders, tmp_path, case
):
    folder = folders / CASES[case][0]
    ref = reference(folder)
    assert (folder / "model.safetensors.index.json").is_file()  # the shards are exercised
    size = sum(p.numel() * 4 for p in ref.parameters())
    first, trained = loss_of(ref, 0).item(), loss_of(ref, 1, train=True)
    trained.backward()
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    after = loss_of(ref, 2).item()
    for rank in launched[case]:
        assert rank["eval_loss"] == pytest.approx(first, rel=1e-5)
        assert rank["train_loss"] == pytest.approx(trained.item(), rel=1e-5)
        assert rank["eval_after_step"] == pytest.approx(after, rel=1e-5)
        # Each rank read exactly the pieces it holds (a quarter of the model here, a tied weight on
        # both its pipeline ranks), and its resident set grew by far less than the model while
        # loading: about its largest piece (measured 0.8-1.6 MiB of 15 MiB;
        # benchmarks/pretrained_memory.py: 0.11 of a 152 MiB model)
        assert rank["bytes_read"] == rank["held_bytes"] <= size / 2
        assert rank["growth_bytes"] < size / 2, (rank["growth_bytes"], size)
    out = tmp_path / "exported"
    assert (
        cli(
            [
                "checkpoint",
                "export",
                str(folders / f"ckpt-{case}"),
                str(out),
                "--max-shard-size",
                "4MB",
            ]
        )
        == 0
    )
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    assert exported.config.tie_word_embeddings == ref.config.tie_word_embeddings
    if exported.config.tie_word_embeddings:
        assert exported.lm_head.weight is exported.model.embed_tokens.weight
    assert loss_of(exported, 2).item() == pytest.approx(
        launched[case][0]["eval_after_step"], rel=1e-5
    )
    worst = max(weights_apart(exported, ref).items(), key=lambda item: item[1])
    assert worst[1] <= 1e-5, worst
    # replaces the last export
    assert cli(["checkpoint", "export", str(folders / f"ckpt-{case}"), f"{out}/"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


def test_loads_into_a_plain_module_as_from_pretrained(folders):
    ref = reference(folders / "untied")
    model = hp.models.load(SPECS["untied"], device="cpu").module
    loaded = hp.checkpoint.load_pretrained(model, folders / "untied")
    assert loaded.tensors == len(ref.state_dict()) and loaded.bytes_read == model_bytes(ref)
    assert all(apart == 0 for apart in weights_apart(model, ref).values())


GPT2 = (
    "hf:GPT2LMHeadModel n_layer=2 n_embd=64 n_head=4 vocab_size=128 n_positions=64 bos_token_id=0"
    " eos_token_id=0"
)


def test_a_base_model_file_loads_into_the_model_with_a_head(tmp_path):
    """GPT-2 as the hub has it: names without ``transformer.``, no head (tied), the old attention
    masks (ignored)."""
    from safetensors.torch import save_file

    source = hp.models.load(GPT2, device="cpu").module
    state = {
        k.removeprefix("transformer."): v
        for k, v in source.state_dict().items()
        if k != "lm_head.weight"
    }
    save_file({**state, "h.0.attn.bias": torch.ones(1, 1, 64, 64)}, tmp_path / "gpt2.safetensors")
    model = hp.models.load(GPT2, device="cpu").module
    loaded = hp.checkpoint.load_pretrained(model, tmp_path / "gpt2.safetensors")
    assert loaded.ignored == ("h.0.attn.bias",)
    # exact: the tied head is the loaded embedding, copied from the file with no arithmetic on it
    assert torch.equal(model.lm_head.weight, source.transformer.wte.weight)
    assert all(apart == 0 for apart in weights_apart(model, source).values())


@pytest.fixture(scope="module")
def gpt2_file(tmp_path_factory):
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("gpt2") / "model.safetensors"
    state = hp.models.load(GPT2, device="cpu").module.state_dict()
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, path)
    return path


def refusal(tmp_path, gpt2_file, change) -> str:
    from safetensors.torch import load_file, save_file

    state = load_file(gpt2_file)
    change(state)
    save_file(state, tmp_path / "bad.safetensors")
    with pytest.raises(ConfigError) as error:
        hp.checkpoint.load_pretrained(
            hp.models.load(GPT2, device="cpu").module, tmp_path / "bad.safetensors"
        )
    assert "\n" not in str(error.value)
    return str(error.value)


def test_missing_stray_and_misshapen_tensors_are_refused_in_one_line(tmp_path, gpt2_file):
    message = refusal(
        tmp_path, gpt2_file, lambda state: state.pop("transformer.h.1.mlp.c_fc.weight")
    )
    assert message.startswith(
        f"{tmp_path / 'bad.safetensors'}: no tensor transformer.h.1.mlp.c_fc.weight that"
    )
    stray = "transformer.h.2.mlp.c_fc.weight"
    message = refusal(
        tmp_path,
        gpt2_file,
        lambda state: state.update({stray: state[stray.replace("2", "1")].clone()}),
    )
    assert "GPT2LMHeadModel has no transformer.h.2.mlp.c_fc.weight" in message

    def widen(state):
        state["transformer.ln_f.weight"] = torch.ones(65)

    message = refusal(tmp_path, gpt2_file, widen)
    assert (
        "transformer.ln_f.weight has shape (65,), the model's transformer.ln_f.weight (64,)"
        in message
    )


def test_paths_that_hold_no_weights_are_refused_in_one_line(tmp_path, gpt2_file):
    model = hp.models.load(GPT2, device="cpu").module
    (tmp_path / "pt").mkdir()
    (tmp_path / "pt" / "pytorch_model.bin").write_bytes(b"")
    (tmp_path / "sharded").mkdir()
    index = {"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "cut.safetensors").write_bytes(gpt2_file.read_bytes()[:100])
    for path, expected in (
        (tmp_path / "missing", "no such file or folder"),
        (
            tmp_path / "pt",
            "no model.safetensors or model.safetensors.index.json (it has PyTorch .bin weights",
        ),
        (tmp_path / "sharded", "lists model-00001-of-00002.safetensors, which is not in"),
        (tmp_path / "cut.safetensors", "not a readable safetensors file"),
    ):
        with pytest.raises(ConfigError, match=re.escape(expected)):
            hp.checkpoint.load_pretrained(model, path)
    with pytest.raises(ConfigError, match="GPT2LMHeadModel has tensors on the meta device"):
        hp.checkpoint.load_pretrained(hp.models.load(GPT2).module, gpt2_file)


def test_a_folder_export_needs_an_hf_model_and_a_folder_of_its_own(tmp_path, capsys):
    step = tmp_path / "ckpt" / "step-00000001"
    step.mkdir(parents=True)
    marker = {
        "format": 1,
        "step": 1,
        "extra": {},
        "world_size": 1,
        "model": {"name": "gpt-tiny"},
        "tied": {},
    }
    (step / "hyparallel.json").write_text(json.dumps(marker))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    for out, expected in (
        (tmp_path / "gpt", "a Hugging Face folder needs an hf: model, and"),
        (
            tmp_path / "taken",
            "it holds notes.txt, not an export's file; give a new or empty folder",
        ),
        (tmp_path / "nowhere" / "out", "no folder"),
    ):
        assert cli(["checkpoint", "export", str(tmp_path / "ckpt"), str(out)]) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, err
    assert cli(["checkpoint", "export", str(step), str(tmp_path / "m.pt"), "--format", "hf"]) == 2
    assert "a Hugging Face folder needs an hf: model" in capsys.readouterr().err
    assert (
        cli(["checkpoint", "export", str(step), str(tmp_path / "o"), "--max-shard-size", "big"])
        == 2
    )
    assert "max shard size 'big'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "taken"]  # nothing written
