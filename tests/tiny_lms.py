"""Hand-written tiny language models for the classes of tensor parallelism the zoo does not show
(issue 16).

Factories for ``hp.models.load("tests.tiny_lms:NAME key=value ...")`` (the repository root on the
path):

* ``scaled_embedding_lm``: the token embedding is an nn.Embedding subclass with its own forward (it
  multiplies by a scale, as Gemma's does), and the first block's MLP up projection an nn.Linear
  subclass with its own forward.
* ``config_split_lm``: nanoGPT's attention, its fused [q | k | v] split with the configured width.
* ``mqa_lm``: multi-query attention, one key/value head shared by every query head; ``fused=True``
  computes [q | k | v] in one Linear split by sizes, otherwise q, k and v are separate Linears.
* ``heads_attribute_lm``: diffusers' attention, its head count in ``heads`` and its head size read
  off the split projection's width.
* ``interleaved_lm``: a fused projection whose output interleaves q, k and v: per head
  (``groups=0``: viewed as (..., heads, 3, head_dim) and unbound, as Bloom does) or per group of
  heads (CodeGen's ``mp_num`` groups, each q | k | v for several heads, regrouped into heads after
  the cut).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.sweep_models import TorchEncoderLM  # the sweep's nn.TransformerEncoder LM, one copy


class ScaledEmbedding(nn.Embedding):
    """An embedding whose forward multiplies by a constant: swapped for a plain one, it would lose
    the scale."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float):
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * self.scale


class ScaledLinear(nn.Linear):
    """A Linear whose forward doubles its output."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 2.0


class Attention(nn.Module):
    """Causal attention with ``kv_heads`` key/value heads (1: multi-query), fused [q | k | v] or
    separate.

    The fused split takes one key/value head of each (kv_heads = 1 when fused).
    """

    def __init__(
        self, hidden: int, heads: int, kv_heads: int, fused: bool, by_config: bool = False
    ):
        super().__init__()
        self.head_dim, self.fused, self.by_config, self.hidden = (
            hidden // heads,
            fused or by_config,
            by_config,
            hidden,
        )
        kv = kv_heads * self.head_dim
        if fused:
            self.qkv = nn.Linear(hidden, hidden + 2 * kv)
        else:
            self.q_proj = nn.Linear(hidden, hidden)
            self.k_proj, self.v_proj = nn.Linear(hidden, kv), nn.Linear(hidden, kv)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # nanoGPT's split(self.n_embd, dim=2): the full width, whatever tp leaves this rank
        if self.by_config:
            q, k, v = self.qkv(x).split(self.hidden, dim=-1)
        # sizes from the tensor, not the config: the query part is what the key/value heads leave
        elif self.fused:
            qkv = self.qkv(x)
            q, k, v = qkv.split(
                (qkv.size(-1) - 2 * self.head_dim, self.head_dim, self.head_dim), dim=-1
            )
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        # each key/value head serves every query head (one group)
        k, v = k.expand_as(q), v.expand_as(q)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class QKNormAttention(Attention):
    """Qwen3's / Kolibri's QK-norm: one norm over head_dim whose weight every head shares, inside
    the split heads."""

    def __init__(self, hidden: int, heads: int):
        super().__init__(hidden, heads, heads, False)
        self.q_norm, self.k_norm = nn.LayerNorm(self.head_dim), nn.LayerNorm(self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (
            t.view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for t in (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        )
        out = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class HeadsAttributeAttention(Attention):
    """diffusers' ``Attention``: the head count in ``heads`` (a name the analysis does not know),
    the head size computed from the projection's width (``head_dim = key.shape[-1] // attn.heads``)
    and an explicit softmax scale of that size. Split by heads without dividing ``heads``, each rank
    would run ``heads`` heads of a smaller size."""

    def __init__(self, hidden: int, heads: int):
        super().__init__(hidden, heads, heads, False)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        head_dim = k.shape[-1] // self.heads
        q, k, v = (t.view(batch, -1, self.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(batch, -1, self.heads * head_dim))


class SharedArgumentAttention(Attention):
    """CTRL's call convention: ``attn(value, key, query)``, the block passing one normed tensor
    three times."""

    def forward(self, v: torch.Tensor, k: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        batch, seq, _ = q.shape
        q, k, v = (
            t.view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for t in (self.q_proj(q), self.k_proj(k), self.v_proj(v))
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SharedArgumentBlock(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = SharedArgumentAttention(hidden, heads, heads, False)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.norm1(x)
        x = x + self.attn(normed, normed, normed)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class InterleavedAttention(nn.Module):
    """Causal attention whose fused qkv interleaves q, k, v per head (``groups=0``) or per group of
    heads."""

    def __init__(self, hidden: int, heads: int, groups: int):
        super().__init__()
        self.head_dim, self.groups = hidden // heads, groups
        self.qkv, self.o_proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.qkv(x)
        if self.groups:  # (..., groups, 3 * width): q | k | v of several heads in each group
            width = qkv.size(-1) // (3 * self.groups)
            q, k, v = qkv.view(batch, seq, self.groups, 3 * width).split(width, dim=-1)
        else:  # (..., heads, 3, head_dim): q, k, v of each head side by side
            q, k, v = qkv.view(batch, seq, -1, 3, self.head_dim).unbind(3)
        q, k, v = (t.reshape(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        fused: bool,
        up: type[nn.Linear] = nn.Linear,
        by_config: bool = False,
        groups: int | None = None,
    ):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, kv_heads, fused, by_config) if groups is None else None
        self.attn = self.attn or InterleavedAttention(hidden, heads, groups)
        self.up, self.down = up(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """Embedding, blocks, norm and an untied vocabulary head."""

    def __init__(self, embedding: nn.Embedding, blocks: list[Block], vocab_size: int):
        super().__init__()
        hidden = embedding.embedding_dim
        self.embed, self.layers = embedding, nn.ModuleList(blocks)
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab_size, bias=False)
        self.config = type("Config", (), {"vocab_size": vocab_size})()

    def example_inputs(
        self, batch_size: int, seq_len: int, device: torch.device | str = "meta"
    ) -> torch.Tensor:
        return torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class HangingLM(TinyLM):
    """A TinyLM whose rank 1 never finishes a training forward (the others then wait in a
    collective)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if self.training and dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(3600)
        return super().forward(tokens)


def hanging_lm(hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64) -> TinyLM:
    """``HangingLM``: a launch that runs past any timeout."""
    blocks = [Block(hidden, heads, heads, False) for _ in range(layers)]
    return HangingLM(nn.Embedding(vocab_size, hidden), blocks, vocab_size)


def scaled_embedding_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64
) -> TinyLM:
    """A scaled token embedding (replicated under tp) and, in layer 0, an MLP up projection with its
    own forward."""
    blocks = [
        Block(hidden, heads, heads, False, ScaledLinear if i == 0 else nn.Linear)
        for i in range(layers)
    ]
    return TinyLM(ScaledEmbedding(vocab_size, hidden, scale=hidden**0.5), blocks, vocab_size)


def mqa_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64, fused: bool = False
) -> TinyLM:
    """Multi-query attention: one key/value head for all ``heads`` query heads."""
    blocks = [Block(hidden, heads, 1, fused) for _ in range(layers)]
    return TinyLM(nn.Embedding(vocab_size, hidden), blocks, vocab_size)


def config_split_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64
) -> TinyLM:
    """nanoGPT's attention: the fused [q | k | v] split by the configured width
    (``split(self.n_embd, dim=2)``)."""
    blocks = [Block(hidden, heads, heads, True, by_config=True) for _ in range(layers)]
    return TinyLM(nn.Embedding(vocab_size, hidden), blocks, vocab_size)


def interleaved_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64, groups: int = 0
) -> TinyLM:
    """A fused qkv interleaved per head (``groups=0``, splittable by heads) or per ``groups`` groups
    of heads."""
    blocks = [Block(hidden, heads, heads, True, groups=groups) for _ in range(layers)]
    return TinyLM(nn.Embedding(vocab_size, hidden), blocks, vocab_size)


def qk_norm_lm(hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64) -> TinyLM:
    """Per-head query and key norms inside the attention (``QKNormAttention``)."""
    blocks = [Block(hidden, heads, heads, False) for _ in range(layers)]
    for block in blocks:
        block.attn = QKNormAttention(hidden, heads)
    return TinyLM(nn.Embedding(vocab_size, hidden), blocks, vocab_size)


def heads_attribute_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64
) -> TinyLM:
    """diffusers' attention (``HeadsAttributeAttention``): its head count in an attribute named
    ``heads``."""
    blocks = [Block(hidden, heads, heads, False) for _ in range(layers)]
    for block in blocks:
        block.attn = HeadsAttributeAttention(hidden, heads)
    return TinyLM(nn.Embedding(vocab_size, hidden), blocks, vocab_size)


def shared_argument_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64
) -> TinyLM:
    """An attention called as ``attn(x, x, x)`` (``SharedArgumentAttention``)."""
    blocks = [SharedArgumentBlock(hidden, heads) for _ in range(layers)]
    return TinyLM(nn.Embedding(vocab_size, hidden), blocks, vocab_size)  # type: ignore[arg-type]


class DeviceBranchLM(TinyLM):
    """Counts its tokens per bucket with ``histc``, on floats on the CPU and on ints elsewhere, as
    transformers' MoE does (``histc`` has no integer kernel on the CPU), and scales the logits by a
    constant it creates in forward (``torch.tensor``, which torch.export lifts): traced on plain
    meta tensors, the int branch is baked in."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.reshape(-1)
        counts = torch.histc(
            ids.float() if ids.device.type == "cpu" else ids.int(), bins=4, min=0, max=63
        )
        x = self.embed(tokens) * (1 + counts.sum() / (counts.sum() + 1e6))
        for layer in self.layers:
            x = layer(x) * torch.tensor(1.0)
        return self.head(self.norm(x))


def device_branch_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64
) -> TinyLM:
    """A device-dependent branch and a tensor constant made in forward (``DeviceBranchLM``)."""
    return DeviceBranchLM(
        nn.Embedding(vocab_size, hidden),
        [Block(hidden, heads, heads, False) for _ in range(layers)],
        vocab_size,
    )


class RankSkewedLM(TinyLM):
    """Wrong on purpose: rank 1 scales its logits by 1.01, so its gradients are not the single
    device's."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        skew = 1.01 if dist.is_initialized() and dist.get_rank() == 1 else 1.0
        return super().forward(tokens) * skew


def rank_skewed_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64
) -> TinyLM:
    """A model whose rank 1 computes something else (``RankSkewedLM``): what a parity check must
    catch."""
    return RankSkewedLM(
        nn.Embedding(vocab_size, hidden),
        [Block(hidden, heads, heads, False) for _ in range(layers)],
        vocab_size,
    )


class MixerBlock(Block):
    """A block whose token mixer is no attention: FNet's Fourier transform over (sequence, hidden),
    or a running mean over the sequence (``cumsum``); each mixes the whole sequence outside the
    split MLP."""

    def __init__(self, hidden: int, heads: int, mixer: str):
        super().__init__(hidden, heads, heads, False)
        self.mixer, self.attn = mixer, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        if self.mixer == "fft":
            mixed = torch.fft.fft(torch.fft.fft(h, dim=-1), dim=-2).real
        else:
            steps = torch.arange(1, h.shape[1] + 1, dtype=h.dtype, device=h.device)
            mixed = h.cumsum(1) / steps[:, None]
        x = x + mixed
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def mixer_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64, mixer: str = "fft"
) -> TinyLM:
    """Blocks mixing tokens without attention (``MixerBlock``): sequence parallelism must not split
    them."""
    blocks = [MixerBlock(hidden, heads, mixer) for _ in range(layers)]
    return TinyLM(nn.Embedding(vocab_size, hidden), blocks, vocab_size)  # type: ignore[arg-type]


class ResidualMLP(nn.Module):
    """Funnel's and XLNet's feed-forward: the residual and its norm inside the module, ``norm(x +
    down(up(x)))``."""

    def __init__(self, hidden: int):
        super().__init__()
        self.up, self.down, self.norm = (
            nn.Linear(hidden, 4 * hidden),
            nn.Linear(4 * hidden, hidden),
            nn.LayerNorm(hidden),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(F.gelu(self.up(x))))


class ResidualMLPBlock(Block):
    def __init__(self, hidden: int, heads: int):
        super().__init__(hidden, heads, heads, False)
        self.mlp = ResidualMLP(hidden)
        del self.up, self.down, self.norm2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x + self.attn(self.norm1(x)))


def residual_mlp_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64
) -> TinyLM:
    """Feed-forward modules that add their own input back (``ResidualMLP``)."""
    blocks = [ResidualMLPBlock(hidden, heads) for _ in range(layers)]
    return TinyLM(nn.Embedding(vocab_size, hidden), blocks, vocab_size)  # type: ignore[arg-type]


class WhereMoE(nn.Module):
    """Top-k routing over a ModuleList of MLP experts, dispatched as most people write it by hand:
    ``token, slot = torch.where(chosen == e)``, ``index_select`` the expert's tokens, weight its
    outputs, ``index_add`` them back (sizes the data decides, issue 38)."""

    def __init__(self, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.router, self.top_k = nn.Linear(hidden, experts, bias=False), top_k
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(
                0, token, expert(flat.index_select(0, token)) * weights[token, slot, None]
            )
        return out.reshape(x.shape)


class WhereMoEBlock(Block):
    def __init__(self, hidden: int, heads: int, experts: int, top_k: int):
        super().__init__(hidden, heads, heads, False)
        self.moe = WhereMoE(hidden, experts, top_k)
        del self.up, self.down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


def where_moe_lm(
    hidden: int = 32,
    heads: int = 4,
    layers: int = 2,
    vocab_size: int = 64,
    experts: int = 4,
    top_k: int = 2,
) -> TinyLM:
    """Blocks whose MLP is a ``WhereMoE``: a hand-written mixture of experts."""
    blocks = [WhereMoEBlock(hidden, heads, experts, top_k) for _ in range(layers)]
    return TinyLM(nn.Embedding(vocab_size, hidden), blocks, vocab_size)  # type: ignore[arg-type]


class NestedLM(TinyLM):
    """Layers in groups (a ModuleList of ModuleLists, as Funnel's blocks of layers)."""

    def __init__(self, embedding: nn.Embedding, groups: list[list[Block]], vocab_size: int):
        super().__init__(embedding, [], vocab_size)
        self.layers = nn.ModuleList(nn.ModuleList(group) for group in groups)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for group in self.layers:
            for layer in group:
                x = layer(x)
        return self.head(self.norm(x))


def nested_lm(
    hidden: int = 32, heads: int = 4, groups: int = 2, per_group: int = 2, vocab_size: int = 64
) -> TinyLM:
    """``groups`` ModuleLists of ``per_group`` blocks each (``NestedLM``)."""
    layers = [[Block(hidden, heads, heads, False) for _ in range(per_group)] for _ in range(groups)]
    return NestedLM(nn.Embedding(vocab_size, hidden), layers, vocab_size)


class NoGradLM(TinyLM):
    """HRM's recurrence: layer 0 runs once without gradients (``torch.no_grad()``), moved with
    ``.to(device)`` as HRM moves its state, then again with them on the sum."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        with torch.no_grad():
            warm = self.layers[0](x).to(x.device)
        x = self.layers[0](x + warm)
        for layer in self.layers[1:]:
            x = layer(x)
        return self.head(self.norm(x))


def no_grad_lm(hidden: int = 32, heads: int = 4, layers: int = 3, vocab_size: int = 64) -> TinyLM:
    """A no-grad region inside forward (``NoGradLM``)."""
    return NoGradLM(
        nn.Embedding(vocab_size, hidden),
        [Block(hidden, heads, heads, False) for _ in range(layers)],
        vocab_size,
    )


class Wrapped(nn.Module):
    """A projection behind a wrapper module (Moshi's MoshiLinear holds its nn.Linear as
    ``.linear``)."""

    def __init__(self, fan_in: int, fan_out: int):
        super().__init__()
        self.linear = nn.Linear(fan_in, fan_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class WrappedAttention(Attention):
    """``Attention`` with q, k, v and o behind wrappers; it views by its input's (batch, seq), as HF
    attention does."""

    def __init__(self, hidden: int, heads: int):
        super().__init__(hidden, heads, heads, False)
        self.q_proj, self.k_proj, self.v_proj = (Wrapped(hidden, hidden) for _ in range(3))
        self.o_proj = Wrapped(hidden, hidden)


class GatedViewMLP(nn.Module):
    """Moshi's gated MLP: one fused [gate | up] projection viewed as (batch, seq, 2, inner) and
    indexed."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = (
            nn.Linear(hidden, 4 * hidden, bias=False),
            nn.Linear(2 * hidden, hidden, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        h = self.fc1(x).view(batch, seq, 2, -1)
        return self.fc2(F.silu(h[..., 0, :]) * h[..., 1, :])


class MoshiLikeBlock(Block):
    def __init__(self, hidden: int, heads: int):
        super().__init__(hidden, heads, heads, False)
        self.attn, self.mlp = WrappedAttention(hidden, heads), GatedViewMLP(hidden)
        del self.up, self.down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def moshi_like_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64
) -> TinyLM:
    """Wrapped projections and a fused [gate | up] indexed after a view (``MoshiLikeBlock``)."""
    blocks = [MoshiLikeBlock(hidden, heads) for _ in range(layers)]
    return TinyLM(nn.Embedding(vocab_size, hidden), blocks, vocab_size)  # type: ignore[arg-type]


class SamplingLM(TinyLM):
    """Perturbs its hidden states with noise in training (as Phi-MoE's jitter and Gumbel-sampled
    routing do)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.training:
            x = x * torch.empty_like(x).uniform_(0.99, 1.01)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def sampling_lm(hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64) -> TinyLM:
    """A model whose training forward draws random numbers (``SamplingLM``)."""
    return SamplingLM(
        nn.Embedding(vocab_size, hidden),
        [Block(hidden, heads, heads, False) for _ in range(layers)],
        vocab_size,
    )


class ListBlock(Block):
    """A block returning ``[hidden]`` (OpenAI GPT's blocks return a list)."""

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[override]
        return [super().forward(x)]


class ListLM(TinyLM):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)[0]
        return self.head(self.norm(x))


def list_lm(hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64) -> TinyLM:
    """Blocks whose output is a list (``ListBlock``)."""
    return ListLM(
        nn.Embedding(vocab_size, hidden),
        [ListBlock(hidden, heads, heads, False) for _ in range(layers)],
        vocab_size,
    )


class InPlaceBlock(Block):
    """Starts by writing its input in place (``x.add_(offset)``), as RoCBert's embeddings do after a
    Linear."""

    def __init__(self, hidden: int, heads: int):
        super().__init__(hidden, heads, heads, False)
        self.offset = nn.Parameter(torch.zeros(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.add_(self.offset))


def in_place_lm(hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64) -> TinyLM:
    """Blocks writing their input in place (``InPlaceBlock``): a pipeline stage receives that
    input."""
    blocks = [InPlaceBlock(hidden, heads) for _ in range(layers)]
    return TinyLM(nn.Embedding(vocab_size, hidden), blocks, vocab_size)  # type: ignore[arg-type]


def with_attention(make, hidden: int, heads: int, layers: int, vocab_size: int) -> TinyLM:
    """A TinyLM whose every block's attention is ``make()``."""
    blocks = [Block(hidden, heads, heads, False) for _ in range(layers)]
    for block in blocks:
        block.attn = make()
    return TinyLM(nn.Embedding(vocab_size, hidden), blocks, vocab_size)


class StridedViewAttention(Attention):
    """Views the attention output without ``contiguous()`` (Afmoe, Dory): the CPU's flash attention
    lays its output out (batch, seq, heads, head_dim), so the view runs there; on meta tensors
    (other strides) it is refused."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        if seq < 1:  # Python control flow on a size: torch.fx cannot trace it, torch.export can
            raise ValueError("empty sequence")
        q, k, v = (
            p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).view(batch, seq, -1))


def strided_view_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64
) -> TinyLM:
    """Attention outputs viewed as the CPU kernel's strides allow (``StridedViewAttention``)."""
    return with_attention(
        lambda: StridedViewAttention(hidden, heads, heads, False), hidden, heads, layers, vocab_size
    )


def unused_tied_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64
) -> TinyLM:
    """Luke's entity tables: an embedding and a head tied to it that the forward never reads
    (without entity ids)."""
    model = TinyLM(
        nn.Embedding(vocab_size, hidden),
        [Block(hidden, heads, heads, False) for _ in range(layers)],
        vocab_size,
    )
    model.entity_embed, model.entity_head = (
        nn.Embedding(16, hidden),
        nn.Linear(hidden, 16, bias=False),
    )
    model.entity_head.weight = model.entity_embed.weight
    return model


class GroupedConvAttention(Attention):
    """Nystromformer's attention: a depthwise convolution over the value heads, its channels the
    model's head count (``Conv2d(heads, heads, groups=heads)``): at one rank's heads under tp it
    cannot run."""

    def __init__(self, hidden: int, heads: int):
        super().__init__(hidden, heads, heads, False)
        self.conv = nn.Conv2d(heads, heads, (3, 1), padding=(1, 0), groups=heads, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (
            p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True) + self.conv(v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


def grouped_conv_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64
) -> TinyLM:
    """Attentions with a per-head depthwise convolution sized by the head count
    (``GroupedConvAttention``)."""
    return with_attention(
        lambda: GroupedConvAttention(hidden, heads), hidden, heads, layers, vocab_size
    )


class DetachedAttention(Attention):
    """Reads its key and value projections without a gradient path: the key only for its shape
    (Mra's attention without its kernels returns ``zeros_like(query).requires_grad_()``), the value
    detached."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = (
            torch.zeros_like(self.k_proj(x))
            .requires_grad_()
            .view(batch, seq, -1, self.head_dim)
            .transpose(1, 2)
        )
        v = self.v_proj(x).detach().view(batch, seq, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


def detached_lm(hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64) -> TinyLM:
    """Key and value projections the forward runs but no loss can give a gradient
    (``DetachedAttention``)."""
    return with_attention(
        lambda: DetachedAttention(hidden, heads, heads, False), hidden, heads, layers, vocab_size
    )


class RootMatmulLM(TinyLM):
    """NeoMME's factorised head: the last hidden states multiplied by a parameter in the root
    module's own forward (``hidden @ self.unembedding.weight``), then the vocabulary head."""

    def __init__(self, hidden: int, heads: int, layers: int, vocab_size: int, rank: int):
        blocks = [Block(hidden, heads, heads, False) for _ in range(layers)]
        super().__init__(nn.Embedding(vocab_size, hidden), blocks, vocab_size)
        self.unembedding = nn.Linear(rank, hidden, bias=False)  # weight (hidden, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x) @ self.unembedding.weight)


def root_matmul_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64, rank: int = 16
) -> TinyLM:
    """A parameter multiplied in the root's forward before the head (``RootMatmulLM``)."""
    return RootMatmulLM(hidden, heads, layers, vocab_size, rank)


class SideOutputLM(TinyLM):
    """Returns its logits and a side branch's states no loss of the logits reads
    (EncoderDecoderModel's encoder, when the decoder has no cross-attention): a gradient under
    another loss, none under the default one."""

    def __init__(self, hidden: int, heads: int, layers: int, vocab_size: int):
        super().__init__(
            nn.Embedding(vocab_size, hidden),
            [Block(hidden, heads, heads, False) for _ in range(layers)],
            vocab_size,
        )
        self.side = nn.Linear(hidden, hidden)

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        x = self.embed(tokens)
        side = self.side(x)
        for layer in self.layers:
            x = layer(x)
        return {"logits": self.head(self.norm(x)), "side_states": side}


def side_output_lm(
    hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64
) -> TinyLM:
    """Logits and a side output the logits do not depend on (``SideOutputLM``)."""
    return SideOutputLM(hidden, heads, layers, vocab_size)


class ScanGate(nn.Module):
    """RecurrentGemma's RG-LRU: a leaf module writing each step's state into a zero tensor it
    returns."""

    def __init__(self, hidden: int):
        super().__init__()
        self.gate = nn.Parameter(torch.full((hidden,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, state = torch.zeros_like(x), torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            state = self.gate * state + x[:, t]
            out[:, t] = state
        return out


class ScanBlock(Block):
    def __init__(self, hidden: int, heads: int):
        super().__init__(hidden, heads, heads, False)
        self.proj, self.scan = nn.Linear(hidden, hidden), ScanGate(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Python control flow on a size: torch.export traces it (one op per leaf module), fx not
        if x.shape[1] < 1:
            raise ValueError("empty sequence")
        return super().forward(x + self.scan(self.proj(x)))


def scan_lm(hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64) -> TinyLM:
    """Blocks with a recurrence written step by step into a zero tensor (``ScanGate``)."""
    return TinyLM(
        nn.Embedding(vocab_size, hidden),
        [ScanBlock(hidden, heads) for _ in range(layers)],
        vocab_size,
    )


@dataclasses.dataclass
class SampleOutput:
    """An output without logits, as diffusers' ``UNet2DOutput(sample=...)``."""

    sample: torch.Tensor


class SampleLM(TinyLM):
    """Returns its head's output as ``SampleOutput(sample=...)``: nothing for token cross-entropy to
    read."""

    def forward(self, tokens: torch.Tensor) -> SampleOutput:  # type: ignore[override]
        return SampleOutput(super().forward(tokens))


def sample_lm(hidden: int = 32, heads: int = 4, layers: int = 2, vocab_size: int = 64) -> SampleLM:
    """A model whose output has no logits (``SampleOutput``); train it with ``sample_mse``."""
    blocks = [Block(hidden, heads, heads, False) for _ in range(layers)]
    return SampleLM(nn.Embedding(vocab_size, hidden), blocks, vocab_size)


def sample_mse(output: SampleOutput, targets: torch.Tensor) -> torch.Tensor:
    """A denoiser's loss: mean squared error of the output's sample against targets shaped like
    it."""
    return F.mse_loss(output.sample.float(), targets)


# ---- torchtitan's layout: own Linear/Embedding classes, layers in a ModuleDict ----


class OwnLinear(nn.Module):
    """A Linear that is not nn.Linear (torchtitan-style): its own weight and F.linear."""

    def __init__(self, i, o, bias=False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(o, i))
        nn.init.normal_(self.weight, std=0.02)
        self.bias = nn.Parameter(torch.zeros(o)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class OwnEmbedding(nn.Module):
    """An Embedding that is not nn.Embedding: its own weight and F.embedding."""

    def __init__(self, n, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d) * 0.02)

    def forward(self, ids):
        return F.embedding(ids, self.weight)


class OwnAttention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.n_heads, self.head_dim = h, d // h
        self.wq, self.wk, self.wv, self.wo = (OwnLinear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class OwnFeedForward(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w1, self.w2, self.w3 = OwnLinear(d, 4 * d), OwnLinear(4 * d, d), OwnLinear(d, 4 * d)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class OwnBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.attention, self.feed_forward = OwnAttention(d, h), OwnFeedForward(d)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(d), nn.RMSNorm(d)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class DictLayersLM(nn.Module):
    def __init__(self, vocab=128, d=64, h=4, n=4):
        super().__init__()
        self.tok_embeddings = OwnEmbedding(vocab, d)
        self.layers = nn.ModuleDict({str(i): OwnBlock(d, h) for i in range(n)})
        self.norm, self.output = nn.RMSNorm(d), OwnLinear(d, vocab)

    def example_inputs(self, batch_size, seq_len, device="meta"):
        return torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def dict_layers_lm(n: int = 4) -> DictLayersLM:
    """torchtitan's Llama layout: its own Linear and Embedding classes (not torch's), layers in a
    ModuleDict."""
    return DictLayersLM(n=n)


def torch_encoder_lm(
    hidden: int = 32, heads: int = 4, layers: int = 4, vocab_size: int = 64, norm_first: bool = True
) -> TorchEncoderLM:
    """nn.TransformerEncoder (pre-norm by default, as GPT-style models are) under a token embedding
    and a head."""
    return TorchEncoderLM(hidden, heads, layers, vocab_size, norm_first)


def ce_plus_router_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy plus the router's load-balancing loss a transformers MoE returns (config
    output_router_logits: true), weighted 1 so that a difference shows (Note [the router's
    auxiliary loss over dp])."""
    logits = output.logits
    return (
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)) + output.aux_loss
    )
