"""Hand-written models of the sweep (benchmarks/sweep.py), the kinds users bring that transformers
does not name.

Factories for ``hp.models.load("benchmarks.sweep_models:NAME")`` (the repository root on the path):

* ``nano_gpt``: karpathy/nanoGPT's model: a fused ``c_attn`` split with ``self.n_embd``, weight-tied
  head.
* ``cnn``: a small convolutional classifier (Conv2d weights have four dims), GroupNorm (no batch
  statistics).
* ``embedding_mlp``: an embedding-heavy model: a 4096-row table, mean-pooled, then an MLP
  classifier.
* ``moe_lm``: a decoder whose MLPs are top-2 routed mixtures of 4 experts (dense dispatch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class NanoAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.n_embd, self.n_head = n_embd, n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = (
            nn.LayerNorm(n_embd),
            NanoAttention(n_embd, n_head),
            nn.LayerNorm(n_embd),
        )
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, n_layer: int, n_embd: int, n_head: int, vocab_size: int, block_size: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(NanoBlock(n_embd, n_head) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def example_inputs(
        self, batch_size: int, seq_len: int, device: torch.device | str = "meta"
    ) -> torch.Tensor:
        return torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def nano_gpt(n_layer: int = 2, n_embd: int = 64, n_head: int = 4, vocab_size: int = 128) -> NanoGPT:
    """nanoGPT at a small size."""
    return NanoGPT(n_layer, n_embd, n_head, vocab_size, block_size=64)


class CNN(nn.Module):
    """Convolutions with GroupNorm, pooled, a linear classifier; inputs (B, 3, 16, 16) images."""

    def __init__(self, width: int = 16, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.GroupNorm(4, width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, stride=2),
            nn.GroupNorm(4, 2 * width),
            nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Sequential(
            nn.Linear(2 * width, 4 * width), nn.ReLU(), nn.Linear(4 * width, classes)
        )

    def example_inputs(
        self, batch_size: int, seq_len: int, device: torch.device | str = "meta"
    ) -> torch.Tensor:
        return torch.zeros(batch_size, 3, 16, 16, device=device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).mean(dim=(2, 3)))


def cnn(width: int = 16, classes: int = 10) -> CNN:
    """A small convolutional classifier."""
    return CNN(width, classes)


class EmbeddingMLP(nn.Module):
    """A large embedding table, mean-pooled over the sequence, then an MLP: most parameters sit in
    the table."""

    def __init__(self, rows: int, dim: int, hidden: int, classes: int):
        super().__init__()
        self.table = nn.Embedding(rows, dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.out = nn.Linear(hidden, classes)
        self.config = type("Config", (), {"vocab_size": rows})()

    def example_inputs(
        self, batch_size: int, seq_len: int, device: torch.device | str = "meta"
    ) -> torch.Tensor:
        return torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.mlp(self.table(ids).mean(dim=1)))


def embedding_mlp(
    rows: int = 4096, dim: int = 32, hidden: int = 64, classes: int = 8
) -> EmbeddingMLP:
    """An embedding-heavy classifier."""
    return EmbeddingMLP(rows, dim, hidden, classes)


class MoE(nn.Module):
    """Top-2 routing over ``experts`` MLPs, dense dispatch: every expert runs on every token and
    each token's outputs are weighted by its renormalised router scores (zero for the experts it did
    not choose). No data-dependent indexing, so it traces on the meta device (a ``torch.where``
    dispatch does not: refused)."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int = 2):
        super().__init__()
        self.router, self.top_k = nn.Linear(hidden, experts, bias=False), top_k
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router(x).softmax(-1)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        combine = torch.zeros_like(scores).scatter(-1, chosen, weights)  # (..., experts)
        return sum(expert(x) * combine[..., i : i + 1] for i, expert in enumerate(self.experts))


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, experts: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.moe = MoE(hidden, ffn, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = torch.full((x.size(1), x.size(1)), float("-inf"), device=x.device).triu(1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.norm2(x))


class MoELM(nn.Module):
    def __init__(
        self, layers: int, hidden: int, heads: int, ffn: int, experts: int, vocab_size: int
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.layers = nn.ModuleList(MoEBlock(hidden, heads, ffn, experts) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab_size, bias=False)

    def example_inputs(
        self, batch_size: int, seq_len: int, device: torch.device | str = "meta"
    ) -> torch.Tensor:
        return torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def moe_lm(
    layers: int = 2, hidden: int = 64, heads: int = 4, ffn: int = 64, experts: int = 4
) -> MoELM:
    """A small mixture-of-experts decoder."""
    return MoELM(layers, hidden, heads, ffn, experts, vocab_size=128)


# ---- torch.nn built-ins (the sweep's "torch.nn" family) ----


class TorchEncoderLM(nn.Module):
    """torch's own nn.TransformerEncoder as a causal LM: its layers in the encoder's ModuleList,
    attention an nn.MultiheadAttention (one fused in_proj_weight, read by
    F.multi_head_attention_forward). tests/tiny_lms.py's torch_encoder_lm builds it too."""

    def __init__(self, hidden: int, heads: int, layers: int, vocab_size: int, norm_first: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        layer = nn.TransformerEncoderLayer(
            hidden,
            heads,
            4 * hidden,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=norm_first,
        )
        self.encoder = nn.TransformerEncoder(
            layer, layers, norm=nn.LayerNorm(hidden), enable_nested_tensor=False
        )
        self.head = nn.Linear(hidden, vocab_size, bias=False)

    def example_inputs(
        self, batch_size: int, seq_len: int, device: torch.device | str = "meta"
    ) -> torch.Tensor:
        return torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(
            input_ids.shape[1], device=input_ids.device
        )
        return self.head(self.encoder(self.embed(input_ids), mask=mask, is_causal=True))


def torch_encoder_lm(
    hidden: int = 64, heads: int = 4, layers: int = 2, vocab_size: int = 128
) -> TorchEncoderLM:
    """nn.TransformerEncoder (pre-norm, as GPT-style models are) under a token embedding and a
    head."""
    return TorchEncoderLM(hidden, heads, layers, vocab_size, norm_first=True)


class LSTMLM(nn.Module):
    """An nn.LSTM language model: embedding, a 2-layer LSTM (one fused cuDNN-style op on the CPU
    too), a head."""

    def __init__(self, hidden: int, layers: int, vocab_size: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size, bias=False)

    def example_inputs(
        self, batch_size: int, seq_len: int, device: torch.device | str = "meta"
    ) -> torch.Tensor:
        return torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(input_ids))[0])  # (B, T, V)


def lstm_lm(hidden: int = 64, layers: int = 2, vocab_size: int = 128) -> LSTMLM:
    """A small nn.LSTM language model."""
    return LSTMLM(hidden, layers, vocab_size)


class SharedBlockLM(nn.Module):
    """One transformer block called at every depth (ALBERT's cross-layer sharing, a looped
    transformer): the same module, and so the same parameters, ``depth`` times in one forward."""

    def __init__(self, depth: int, hidden: int, heads: int, vocab_size: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.block = NanoBlock(hidden, heads)
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab_size, bias=False)
        self.depth = depth

    def example_inputs(
        self, batch_size: int, seq_len: int, device: torch.device | str = "meta"
    ) -> torch.Tensor:
        return torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for _ in range(self.depth):
            x = self.block(x)
        return self.head(self.norm(x))


def shared_block_lm(
    depth: int = 4, hidden: int = 64, heads: int = 4, vocab_size: int = 128
) -> SharedBlockLM:
    """A decoder reusing one block at every depth."""
    return SharedBlockLM(depth, hidden, heads, vocab_size)


# ---- losses for outputs the default token cross-entropy does not read (Note [the loss a check
# trains]) ----


def sample_mse(output, targets: torch.Tensor) -> torch.Tensor:
    """A denoiser's loss: mean squared error of the output's ``sample`` (diffusers' UNet2DOutput)
    against float targets shaped like it."""
    return F.mse_loss(output.sample.float(), targets)


def hidden_mse(output, targets: torch.Tensor) -> torch.Tensor:
    """An encoder without a head (CLIPTextModel): mean squared error of its first output, the last
    hidden state (B, T, hidden), against float targets shaped like it."""
    return F.mse_loss(output[0].float(), targets)


# ---- diffusers (the sweep's "diffusion" family; pip install -e ".[sweep]") ----


def unet2d(channels: int = 32, head_dim: int = 16, size: int = 8):
    """diffusers' UNet2DModel at a small size: two resolutions (``channels``, 2 x ``channels``), one
    ResNet per block, self-attention in the lower down/up blocks and the mid block with 2 x channels
    / head_dim heads (4), GroupNorm of 8 groups. Inputs: a noisy (B, 3, size, size) sample and a
    timestep per row; trained with
    ``sample_mse``."""
    from diffusers import UNet2DModel

    class SweepUNet2D(UNet2DModel):
        def example_inputs(
            self, batch_size: int, seq_len: int, device: torch.device | str = "meta"
        ) -> dict:
            return {
                "sample": torch.zeros(batch_size, 3, size, size, device=device),
                "timestep": torch.zeros(batch_size, dtype=torch.long, device=device),
            }

    return SweepUNet2D(
        sample_size=size,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(channels, 2 * channels),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
        attention_head_dim=head_dim,
    )


# ---- torchtitan (the sweep's "torchtitan" family; pip install -e ".[sweep]", torchtitan itself
# --no-deps) ----


def titan_llama3(
    dim: int = 64, n_heads: int = 4, n_kv_heads: int = 2, n_layers: int = 2, vocab_size: int = 128
):
    """torchtitan's Llama3Model built as its ``_debugmodel`` is (fused wqkv, SwiGLU, RMSNorm,
    llama-scaled RoPE), shrunk, with grouped-query attention and torch's SDPA as the inner attention
    (causal): torchtitan's language model backends are flex attention and varlen, which need an
    attention mask built by its trainer."""
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock

    class SweepLlama3(Llama3Model):
        def example_inputs(
            self, batch_size: int, seq_len: int, device: torch.device | str = "meta"
        ) -> torch.Tensor:
            return torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)

    rope = ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=256, theta=500000, scaling="llama")
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim),
            ffn_norm=RMSNorm.Config(normalized_shape=dim),
            attention=make_gqa_config(
                dim=dim,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                wqkv_param_init={},
                wo_param_init={},
                inner_attention=ScaledDotProductAttention.Config(),
                fuse_qkv=True,
                rope=rope,
            ),
            feed_forward=make_ffn_config(
                dim=dim,
                hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
                w1_param_init={},
                w2w3_param_init={},
            ),
        )
        for _ in range(n_layers)
    ]
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size),
        layers=layers,
    )
    return SweepLlama3(config)
