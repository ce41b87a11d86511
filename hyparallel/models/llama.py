"""Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention.

Separate q/k/v projections (unlike the GPT's fused QKV) so tensor parallelism meets both forms.
Traceable by ``torch.fx.symbolic_trace``; head counts are inferred from tensor sizes in ``forward``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyparallel.kernels import swiglu
from hyparallel.models.bounds import check_bool, check_common, check_int, check_number
from hyparallel.spec.limits import MAX_FFN_HIDDEN

# Traced as one op (the kernel's Python dispatch is not traceable), like a leaf module.
torch.fx.wrap("swiglu")


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama model; ``num_kv_heads`` < ``num_heads`` gives grouped-query attention."""

    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    num_kv_heads: int | None = None
    vocab_size: int = 32000
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        check_common(
            self.num_layers, self.hidden_size, self.num_heads, self.vocab_size, self.max_seq_len
        )
        check_int("ffn_hidden_size", self.ffn_hidden_size, 1, MAX_FFN_HIDDEN)
        if self.num_kv_heads is not None:
            check_int("num_kv_heads", self.num_kv_heads, 1, self.num_heads)
        check_number("rope_theta", self.rope_theta, 0.0, 1e12, open_low=True)
        check_number("norm_eps", self.norm_eps, 0.0, 1.0, open_low=True)
        check_bool("tie_embeddings", self.tie_embeddings)
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_heads"
                f" ({self.num_heads})"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.kv_heads})"
            )

    @property
    def kv_heads(self) -> int:
        """Key/value heads (num_heads unless grouped-query attention)."""
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        """hidden_size / num_heads."""
        return self.hidden_size // self.num_heads

    def num_params(self) -> int:
        """Closed-form parameter count (tied head counted once)."""
        h, f, kv = self.hidden_size, self.ffn_hidden_size, self.kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h
        mlp = 3 * h * f
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * (attn + mlp + 2 * h) + h + head


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotary positions (Su et al. 2021), halves duplicated as in HF Llama."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)compute the tables on the buffers' device (after ``to_empty`` from meta, too)."""
        device = self.cos.device
        inv_freq = 1.0 / self.theta ** (
            torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
        )
        angles = torch.outer(
            torch.arange(self.max_seq_len, device=device, dtype=torch.float32), inv_freq
        )
        angles = torch.cat((angles, angles), dim=-1)  # (max_seq_len, head_dim)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``(T, head_dim)`` for positions 0..T-1, or ``(B, 1, T, head_dim)`` for
        ``position_ids`` ``(B, T)``."""
        if position_ids is not None:
            return (
                self.cos[position_ids].unsqueeze(1).to(x.dtype),
                self.sin[position_ids].unsqueeze(1).to(x.dtype),
            )
        seq_len = x.size(1)
        return self.cos[:seq_len].to(x.dtype), self.sin[:seq_len].to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, head_dim) by per-position angles (T, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Causal grouped-query attention with rotary positions; no biases."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # (B, n_head, T, head_dim)
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        # (B, n_kv_head, T, head_dim)
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        group = q.size(1) // k.size(1)  # query heads per key/value head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).flatten(2))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer 2020)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # silu(gate) * up, one kernel on CUDA
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: attention then SwiGLU, each with a residual."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama decoder: ``forward(tokens (B, T) int64) -> logits (B, T, vocab)``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    def forward(
        self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``(B, T, vocab)``; ``position_ids`` ``(B, T)``: each token's position (default
        0..T-1; context parallelism passes the global ones)."""
        x = self.tok_embeddings(tokens)  # (B, T, hidden)
        cos, sin = self.rope(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """N(0, std) weights, output projections scaled by 1/sqrt(2 * num_layers), rotary tables
        recomputed."""
        residual_std = std / math.sqrt(2 * self.config.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(
                    module.weight,
                    0.0,
                    residual_std if name.endswith(("o_proj", "down_proj")) else std,
                )
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, (nn.RMSNorm, RotaryEmbedding)):
                module.reset_parameters()

    def init_std(self, name: str, std: float = 0.02) -> float:
        """Standard deviation of parameter ``name``'s normal init (residual projections scaled by
        1/sqrt(2L))."""
        residual = name.removesuffix(".weight").endswith(("o_proj", "down_proj"))
        return std / math.sqrt(2 * self.config.num_layers) if residual else std

    def example_inputs(
        self, batch_size: int, seq_len: int, device: torch.device | str = "meta"
    ) -> tuple[torch.Tensor]:
        """Token ids of the given shape, for tracing and planning."""
        return (torch.zeros(batch_size, seq_len, dtype=torch.long, device=device),)
