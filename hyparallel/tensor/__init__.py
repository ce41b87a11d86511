"""Tensor parallelism: collectives with autograd, split modules, applying a plan's styles, Triton kernels.

Exports load lazily so that ``hyparallel.tensor.kernels`` (used by the model zoo) imports without
torch.distributed.
"""

from importlib import import_module

_EXPORTS = {
    "TensorParallelInfo": "apply",
    "apply_tensor_parallel": "apply",
    "ColumnParallelLinear": "layers",
    "RowParallelLinear": "layers",
    "VocabParallelEmbedding": "layers",
    "VocabParallelHead": "layers",
    "vocab_parallel_cross_entropy": "layers",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"hyparallel.tensor.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'hyparallel.tensor' has no attribute '{name}'")
