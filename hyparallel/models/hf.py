"""Hugging Face transformers architectures built from a config (nothing is downloaded)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from hyparallel.models.bounds import check_hf_config
from hyparallel.models.meta import build_on
from hyparallel.spec.errors import ModelSpecError


def build_hf(arch: str, device: torch.device | str = "meta", **overrides) -> nn.Module:
    """Build ``arch`` (a class name such as ``LlamaForCausalLM``, or a model type such as
    ``llama``).

    ``overrides`` are config fields (``num_hidden_layers=4``). The KV cache is turned off
    (``use_cache=False``, for configs that have one), as training and tracing want. The config's
    shape (layers, widths, heads, vocabulary, positions) is checked against hyparallel.spec.limits
    before the model is built.
    """
    try:
        import transformers
    except ImportError:
        raise ModelSpecError(
            "hf: models need the 'transformers' package; pip install transformers"
        ) from None
    model_cls = getattr(transformers, arch, None)
    from_class = isinstance(model_cls, type) and issubclass(model_cls, transformers.PreTrainedModel)
    if not from_class and arch not in transformers.CONFIG_MAPPING:
        raise ModelSpecError(
            f"unknown Hugging Face architecture '{arch}'; give a transformers model class (e.g."
            " hf:LlamaForCausalLM, hf:GPT2LMHeadModel) or a model type (e.g. hf:llama, hf:gpt2)"
        )
    errors = _config_errors()
    config_cls = model_cls.config_class if from_class else transformers.CONFIG_MAPPING[arch]
    if "use_cache" in getattr(config_cls, "__dataclass_fields__", {}) or _has_setting(
        config_cls, "use_cache", errors
    ):
        overrides = {"use_cache": False, **overrides}
    unlisted = _unlisted(config_cls, overrides, errors)
    try:
        config = config_cls(**overrides)
        try:
            check_hf_config(config)
        except ValueError as exc:
            raise ModelSpecError(f"hf:{arch}: {exc}") from None
        unused = [key for key in unlisted if not _consumed(config_cls, overrides, key, errors)]
        with _reads(config_cls) as read:
            model = build_on(
                device,
                lambda: (
                    model_cls(config)
                    if from_class
                    else transformers.AutoModelForCausalLM.from_config(config)
                ),
            )
        unused = [key for key in unused if key not in read]
        known = _settings_of_any_config(transformers) if unused else set()
        if typos := [key for key in unused if key not in known]:
            raise ModelSpecError(
                f"hf:{arch}: no transformers config has a setting {', '.join(map(repr, typos))};"
                f" check the spelling against {config_cls.__name__}'s documentation (transformers"
                " would keep it and ignore it)"
            )
        if unused:
            warnings.warn(
                f"hf:{arch}: {config_cls.__name__} and the model do not read"
                f" {', '.join(map(repr, unused))} (a setting of other transformers configs): it"
                " changes nothing here",
                stacklevel=2,
            )
        return model
    except ModelSpecError:
        raise
    except errors as exc:
        text = " ".join(line.strip() for line in str(exc).splitlines()) or type(exc).__name__
        raise ModelSpecError(
            f"hf:{arch}: cannot build from config {overrides}: {text[:200]}"
        ) from None


# Note [a config key judged by its use]
#     transformers keeps a key its config does not know as a plain attribute, silently: a typo
#     (``num_hiden_layers=4``) would build the default model. But a key the default config lacks is
#     not always a typo: the config may fold it into another setting (``partial_rotary_factor`` into
#     transformers 5's ``rope_parameters``), or the model may read it with ``getattr(config, key,
#     default)`` (CodeGen's ``pad_token_id``, OPT's ``activation_dropout`` in older releases), or it
#     may be a setting every published config.json of the family carries that this release no longer
#     reads. So an override the default config lacks is taken when building the config without it
#     changes anything else or building the model reads it; else it is taken with a warning when
#     some transformers config has that setting, and refused as a typo when none has.


def _unlisted(
    config_cls: type, overrides: dict, errors: tuple[type[BaseException], ...]
) -> list[str]:
    """The overrides the default config has no setting for (Note [a config key judged by its
    use])."""
    try:
        default = config_cls()
    except errors:
        return []  # a config that needs arguments: nothing to compare with
    aliases = getattr(config_cls, "attribute_map", {}) or {}
    return [
        key
        for key in overrides
        if key not in aliases and not hasattr(default, key) and not hasattr(default, f"_{key}")
    ]


def _consumed(
    config_cls: type, overrides: dict, key: str, errors: tuple[type[BaseException], ...]
) -> bool:
    """Whether the config built with ``key`` differs from the one built without it in anything but
    ``key``."""
    try:
        with_key = config_cls(**overrides).to_dict()
        without = config_cls(**{k: v for k, v in overrides.items() if k != key}).to_dict()
    except errors:
        return True  # the key changes what the config accepts: it is read
    with_key.pop(key, None)
    return with_key != without


@functools.cache
def _settings_of_any_config(transformers) -> frozenset[str]:
    """Every setting some transformers config declares (its dataclass fields, or its __init__'s
    parameters in releases before configs were dataclasses) and every alias: a key outside it is a
    typo. Imports every config module (seconds): asked only for an override neither its config nor
    its model reads."""
    names: set[str] = set()
    for model_type in list(transformers.CONFIG_MAPPING.keys()):
        try:
            config_cls = transformers.CONFIG_MAPPING[model_type]
        except Exception:  # noqa: BLE001 -- a config module that does not import here names nothing
            continue
        names |= set(getattr(config_cls, "__dataclass_fields__", {}))
        names |= set(getattr(config_cls, "attribute_map", {}) or {})
        with contextlib.suppress(TypeError, ValueError):
            names |= set(inspect.signature(config_cls.__init__).parameters)
    return frozenset(names - {"self", "kwargs"})


@contextlib.contextmanager
def _reads(config_cls: type) -> Iterator[set[str]]:
    """The attribute names read from instances of ``config_cls`` inside the block."""
    read: set[str] = set()
    own = config_cls.__dict__.get("__getattribute__")
    inherited = config_cls.__getattribute__

    def recording(self, name: str):
        read.add(name)
        return inherited(self, name)

    config_cls.__getattribute__ = recording
    try:
        yield read
    finally:
        if own is not None:
            config_cls.__getattribute__ = own
        else:
            del config_cls.__getattribute__


def _has_setting(config_cls: type, key: str, errors: tuple[type[BaseException], ...]) -> bool:
    try:
        return hasattr(config_cls(), key)
    except errors:
        # a config that needs arguments: the setting is passed and transformers judges it
        return True


def _config_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises for a config it refuses: its own checks use asserts, its configs
    divide by head counts, and recent versions validate fields as strict dataclasses
    (huggingface_hub)."""
    errors: tuple[type[BaseException], ...] = (
        TypeError,
        ValueError,
        AttributeError,
        AssertionError,
        ZeroDivisionError,
    )
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return errors
    return (*errors, StrictDataclassError)
