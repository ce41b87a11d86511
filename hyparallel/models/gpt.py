"""GPT (GPT-2/GPT-3 shapes): pre-LayerNorm blocks, learned positions, GeLU MLP, fused QKV.

Written to be traced by ``torch.fx.symbolic_trace`` (no Python control flow on tensor values) and
built on the meta device for planning. Head counts are inferred from tensor sizes in ``forward``,
so a tensor-parallel shard that holds fewer heads needs no attribute changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyparallel.kernels import bias_dropout_residual
from hyparallel.models.bounds import check_bool, check_common, check_int, check_number
from hyparallel.spec.limits import MAX_FFN_HIDDEN

# Traced as one op (the kernel's Python dispatch is not traceable), like a leaf module.
torch.fx.wrap("bias_dropout_residual")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model; ``ffn_hidden_size`` defaults to 4 x hidden."""

    num_layers: int
    hidden_size: int
    num_heads: int
    # GPT-2's 50257 BPE tokens padded to a multiple of 128 (as Megatron-LM and nanoGPT do)
    vocab_size: int = 50304
    max_seq_len: int = 2048
    ffn_hidden_size: int | None = None
    tie_embeddings: bool = True
    bias: bool = True
    dropout: float = 0.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        check_common(
            self.num_layers, self.hidden_size, self.num_heads, self.vocab_size, self.max_seq_len
        )
        if self.ffn_hidden_size is not None:
            check_int("ffn_hidden_size", self.ffn_hidden_size, 1, MAX_FFN_HIDDEN)
        check_bool("tie_embeddings", self.tie_embeddings)
        check_bool("bias", self.bias)
        check_number("dropout", self.dropout, 0.0, 1.0, open_high=True)
        check_number("norm_eps", self.norm_eps, 0.0, 1.0, open_low=True)
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads"
                f" ({self.num_heads})"
            )

    @property
    def ffn_size(self) -> int:
        """Width of the MLP's hidden layer."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        """hidden_size / num_heads."""
        return self.hidden_size // self.num_heads

    def num_params(self) -> int:
        """Closed-form parameter count (tied head counted once)."""
        h, f, b = self.hidden_size, self.ffn_size, int(self.bias)
        norm = h + b * h
        attn = 3 * h * h + b * 3 * h + h * h + b * h
        mlp = h * f + b * f + f * h + b * h
        embeddings = self.vocab_size * h + self.max_seq_len * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return embeddings + self.num_layers * (2 * norm + attn + mlp) + norm + head


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with a fused QKV projection laid out [q | k | v]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # each (B, T, n_head * head_dim)
        # (B, n_head, T, head_dim)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.proj(y.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """hidden -> ffn -> hidden with tanh-approximated GeLU (as GPT-2)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=cfg.bias)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block; dropout and residual add after each projection run as one
    kernel."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.dropout = cfg.dropout
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = bias_dropout_residual(
            self.attn(self.attn_norm(x)), None, x, self.dropout, self.training
        )
        return bias_dropout_residual(
            self.mlp(self.mlp_norm(x)), None, x, self.dropout, self.training
        )


class GPT(nn.Module):
    """Decoder-only GPT: ``forward(tokens (B, T) int64) -> logits (B, T, vocab)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.bias)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``(B, T, vocab)``; ``position_ids`` ``(B, T)``: each token's position (default
        0..T-1; context parallelism passes the global ones)."""
        positions = (
            torch.arange(tokens.size(1), device=tokens.device)
            if position_ids is None
            else position_ids
        )
        # (B, T, hidden)
        x = self.dropout(self.tok_embeddings(tokens) + self.pos_embeddings(positions))
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """GPT-2 initialisation: N(0, std), residual projections scaled by 1/sqrt(2 *
        num_layers)."""
        residual_std = std / math.sqrt(2 * self.config.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, residual_std if name.endswith(".proj") else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def init_std(self, name: str, std: float = 0.02) -> float:
        """Standard deviation of parameter ``name``'s normal init (residual projections scaled by
        1/sqrt(2L))."""
        residual = name.removesuffix(".weight").endswith(".proj")
        return std / math.sqrt(2 * self.config.num_layers) if residual else std

    def example_inputs(
        self, batch_size: int, seq_len: int, device: torch.device | str = "meta"
    ) -> tuple[torch.Tensor]:
        """Token ids of the given shape, for tracing and planning."""
        return (torch.zeros(batch_size, seq_len, dtype=torch.long, device=device),)
