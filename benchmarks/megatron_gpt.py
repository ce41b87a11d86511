"""Megatron-LM's GPT of 2021-2022, as the published rows ran it: the zoo GPT with Megatron's unfused
attention.

benchmarks/published.py costs its rows on this model (Note [the publications' model]). Everything
but the attention and the residual's dropout is the zoo GPT (hyparallel.models.gpt), reused by
subclassing.

Note [the publications' model]
    Megatron-LM's ParallelAttention (megatron/model/transformer.py at the SC21 scripts' commit
    de7dc40, the code of both publications' runs) does not fuse attention. Per layer, with (s, b)
    sequence-first activations: one QKV GEMM whose output is viewed per head as [np, 3 * hn] (q, k
    and v of a head side by side); the scores ``baddbmm(empty, q, k^T, beta=0, alpha=1 /
    norm_factor)`` materialised as (b * np, s, s); FusedScaleMaskSoftmax (one CUDA kernel: scale,
    causal mask, softmax); ``nn.Dropout(--attention-dropout 0.1)`` on the probabilities;
    ``bmm`` with v; a permute + contiguous copy to (s, b, h); the output GEMM with its bias left to
    a bias-dropout-add (``--hidden-dropout 0.1``) that torch.jit fuses into one kernel. This model
    traces to the same kernels where PyTorch allows it:
      * the scale is baddbmm's alpha, as Megatron's (``apply_query_key_layer_scaling`` moves a
        factor of the layer number from alpha into the softmax: the same kernels, the same product);
      * the causal mask is baddbmm's added input (an (s, s) additive bias of 0 and -inf, broadcast):
        the traced GEMM writes masked scores and the softmax is one op, as Megatron's GEMM + fused
        scale-mask-softmax. The cost model reads the (s, s) bias once per sequence: 1 / (heads per
        rank) of one read of the scores;
      * the QKV output is viewed per head as [q_i | k_i | v_i] (Megatron's layout, which
        hyparallel's tensor-parallel analysis reads as a per-head interleave: the same column/row
        splits and head counts as the zoo GPT's [q | k | v]);
      * the residual's bias-dropout-add is one dropout op (``BiasDropoutAdd``, a Dropout that adds
        the residual), which keeps a one-byte mask and nothing else, as the fused kernel (the zoo's
        ``bias_dropout_residual`` traces as a dropout and an add).
    What stays different, and which way it moves a prediction:
      * layout: Megatron is sequence-first, (s, b, np, hn) -> (s, b * np, hn) is a view and baddbmm
        reads q and k strided; hyparallel's sequence parallelism gathers dim 1 of (batch, seq,
        hidden), so this model stays batch-first and (b, s, np, hn) -> (b * np, s, hn) copies q, k
        and v (three copies of (s, h / tp) per sequence that Megatron does not make). Against one
        pass over the scores (np / tp x s^2 elements) each copy moves 2 hn / s of it: 3 x 2 x 128 /
        2048 = 0.375 score passes at hn 128, where the scores' own memory-bound traffic per layer is
        about 6.5 passes forward (write, softmax read and write, dropout read, write and mask, bmm
        read): pessimistic by some 5% of the attention's memory-bound time forward, and three kernel
        floors per layer (more on the smallest rows, hn 96: 0.28 passes, the floors weigh more);
      * the causal mask read by baddbmm is charged once per sequence of the micro-batch (the cost
        model scales every input by the micro-batch): pessimistic by 1 / (heads per rank) of one
        score read, under 1%;
      * the cost model charges every memory-bound op's backward twice its forward (profile.py,
        _BACKWARD_RATIO's default), where softmax's backward moves 1.5 times its forward bytes
        (probabilities and their gradient in, one gradient out) and dropout's about 1 time (gradient
        and mask in, one out): some 3 score passes per layer more than Megatron moves, pessimistic
        by roughly 4% of the 1.7B row's step (a pass there is 16 x 24 x 2048^2 x 2 bytes, 2 ms at
        the a100-80g preset's 0.8 x 2.039 TB/s; 24 layers), less as the scores' share of a layer
        falls with the hidden size. Not corrected here: it is the cost model's, for every model;
      * Megatron's FusedScaleMaskSoftmax reads fp16 scores and writes fp16 probabilities (fp32
        inside): the trace's softmax is costed at the plan's dtype in and out, the same bytes;
        torch's dropout keeps a one-byte bool mask, as Megatron's nn.Dropout and its jit-fused
        bias-dropout-add.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hyparallel.models.gpt import GPT, Block, CausalSelfAttention, GPTConfig

# GPT-2's BPE vocabulary (gpt2-vocab.json: 50,257 tokens), which Megatron-LM pads per
# tensor-parallel degree.
GPT2_VOCAB = 50257
# Megatron-LM's --make-vocab-size-divisible-by default (megatron/arguments.py at de7dc40).
VOCAB_DIVISIBLE_BY = 128


def padded_vocab(tp: int, vocab: int = GPT2_VOCAB, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """The vocabulary Megatron-LM trains: ``vocab`` padded up to a multiple of divisible_by x tp
    (megatron/tokenizer/tokenizer.py, _vocab_size_with_padding, at de7dc40): 51,200 at tp 8, 50,304
    at tp 1."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


class MegatronAttention(CausalSelfAttention):
    """Megatron-LM's unfused causal attention (Note [the publications' model]); the zoo's qkv and
    proj Linears, the QKV output laid out per head as [q_i | k_i | v_i]."""

    def __init__(self, cfg: GPTConfig, causal_bias: torch.Tensor):
        super().__init__(cfg)
        self.attention_dropout = nn.Dropout(cfg.dropout)
        # (max_seq_len, max_seq_len): 0 on and below the diagonal, -inf above; one tensor shared by
        # every layer.
        self.register_buffer("causal_bias", causal_bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        mixed = self.qkv(x).unflatten(-1, (-1, 3 * self.head_dim))  # (B, T, n_head, 3 * head_dim)
        # Each (B, T, n_head, head_dim) -> (B * n_head, T, head_dim): a copy (Note [the
        # publications' model]).
        q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in mixed.chunk(3, dim=-1))
        # (B * n_head, T, T): masked scores, scale and mask folded into the GEMM
        scores = torch.baddbmm(
            self.causal_bias[:seq, :seq], q, k.transpose(1, 2), alpha=1.0 / math.sqrt(self.head_dim)
        )
        probs = self.attention_dropout(torch.softmax(scores, dim=-1))
        context = torch.bmm(probs, v)  # (B * n_head, T, head_dim)
        # one copy, as Megatron's
        return self.proj(context.unflatten(0, (batch, -1)).transpose(1, 2).flatten(2))


class BiasDropoutAdd(nn.Dropout):
    """``residual + dropout(x)`` as one op, as Megatron-LM's jit-fused bias-dropout-add (the bias is
    the preceding Linear's here): a Dropout, so the trace keeps its one-byte mask and nothing else
    for the backward."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return residual + F.dropout(x, self.p, self.training)


class MegatronBlock(Block):
    """The zoo's pre-LayerNorm block with Megatron's attention and fused bias-dropout-add
    residuals."""

    def __init__(self, cfg: GPTConfig, causal_bias: torch.Tensor):
        super().__init__(cfg)
        self.attn = MegatronAttention(cfg, causal_bias)
        self.attn_residual = BiasDropoutAdd(cfg.dropout)
        self.mlp_residual = BiasDropoutAdd(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn_residual(self.attn(self.attn_norm(x)), x)
        return self.mlp_residual(self.mlp(self.mlp_norm(x)), x)


class MegatronGPT(GPT):
    """The zoo GPT with Megatron-LM's blocks (Note [the publications' model]); same parameters and
    names."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg)
        seq = cfg.max_seq_len
        causal_bias = torch.full((seq, seq), float("-inf")).triu(1)
        self.layers = nn.ModuleList(MegatronBlock(cfg, causal_bias) for _ in range(cfg.num_layers))
        self.init_weights()
