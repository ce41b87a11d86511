"""Hugging Face transformers architectures built from a config (nothing is downloaded)."""

from __future__ import annotations

import torch
from torch import nn

from hyparallel.errors import ModelSpecError


def build_hf(arch: str, device: torch.device | str = "meta", **overrides) -> nn.Module:
    """Build ``arch`` (a class name such as ``LlamaForCausalLM``, or a model type such as ``llama``).

    ``overrides`` are config fields (``num_hidden_layers=4``). The KV cache is turned off
    (``use_cache=False``), as training and tracing want.
    """
    try:
        import transformers
    except ImportError:
        raise ModelSpecError("hf: models need the 'transformers' package; pip install transformers") from None
    overrides = {"use_cache": False, **overrides}
    model_cls = getattr(transformers, arch, None)
    try:
        if isinstance(model_cls, type) and issubclass(model_cls, transformers.PreTrainedModel):
            config = model_cls.config_class(**overrides)
            with torch.device(device):
                return model_cls(config)
        try:
            config = transformers.AutoConfig.for_model(arch, **overrides)
        except ValueError:
            raise ModelSpecError(
                f"unknown Hugging Face architecture '{arch}'; give a transformers model class "
                "(e.g. hf:LlamaForCausalLM, hf:GPT2LMHeadModel) or a model type (e.g. hf:llama, hf:gpt2)"
            ) from None
        with torch.device(device):
            return transformers.AutoModelForCausalLM.from_config(config)
    except ModelSpecError:
        raise
    except (TypeError, ValueError, AttributeError, AssertionError) as exc:  # transformers checks configs with asserts too
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelSpecError(f"hf:{arch}: cannot build from config {overrides}: {first}") from None
