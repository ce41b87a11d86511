"""Fused Triton kernels with plain torch fallbacks, used by the model zoo and the tensor-parallel
layers.

A leaf package: it imports torch and nothing else of hyparallel, and triton only on the first kernel
launch, so importing it (or hyparallel) needs neither triton nor a GPU. The code is in
``hyparallel.kernels.fused``.
"""

from hyparallel.kernels.fused import (
    Activation,
    bias_dropout_residual,
    interpreting,
    kernels_enabled,
    linear_act,
    swiglu,
    swiglu_linear,
)

__all__ = [
    "Activation",
    "bias_dropout_residual",
    "interpreting",
    "kernels_enabled",
    "linear_act",
    "swiglu",
    "swiglu_linear",
]
