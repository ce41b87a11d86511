"""A GPT written by hand as users write them (nanoGPT's shape): ``forward(idx)`` on token ids, no
example_inputs method.

nanoGPT's length check (``assert t <= block_size``) does not trace with torch.fx, so hyparallel
traces it with torch.export, which fixes the micro-batch shape. The CLI tests load it as
``tests.user_gpt:make_model`` with
``--example-inputs tests.user_gpt:make_inputs``; the other callables here are deliberately bad input
specs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 96
BLOCK_SIZE = 32


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class UserGPT(nn.Module):
    def __init__(self, n_layer: int = 2, n_head: int = 2, n_embd: int = 32):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, n_embd)
        self.wpe = nn.Embedding(BLOCK_SIZE, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as nanoGPT does

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.size()
        assert t <= BLOCK_SIZE, (
            f"cannot forward a sequence of length {t}, the block size is {BLOCK_SIZE}"
        )
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def make_model(n_layer: int = 2) -> UserGPT:
    """The factory `--model tests.user_gpt:make_model` calls (on the meta device)."""
    return UserGPT(n_layer=n_layer)


def make_inputs(batch_size: int, seq_len: int) -> torch.Tensor:
    """Token ids of one micro-batch, (batch_size, seq_len): what `--example-inputs
    tests.user_gpt:make_inputs` gives."""
    return torch.zeros(batch_size, seq_len, dtype=torch.long)


def make_words(batch_size: int, seq_len: int) -> str:
    """Not inputs: a bad --example-inputs spec."""
    return "tokens"


def make_fixed(batch_size: int, seq_len: int) -> torch.Tensor:
    """Ignores its arguments: a bad --example-inputs spec."""
    return torch.zeros(4, 8, dtype=torch.long)


NOT_CALLABLE = 3


def make_pixels(batch_size: int, seq_len: int) -> torch.Tensor:
    """Images, (batch_size, 3, 32, 32), whatever seq_len says: an image model's --example-inputs."""
    return torch.zeros(batch_size, 3, 32, 32)
