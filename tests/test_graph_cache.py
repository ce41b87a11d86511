"""The disk cache of traced graphs (hyparallel.graph.cache): a hit is the graph a fresh trace gives,
and anything that decides the trace changes the key (Note [what a cached graph is keyed by])."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

import hyparallel as hp
import hyparallel.graph
from hyparallel.graph import cache
from hyparallel.planner import api, search

from .conftest import HF_LLAMA_TINY
from .test_cli import run


def cpus(n: int) -> hp.ClusterSpec:
    return hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=n)


class Attention(nn.Module):
    """Heads sized by an integer attribute the parameters do not show."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.num_heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, w // self.num_heads).unbind(2)
        y = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )
        return self.out(y.transpose(1, 2).reshape(b, s, w))


def graph_files():
    folder = cache.cache_dir() / "graphs"
    return sorted(folder.glob("*.pkl")) if folder.exists() else []


def test_a_hit_is_the_graph_a_fresh_trace_gives_and_skips_the_trace(monkeypatch):
    model = hp.models.build("gpt-tiny")
    fresh = search(model, cpus(4), 8, 16, "fp32", top=3)
    assert graph_files() == []  # cache=False (the API's default) writes nothing
    first = search(model, cpus(4), 8, 16, "fp32", top=3, cache=True)
    assert len(graph_files()) == 1

    def no_trace(*args, **kwargs):
        raise AssertionError("traced although the graph is cached")

    monkeypatch.setattr(hyparallel.graph, "trace", no_trace)  # what the planner's _graph imports
    monkeypatch.setattr(api, "replicate_what_fails", no_trace)
    hit = search(model, cpus(4), 8, 16, "fp32", top=3, cache=True)
    for result in (first, hit):
        assert result.graph.ops == fresh.graph.ops and result.graph.values == fresh.graph.values
        assert (
            result.graph.blocks == fresh.graph.blocks
            and result.graph.replicated == fresh.graph.replicated
        )
        assert result.graph.fingerprint == fresh.graph.fingerprint
        assert [b.config for b in result.best] == [b.config for b in fresh.best]
        assert [b.step_time_s for b in result.best] == [b.step_time_s for b in fresh.best]
    assert hit.graph.program is None  # the fx program is not stored: only the runtime cuts it


def test_what_fails_at_one_ranks_sizes_is_cached_with_the_graph(monkeypatch):
    """An attention sliced with the model's constants: the dry run replicates it; a hit keeps
    that."""
    model = hp.models.load("tests.tiny_lms:config_split_lm").module
    first = search(model, cpus(2), 4, 16, "fp32", cache=True)
    assert any(".attn." in op for op in first.graph.replicated), first.graph.replicated
    monkeypatch.setattr(
        api, "replicate_what_fails", lambda *a, **k: pytest.fail("dry run although cached")
    )
    hit = search(model, cpus(2), 4, 16, "fp32", cache=True)
    assert hit.graph.replicated == first.graph.replicated
    assert hit.plan().tensor_parallel == first.plan().tensor_parallel


def test_the_key_follows_what_decides_the_trace():
    x = torch.zeros(1, 8, 32)
    base = cache.key(Attention(32, 4), (x,), "m", [2, 4])
    assert base is not None and base == cache.key(Attention(32, 4), (x,), "m", [4, 2])
    others = {
        "heads (an attribute)": cache.key(Attention(32, 8), (x,), "m", [2, 4]),
        "a parameter's shape": cache.key(Attention(64, 4), (torch.zeros(1, 8, 64),), "m", [2, 4]),
        "the inputs' shape": cache.key(Attention(32, 4), (torch.zeros(1, 16, 32),), "m", [2, 4]),
        "the inputs' dtype": cache.key(Attention(32, 4), (x.double(),), "m", [2, 4]),
        "the degrees": cache.key(Attention(32, 4), (x,), "m", [2]),
        "the name": cache.key(Attention(32, 4), (x,), "other", [2, 4]),
    }
    frozen = Attention(32, 4)
    frozen.out.weight.requires_grad_(False)
    others["requires_grad"] = cache.key(frozen, (x,), "m", [2, 4])
    tied = Attention(32, 4)
    tied.extra = nn.Linear(32, 32)
    untied = Attention(32, 4)
    untied.extra = nn.Linear(32, 32)
    tied.extra.weight = tied.out.weight
    others["a tie"] = cache.key(tied, (x,), "m", [2, 4])
    assert cache.key(untied, (x,), "m", [2, 4]) != others["a tie"]
    # dropout traced or not
    others["eval mode"] = cache.key(Attention(32, 4).eval(), (x,), "m", [2, 4])
    hooked = Attention(32, 4)
    hooked.out.register_forward_hook(lambda module, args, out: out * 2)
    others["a forward hook"] = cache.key(hooked, (x,), "m", [2, 4])
    configured = []
    for theta in (1e4, 5e5):  # a plain config object: read by its attributes
        model = Attention(32, 4)
        model.config = types.SimpleNamespace(rope_theta=theta, sizes=[32, 4])
        configured.append(cache.key(model, (x,), "m", [2, 4]))
    others["a config's attribute"] = configured[0]
    assert configured[1] not in (None, configured[0])
    assert all(k is not None and k != base for k in others.values()), others
    assert len(set(others.values())) == len(others)


def test_an_attribute_the_key_cannot_describe_is_traced_every_time():
    class Slotted:  # no __dict__ to read, as a handle from a C extension
        __slots__ = ("state",)

    model = Attention(32, 4)
    model.helper = Slotted()
    x = torch.zeros(1, 8, 32)
    assert cache.key(model, (x,), "m", [2]) is None
    search(model, cpus(2), 4, 8, "fp32", example_inputs=(x,), cache=True)
    assert graph_files() == []


def test_an_edited_source_file_of_the_models_package_changes_the_key(tmp_path, monkeypatch):
    package = tmp_path / "mymodels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("SCALE = 1\n")
    (package / "net.py").write_text(
        "from torch import nn\nfrom mymodels import helpers\nclass Net(nn.Linear):\n    def"
        " forward(self, x):\n        return super().forward(x) * helpers.SCALE\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    net = importlib.import_module("mymodels.net")
    try:
        x = torch.zeros(1, 4)
        before = cache.key(net.Net(4, 4), (x,), "m", [2])
        (package / "helpers.py").write_text("SCALE = 2  # changed\n")
        after = cache.key(net.Net(4, 4), (x,), "m", [2])
        assert before is not None and after is not None and before != after
    finally:
        for name in [n for n in sys.modules if n == "mymodels" or n.startswith("mymodels.")]:
            del sys.modules[name]


def test_an_unreadable_cache_file_is_traced_again_and_rewritten():
    model = hp.models.build("gpt-tiny")
    search(model, cpus(2), 4, 16, "fp32", cache=True)
    (path,) = graph_files()
    path.write_bytes(b"not a pickle")
    again = search(model, cpus(2), 4, 16, "fp32", cache=True)
    assert again.graph.ops and cache.load(path.stem) is not None  # rewritten by the fresh trace


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HYPARALLEL_CACHE_DIR", str(blocker))  # a file where the folder should be
    result = search(hp.models.build("gpt-tiny"), cpus(2), 4, 16, "fp32", cache=True)
    assert result.best


def test_cli_plan_caches_unless_no_cache(capsys, tmp_path):
    argv = (
        "plan",
        "--model",
        "gpt-tiny",
        "--cluster",
        "cpu",
        "--gpus",
        "2",
        "--global-batch",
        "4",
        "--seq-len",
        "16",
    )
    code, _, err = run(capsys, *argv, "--no-cache", "-o", str(tmp_path / "a.yaml"))
    assert code == 0, err
    assert graph_files() == []
    assert run(capsys, *argv, "-o", str(tmp_path / "b.yaml"))[0] == 0
    assert len(graph_files()) == 1
    assert run(capsys, *argv, "-o", str(tmp_path / "c.yaml"))[0] == 0
    written = [(tmp_path / f"{n}.yaml").read_text() for n in "abc"]
    assert written[0] == written[1] == written[2]


def test_a_hugging_face_model_is_keyed_by_its_whole_config_attention_implementation_included():
    keys = []
    for implementation in ("eager", "sdpa"):
        model = hp.models.load(HF_LLAMA_TINY).module
        model.config._attn_implementation = implementation  # what decides which attention is traced
        keys.append(cache.key(model, hp.models.example_inputs(model, 1, 16), "llama", [2]))
    assert None not in keys and keys[0] != keys[1]


def test_the_cache_keeps_a_bounded_number_of_graphs(monkeypatch):
    monkeypatch.setattr(cache, "KEPT", 2)
    graph = hp.trace(hp.models.build("gpt-tiny"), hp.models.build("gpt-tiny").example_inputs(1, 16))
    for name in ("a", "b", "c"):
        cache.store(name, graph)
    assert [p.stem for p in graph_files()] == ["b", "c"]
    assert cache.load("a") is None and cache.load("c").ops == graph.ops


def test_the_key_is_the_same_in_every_process():
    """A key that changed per process (a str hash, an object's id) would never hit: two fresh
    processes, two hash seeds, one key, for a zoo model and a Hugging Face one."""
    script = (
        "import hyparallel as hp\nfrom hyparallel.graph import cache\n"
        f"for spec in ('gpt-tiny', {HF_LLAMA_TINY!r}):\n"
        "    m = hp.models.load(spec).module\n"
        "    print(cache.key(m, hp.models.example_inputs(m, 1, 16), 'n', [2]))\n"
    )
    keys = [
        subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.split()
        for seed in ("1", "2")
    ]
    assert len(keys[0]) == 2 and "None" not in keys[0] and keys[0] == keys[1]


HELD_MODULES = """
import torch
from torch import nn
from hyparallel.graph import cache

class Rotary(nn.Module):
    def forward(self, x):
        return x

def pick(names):  # its code holds a comprehension's code object and a frozenset of strings
    return [n for n in names if n in {"q_proj", "k_proj", "v_proj", "o_proj"}]

class Net(nn.Linear):
    def __init__(self):
        super().__init__(4, 4)
        # as transformers 5.25's kernels keep them
        self.__dict__["_kernel_funcs"] = {"rotary": Rotary()}
        self.__dict__["root"] = self  # a back-reference to a module of the model
        self.pick = pick

    def forward(self, x):
        return self._kernel_funcs["rotary"](super().forward(x))

print(cache.key(Net(), (torch.zeros(1, 4),), "n", [2]))
"""


def test_held_modules_and_a_functions_constants_are_keyed_alike_in_every_process():
    """A module held outside _modules (by its path when it is the model's, else by its class and
    state) and a function's nested code and set constants (whose reprs hold an address and a
    str-hash order)."""
    keys = [
        subprocess.run(
            [sys.executable, "-c", HELD_MODULES],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.split()
        for seed in ("1", "2")
    ]
    assert len(keys[0]) == 1 and "None" not in keys[0] and keys[0] == keys[1]


def test_a_held_module_is_keyed_by_its_state():
    model, x = Attention(32, 4), torch.zeros(1, 8, 32)
    keys = []
    for helper in (nn.Dropout(0.1), nn.Dropout(0.2), model.qkv, model.out):
        model.__dict__["helper"] = helper
        keys.append(cache.key(model, (x,), "m", [2]))
    assert None not in keys and len(set(keys)) == 4


def test_a_graph_pickle_refuses_is_not_cached_and_leaves_no_file():
    graph = hp.trace(hp.models.build("gpt-tiny"), hp.models.build("gpt-tiny").example_inputs(1, 16))
    graph.replicated["x"] = lambda: None  # pickle cannot store a lambda
    cache.store("k", graph)
    folder = cache.cache_dir() / "graphs"
    assert list(folder.iterdir()) == []
