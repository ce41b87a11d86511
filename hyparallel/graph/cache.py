"""A disk cache of traced graphs, so that planning the same model again skips the trace and its dry
runs.

``hyparallel plan`` is run many times over one model (other GPU counts, batches, constraints); its
trace on the meta device and the dry runs at one rank's sizes (Note [the planner replicates what
fails at one rank's sizes]) cost seconds and are the same every time. The planner stores the graph
they give under a key of everything that decides them (Note [what a cached graph is keyed by]) and
reads it back when the key matches.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import logging
import os
import pickle
import sys
import tempfile
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hyparallel.graph.model_graph import ModelGraph

log = logging.getLogger(__name__)
FORMAT = 1  # bumped when what a cache file holds changes
# graphs kept on disk (GPT-3 175B's is 0.8 MB); the least recently written beyond them are removed
KEPT = 64

# Note [what a cached graph is keyed by]
#     A cached graph must be the graph a fresh trace would give, never a stale one (a plan from it
#     would be silently wrong). Its key hashes: hyparallel's own source files and torch's version
#     (the tracer, the cost fields, the dry runs); the example inputs' structure, shapes and dtypes;
#     the tensor-parallel degrees dry run; and the model as its forward sees it: every module's path
#     and class, the source files of every class in its MRO and of every loaded module of the same
#     top-level package (what its forward may call), each module's attributes (numbers, strings,
#     configs, functions by their code, hooks, a module held outside _modules by its path when it is
#     one of the model's, else by its class, forward and state), and every parameter's and buffer's
#     name, shape, dtype and tie; a plain config object by its attributes and its class's source.
#     Every description is the same in every process: never an id, an address or a str hash's order.
#     A value the key cannot describe exactly (an object with none of those forms, a container of
#     more than _ITEMS items) makes the model uncacheable: it is traced every time. torch's and site
#     packages' files are named by their distribution's version rather than read.

_SKIPPED_ATTRIBUTES = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}
_DEPTH = 8
# Attributes that differ in every process and decide nothing traced: transformers' GenerationConfig
# keeps a hash() of itself (randomised per process), which would make every run's key new.
_PROCESS_LOCAL = {"_original_object_hash"}
# a larger container (a dataset held by a module) is not described: the model is traced
_ITEMS = 10_000


class Uncacheable(Exception):
    """A value the key cannot describe exactly."""


def cache_dir() -> Path:
    """Where cached graphs live: ``$HYPARALLEL_CACHE_DIR``, else ``$XDG_CACHE_HOME/hyparallel``,
    else
    ``~/.cache/hyparallel``."""
    if os.environ.get("HYPARALLEL_CACHE_DIR"):
        return Path(os.environ["HYPARALLEL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hyparallel"


def key(model: nn.Module, inputs: Any, name: str, degrees: list[int]) -> str | None:
    """The cache key of ``model`` traced with ``inputs`` and dry run at ``degrees`` (Note [what a
    cached graph is keyed by]); None when the model holds a value the key cannot describe (then it
    is not cached)."""
    digest = hashlib.sha256()
    try:
        for part in _parts(model, inputs, name, degrees):
            digest.update(part.encode())
            digest.update(b"\0")
    except Uncacheable as why:
        log.info("not caching the trace of %s: %s", name, why)
        return None
    return digest.hexdigest()[:32]


def load(cache_key: str | None) -> ModelGraph | None:
    """The graph stored under ``cache_key``; None when there is none or it cannot be read (it is
    traced again)."""
    if cache_key is None:
        return None
    path = cache_dir() / "graphs" / f"{cache_key}.pkl"
    try:
        with path.open("rb") as file:
            stored = pickle.load(file)
    except FileNotFoundError:
        return None
    except Exception as exc:  # a truncated or foreign file: ignore it, the trace rewrites it
        log.info("ignoring the cached graph %s (%s: %s)", path, type(exc).__name__, exc)
        return None
    if not (isinstance(stored, tuple) and len(stored) == 2 and stored[0] == FORMAT):
        return None
    graph = stored[1]
    return graph if isinstance(graph, ModelGraph) else None


def store(cache_key: str | None, graph: ModelGraph) -> None:
    """Write ``graph`` (without its fx program, which only the runtime cuts) under ``cache_key``; a
    cache that cannot be written is skipped with a log line, never an error."""
    if cache_key is None:
        return
    folder = cache_dir() / "graphs"
    light = dataclasses.replace(graph, program=None, traced=None, replicated=dict(graph.replicated))
    written = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as file:
            written = file.name
            pickle.dump((FORMAT, light), file, protocol=pickle.HIGHEST_PROTOCOL)
        # atomic: a reader sees the old file or the new one
        os.replace(written, folder / f"{cache_key}.pkl")
        written = None
        stored = sorted(folder.glob("*.pkl"), key=lambda p: p.stat().st_mtime_ns)
        for old in stored[:-KEPT]:  # the least recently written go: the cache stays a bounded size
            old.unlink(missing_ok=True)
    # a full disk, a read-only folder, a value pickle refuses: the plan goes on
    except Exception as exc:
        log.info("not caching the trace in %s (%s: %s)", folder, type(exc).__name__, exc)
    finally:
        if written is not None:
            Path(written).unlink(missing_ok=True)


def _parts(model: nn.Module, inputs: Any, name: str, degrees: list[int]):
    yield f"format {FORMAT}; torch {torch.__version__}; hyparallel {_own_sources()}"
    yield (
        f"name {name!r}; degrees {sorted(set(degrees))}; default dtype {torch.get_default_dtype()}"
    )
    leaves, spec = tree_flatten(inputs)
    yield f"inputs {spec}"
    # every module by its first path: a module held outside _modules that is one of them is named by
    # it, not its id
    paths: dict[int, str] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), path)
    for leaf in leaves:
        yield _canon(leaf, 0, paths)
    yield f"global hooks {_global_hooks()}"
    classes: dict[type, None] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        classes.update(
            dict.fromkeys(c for c in type(module).__mro__ if c not in (object, nn.Module))
        )
        yield f"module {path!r} {type(module).__module__}.{type(module).__qualname__}"
        for attribute, value in sorted(vars(module).items()):
            if attribute not in _SKIPPED_ATTRIBUTES:
                yield f"{attribute}={_canon(value, 0, paths)}"
        for buffer, tensor in module._buffers.items():
            persistent = buffer not in module._non_persistent_buffers_set
            yield f"buffer {buffer} {_canon(tensor, 0, paths)} persistent={persistent}"
    first: dict[int, str] = {}
    for param_name, param in model.named_parameters(remove_duplicate=False):
        tie = first.setdefault(id(param), param_name)
        yield f"param {param_name} {_canon(param, 0, paths)} grad={param.requires_grad} tie={tie}"
    yield from sorted(_sources(classes))


def _canon(value: Any, depth: int, paths: Mapping[int, str]) -> str:
    """An exact description of ``value`` for the key, the same in every process (never an id, an
    address or a str hash's order); ``paths`` names the model's modules. Raises Uncacheable for a
    value it cannot describe."""
    if depth > _DEPTH:
        raise Uncacheable("a value nested too deep")
    if value is None or isinstance(
        value, (bool, int, float, complex, str, bytes, range, slice, enum.Enum)
    ):
        return repr(value)
    if isinstance(
        value, (torch.dtype, torch.device, torch.layout, torch.memory_format, torch.Size)
    ):
        return repr(value)
    if isinstance(value, torch.Tensor):  # a meta trace reads a tensor's kind, never its values
        return (
            f"tensor({tuple(value.shape)}, {value.dtype}, {value.device.type},"
            f" {type(value).__name__})"
        )
    # a module held as an attribute outside _modules (it is traced as such)
    if isinstance(value, nn.Module):
        return _held_module(value, depth, paths)
    if isinstance(value, (tuple, list, set, frozenset)):
        if len(value) > _ITEMS:
            raise Uncacheable(f"a collection of {len(value):,} items")
        items = [_canon(v, depth + 1, paths) for v in value]
        inner = ", ".join(sorted(items) if isinstance(value, (set, frozenset)) else items)
        return f"{type(value).__name__}[{inner}]"
    if isinstance(value, dict):
        if len(value) > _ITEMS:
            raise Uncacheable(f"a mapping of {len(value):,} items")
        inner = ", ".join(
            f"{_canon(k, depth + 1, paths)}: {_canon(v, depth + 1, paths)}"
            for k, v in value.items()
        )
        return f"{type(value).__name__}{{{inner}}}"
    if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
        return _callable(value, depth, paths)
    if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType, type)):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    if type(value).__module__ != "builtins" and isinstance(getattr(value, "__dict__", None), dict):
        # A config object (Hugging Face's, a dataclass, a class of attributes, a SimpleNamespace):
        # every attribute, private ones too (a Hugging Face config's fields and to_dict leave out
        # _attn_implementation_internal, which decides which attention is traced), and its class's
        # source.
        kind = type(value)
        described = {k: v for k, v in vars(value).items() if k not in _PROCESS_LOCAL}
        return (
            f"{kind.__module__}.{kind.__qualname__}"
            f" {_type_source(kind)}{_canon(described, depth + 1, paths)}"
        )
    if dataclasses.is_dataclass(value):  # one with slots
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        kind = type(value)
        return (
            f"{kind.__module__}.{kind.__qualname__}"
            f" {_type_source(kind)}{_canon(fields, depth + 1, paths)}"
        )
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):  # a config with no __dict__ (slots) that describes itself
        described = _canon(to_dict(), depth + 1, paths)
        return f"{type(value).__module__}.{type(value).__qualname__}{described}"
    raise Uncacheable(f"an attribute of type {type(value).__module__}.{type(value).__qualname__}")


def _type_source(kind: type) -> str:
    """The version of the distribution defining ``kind``, or the hash of its module's file."""
    version = _distribution_version(kind.__module__.partition(".")[0])
    if version is not None:
        return version
    file = getattr(sys.modules.get(kind.__module__), "__file__", None)
    if not file or not os.path.isfile(file):
        return ""
    stat = os.stat(file)
    return _file_hash(file, stat.st_mtime_ns, stat.st_size)


def _held_module(module: nn.Module, depth: int, paths: Mapping[int, str]) -> str:
    """A module held outside ``_modules`` (a back-reference, a helper a decorator attaches:
    transformers 5.25's kernels keep a ``Func`` module per attention in ``_kernel_funcs``): one of
    the model's by its path, another by its class, its forward's code and its whole state."""
    kind = type(module)
    name = f"module {kind.__module__}.{kind.__qualname__}"
    if id(module) in paths:
        return f"{name} at {paths[id(module)]!r}"
    state = {k: v for k, v in vars(module).items() if k not in _PROCESS_LOCAL}
    forward = _callable(kind.forward, depth + 1, paths)
    return f"{name} {_type_source(kind)} {forward} {_canon(state, depth + 1, paths)}"


def _callable(value: Any, depth: int, paths: Mapping[int, str]) -> str:
    if isinstance(value, functools.partial):
        return (
            f"partial({_callable(value.func, depth + 1, paths)},"
            f" {_canon(value.args, depth + 1, paths)}, "
            + f"{_canon(value.keywords, depth + 1, paths)})"
        )
    if isinstance(value, types.MethodType):
        return (
            f"method {_callable(value.__func__, depth + 1, paths)} of"
            f" {_canon(value.__self__, depth + 1, paths)}"
        )
    code = getattr(value, "__code__", None)
    body = _code_digest(code) if isinstance(code, types.CodeType) else ""
    return (
        f"function {getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')} {body}"
    )


def _code_digest(code: types.CodeType) -> str:
    """A hash of ``code``'s bytecode and constants, the same in every process: a nested function's
    code (a lambda, a comprehension) by its own hash, not its repr (which holds its address), a
    frozenset (``x in {"a", "b"}``) by its sorted items, not its repr (ordered by str hashes)."""
    return hashlib.sha256(code.co_code + _constant(code.co_consts).encode()).hexdigest()[:16]


def _constant(value: Any) -> str:
    if isinstance(value, types.CodeType):
        return f"code {_code_digest(value)}"
    if isinstance(value, tuple):
        return f"({', '.join(_constant(v) for v in value)})"
    if isinstance(value, frozenset):
        return f"frozenset({{{', '.join(sorted(_constant(v) for v in value))}}})"
    return repr(value)


def _global_hooks() -> str:
    from torch.nn.modules import module as module_file

    hooks = [
        getattr(module_file, name, {})
        for name in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_module_registration_hooks",
        )
    ]
    return ", ".join(_callable(h, 0, {}) for table in hooks for h in table.values())


@functools.cache
def _own_sources() -> str:
    """A hash of hyparallel's own source files (a change to the tracer or the dry runs invalidates
    the cache)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _sources(classes: dict[type, None]) -> set[str]:
    """The source files the model's classes may run: their own files and those of every loaded
    module of the same top-level package, by content; a distribution's files by its version."""
    packages = {c.__module__.partition(".")[0] for c in classes}
    described: set[str] = set()
    for package in packages:
        version = _distribution_version(package)
        if version is not None:
            described.add(f"package {package} {version}")
            continue
        for module_name, module in list(sys.modules.items()):
            if module_name == package or module_name.startswith(package + "."):
                file = getattr(module, "__file__", None)
                if file and os.path.isfile(file):
                    # an edited file is read again, in a long-lived process too
                    stat = os.stat(file)
                    described.add(
                        f"file {module_name} {_file_hash(file, stat.st_mtime_ns, stat.st_size)}"
                    )
    return described


def _distribution_version(package: str) -> str | None:
    """The installed version of the distribution holding ``package`` when it lies in site packages
    (not an editable or source checkout, whose files may change under one version); None
    otherwise."""
    if package in ("torch", "builtins", "__main__"):
        return torch.__version__ if package == "torch" else None
    module = sys.modules.get(package)
    file = getattr(module, "__file__", None) or ""
    if "site-packages" not in file and "dist-packages" not in file:
        return None
    from importlib import metadata

    try:  # most distributions are named as their package: no scan of every installed one
        return f"{package} {metadata.version(package)}"
    except metadata.PackageNotFoundError:
        pass
    for distribution in _distributions().get(package, []):
        try:
            return f"{distribution} {metadata.version(distribution)}"
        except metadata.PackageNotFoundError:
            continue
    return None


@functools.cache
def _distributions() -> dict[str, list[str]]:
    from importlib import metadata

    return metadata.packages_distributions()


@functools.cache
def _file_hash(path: str, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
