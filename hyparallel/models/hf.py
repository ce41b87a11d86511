"""Hugging Face transformers architectures built from a config (nothing is downloaded)."""

from __future__ import annotations

import torch
from torch import nn

from hyparallel.errors import ModelSpecError
from hyparallel.models.bounds import check_hf_config
from hyparallel.models.meta import build_on


def build_hf(arch: str, device: torch.device | str = "meta", **overrides) -> nn.Module:
    """Build ``arch`` (a class name such as ``LlamaForCausalLM``, or a model type such as ``llama``).

    ``overrides`` are config fields (``num_hidden_layers=4``). The KV cache is turned off (``use_cache=False``,
    for configs that have one), as training and tracing want. The config's shape (layers, widths, heads,
    vocabulary, positions) is checked against hyparallel.limits before the model is built.
    """
    try:
        import transformers
    except ImportError:
        raise ModelSpecError("hf: models need the 'transformers' package; pip install transformers") from None
    model_cls = getattr(transformers, arch, None)
    from_class = isinstance(model_cls, type) and issubclass(model_cls, transformers.PreTrainedModel)
    if not from_class and arch not in transformers.CONFIG_MAPPING:
        raise ModelSpecError(
            f"unknown Hugging Face architecture '{arch}'; give a transformers model class "
            "(e.g. hf:LlamaForCausalLM, hf:GPT2LMHeadModel) or a model type (e.g. hf:llama, hf:gpt2)"
        )
    errors = _config_errors()
    config_cls = model_cls.config_class if from_class else transformers.CONFIG_MAPPING[arch]
    if "use_cache" in getattr(config_cls, "__dataclass_fields__", {}) or _has_setting(config_cls, "use_cache", errors):
        overrides = {"use_cache": False, **overrides}
    _check_known(arch, config_cls, overrides, errors)
    try:
        config = config_cls(**overrides)
        try:
            check_hf_config(config)
        except ValueError as exc:
            raise ModelSpecError(f"hf:{arch}: {exc}") from None
        return build_on(
            device, lambda: model_cls(config) if from_class else transformers.AutoModelForCausalLM.from_config(config)
        )
    except ModelSpecError:
        raise
    except errors as exc:
        text = " ".join(line.strip() for line in str(exc).splitlines()) or type(exc).__name__
        raise ModelSpecError(f"hf:{arch}: cannot build from config {overrides}: {text[:200]}") from None


def _check_known(arch: str, config_cls: type, overrides: dict, errors: tuple[type[BaseException], ...]) -> None:
    """Refuse an override the config does not have: transformers keeps unknown keys silently, so a typo
    (``num_hiden_layers=4``) would build the default model."""
    try:
        default = config_cls()
    except errors:
        return  # a config that needs arguments: nothing to compare with
    aliases = getattr(config_cls, "attribute_map", {}) or {}
    unknown = [
        key for key in overrides if key not in aliases and not hasattr(default, key) and not hasattr(default, f"_{key}")
    ]
    if unknown:
        raise ModelSpecError(
            f"hf:{arch}: {config_cls.__name__} has no setting {', '.join(map(repr, unknown))}; "
            "check the spelling against its documentation (transformers would ignore it)"
        )


def _has_setting(config_cls: type, key: str, errors: tuple[type[BaseException], ...]) -> bool:
    try:
        return hasattr(config_cls(), key)
    except errors:
        return True  # a config that needs arguments: the setting is passed and transformers judges it


def _config_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises for a config it refuses: its own checks use asserts, its configs divide by head
    counts, and recent versions validate fields as strict dataclasses (huggingface_hub)."""
    errors: tuple[type[BaseException], ...] = (TypeError, ValueError, AttributeError, AssertionError, ZeroDivisionError)
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return errors
    return (*errors, StrictDataclassError)
