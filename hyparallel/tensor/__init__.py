"""Tensor parallelism: collectives with autograd, split modules, applying a plan's styles.

The fused Triton kernels these modules call live in the leaf package ``hyparallel.kernels``.
"""

from hyparallel.tensor.apply import TensorParallelInfo, apply_tensor_parallel
from hyparallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelInfo",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "apply_tensor_parallel",
    "vocab_parallel_cross_entropy",
]
