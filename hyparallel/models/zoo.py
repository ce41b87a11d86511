"""The built-in model zoo: named presets of the GPT and Llama families."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from hyparallel.errors import ModelSpecError
from hyparallel.models.gpt import GPT, GPTConfig
from hyparallel.models.llama import Llama, LlamaConfig
from hyparallel.models.meta import build_on

ModelConfig = GPTConfig | LlamaConfig

# GPT-3 shapes from Brown et al. 2020, Table 2.1 (context 2048). Where the table's head count does not
# divide d_model (XL: 24 heads of 128 for d_model 2048; 13B: d_model 5140) we use the shapes Megatron-LM
# and later replications train: 16 heads for 1.3B, d_model 5120 for 13B.
# gpt-1t: the 1T-parameter configuration of Narayanan et al. 2021 (Megatron-LM), Table 1.
# Llama shapes from Touvron et al. 2023 (Llama 2; 70B uses grouped-query attention with 8 KV heads).
PRESETS: dict[str, ModelConfig] = {
    "gpt-tiny": GPTConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=256, max_seq_len=128),
    "gpt-mini": GPTConfig(num_layers=4, hidden_size=128, num_heads=8, vocab_size=512, max_seq_len=256),
    "gpt-125m": GPTConfig(num_layers=12, hidden_size=768, num_heads=12),
    "gpt-350m": GPTConfig(num_layers=24, hidden_size=1024, num_heads=16),
    "gpt-760m": GPTConfig(num_layers=24, hidden_size=1536, num_heads=16),
    "gpt-1.3b": GPTConfig(num_layers=24, hidden_size=2048, num_heads=16),
    "gpt-2.7b": GPTConfig(num_layers=32, hidden_size=2560, num_heads=32),
    "gpt-6.7b": GPTConfig(num_layers=32, hidden_size=4096, num_heads=32),
    "gpt-13b": GPTConfig(num_layers=40, hidden_size=5120, num_heads=40),
    "gpt-175b": GPTConfig(num_layers=96, hidden_size=12288, num_heads=96),
    "gpt-1t": GPTConfig(num_layers=128, hidden_size=25600, num_heads=160),
    "llama-tiny": LlamaConfig(
        num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=160, vocab_size=256, max_seq_len=128
    ),
    "llama-7b": LlamaConfig(num_layers=32, hidden_size=4096, num_heads=32, ffn_hidden_size=11008),
    "llama-13b": LlamaConfig(num_layers=40, hidden_size=5120, num_heads=40, ffn_hidden_size=13824),
    "llama-70b": LlamaConfig(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672),
}


@dataclass(frozen=True)
class ZooEntry:
    """One row of ``hyparallel models``."""

    name: str
    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    kv_heads: int
    vocab_size: int
    num_params: int


def names() -> list[str]:
    """Names accepted by :func:`build` and ``--model``."""
    return list(PRESETS)


def config(name: str, **overrides) -> ModelConfig:
    """The preset's config dataclass, with fields replaced by ``overrides``."""
    if name not in PRESETS:
        raise ModelSpecError(f"unknown model '{name}'; run `hyparallel models` for the built-in names")
    base = PRESETS[name]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ModelSpecError(
            f"model '{name}' has no setting {', '.join(map(repr, unknown))}; settings: {', '.join(sorted(fields))}"
        )
    try:
        return dataclasses.replace(base, **overrides)
    except (TypeError, ValueError) as exc:
        raise ModelSpecError(f"model '{name}': {exc}") from None


def build(name: str, device: torch.device | str = "meta", **overrides) -> nn.Module:
    """Build a zoo model; on ``device="meta"`` (the default) it allocates no memory, even at 175B."""
    cfg = config(name, **overrides)
    cls = GPT if isinstance(cfg, GPTConfig) else Llama
    return build_on(device, lambda: cls(cfg))


def entries() -> list[ZooEntry]:
    """One :class:`ZooEntry` per preset, with closed-form parameter counts."""
    rows = []
    for name, cfg in PRESETS.items():
        is_gpt = isinstance(cfg, GPTConfig)
        rows.append(
            ZooEntry(
                name=name,
                family="gpt" if is_gpt else "llama",
                num_layers=cfg.num_layers,
                hidden_size=cfg.hidden_size,
                num_heads=cfg.num_heads,
                kv_heads=cfg.num_heads if is_gpt else cfg.kv_heads,
                vocab_size=cfg.vocab_size,
                num_params=cfg.num_params(),
            )
        )
    return rows
