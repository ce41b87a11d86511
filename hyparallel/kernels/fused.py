"""Fused Triton kernels for tensor-parallel layers, each with a plain torch fallback.

- ``linear_act``: ``act(x @ weight.T + bias)``, a matmul whose epilogue adds the bias and applies
  the activation.
- ``swiglu``: ``silu(gate) * up``, elementwise forward and backward.
- ``swiglu_linear``: ``silu(x @ gate_weight.T) * (x @ up_weight.T)``, both products in one pass over
  ``x``.
- ``bias_dropout_residual``: ``residual + dropout(x + bias)``, the mask regenerated from a seed in
  backward.

The kernels run when ``kernels_enabled`` says so (CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1`` for the tests); otherwise every function computes the same thing with torch.
Triton is imported on the first kernel launch, never at module import: importing hyparallel must
work, and stay fast, on machines without triton or a GPU.

# Note [what backward saves]
- ``linear_act`` saves ``x`` (reshaped to (M, K), a view when its strides allow) and ``weight`` and,
  for an activation other than "none", the pre-activation ``x @ weight.T + bias`` in the input
  dtype: the forward kernel writes it beside the output in the same epilogue. Recomputing it would
  cost a second matmul in backward; storing it costs one (M, N) tensor, which is what torch itself
  keeps for ``F.linear`` followed by an activation. It is only written when a gradient is needed.
- ``swiglu_linear`` saves ``x``, both weights and the two pre-activations ``x @ gate_weight.T`` and
  ``x @ up_weight.T`` (again only when a gradient is needed), for the same reason.
- ``swiglu`` saves its two inputs.
- ``bias_dropout_residual`` saves no tensor: backward regenerates the keep mask from (seed, element
  offset) with ``tl.rand``, exactly as the forward drew it.
All backward passes use torch matmuls for the weight and input gradients and a Triton elementwise
kernel for the activation derivative. They are once-differentiable (no double backward).

# Note [bf16 dot under the interpreter]
Triton's CPU interpreter stores bf16 as uint16 and its ``tl.dot`` multiplies those integers, so
under
``TRITON_INTERPRET=1`` bf16 tiles are upcast to fp32 before the dot (``UPCAST_DOT``). The products
of bf16 values are exact in fp32, which is what the tensor cores compute on a GPU, so the numbers do
not change; on a GPU the flag is off and the dot takes bf16 operands.
"""

from __future__ import annotations

import contextlib
import functools
import os
from types import SimpleNamespace
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = [
    "Activation",
    "bias_dropout_residual",
    "interpreting",
    "kernels_enabled",
    "linear_act",
    "swiglu",
    "swiglu_linear",
]

Activation = Literal["none", "gelu", "gelu_tanh", "silu"]
ACTIVATIONS: tuple[str, ...] = get_args(Activation)

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------
# When the kernels run
# ----------------------------------------------------------------------------


def interpreting() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's CPU interpreter (the values Triton's own
    getenv_bool accepts)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernels_enabled(*tensors: Tensor | None) -> bool:
    """Whether the Triton path runs for these tensors (``None`` entries, e.g. a missing bias, are
    ignored).

    True when HYPARALLEL_TRITON is not "0", every tensor is on CUDA (or on the CPU with
    TRITON_INTERPRET=1), all share one device and one dtype among float16, bfloat16 and float32, and
    triton imports.
    """
    if os.environ.get("HYPARALLEL_TRITON", "").strip() == "0":
        return False
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        # being traced (torch.compile, torch.export): the torch reference is what gets captured
        return False
    present = [t for t in tensors if t is not None]
    if not present:
        return False
    first = present[0]
    if any(t.device != first.device or t.dtype != first.dtype for t in present[1:]):
        return False
    devices = ("cuda", "cpu") if interpreting() else ("cuda",)
    if first.device.type not in devices or first.dtype not in _KERNEL_DTYPES:
        return False
    return _triton_importable()


def _use_kernels(*tensors: Tensor | None) -> bool:
    """kernels_enabled, plus what the launchers need: no empty tensor, and no autocast region (there
    the torch fallback runs so that autocast's casting rules apply)."""
    present = [t for t in tensors if t is not None]
    if not kernels_enabled(*present) or any(t.numel() == 0 for t in present):
        return False
    return not torch.is_autocast_enabled(present[0].device.type)


def _needs_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {list(ACTIVATIONS)}")


def _device_guard(tensor: Tensor):
    # Triton launches on the current CUDA device; make it the tensors' device.
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


# ----------------------------------------------------------------------------
# Kernels
#
# Note [kernels are module-level functions jitted on first use]
# The device functions and kernels below are plain Python functions until _kernels() runs. It
# imports triton, binds `tl`, replaces each device function in this module's globals with its
# triton.jit version, and wraps the kernels with autotune. They are not built as closures inside a
# builder function because Triton's interpreter (TRITON_INTERPRET=1) re-executes a kernel's source
# in the function's __globals__ and ignores closures: every name a kernel uses must be a module
# global. So Triton is imported on first use only (never when hyparallel is imported), and the
# kernels read as ordinary module-level Triton.
# ----------------------------------------------------------------------------

tl: Any = None  # triton.language, bound by _kernels()


def _activation_forward(z, ACTIVATION: tl.constexpr):
    if ACTIVATION == "gelu":
        z = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))  # 1/sqrt(2)
    elif ACTIVATION == "gelu_tanh":
        # 0.5 * (1 + tanh(u)) == sigmoid(2u), u = sqrt(2/pi) * (z + 0.044715 z^3)
        z = z * tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
    elif ACTIVATION == "silu":
        z = z * tl.sigmoid(z)
    return z


def _activation_derivative(z, ACTIVATION: tl.constexpr):
    if ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
        slope = cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327  # 1/sqrt(2 pi)
    elif ACTIVATION == "gelu_tanh":
        # d/dz [z s], s = sigmoid(2u) = 0.5 (1 + tanh u), ds/dz = 2 s (1 - s) du/dz
        s = tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
        du_dz = 0.7978845608028654 * (1.0 + 0.134145 * z * z)  # sqrt(2/pi) (1 + 3 * 0.044715 z^2)
        slope = s + 2.0 * z * s * (1.0 - s) * du_dz
    elif ACTIVATION == "silu":
        s = tl.sigmoid(z)
        slope = s * (1.0 + z * (1.0 - s))
    else:
        slope = tl.full(z.shape, 1.0, tl.float32)
    return slope


def _swiglu_grads(gate, up, grad):
    sig = tl.sigmoid(gate)
    return grad * up * sig * (1.0 + gate * (1.0 - sig)), grad * gate * sig  # (d gate, d up)


def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row tiles walk the column tiles together, so weight tiles are reused
    # from L2.
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_in_group = GROUP_M * tiles_n
    first_m = (pid // tiles_in_group) * GROUP_M
    group_rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_in_group) % group_rows
    pid_n = (pid % tiles_in_group) // group_rows
    return pid_m, pid_n


def _dot(a, b, acc, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    if UPCAST_DOT:  # Note [bf16 dot under the interpreter]
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


def _store_tile(ptr, values, offs_m, offs_n, M, N):
    # Output tiles go to a contiguous (M, N) tensor.
    ptrs = ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(
        ptrs, values.to(ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N)
    )


def _dropout_keep(seed, offs, p, WIDE_RNG: tl.constexpr):
    # 32-bit Philox counters unless the tensor has 2**31 elements or more.
    if WIDE_RNG:
        uniform = tl.rand(seed, offs)
    else:
        uniform = tl.rand(seed, offs.to(tl.int32))
    return uniform >= p


_DEVICE_FUNCTIONS = (
    _activation_forward,
    _activation_derivative,
    _swiglu_grads,
    _tile_ids,
    _dot,
    _store_tile,
    _dropout_keep,
)


def _linear_act_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    preact_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    HAS_BIAS: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    ACTIVATION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # x (M, K) and weight (N, K) with any strides; out and preact contiguous (M, N).
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge wrap to valid ones (their results are never stored): loads mask
    # only K.
    x_ptrs = x_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + (offs_n % N).to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0)
            w = tl.load(w_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
        acc = _dot(x, w, acc, UPCAST_DOT, DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if STORE_PREACT:
        _store_tile(preact_ptr, acc, offs_m, offs_n, M, N)
    _store_tile(out_ptr, _activation_forward(acc, ACTIVATION), offs_m, offs_n, M, N)


def _swiglu_linear_kernel(
    x_ptr,
    wg_ptr,
    wu_ptr,
    out_ptr,
    gate_ptr,
    up_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_gn,
    stride_gk,
    stride_un,
    stride_uk,
    STORE_PREACT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # As _linear_act_kernel, with two weights (N, K) sharing each x tile: two accumulators per
    # program.
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    wrapped_n = (offs_n % N).to(tl.int64)[None, :]
    x_ptrs = x_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    wg_ptrs = wg_ptr + wrapped_n * stride_gn + offs_k[:, None] * stride_gk
    wu_ptrs = wu_ptr + wrapped_n * stride_un + offs_k[:, None] * stride_uk
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs)
            wg = tl.load(wg_ptrs)
            wu = tl.load(wu_ptrs)
        else:
            x = tl.load(x_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0.0)
            wg = tl.load(wg_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
            wu = tl.load(wu_ptrs, mask=offs_k[:, None] < K - k * BLOCK_K, other=0.0)
        acc_gate = _dot(x, wg, acc_gate, UPCAST_DOT, DOT_PRECISION)
        acc_up = _dot(x, wu, acc_up, UPCAST_DOT, DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        wg_ptrs += BLOCK_K * stride_gk
        wu_ptrs += BLOCK_K * stride_uk
    if STORE_PREACT:
        _store_tile(gate_ptr, acc_gate, offs_m, offs_n, M, N)
        _store_tile(up_ptr, acc_up, offs_m, offs_n, M, N)
    _store_tile(out_ptr, acc_gate * tl.sigmoid(acc_gate) * acc_up, offs_m, offs_n, M, N)


# The elementwise kernels run over contiguous tensors of n_elements, with 64-bit offsets.


def _activation_backward_kernel(
    grad_ptr, preact_ptr, grad_preact_ptr, n_elements, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    preact = tl.load(preact_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    grad_preact = grad * _activation_derivative(preact, ACTIVATION)
    tl.store(grad_preact_ptr + offs, grad_preact.to(grad_preact_ptr.dtype.element_ty), mask=mask)


def _swiglu_forward_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def _swiglu_backward_kernel(
    gate_ptr, up_ptr, grad_ptr, grad_gate_ptr, grad_up_ptr, n_elements, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    grad_gate, grad_up = _swiglu_grads(gate, up, grad)
    tl.store(grad_gate_ptr + offs, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_up_ptr + offs, grad_up.to(grad_up_ptr.dtype.element_ty), mask=mask)


def _bias_dropout_residual_kernel(
    x_ptr,
    bias_ptr,
    residual_ptr,
    out_ptr,
    n_elements,
    n_cols,
    p,
    scale,
    seed,
    HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr,
    WIDE_RNG: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    hidden = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        hidden += tl.load(bias_ptr + offs % n_cols, mask=mask, other=0.0).to(tl.float32)
    if DROPOUT:
        hidden = tl.where(_dropout_keep(seed, offs, p, WIDE_RNG), hidden * scale, 0.0)
    residual = tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (residual + hidden).to(out_ptr.dtype.element_ty), mask=mask)


def _dropout_backward_kernel(
    grad_ptr, grad_x_ptr, n_elements, p, scale, seed, WIDE_RNG: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    grad_x = tl.where(_dropout_keep(seed, offs, p, WIDE_RNG), grad * scale, 0.0)
    tl.store(grad_x_ptr + offs, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)


def _matmul_configs(interpret: bool, two_accumulators: bool) -> list:
    import triton

    def config(block_m, block_n, block_k, warps, stages):
        sizes = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8}
        return triton.Config(sizes, num_warps=warps, num_stages=stages)

    # one small config: the tests stay fast, and M=37, N=45, K=29 cross every tile edge
    if interpret:
        return [
            triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}, num_warps=1)
        ]
    # twice the accumulator registers and weight tiles per program: smaller tiles
    if two_accumulators:
        return [
            config(128, 128, 64, 8, 3),
            config(128, 128, 64, 8, 4),
            config(128, 64, 64, 4, 4),
            config(64, 128, 64, 4, 4),
            config(64, 64, 64, 4, 4),
        ]
    # Shared memory of the largest in bf16: (128*64 + 64*256) * 2 B * 3 stages = 144 KiB (Hopper has
    # 227 KiB).
    return [
        config(128, 256, 64, 8, 3),
        config(256, 128, 64, 8, 3),
        config(128, 128, 64, 8, 4),
        config(128, 128, 64, 4, 4),
        config(128, 64, 64, 4, 4),
        config(64, 128, 64, 4, 4),
    ]


def _elementwise_configs(interpret: bool) -> list:
    import triton

    if interpret:
        return [triton.Config({"BLOCK": 256}, num_warps=1)]
    return [
        triton.Config({"BLOCK": 1024}, num_warps=4),
        triton.Config({"BLOCK": 2048}, num_warps=8),
        triton.Config({"BLOCK": 4096}, num_warps=8),
    ]


@functools.cache
def _kernels() -> SimpleNamespace:
    """Jit everything above, once (Note [kernels are module-level functions jitted on first use]).

    Like triton.jit, this reads TRITON_INTERPRET once: set it before the first kernel launch.
    """
    import triton
    import triton.language

    module = globals()
    module["tl"] = triton.language
    for device_function in _DEVICE_FUNCTIONS:
        module[device_function.__name__] = triton.jit(device_function)
    interpret = interpreting()
    even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})

    def matmul(kernel, two_accumulators: bool):
        configs = _matmul_configs(interpret, two_accumulators)
        return triton.autotune(configs=configs, key=["M", "N", "K"])(even_k(triton.jit(kernel)))

    def elementwise(kernel, **jit_options):
        autotune = triton.autotune(configs=_elementwise_configs(interpret), key=["n_elements"])
        return autotune(triton.jit(kernel, **jit_options))

    return SimpleNamespace(
        interpret=interpret,
        linear_act=matmul(_linear_act_kernel, two_accumulators=False),
        swiglu_linear=matmul(_swiglu_linear_kernel, two_accumulators=True),
        activation_backward=elementwise(_activation_backward_kernel),
        swiglu_forward=elementwise(_swiglu_forward_kernel),
        swiglu_backward=elementwise(_swiglu_backward_kernel),
        # A seed is an ordinary value: no recompilation for seeds that happen to be 1 or divisible
        # by 16.
        bias_dropout_residual=elementwise(
            _bias_dropout_residual_kernel, do_not_specialize=["seed"]
        ),
        dropout_backward=elementwise(_dropout_backward_kernel, do_not_specialize=["seed"]),
    )


# ----------------------------------------------------------------------------
# Launchers: allocate outputs, pick the grid, pass strides. Outputs are contiguous, in the input
# dtype. ----------------------------------------------------------------------------


def _dot_options(dtype: torch.dtype) -> dict:
    interpret = _kernels().interpret
    # fp32 inputs follow torch's matmul precision setting (TF32 unless "highest"); 16-bit inputs
    # ignore it.
    tf32 = dtype != torch.float32 or torch.get_float32_matmul_precision() != "highest"
    return {
        "UPCAST_DOT": interpret and dtype == torch.bfloat16,
        "DOT_PRECISION": "tf32" if tf32 else "ieee",
    }


def _matmul_grid(M: int, N: int):
    return lambda meta: (_cdiv(M, meta["BLOCK_M"]) * _cdiv(N, meta["BLOCK_N"]),)


def _elementwise_grid(n_elements: int):
    return lambda meta: (_cdiv(n_elements, meta["BLOCK"]),)


def _launch_linear_act(
    x2d: Tensor, weight: Tensor, bias: Tensor | None, activation: str, store_preact: bool
) -> tuple[Tensor, Tensor | None]:
    (M, K), N = x2d.shape, weight.shape[0]
    out = torch.empty((M, N), device=x2d.device, dtype=x2d.dtype)
    preact = torch.empty_like(out) if store_preact else None
    bias = bias.contiguous() if bias is not None else None
    with _device_guard(x2d):
        _kernels().linear_act[_matmul_grid(M, N)](
            x2d,
            weight,
            bias if bias is not None else out,
            out,
            preact if store_preact else out,
            M,
            N,
            K,
            x2d.stride(0),
            x2d.stride(1),
            weight.stride(0),
            weight.stride(1),
            HAS_BIAS=bias is not None,
            STORE_PREACT=store_preact,
            ACTIVATION=activation,
            **_dot_options(x2d.dtype),
        )
    return out, preact


def _launch_swiglu_linear(
    x2d: Tensor, gate_weight: Tensor, up_weight: Tensor, store_preact: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    (M, K), N = x2d.shape, gate_weight.shape[0]
    out = torch.empty((M, N), device=x2d.device, dtype=x2d.dtype)
    gate = torch.empty_like(out) if store_preact else None
    up = torch.empty_like(out) if store_preact else None
    with _device_guard(x2d):
        _kernels().swiglu_linear[_matmul_grid(M, N)](
            x2d,
            gate_weight,
            up_weight,
            out,
            gate if store_preact else out,
            up if store_preact else out,
            M,
            N,
            K,
            x2d.stride(0),
            x2d.stride(1),
            gate_weight.stride(0),
            gate_weight.stride(1),
            up_weight.stride(0),
            up_weight.stride(1),
            STORE_PREACT=store_preact,
            **_dot_options(x2d.dtype),
        )
    return out, gate, up


def _launch_activation_backward(grad: Tensor, preact: Tensor, activation: str) -> Tensor:
    grad = grad.contiguous()
    grad_preact = torch.empty_like(preact)
    with _device_guard(grad):
        _kernels().activation_backward[_elementwise_grid(grad.numel())](
            grad, preact, grad_preact, grad.numel(), ACTIVATION=activation
        )
    return grad_preact


def _launch_swiglu_backward(gate: Tensor, up: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    grad = grad.contiguous()
    grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
    with _device_guard(grad):
        _kernels().swiglu_backward[_elementwise_grid(grad.numel())](
            gate, up, grad, grad_gate, grad_up, grad.numel()
        )
    return grad_gate, grad_up


# ----------------------------------------------------------------------------
# Autograd functions (Note [what backward saves])
# ----------------------------------------------------------------------------


class _LinearAct(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, needs_grad: bool
    ) -> Tensor:
        x2d = x.reshape(-1, x.shape[-1])  # (M, K), a view when the strides allow
        store_preact = needs_grad and activation != "none"
        out, preact = _launch_linear_act(x2d, weight, bias, activation, store_preact)
        ctx.activation, ctx.x_shape, ctx.has_bias = activation, x.shape, bias is not None
        ctx.save_for_backward(x2d, weight, preact)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        x2d, weight, preact = ctx.saved_tensors
        grad_preact = grad_out.reshape(-1, weight.shape[0])  # (M, N)
        if ctx.activation != "none":
            grad_preact = _launch_activation_backward(grad_preact, preact, ctx.activation)
        needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_x = (grad_preact @ weight).view(ctx.x_shape) if needs_x else None
        grad_weight = grad_preact.t() @ x2d if needs_weight else None
        grad_bias = grad_preact.sum(0) if needs_bias and ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None, None


class _SwiGLULinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, gate_weight: Tensor, up_weight: Tensor, needs_grad: bool) -> Tensor:
        x2d = x.reshape(-1, x.shape[-1])  # (M, K)
        out, gate, up = _launch_swiglu_linear(x2d, gate_weight, up_weight, store_preact=needs_grad)
        ctx.x_shape = x.shape
        ctx.save_for_backward(x2d, gate_weight, up_weight, gate, up)
        return out.view(*x.shape[:-1], gate_weight.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        x2d, gate_weight, up_weight, gate, up = ctx.saved_tensors
        # (M, N) each
        grad_gate, grad_up = _launch_swiglu_backward(gate, up, grad_out.reshape(gate.shape))
        needs_x, needs_gate_weight, needs_up_weight = ctx.needs_input_grad[:3]
        grad_x = (
            torch.addmm(grad_gate @ gate_weight, grad_up, up_weight).view(ctx.x_shape)
            if needs_x
            else None
        )
        grad_gate_weight = grad_gate.t() @ x2d if needs_gate_weight else None
        grad_up_weight = grad_up.t() @ x2d if needs_up_weight else None
        return grad_x, grad_gate_weight, grad_up_weight, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        with _device_guard(gate):
            _kernels().swiglu_forward[_elementwise_grid(gate.numel())](gate, up, out, gate.numel())
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        gate, up = ctx.saved_tensors
        return _launch_swiglu_backward(gate, up, grad_out)


class _BiasDropoutResidual(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: Tensor, bias: Tensor | None, residual: Tensor, p: float, seed: int
    ) -> Tensor:
        # p == 0 means no dropout; the caller folds `training` into p.
        x, residual = x.contiguous(), residual.contiguous()
        out = torch.empty_like(x)
        n_elements = x.numel()
        ctx.p, ctx.seed, ctx.n_cols, ctx.has_bias = p, seed, x.shape[-1], bias is not None
        with _device_guard(x):
            _kernels().bias_dropout_residual[_elementwise_grid(n_elements)](
                x,
                bias.contiguous() if bias is not None else x,
                residual,
                out,
                n_elements,
                x.shape[-1],
                p,
                _dropout_scale(p),
                seed,
                HAS_BIAS=bias is not None,
                DROPOUT=p > 0,
                WIDE_RNG=n_elements >= 2**31,
            )
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        grad_x = grad_out
        if ctx.p > 0:  # the same (seed, offset) pairs as the forward: the same mask
            grad_out = grad_out.contiguous()
            grad_x = torch.empty_like(grad_out)
            n_elements = grad_out.numel()
            with _device_guard(grad_out):
                _kernels().dropout_backward[_elementwise_grid(n_elements)](
                    grad_out,
                    grad_x,
                    n_elements,
                    ctx.p,
                    _dropout_scale(ctx.p),
                    ctx.seed,
                    WIDE_RNG=n_elements >= 2**31,
                )
        needs_x, needs_bias, needs_residual = ctx.needs_input_grad[:3]
        grad_bias = grad_x.reshape(-1, ctx.n_cols).sum(0) if needs_bias and ctx.has_bias else None
        return (
            grad_x if needs_x else None,
            grad_bias,
            grad_out if needs_residual else None,
            None,
            None,
        )


def _dropout_scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


# ----------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------


def _activation_torch(z: Tensor, activation: str) -> Tensor:
    if activation == "gelu":
        return F.gelu(z)
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if activation == "silu":
        return F.silu(z)
    return z


def linear_act(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: Activation = "none"
) -> Tensor:
    """``act(x @ weight.T + bias)`` for x (..., K), weight (N, K) as in nn.Linear, bias (N,) or
    None.

    One fused Triton matmul with a bias + activation epilogue ("gelu" is the erf form, "gelu_tanh"
    the tanh approximation); the torch fallback is ``F.linear`` followed by the activation.
    """
    _check_activation(activation)
    if not _use_kernels(x, weight, bias):
        return _activation_torch(F.linear(x, weight, bias), activation)
    return _LinearAct.apply(x, weight, bias, activation, _needs_grad(x, weight, bias))


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` in one elementwise kernel, forward and backward; the inputs broadcast."""
    if not _use_kernels(gate, up):
        return F.silu(gate) * up
    if gate.shape != up.shape:
        # autograd sums the gradients back over broadcast dims
        gate, up = torch.broadcast_tensors(gate, up)
    return _SwiGLU.apply(gate, up)


def swiglu_linear(x: Tensor, gate_weight: Tensor, up_weight: Tensor) -> Tensor:
    """``silu(x @ gate_weight.T) * (x @ up_weight.T)``: both products accumulate in one kernel pass
    over x (two accumulators per program) and the SwiGLU is applied in the epilogue. Weights are (N,
    K)."""
    if not _use_kernels(x, gate_weight, up_weight) or gate_weight.shape != up_weight.shape:
        return F.silu(F.linear(x, gate_weight)) * F.linear(x, up_weight)
    return _SwiGLULinear.apply(x, gate_weight, up_weight, _needs_grad(x, gate_weight, up_weight))


def bias_dropout_residual(
    x: Tensor,
    bias: Tensor | None,
    residual: Tensor,
    p: float,
    training: bool,
    seed: int | None = None,
) -> Tensor:
    """``residual + dropout(x + bias, p)`` in one kernel; bias is (x.shape[-1],) or None.

    On the Triton path the keep mask is drawn in-kernel from (seed, element offset), so backward
    regenerates it instead of storing it, and the same seed gives the same mask. ``seed=None`` draws
    one from torch's default generator (``torch.manual_seed`` makes it reproducible). The torch
    fallback uses ``F.dropout`` and ignores ``seed``.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    p = float(p) if training else 0.0
    shapes_fit = residual.shape == x.shape and (bias is None or bias.shape == x.shape[-1:])
    if not shapes_fit or not _use_kernels(x, bias, residual):
        hidden = x + bias if bias is not None else x
        return residual + F.dropout(hidden, p, training=p > 0)
    if p > 0 and seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    return _BiasDropoutResidual.apply(x, bias, residual, p, seed if p > 0 else 0)
