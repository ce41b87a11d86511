"""The built-in model zoo: named presets of the GPT, Llama and DLRM families, and mixtures of
experts as transformers builds them (``HF_PRESETS``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from hyparallel.models.dlrm import DLRM, DLRMConfig
from hyparallel.models.gpt import GPT, GPTConfig
from hyparallel.models.llama import Llama, LlamaConfig
from hyparallel.models.meta import build_on
from hyparallel.spec.errors import ModelSpecError

ModelConfig = GPTConfig | LlamaConfig | DLRMConfig
_MODEL_CLASS: dict[type, type[nn.Module]] = {GPTConfig: GPT, LlamaConfig: Llama, DLRMConfig: DLRM}

# GPT-3 shapes from Brown et al. 2020, Table 2.1 (context 2048). Where the table's head count does
# not divide d_model (XL: 24 heads of 128 for d_model 2048; 13B: d_model 5140) we use the shapes
# Megatron-LM and later replications train: 16 heads for 1.3B, d_model 5120 for 13B.
# gpt-1t: the 1T-parameter configuration of Narayanan et al. 2021 (Megatron-LM), Table 1.
# Llama shapes from Touvron et al. 2023 (Llama 2; 70B uses grouped-query attention with 8 KV heads).
# dlrm-tiny trains in seconds on a CPU (tests/test_dlrm.py); dlrm-mid (12.4M parameters, 386K rows)
# is a CPU benchmark's size. dlrm-criteo-tb is MLPerf Training's DLRM on Criteo Terabyte (the
# reference's --arch-mlp-bot=13-512-256-128 --arch-mlp-top=1024-1024-512-256-1
# --arch-sparse-feature-size=128, one id per feature): its table sizes are the day_fea_count of the
# 24 days with --max-ind-range=40000000 (github.com/ mlcommons/training, recommendation/dlrm;
# facebookresearch/dlrm's data_utils.py hashes each feature's ids into at most that many rows).
# 187.8M rows x 128 x 4 bytes = 96 GB of fp32 tables: build it on meta only.
CRITEO_TB_ROWS = (
    39884406,
    39043,
    17289,
    7420,
    20263,
    3,
    7120,
    1543,
    63,
    38532951,
    2953546,
    403346,
    10,
    2208,
    11938,
    155,
    4,
    976,
    14,
    39979771,
    25641295,
    39664984,
    585935,
    12972,
    108,
    36,
)
PRESETS: dict[str, ModelConfig] = {
    "gpt-tiny": GPTConfig(
        num_layers=2, hidden_size=64, num_heads=4, vocab_size=256, max_seq_len=128
    ),
    "gpt-mini": GPTConfig(
        num_layers=4, hidden_size=128, num_heads=8, vocab_size=512, max_seq_len=256
    ),
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
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=160,
        vocab_size=256,
        max_seq_len=128,
    ),
    "llama-7b": LlamaConfig(num_layers=32, hidden_size=4096, num_heads=32, ffn_hidden_size=11008),
    "llama-13b": LlamaConfig(num_layers=40, hidden_size=5120, num_heads=40, ffn_hidden_size=13824),
    "llama-70b": LlamaConfig(
        num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672
    ),
    # Llama 3.1 8B (Grattafiori et al. 2024): grouped-query attention, a 128K vocabulary and context
    "llama3-8b": LlamaConfig(
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        ffn_hidden_size=14336,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
    ),
    "dlrm-tiny": DLRMConfig(
        num_dense=4, table_rows=(200, 100, 50, 30), dim=8, bottom=(16,), top=(16,), bag=2
    ),
    "dlrm-mid": DLRMConfig(
        num_dense=13,
        table_rows=(200_000, 100_000, 50_000, 20_000, 10_000, 5_000, 1_000, 100),
        dim=32,
        bottom=(64,),
        top=(64, 32),
        bag=4,
    ),
    "dlrm-criteo-tb": DLRMConfig(
        num_dense=13,
        table_rows=CRITEO_TB_ROWS,
        dim=128,
        bottom=(512, 256),
        top=(1024, 1024, 512, 256),
        bag=1,
    ),
}


# Note [a DLRM in the zoo's table]
#     ``hyparallel models`` has a transformer's columns. A DLRM row reads them as: layers, its
#     Linear layers (bottom and top MLPs); hidden, the embedding dim; heads 0 (it has no attention);
#     vocab, the rows of all its embedding tables together (what a vocabulary is to a language
#     model: rows looked up by id).
@dataclass(frozen=True)
class ZooEntry:
    """One row of ``hyparallel models`` (a DLRM's: Note [a DLRM in the zoo's table])."""

    name: str
    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    kv_heads: int
    vocab_size: int
    num_params: int


@dataclass(frozen=True)
class HFPreset:
    """A published model's shape as a transformers config: ``hf:<arch>`` with these settings."""

    arch: str
    settings: dict
    num_params: int  # what the meta build counts (tests/test_models.py checks it)


# Mixtures of experts for planning (issue 38), as their model cards and papers give them:
# Mixtral 8x7B (Jiang et al. 2024; mistralai/Mixtral-8x7B-v0.1's config.json): 8 experts, top-2.
# DeepSeek-V3 (DeepSeek-AI 2024, Table/config.json of deepseek-ai/DeepSeek-V3): 61 layers, the first
# 3 dense, 256 routed experts and 1 shared, top-8 in 4 of 8 groups, multi-head latent attention;
# 671B parameters without its multi-token-prediction module.
HF_PRESETS: dict[str, HFPreset] = {
    "mixtral-8x7b": HFPreset(
        "MixtralForCausalLM",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=32768,
        ),
        46_702_792_704,
    ),
    "deepseek-v3": HFPreset(
        "DeepseekV3ForCausalLM",
        dict(
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            first_k_dense_replace=3,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            kv_lora_rank=512,
            q_lora_rank=1536,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            max_position_embeddings=163840,
        ),
        671_026_404_352,
    ),
}


def names() -> list[str]:
    """Names accepted by :func:`build` and ``--model``."""
    return [*PRESETS, *HF_PRESETS]


def config(name: str, **overrides) -> ModelConfig:
    """The preset's config dataclass, with fields replaced by ``overrides``."""
    if name not in PRESETS:
        raise ModelSpecError(
            f"unknown model '{name}'; run `hyparallel models` for the built-in names"
        )
    base = PRESETS[name]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ModelSpecError(
            f"model '{name}' has no setting {', '.join(map(repr, unknown))}; settings:"
            f" {', '.join(sorted(fields))}"
        )
    try:
        return dataclasses.replace(base, **overrides)
    except (TypeError, ValueError) as exc:
        raise ModelSpecError(f"model '{name}': {exc}") from None


def build(name: str, device: torch.device | str = "meta", **overrides) -> nn.Module:
    """Build a zoo model; on ``device="meta"`` (the default) it allocates no memory, even at
    175B."""
    if name in HF_PRESETS:
        from hyparallel.models.hf import build_hf

        preset = HF_PRESETS[name]
        return build_hf(preset.arch, device=device, **{**preset.settings, **overrides})
    cfg = config(name, **overrides)
    cls = _MODEL_CLASS[type(cfg)]
    return build_on(device, lambda: cls(cfg))


def entries() -> list[ZooEntry]:
    """One :class:`ZooEntry` per preset, with closed-form parameter counts."""
    return [_entry(name, cfg) for name, cfg in PRESETS.items()] + [
        _hf_entry(name, preset) for name, preset in HF_PRESETS.items()
    ]


def _hf_entry(name: str, preset: HFPreset) -> ZooEntry:
    s = preset.settings
    return ZooEntry(
        name=name,
        family=preset.arch.removesuffix("ForCausalLM").lower() + " (moe)",
        num_layers=s["num_hidden_layers"],
        hidden_size=s["hidden_size"],
        num_heads=s["num_attention_heads"],
        kv_heads=s["num_key_value_heads"],
        vocab_size=s["vocab_size"],
        num_params=preset.num_params,
    )


def _entry(name: str, cfg: ModelConfig) -> ZooEntry:
    if isinstance(cfg, DLRMConfig):  # Note [a DLRM in the zoo's table]
        bottom, top = cfg.mlp_widths()
        return ZooEntry(
            name=name,
            family="dlrm",
            num_layers=len(bottom) - 1 + len(top) - 1,
            hidden_size=cfg.dim,
            num_heads=0,
            kv_heads=0,
            vocab_size=sum(cfg.table_rows),
            num_params=cfg.num_params(),
        )
    is_gpt = isinstance(cfg, GPTConfig)
    return ZooEntry(
        name=name,
        family="gpt" if is_gpt else "llama",
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        kv_heads=cfg.num_heads if is_gpt else cfg.kv_heads,
        vocab_size=cfg.vocab_size,
        num_params=cfg.num_params(),
    )
