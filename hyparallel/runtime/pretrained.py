"""Weights in and out: pretrained safetensors into a parallel model, a checkpoint out as a Hugging
Face folder.

``load_pretrained(pmodel, path)`` (``hp.checkpoint.load_pretrained``) fills a parallelized model
from a Hugging Face folder or one ``.safetensors`` file, each rank reading only the rectangles it
holds (Note [reading only this rank's pieces]). ``export_hf(directory, out)`` (``hyparallel
checkpoint export CKPT OUT/``) writes a checkpoint of an ``hf:`` model as ``config.json`` and
sharded safetensors that ``from_pretrained`` loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from hyparallel.spec import files
from hyparallel.spec.errors import ConfigError

if TYPE_CHECKING:
    from hyparallel.runtime.checkpoint import Entry

# hyparallel.runtime.checkpoint re-exports load_pretrained: it is imported where used, so either
# module may load first.

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
ExportFormat = Literal["auto", "hf", "safetensors", "torch"]

# Note [reading only this rank's pieces]
#     state_entries maps each single-device tensor to the rectangles this rank holds
#     (tensor-parallel rows or columns, fused q|k|v runs, FSDP rows, vocabulary padding left out,
#     Conv1D transposed; only this rank's pipeline stages). Each rectangle is read by name with
#     safetensors' get_slice, which copies just those bytes out of the file, and copied into the
#     rank's tensor. safe_open maps the file into memory, and the pages a read touches count in the
#     process's resident set until the file is closed, so each tensor is read under a safe_open of
#     its own: a rank's memory grows by at most about one tensor's pages, never by the model. The
#     checks (every tensor present, shapes equal, no stray names) read only the files' headers,
#     against the whole model's names and shapes, so every rank makes the same decision and none
#     needs a collective.

# Note [names in the file that the model lacks]
#     Refused (one line naming the first few), except what transformers itself drops as harmless: a
#     buffer the model does not keep in its state dict (rotary tables older checkpoints saved: the
#     model computes its own), and names matching the class's ``_keys_to_ignore_on_load_unexpected``
#     (GPT-2's old attention masks). A file saved from the base model (``h.0...`` for GPT-2's
#     ``transformer.h.0...``) or the model with a head loads too: names are matched with or without
#     the class's ``base_model_prefix``, as from_pretrained does.


@dataclass(frozen=True)
class PretrainedLoad:
    """What ``load_pretrained`` did on this rank: tensors filled, bytes read, names in the file it
    ignored."""

    path: Path
    tensors: int
    bytes_read: int
    ignored: tuple[str, ...]


def load_pretrained(pmodel, path: str | Path) -> PretrainedLoad:
    """Copy pretrained weights from ``path`` into ``pmodel``, each rank reading only the slices it
    holds.

    ``path``: a Hugging Face folder (``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``) or one ``.safetensors`` file; names are the single-device
    model's (a tied weight under any of its names).
    ``pmodel`` is a ParallelModel (any plan; every rank calls this, no collective) or a plain module
    with real tensors. Persistent buffers load too; a missing or extra name, or a shape that
    differs, is one ConfigError.
    """
    if getattr(pmodel, "ps_mode", False):
        raise ConfigError(
            "load_pretrained: a parameter-server plan's servers start from the model's weights;"
            " load them into the model (hp.checkpoint.load_pretrained(model, path)) before"
            " hp.parallelize"
        )
    safe_open = _safe_open()
    path = Path(path)
    header = _read_headers(_weight_files(path), safe_open)  # name -> (file, shape)
    target = pmodel if hasattr(pmodel, "local_modules") else _Whole(pmodel)
    found, ignored = _match_names(target, header, path)
    from hyparallel.runtime.checkpoint import state_entries

    entries = state_entries(target, None)
    if any(piece.view.is_meta for entry in entries.values() for piece in entry.pieces):
        raise ConfigError(
            f"{_class_name(target.module)} has tensors on the meta device; parallelize it"
            " (hp.parallelize) or materialise it before loading weights into it"
        )
    read, tensors = 0, 0
    with torch.no_grad():
        for fqn, entry in entries.items():
            # every tensor of this rank is one of the whole model's
            key = found[fqn[len("model.") :]]
            if key is not None:
                read += _read_pieces(safe_open, header[key][0], key, entry)
                tensors += 1
    return PretrainedLoad(path, tensors, read, tuple(ignored))


def _match_names(
    pmodel, header: dict[str, Any], path: Path
) -> tuple[dict[str, str | None], list[str]]:
    """Each of the whole model's tensors -> its name in the files (None: missing, harmlessly), and
    the files' names passed over (Note [names in the file that the model lacks]); anything else is
    one ConfigError."""
    model = pmodel.module
    shapes, aliases, skippable = _model_names(pmodel)
    prefix = getattr(model, "base_model_prefix", "") or ""
    found = {name: _find(name, aliases[name], header, prefix) for name in shapes}
    where = path if path.is_file() else path / (INDEX if (path / INDEX).is_file() else SINGLE)
    missing = [
        name for name, key in found.items() if key is None and not _matches(model, "missing", name)
    ]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConfigError(
            f"{where}: no tensor {', '.join(missing[:3])}{more} that {_class_name(model)} needs; "
            "give the weights of this model (same architecture and sizes)"
        )
    for name, key in found.items():
        if key is not None and tuple(header[key][1]) != shapes[name]:
            raise ConfigError(
                f"{where}: {key} has shape {tuple(header[key][1])}, the model's {name}"
                f" {shapes[name]}; build the model with the config these weights were saved with"
            )
    # a tied weight's other name in the file is the model's
    known = {n for names in aliases.values() for n in names}
    taken = set(found.values())
    ignored = [key for key in header if key not in taken and key not in known]
    unknown = [key for key in ignored if not _harmless(model, key, skippable, prefix)]
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise ConfigError(
            f"{where}: {_class_name(model)} has no {', '.join(unknown[:3])}{more}; these weights"
            " are of another model (or another version of it): build the model they were saved"
            " from"
        )
    return found, ignored


def _class_name(model: nn.Module) -> str:
    """The model's class name (FSDP2 swaps in a subclass of its own, FSDP<name>)."""
    return next(
        c.__name__ for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed")
    )


def _read_pieces(safe_open, file: Path, key: str, entry: Entry) -> int:
    """Copy each of ``entry``'s pieces from ``key`` in ``file`` (Note [reading only this rank's
    pieces])."""
    read = 0
    with safe_open(str(file), framework="pt") as handle:
        source = handle.get_slice(key)
        for piece in entry.pieces:
            if piece.view.dim() == 0:
                data = handle.get_tensor(key)
            else:
                data = source[
                    tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.view.shape))
                ]
            piece.view.copy_(data)
            read += data.numel() * data.element_size()
    return read


class _Whole:
    """A plain module seen as a ParallelModel of one rank holding every tensor whole."""

    def __init__(self, module: nn.Module):
        self.module = module

    def named_parameters(self):
        return self.module.named_parameters()

    def local_modules(self) -> list[nn.Module]:
        return [self.module]


def _model_names(pmodel) -> tuple[dict[str, tuple[int, ...]], dict[str, list[str]], set[str]]:
    """The whole model's tensors to load (every stage's, not only this rank's): single-device shape
    by first name, every name of each (a tied weight's), and the buffers it does not keep in its
    state dict."""
    from hyparallel.runtime.checkpoint import _canonical_names, _entry

    model = pmodel.module
    first = _canonical_names(pmodel)
    aliases: dict[str, list[str]] = {}
    for name, canonical in first.items():
        aliases.setdefault(canonical, []).append(name)
    shapes = {
        name: _entry(pmodel, name, param.detach()).shape for name, param in model.named_parameters()
    }
    state = model.state_dict(keep_vars=True)
    for name, tensor in state.items():
        if not isinstance(tensor, nn.Parameter) and name not in first:
            shapes[name], aliases[name] = tuple(tensor.shape), [name]
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    return shapes, aliases, buffers - set(state)


def _find(name: str, names: list[str], header: dict[str, Any], prefix: str) -> str | None:
    """The file's name for the model's tensor ``name``: any of its ``names``, with or without
    ``prefix``."""
    for candidate in names:
        for key in (
            candidate,
            _strip(candidate, prefix),
            f"{prefix}.{candidate}" if prefix else None,
        ):
            if key is not None and key in header:
                return key
    return None


def _strip(name: str, prefix: str) -> str | None:
    return name[len(prefix) + 1 :] if prefix and name.startswith(prefix + ".") else None


def _harmless(model: nn.Module, key: str, skippable: set[str], prefix: str) -> bool:
    """Note [names in the file that the model lacks]."""
    names = {key, _strip(key, prefix), f"{prefix}.{key}" if prefix else None}
    return bool(names & skippable) or _matches(model, "unexpected", key)


def _matches(model: nn.Module, kind: str, name: str) -> bool:
    """Whether transformers' class declares ``name`` safe to be missing or unexpected (its regex
    lists)."""
    patterns = getattr(model, f"_keys_to_ignore_on_load_{kind}", None) or ()
    return any(re.search(pattern, name) for pattern in patterns)


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of ``path``: itself, a folder's ``model.safetensors``, or the shards of
    its index."""
    kind = files.kind_of(path)
    if kind == "file":
        if path.suffix != ".safetensors":
            raise ConfigError(
                f"{path}: not a .safetensors file; give a Hugging Face folder or a .safetensors"
                " file"
            )
        return [path]
    if kind != "folder":
        raise ConfigError(
            f"{path}: no such file or folder; give a Hugging Face folder or a .safetensors file"
        )
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(
                f"{path / INDEX}: not a safetensors index (no weight_map of names to files)"
            ) from None
        absent = [name for name in names if not (path / name).is_file()]
        if absent:
            raise ConfigError(
                f"{path / INDEX} lists {absent[0]}, which is not in {path}; download every shard"
            )
        return [path / name for name in names]
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    other = (
        " (it has PyTorch .bin weights: save them as safetensors first)"
        if any(path.glob("*.bin"))
        else ""
    )
    raise ConfigError(
        f"{path}: no {SINGLE} or {INDEX}{other}; give a Hugging Face model folder or a .safetensors"
        " file"
    )


def _read_headers(files: list[Path], safe_open) -> dict[str, tuple[Path, list[int]]]:
    """Every tensor's file and shape, from the files' headers alone."""
    header: dict[str, tuple[Path, list[int]]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    header[key] = (file, list(handle.get_slice(key).get_shape()))
        # safetensors' SafetensorError and OSError: a file cut short, not safetensors
        except Exception as exc:
            text = " ".join(str(exc).split())[:200]
            raise ConfigError(f"{file}: not a readable safetensors file ({text})") from None
    return header


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError:
        raise ConfigError(
            "loading pretrained weights needs the safetensors package: pip install safetensors"
        ) from None
    return safe_open


# ---- export: a checkpoint out as a Hugging Face folder -------------------------------------------

# What an export writes: an existing folder holding only these is replaced, any other is refused.
_EXPORT_FILES = re.compile(
    r"(generation_)?config\.json|model\.safetensors\.index\.json|model.*\.safetensors"
)


def hf_spec(model: nn.Module) -> dict[str, Any] | None:
    """What rebuilds a transformers model for export: its class name and whole config (None for
    other models)."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    # The first class transformers exports: FSDP2 (ZeRO >= 1) swaps the model's class for a subclass
    # of its own
    known = next(
        (c for c in type(model).__mro__ if getattr(transformers, c.__name__, None) is c), None
    )
    # remote code (trust_remote_code): no class of transformers' own to rebuild it with
    if known is None:
        return None
    try:
        config = json.loads(model.config.to_json_string(use_diff=False))
    # a config holding what JSON cannot: a save goes on, export will say why
    except (TypeError, ValueError):
        return None
    return {"class": known.__name__, "config": config}


def export_format(out: str | Path, format: ExportFormat) -> Literal["hf", "safetensors", "torch"]:
    """What ``checkpoint export`` writes to ``out``: ``auto`` is a Hugging Face folder for a name
    ending in ``/``, an existing folder or a name without a suffix; ``.safetensors`` one safetensors
    file; else ``torch.save``."""
    if format not in ("auto", "hf", "safetensors", "torch"):
        raise ConfigError(f"export format {format!r}: use auto, hf, safetensors or torch")
    if format != "auto":
        return format
    text = str(out)
    if text.endswith(("/", os.sep)) or files.kind_of(text) == "folder" or not Path(text).suffix:
        return "hf"
    return "safetensors" if Path(text).suffix == ".safetensors" else "torch"


def export_hf(directory: str | Path, out: str | Path, max_shard_size: int | str = "5GB") -> Path:
    """Write the newest checkpoint under ``directory`` of an ``hf:`` model as a Hugging Face folder
    ``out``:
    ``config.json``, safetensors shards of at most ``max_shard_size`` and their index. One process,
    no group."""
    from hyparallel.runtime import checkpoint

    out = _check_folder_output(Path(str(out).rstrip("/" + os.sep) or str(out)))
    _shard_bytes(max_shard_size)
    path = checkpoint.newest_checkpoint(directory)
    marker = checkpoint._read_marker(path)
    spec = marker.get("hf") or _spec_from_name(marker)
    if spec is None:
        name = (marker.get("model") or {}).get("name", "a model")
        raise ConfigError(
            f"{out}: a Hugging Face folder needs an hf: model, and {path} holds {name!r}; "
            "give OUT a .pt or .safetensors name for one state dict"
        )
    state = checkpoint.consolidated(path)
    state.update(
        {alias: state[first] for alias, first in marker.get("tied", {}).items() if first in state}
    )
    model = _rebuild(spec, path)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        text = " ".join(str(exc).split())[:300]
        raise ConfigError(
            f"{path}: does not fit {spec['class']} built from its config: {text}"
        ) from None
    model.tie_weights()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with _quiet_transformers():
            model.save_pretrained(tmp, max_shard_size=max_shard_size)
        _replace_folder(tmp, out)
    except OSError as exc:
        raise ConfigError(
            f"cannot write {out}: {exc.strerror or exc}; check the folder is writable"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_folder_output(out: Path) -> Path:
    """Fail early, in one line, when ``out`` cannot become an export folder; one holding other files
    is kept."""
    kind = files.kind_of(out)
    if files.kind_of(out.parent) != "folder":
        raise ConfigError(f"cannot write {out}: no folder {out.parent}; create it first")
    if kind not in ("missing", "folder"):
        raise ConfigError(
            f"cannot write {out}: it is a file; give a folder name (or --format torch for a file)"
        )
    if kind == "folder":
        stray = [p.name for p in out.iterdir() if not _EXPORT_FILES.fullmatch(p.name)]
        if stray:
            raise ConfigError(
                f"cannot write {out}: it holds {stray[0]}, not an export's file; give a new or"
                " empty folder"
            )
    if not os.access(out.parent, os.W_OK):
        raise ConfigError(f"cannot write {out}: permission denied")
    return out


def _shard_bytes(max_shard_size: int | str) -> int:
    try:
        from transformers.utils.hub import convert_file_size_to_int
    except ImportError:
        raise ConfigError(
            "a Hugging Face folder is written by transformers: pip install transformers"
        ) from None
    try:
        size = convert_file_size_to_int(max_shard_size)
    except (ValueError, TypeError, AttributeError):
        size = 0
    if not isinstance(size, int) or size <= 0:
        raise ConfigError(
            f"max shard size {max_shard_size!r}: give a size such as 5GB, 500MB or a number of"
            " bytes"
        )
    return size


def _spec_from_name(marker: dict[str, Any]) -> dict[str, Any] | None:
    """A checkpoint saved before the marker held the config: the plan's model name, if it is an hf:
    spec."""
    name = (marker.get("model") or {}).get("name") or ""
    if not name.startswith("hf:"):
        return None
    from hyparallel.models import load

    return hf_spec(load(name).module)


def _rebuild(spec: dict[str, Any], path: Path) -> nn.Module:
    """The transformers model of ``spec``, parameters on meta (the checkpoint's tensors are assigned
    to it)."""
    import transformers

    from hyparallel.models import empty_init

    model_cls = getattr(transformers, spec.get("class", ""), None)
    if not (isinstance(model_cls, type) and issubclass(model_cls, transformers.PreTrainedModel)):
        raise ConfigError(
            f"{path}: saved from transformers class {spec.get('class')!r}, which this transformers "
            f"({transformers.__version__}) lacks; install the version that trained it"
        )
    config = model_cls.config_class.from_dict(spec["config"])
    with empty_init():
        return model_cls(config)


def _replace_folder(tmp: Path, out: Path) -> None:
    """Put the finished folder ``tmp`` at ``out``; a previous export there goes only once the new is
    in place."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _quiet_transformers():
    """No progress bar from save_pretrained (the CLI prints one line of its own)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


__all__ = ["PretrainedLoad", "export_format", "export_hf", "hf_spec", "load_pretrained"]
