"""The house is built in layers, its folders named after them, and imports only go downwards.

    spec      hyparallel.spec (errors, limits, files, yaml_io, schema, cluster); hyparallel.kernels
              beside it
    model     hyparallel.graph (tracer, ModelGraph, structure, checks: check_plan, what the planner
              filters its candidates by and the runtime refuses), hyparallel.models
    planner   hyparallel.planner: every cost formula; it reads the pipeline's schedule IR
              (pipeline.schedule)
    parallel  hyparallel.tensor, hyparallel.pipeline: the tensor- and pipeline-parallel modules and
              engine
    runtime   hyparallel.runtime: parallelize and ParallelModel, data parallelism, compression,
              recomputation, launch, checkpoints, metrics, the parameter-server mode (runtime.ps)
    tools     hyparallel.tools: calibrate, the parity check, views and pictures, the demo, docgen,
              dlrover-run
    top       hyparallel.cli (and __main__)

A plan is made (and shown, and simulated) on a laptop without the runtime, and the runtime applies a
plan it is given without planning. These tests read hyparallel's own source with ``ast`` and build
its import graph: an arrow for every ``import``, at module level or inside a function, ``from a
import b`` to the module ``a.b`` when that is a module file, and from every module to its package
(``hyparallel.a.b`` cannot load without
``hyparallel/a/__init__.py``; the root ``hyparallel/__init__.py`` is the facade and is only an arrow
when imported by name). ``torch.distributed*`` modules are external nodes. Each rule in ``RULES``
says which modules must not reach which others, transitively; a failure names every chain that
crosses the line. The folders themselves form no cycle (``test_the_folders_are_layers``). Names
computed at run time (``import_module(f"...")``) are not seen here; the subprocess tests back that
up.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = "hyparallel"
SPEC = ("hyparallel.spec",)
LEAF = ("hyparallel.kernels",)
MODEL = ("hyparallel.graph", "hyparallel.models")
CHECKS = ("hyparallel.graph.checks",)
PLANNER = ("hyparallel.planner",)
PARALLEL = ("hyparallel.tensor", "hyparallel.pipeline")
RUNTIME = ("hyparallel.runtime", *PARALLEL)
TOOLS = ("hyparallel.tools",)
TOP = ("hyparallel.cli", "hyparallel.__main__")
# The pipeline's schedule IR (pure Python: actions, schedules, their simulation) is what the
# planner's timeline runs; the engine that executes it is runtime.
SCHEDULE = ("hyparallel.pipeline", "hyparallel.pipeline.schedule", "hyparallel.pipeline.split")
DISTRIBUTED = "torch.distributed"
# The folders, lowest first: a module may import only from its own level or one listed before it
# (test_the_folders_are_layers). The model graph and the zoo are one level (a zoo model is built for
# the tracer, the tracer builds models on meta); tensor and pipeline sit below the planner for the
# schedule IR alone, which the planner simulates (the rules below keep the planner off everything
# else of theirs).
FOLDERS = (
    ("spec",),
    ("kernels",),
    ("graph", "models"),
    ("tensor",),
    ("pipeline",),
    ("planner",),
    ("runtime",),
    ("tools",),
    ("cli",),
)
LEVEL = {folder: level for level, folders in enumerate(FOLDERS) for folder in folders}


@dataclass(frozen=True)
class Rule:
    """The modules under ``sources`` never reach one under ``forbidden`` (unless it is under
    ``allowed``).

    Every entry names a module and everything under it. ``direct``: only the sources' own imports
    count.
    """

    name: str
    sources: tuple[str, ...]
    forbidden: tuple[str, ...]
    why: str
    allowed: tuple[str, ...] = ()
    direct: bool = False


RULES = [
    Rule(
        "spec-is-the-floor",
        SPEC,
        (PACKAGE, DISTRIBUTED),
        "plan and cluster files are read, checked and written with nothing above them: no model,"
        " planner or runtime",
        allowed=SPEC,
    ),
    Rule(
        "kernels-are-a-leaf",
        LEAF,
        (PACKAGE,),
        "the kernels are used by the zoo and the runtime alike, so they import nothing of"
        " hyparallel but errors",
        allowed=(*LEAF, "hyparallel.spec.errors"),
    ),
    Rule(
        "graph-and-models-know-neither-planner-nor-runtime",
        MODEL,
        (*PLANNER, *RUNTIME, *TOOLS, *TOP),
        "the model graph and the zoo are what the checks, the planner and the runtime read; they"
        " are below all three",
    ),
    Rule(
        "checks-never-run-anything",
        CHECKS,
        (*PLANNER, *RUNTIME, *TOOLS, DISTRIBUTED),
        "the planner and the runtime read one set of constraints: check_plan reads a plan and a"
        " trace, it touches no process group and knows neither who plans nor who runs",
    ),
    Rule(
        "planner-never-runs-anything",
        PLANNER,
        (*RUNTIME, *TOOLS, *TOP, DISTRIBUTED),
        "plans are made on one machine without a launch: the planner computes, it imports no"
        " runtime (the pipeline's schedule IR aside, which it simulates)",
        allowed=SCHEDULE,
    ),
    Rule(
        "runtime-never-plans-below-parallelize",
        PARALLEL,
        PLANNER,
        "the tensor- and pipeline-parallel engines apply the plan they are given; what they share"
        " with the planner lives below both",
    ),
    Rule(
        "runtime-never-reaches-the-tools",
        RUNTIME,
        (*TOOLS, *TOP),
        "the runtime is what training needs; the tools and the CLI are built on it, never under it",
    ),
    Rule(
        "tools-never-reach-the-cli",
        TOOLS,
        TOP,
        "the CLI parses arguments and calls the tools; a tool is callable without it",
    ),
    Rule(
        "upstream-never-imports-torch-distributed",
        (*MODEL, *PLANNER, *SPEC, *LEAF),
        (DISTRIBUTED,),
        "nothing upstream of the runtime imports torch.distributed itself",
        direct=True,
    ),
]

# What `hyparallel show --model` and `hyparallel simulate` must not load; `import torch` itself
# loads torch.distributed and torch.distributed.device_mesh, so those are not watched.
RUNTIME_MODULES = [
    "hyparallel.runtime.parallel",
    "hyparallel.pipeline.executor",
    "hyparallel.tensor.apply",
    "hyparallel.tensor.layers",
    "hyparallel.tensor.collectives",
    "hyparallel.runtime.data_parallel",
    "hyparallel.runtime.compression",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.pipelining",
]
PLAN = "configs/plans/cpu-dp2-tp2-pp2.yaml"
COMMANDS = {
    "show-model": ["show", "{plan}", "--model", "gpt-tiny"],
    "simulate": ["simulate", "{plan}"],
    "simulate-picture": ["simulate", "{plan}", "--out", "{tmp}/timeline.png"],
}

# Runs hyparallel.cli.main in-process, then writes which watched modules hyparallel loaded and
# through which of its modules. A first load is hyparallel's when a hyparallel module is among the
# modules being executed for it, or the function whose import statement started them is
# hyparallel's: torch's own lazy imports are not (a model's first parameter made on the meta device
# goes through torch._compile, whose torch._dynamo loads torch.distributed.fsdp and
# torch.distributed.tensor). An import statement in a hyparallel module naming a watched module
# counts even when torch loaded that module before.
DRIVER = r"""
import builtins, importlib.util, json, sys

watched, argv, result = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
loaded = {}


def ours(module):
    return module == "hyparallel" or module.startswith("hyparallel.")


def note(name, chain):
    for module in watched:
        if (name == module or name.startswith(module + ".")) and module not in loaded:
            loaded[module] = [*[m for m in chain if ours(m)], module]


class Watch:
    def find_spec(self, name, path=None, target=None):
        chain, frame = [], sys._getframe(1)
        # the modules being executed, out to the function whose import started them
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            watcher = frame.f_code is watching_import.__code__
            if not watcher and module.partition(".")[0] != "importlib":
                if module not in chain:
                    chain.append(module)
                if frame.f_code.co_name != "<module>":
                    break
            frame = frame.f_back
        if any(map(ours, chain)):
            note(name, chain[::-1])
        return None


def watching_import(name, globals=None, locals=None, fromlist=(), level=0):
    # a first load notes its longer chain
    imported = real_import(name, globals, locals, fromlist, level)
    importer = (globals or {}).get("__name__", "")
    if ours(importer):
        package = globals.get("__package__")
        base = importlib.util.resolve_name("." * level + name, package) if level else name
        for target in (base, *(f"{base}.{item}" for item in fromlist or ())):
            note(target, [importer])
    return imported


real_import, builtins.__import__ = builtins.__import__, watching_import
sys.meta_path.insert(0, Watch())
import hyparallel
from hyparallel.cli import main

try:
    code = main(argv)
except SystemExit as exc:
    code = exc.code
with open(result, "w") as out:
    json.dump({"code": code or 0, "loaded": loaded, "package": hyparallel.__file__}, out)
"""

# --- the import graph -----------------------------------------------------------------------------


def module_files(root: Path) -> dict[str, Path]:
    """hyparallel's modules by dotted name: ``hyparallel/a/b.py`` is ``hyparallel.a.b``, a package
    its ``__init__``."""
    files = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def imported(node: ast.AST, module: str, is_package: bool, modules) -> list[str]:
    """The modules one ``import`` statement (or ``import_module("...")`` call) loads, as far as the
    graph cares."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: from the module's package, one level up per extra dot
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        names = [f"{source}.{alias.name}" for alias in node.names]
        if source == "torch":  # from torch import distributed
            return [name for name in names if under(name, [DISTRIBUTED])]
        found = [name for name in names if name in modules]
        return found + ([source] if len(found) < len(names) else [])
    if (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None))
        in ("import_module", "__import__")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def build_import_graph(root: Path) -> nx.DiGraph:
    """hyparallel's modules and the torch.distributed modules they import; an edge's ``where`` is
    the line."""
    files = module_files(root)
    graph = nx.DiGraph()
    graph.add_nodes_from(files, external=False)
    for module, path in files.items():
        parent = module.rpartition(".")[0]
        if parent and parent != PACKAGE:
            graph.add_edge(module, parent, where=f"{parent} loads first")
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):
            for target in imported(node, module, path.name == "__init__.py", files):
                if under(target, [PACKAGE]) or under(target, [DISTRIBUTED]):
                    if target != module and not graph.has_edge(module, target):
                        graph.add_node(target, external=not under(target, [PACKAGE]))
                        where = f"{path.relative_to(root)}:{node.lineno}"
                        graph.add_edge(module, target, where=where)
    return graph


def crossings(graph: nx.DiGraph, rule: Rule) -> list[list[str]]:
    """Every arrow into a forbidden module from where the sources reach, with the shortest chain
    that gets there.

    The walk stops at the first forbidden module of each chain: what lies behind it is that module's
    business.
    """

    def forbidden(name):
        return under(name, rule.forbidden) and not under(name, rule.allowed)

    sources = sorted(n for n in graph if under(n, rule.sources))
    parent = dict.fromkeys(sources)
    queue = deque(sources)
    chains = []
    while queue:
        module = queue.popleft()
        for target in sorted(graph.successors(module)):
            if forbidden(target):
                chain = [target, module]
                while parent[chain[-1]] is not None:
                    chain.append(parent[chain[-1]])
                chains.append(chain[::-1])
            elif target not in parent and not rule.direct:
                parent[target] = module
                queue.append(target)
    return sorted(chains, key=lambda chain: (len(chain), chain))


def describe(graph: nx.DiGraph, chain: list[str]) -> str:
    arrows = ", ".join(graph.edges[a, b]["where"] for a, b in zip(chain, chain[1:]))
    return f"  {' -> '.join(chain)}\n      ({arrows})"


@pytest.fixture(scope="module")
def import_graph(repo):
    return build_import_graph(repo)


# --- the rules ------------------------------------------------------------------------------------


def test_the_import_graph_sees_the_known_arrows(import_graph):
    """The rules cannot pass vacuously: the layers exist and the graph finds arrows of every
    kind."""
    for layer in (
        "hyparallel.graph",
        "hyparallel.models",
        "hyparallel.planner",
        "hyparallel.spec.schema",
    ):
        assert any(under(n, [layer]) for n in import_graph), f"no module under {layer}"
    for layer in (
        "hyparallel.tensor",
        "hyparallel.pipeline",
        "hyparallel.runtime.parallel",
        "hyparallel.cli",
    ):
        assert any(under(n, [layer]) for n in import_graph), f"no module under {layer}"
    known = [
        ("hyparallel.runtime.parallel", "torch.distributed"),  # import torch.distributed as dist
        # import torch.distributed.checkpoint as dcp
        ("hyparallel.runtime.checkpoint", "torch.distributed.checkpoint"),
        # from hyparallel.spec.schema import Plan
        ("hyparallel.planner.api", "hyparallel.spec.schema"),
        # from hyparallel.planner import costs
        ("hyparallel.planner.api", "hyparallel.planner.costs"),
        ("hyparallel.cli", "hyparallel.planner"),  # inside a function
        # the planner filters its candidates by check_plan
        ("hyparallel.planner.api", "hyparallel.graph.checks"),
        ("hyparallel.pipeline.schedule", "hyparallel.pipeline"),  # a module's package loads first
    ]
    missing = [f"{a} -> {b}" for a, b in known if not import_graph.has_edge(a, b)]
    assert not missing, f"the import graph misses known arrows: {missing}"
    assert nx.has_path(import_graph, "hyparallel.cli", "torch.distributed")
    assert nx.has_path(import_graph, "hyparallel.planner", "hyparallel.spec.errors")
    assert (
        not import_graph.nodes["hyparallel.planner"]["external"]
        and import_graph.nodes["torch.distributed"]["external"]
    )


def folder_of(module: str) -> str | None:
    """The layer folder a hyparallel module lives in (``cli`` for the root's CLI modules); None for
    the facade."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) == 1:
        return None
    return "cli" if parts[1] in ("cli", "__main__") else parts[1]


def test_the_folders_are_layers(import_graph, repo):
    """Every folder imports only from itself and the folders below it (FOLDERS, lowest first); the
    root holds the facade and the CLI."""
    folders = {folder_of(m) for m in import_graph if not import_graph.nodes[m]["external"]} - {None}
    assert folders == set(LEVEL), (
        f"folders not in FOLDERS (or gone): {sorted(folders ^ set(LEVEL))}"
    )
    upward = [
        f"  {a} -> {b} ({import_graph.edges[a, b]['where']})"
        for a, b in import_graph.edges
        if folder_of(a) and folder_of(b) and LEVEL[folder_of(b)] > LEVEL[folder_of(a)]
    ]
    assert not upward, "imports that go up a layer (tests/test_layering.py FOLDERS):\n" + "\n".join(
        upward
    )
    root = sorted(p.name for p in (repo / PACKAGE).glob("*.py"))
    assert root == ["__init__.py", "__main__.py", "cli.py"], f"the package root holds {root}"


@pytest.mark.parametrize("rule", RULES, ids=[rule.name for rule in RULES])
def test_layering_rule(import_graph, rule):
    sources = [
        n for n in import_graph if under(n, rule.sources) and not import_graph.nodes[n]["external"]
    ]
    if not sources:
        pytest.fail(
            f"rule {rule.name}: no module under {', '.join(rule.sources)}: is the rule out of date?"
        )
    chains = crossings(import_graph, rule)
    reach = "import" if rule.direct else "reach"
    but = f" (but {', '.join(rule.allowed)})" if rule.allowed else ""
    assert not chains, (
        f"{', '.join(rule.sources)} must not {reach} {', '.join(rule.forbidden)}{but}:"
        f" {rule.why}.\n{len(chains)} chain(s) cross the line:\n"
        + "\n".join(describe(import_graph, c) for c in chains)
    )


@pytest.mark.parametrize("command", COMMANDS, ids=list(COMMANDS))
def test_planning_commands_never_load_the_runtime(repo, tmp_path, command):
    """`hyparallel show (--model)` and `hyparallel simulate` run without the runtime or
    torch.distributed's parts."""
    argv = [arg.format(plan=repo / PLAN, tmp=tmp_path) for arg in COMMANDS[command]]
    shown = "hyparallel " + " ".join(COMMANDS[command]).format(plan=PLAN, tmp="TMP")
    result = tmp_path / "result.json"
    paths = [str(repo), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(RUNTIME_MODULES), json.dumps(argv), str(result)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0 and result.exists(), (
        f"the driver failed:\n{proc.stdout}\n{proc.stderr}"
    )
    report = json.loads(result.read_text())
    assert Path(report["package"]).is_relative_to(repo / PACKAGE), (
        f"imported {report['package']}, not this checkout"
    )
    assert report["code"] == 0, f"{shown} exited {report['code']}:\n{proc.stdout}\n{proc.stderr}"
    loaded = report["loaded"]
    assert not loaded, f"{shown} loaded the runtime:\n" + "\n".join(
        f"  {' -> '.join(chain)}" for chain in loaded.values()
    )


def test_package_imports_without_triton_or_cuda():
    # Lazy accelerator imports: importing hyparallel must not pull in triton.
    code = (
        "import sys, hyparallel; assert not sys.modules.get('triton'), 'triton imported at package"
        " import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_parameter_servers_actor_starts_without_distributed_checkpointing():
    # Every server actor (and each restart of a crashed one) is a fresh Ray worker importing
    # hyparallel.runtime.ps.actors: torch.distributed.checkpoint and DTensor cost it 0.9 s of CPU
    # for one file name (measured 2.9 -> 2.0 s an import on 2 cores).
    code = (
        "import sys, hyparallel.runtime.ps.actors; assert 'torch.distributed.checkpoint' not in"
        " sys.modules, 'the actors import distributed checkpointing'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
