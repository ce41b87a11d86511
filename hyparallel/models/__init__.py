"""Models: the built-in zoo (GPT, Llama, DLRM), Hugging Face architectures from a config, and user
factories.

``build(name)`` builds a zoo model (on the meta device by default); ``load(spec)`` resolves any
MODEL spec the CLI accepts: a zoo name, ``package.module:factory`` or ``hf:ARCH``, each optionally
followed by ``key=value`` overrides.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import yaml
from torch import nn

from hyparallel.models.dlrm import DLRM, DLRMConfig, batch_for, bce_loss, synthetic_clicks
from hyparallel.models.gpt import GPT, GPTConfig
from hyparallel.models.hf import build_hf
from hyparallel.models.llama import Llama, LlamaConfig
from hyparallel.models.meta import build_on, empty_init
from hyparallel.models.zoo import ZooEntry, build, config, entries, names
from hyparallel.spec.errors import ModelSpecError
from hyparallel.spec.yaml_io import load_yaml_text

__all__ = [
    "DLRM",
    "DLRMConfig",
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "ZooEntry",
    "LoadedModel",
    "build",
    "build_hf",
    "build_on",
    "empty_init",
    "config",
    "entries",
    "names",
    "load",
    "load_callable",
    "example_inputs",
    "fingerprint",
    "batch_for",
    "bce_loss",
    "synthetic_clicks",
]


@dataclass
class LoadedModel:
    """A model resolved from a spec, with the name plans record for it."""

    name: str
    module: nn.Module


def load(spec: str | Sequence[str], device: torch.device | str = "meta") -> LoadedModel:
    """Resolve a MODEL spec: ``gpt-175b``, ``mypkg.models:make_model``, ``hf:LlamaForCausalLM
    num_hidden_layers=4``.

    The spec may be one string (words separated by spaces) or a list of words; every word after
    the first is a ``key=value`` override, its value read as YAML (``4`` is an int, ``true`` a
    bool).
    """
    try:
        words = (
            shlex.split(spec)
            if isinstance(spec, str)
            else [w for part in spec for w in shlex.split(part)]
        )
    except ValueError as exc:  # an unclosed quote
        raise ModelSpecError(
            f"model spec {spec!r:.80}: {exc}; quote each key=value whole"
        ) from None
    if not words:
        raise ModelSpecError(
            "no model given; pass a name from `hyparallel models`, package.module:factory or"
            " hf:ARCH"
        )
    head, overrides = words[0], _parse_overrides(words[1:])
    suffix = "".join(f" {w}" for w in words[1:])
    if head in names():
        return LoadedModel(head + suffix, build(head, device=device, **overrides))
    if head.startswith("hf:"):
        return LoadedModel(head + suffix, build_hf(head[3:], device=device, **overrides))
    if ":" in head:
        return LoadedModel(head + suffix, _from_factory(head, device, overrides))
    raise ModelSpecError(
        f"unknown model '{head}'; run `hyparallel models` for built-in names, or pass"
        " package.module:factory or hf:ARCH"
    )


def _parse_overrides(words: Sequence[str]) -> dict[str, Any]:
    overrides = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep or not key.isidentifier():
            raise ModelSpecError(f"model override '{word}' is not key=value (e.g. num_layers=4)")
        # JSON first: YAML 1.1 reads {"a":1} (no space after the colon) as a key "a:1"
        if value[:1] in "{[":
            try:
                overrides[key] = json.loads(value)
                continue
            except ValueError:
                pass
        try:
            overrides[key] = load_yaml_text(value)
        except yaml.YAMLError:  # not YAML (or nested too deep, a huge number...): the text itself
            overrides[key] = value
    return overrides


def _from_factory(spec: str, device: torch.device | str, overrides: dict[str, Any]) -> nn.Module:
    factory = load_callable(spec, "model factory")
    _check_call(spec, factory, overrides)
    model = build_on(device, lambda: factory(**overrides))
    if not isinstance(model, nn.Module):
        raise ModelSpecError(
            f"model factory '{spec}' returned {type(model).__name__}, expected a torch.nn.Module"
        )
    return model


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """The callable a ``package.module:name`` spec names; ``what`` (e.g. "model factory") words the
    errors."""
    module_name, colon, attr = spec.partition(":")
    if not (colon and module_name and attr):
        raise ModelSpecError(
            f"{what} '{spec}' is not package.module:name (e.g. mypkg.models:make_model)"
        )
    try:
        module = importlib.import_module(module_name)
    # ValueError, TypeError: an empty or relative module name
    except (ImportError, ValueError, TypeError) as exc:
        raise ModelSpecError(f"{what} '{spec}': cannot import '{module_name}': {exc}") from None
    found = getattr(module, attr, None)
    if not callable(found):
        raise ModelSpecError(f"{what} '{spec}': '{module_name}' has no callable '{attr}'")
    return found


def _check_call(spec: str, factory: Any, overrides: dict[str, Any]) -> None:
    """Refuse overrides the factory's signature does not take (before calling it, so nothing
    runs)."""
    try:
        signature = inspect.signature(factory)
    # no signature to check (some builtins): the call itself will say
    except (TypeError, ValueError):
        return
    try:
        signature.bind(**overrides)
    except TypeError as exc:
        raise ModelSpecError(
            f"model factory '{spec}' cannot be called with {overrides or 'no arguments'}: {exc}; "
            "pass key=value for each of its parameters"
        ) from None


def example_inputs(
    model: nn.Module, batch_size: int, seq_len: int, device: torch.device | str = "meta"
) -> Any:
    """Inputs of the given batch and sequence length for tracing ``model``.

    Uses ``model.example_inputs(batch_size, seq_len, device)`` when the model defines it (the zoo
    does), token ids under ``model.main_input_name`` for Hugging Face models (and
    ``decoder_input_ids`` of the same shape for an encoder-decoder such as T5, whose decoder needs
    them); for anything else the caller passes its own (``hp.plan(..., example_inputs=)``) or the
    model defines that method. A zoo model refuses a ``seq_len`` past its position table
    (``max_seq_len``).
    """
    limit = getattr(getattr(model, "config", None), "max_seq_len", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ModelSpecError(
            f"seq_len {seq_len} is longer than the model's max_seq_len ({limit}); pass a shorter "
            f"--seq-len, or build the model with max_seq_len={seq_len}"
        )
    if callable(getattr(model, "example_inputs", None)):
        return model.example_inputs(batch_size, seq_len, device)
    main_input = getattr(model, "main_input_name", None)
    config = getattr(model, "config", None)
    inputs = _hf_main_input(main_input, config, batch_size, seq_len, device)
    if inputs is not None:
        # T5, BART, Whisper: the decoder's tokens too
        if getattr(config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = torch.zeros(
                batch_size, seq_len, dtype=torch.long, device=device
            )
        return inputs
    raise ModelSpecError(
        f"cannot tell what inputs {type(model).__name__} takes; pass example_inputs= (one"
        " micro-batch: a tensor, a tuple of args or a dict of kwargs; `hyparallel plan"
        " --example-inputs package.module:make_inputs`), or give the model a method"
        " example_inputs(batch_size, seq_len, device) returning them"
    )


def fingerprint(model: nn.Module) -> str:
    """A short hash of the parameter names and shapes: plans refuse a model whose fingerprint
    differs."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)};".encode())
    return "sha256:" + digest.hexdigest()[:16]


def _hf_main_input(
    name: str | None, config: Any, batch_size: int, seq_len: int, device
) -> dict | None:
    """A Hugging Face model's main input by its ``main_input_name``: token ids (batch, seq_len),
    images (batch, num_channels, image_size, image_size) or log-mel features (batch, num_mel_bins, 2
    x max_source_positions, Whisper's); None for another input or a config without those sizes."""
    if name == "input_ids":
        return {name: torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)}
    sizes = getattr(config, "vision_config", None) or config  # a vision tower's own config (CLIP's)
    if name == "pixel_values" and isinstance(
        getattr(sizes, "image_size", None), (int, list, tuple)
    ):
        side = sizes.image_size
        height, width = (side, side) if isinstance(side, int) else tuple(side)[:2]
        channels = getattr(sizes, "num_channels", 3)
        return {name: torch.zeros(batch_size, channels, height, width, device=device)}
    if name == "input_features" and all(
        hasattr(config, a) for a in ("num_mel_bins", "max_source_positions")
    ):
        frames = 2 * config.max_source_positions  # the encoder's two convolutions halve them once
        return {name: torch.zeros(batch_size, config.num_mel_bins, frames, device=device)}
    return None
