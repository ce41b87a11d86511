"""Tensor-parallel modules, collectives with autograd and Triton kernels (the Tensor-parallelism issue)."""
