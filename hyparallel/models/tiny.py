"""A small copy of a Hugging Face architecture: its own config class, shrunk, its structure kept.

``tiny_overrides(config_cls)`` returns the config fields that make a model of a few hundred thousand
parameters out of any config class: 2 layers, width 64, 4 query heads of 16, a vocabulary of 128, 64
positions, 4 experts of which 2 are routed (in every layer). What makes the architecture what it is
stays: multi-query stays multi-query (one key/value head), grouped-query stays grouped (2 key/value
heads for 4 query heads), tied or untied embeddings, biases, partial rotary (the rotary share of a
head kept), the layer pattern (recomputed by the config from the new depth). Dropout is switched off
(a parity check compares two runs draw for draw, which no other layout reproduces). Sub-configs
(``text_config``, ``vision_config``, ...) are shrunk the same way.

A field is recognised by its name (the names transformers' configs use, across families); what the
heuristics do not know is left at its default. ``hyparallel check`` and the sweep
(benchmarks/sweep.py) build from these.
"""

from __future__ import annotations

from typing import Any

LAYERS, HIDDEN, HEADS, HEAD_DIM, FFN, VOCAB, POSITIONS = 2, 64, 4, 16, 128, 128, 64
EXPERTS, EXPERTS_PER_TOKEN, EXPERT_FFN = 4, 2, 32

_LAYERS = {
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "n_layers",
    "num_decoder_layers",
    "decoder_layers",
    "encoder_layers",
    "num_encoder_layers",
    "n_layers_per_block",
}
_HIDDEN = {
    "hidden_size",
    "n_embd",
    "d_model",
    "n_embed",
    "embed_dim",
    "dim",
    "model_dim",
    "d_embed",
}
_HEADS = {
    "num_attention_heads",
    "n_head",
    "num_heads",
    "n_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
}
_KV_HEADS = {
    "num_key_value_heads",
    "n_kv_heads",
    "num_kv_heads",
    "multi_query_group_num",
    "n_head_kv",
}
_HEAD_DIM = {"head_dim", "attention_head_dim", "d_head", "d_kv", "kv_channels", "v_head_dim"}
_FFN = {
    "intermediate_size",
    "n_inner",
    "ffn_dim",
    "d_ff",
    "ffn_hidden_size",
    "decoder_ffn_dim",
    "encoder_ffn_dim",
    "dim_ff",
    "inner_hidden_size",
    "mlp_dim",
}
_EXPERT_FFN = {
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "expert_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "ffn_hidden_size_moe",
}
_EXPERTS = {
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_routed_experts",
}
_EXPERTS_PER_TOKEN = {"num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k", "moe_k"}
_POSITIONS = {
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "max_seq_len",
    "max_sequence_length",
}
_TOKEN_IDS = {
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "decoder_start_token_id",
    "sep_token_id",
    "cls_token_id",
    "mask_token_id",
    "unk_token_id",
    "forced_bos_token_id",
    "forced_eos_token_id",
}
_LORA = {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8}
# Dense layers before the first mixture of experts (DeepSeek-V3's 3 of 61): none in a small copy,
# both of its layers route. With 3 it had no MoE layer at all; with 1 its two layers differ, and a
# layer repeating no other is no block to split or cut between (a real model's 3 dense and 58 MoE
# layers each repeat). The dense MLP's class stays as the shared experts.
_DENSE_PREFIX = {"first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"}
# Group-limited routing (DeepSeek-V3: 8 groups of experts, the top 4 groups): groups of 2 of the
# EXPERTS experts, the top 1 group, so that top-EXPERTS_PER_TOKEN fits in the chosen groups
_EXPERT_GROUPS = {"n_group", "num_expert_group"}
_TOP_GROUPS = {"topk_group"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tiny_overrides(config_cls: type, **keep: Any) -> dict[str, Any]:
    """Config fields that shrink ``config_cls``'s default model (see the module docstring); ``keep``
    wins."""
    from transformers import PretrainedConfig

    default = config_cls()
    fields = default.to_dict()
    out: dict[str, Any] = {}
    heads = next((fields[k] for k in _HEADS if _is_int(fields.get(k))), None)
    for key, value in fields.items():
        if key in keep:
            continue
        if isinstance(value, dict) and isinstance(getattr(default, key, None), PretrainedConfig):
            # text_config, vision_config: shrunk the same way
            sub = tiny_overrides(type(getattr(default, key)))
            if sub:  # only what changes: the sub-config class fills in its own defaults
                out[key] = sub
            continue
        shrunk = _shrink(key, value, heads, fields)
        if shrunk is not None and shrunk != value:
            out[key] = shrunk
    return {**out, **keep}


def _shrink(key: str, value: Any, heads: int | None, fields: dict[str, Any]) -> Any:
    lowered = key.lower()
    if isinstance(value, float) and (
        "dropout" in lowered or "pdrop" in lowered or "drop_rate" in lowered
    ):
        return 0.0
    if "layerdrop" in lowered and isinstance(value, float):
        return 0.0
    if key in _TOKEN_IDS:
        if _is_int(value) and value >= VOCAB:
            return VOCAB - 1
        if isinstance(value, list) and value and all(_is_int(v) for v in value):
            return [v if v < VOCAB else VOCAB - 1 for v in value]
        return None
    if (
        isinstance(value, list)
        and value
        and all(_is_int(v) for v in value)
        and key in _FFN | _EXPERT_FFN
    ):
        # per-layer widths, one per layer kept
        return [_shrink(key, v, heads, fields) for v in value[:LAYERS]]
    if not _is_int(value):
        return None
    if key in _LAYERS:
        return min(value, LAYERS)
    if key in _HIDDEN:
        return HIDDEN
    if key in _HEADS:
        return HEADS
    if key in _KV_HEADS:
        if heads is None or value >= heads:
            return HEADS
        return 1 if value == 1 else 2  # multi-query stays multi-query, grouped-query stays grouped
    if key == "head_dim" and _is_int(fields.get("qk_rope_head_dim")):
        return _LORA["qk_rope_head_dim"]  # multi-head latent attention: the rotary part of a head
    if key in _HEAD_DIM:
        return HEAD_DIM
    if key in _FFN:
        return FFN
    if key in _EXPERT_FFN:
        return EXPERT_FFN
    if key in _EXPERTS:
        return EXPERTS if value > 1 else value
    if key in _EXPERTS_PER_TOKEN:
        return min(value, EXPERTS_PER_TOKEN)
    if key in _DENSE_PREFIX:
        return 0
    if key in _EXPERT_GROUPS:
        return min(value, EXPERTS // EXPERTS_PER_TOKEN)
    if key in _TOP_GROUPS:
        return 1
    if key in _POSITIONS:
        return POSITIONS
    # per-layer input vocabularies too (Gemma 3n, 4)
    if key == "vocab_size" or key.startswith("vocab_size_"):
        return VOCAB
    # side tables: Luke's 500k entities shrunk, BERT's 2 token types kept
    if key.endswith("_vocab_size"):
        return min(value, VOCAB)
    if key in _LORA:
        return _LORA[key]
    if key == "rotary_dim" and heads:  # partial rotary: the same share of a smaller head
        hidden = next((fields[k] for k in _HIDDEN if _is_int(fields.get(k))), None)
        if hidden:
            share = value / (hidden // heads)
            return max(2, int(share * HEAD_DIM) // 2 * 2)
    return None
