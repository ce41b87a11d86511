"""Triton kernels against plain torch references, run on the CPU under Triton's interpreter (no GPU
needed).

Every kernel is checked forward and backward (the gradient of every input) in fp32 and bf16, on
shapes that are not multiples of the interpreter's block sizes (16 for the matmuls, 256 for
elementwise kernels) and on 3-D (batch, seq, hidden) inputs.
"""

from __future__ import annotations

import os

# Run by tests/test_kernels.py in a process of its own started with TRITON_INTERPRET=1: Triton reads
# the variable when it is first imported, and nothing else in the suite should run under the
# interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip(
    "triton", reason="triton is not installed: the kernel tests run under its CPU interpreter"
)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hyparallel.kernels import (  # noqa: E402
    bias_dropout_residual,
    kernels_enabled,
    linear_act,
    swiglu,
    swiglu_linear,
)

# The module itself, not the package: _kernels() rebinds its globals (tl, the device functions) on
# first use.
from hyparallel.kernels import fused as kernels  # noqa: E402

# The interpreter computes sigmoid(z) as 1 / (1 + exp(-z)) in numpy, which warns when exp overflows
# to inf for very negative z; the result (0) is the right one.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPES = [torch.float32, torch.bfloat16]
ACTIVATIONS = ["none", "gelu", "gelu_tanh", "silu"]

# Tolerances, relative to each tensor's largest reference magnitude (at least 1):
# - fp32: the kernels accumulate in fp32 like torch and only the summation order differs, so on
#   these sizes (K <= 45 terms) results agree to about 1e-6; 1e-5 leaves room and still catches any
#   wrong term or mask.
# - bf16: outputs carry 8 significant bits (one rounding is up to 2**-8 relative, and the
#   interpreter truncates rather than rounds, up to 2**-7). The torch reference also rounds its
#   intermediates (the pre-activation, the gradient of the pre-activation) to bf16 where the kernels
#   keep fp32, and those differences add up in the backward matmuls: measured errors reach 8e-3
#   (swiglu_linear), so 2e-2.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# (x shape, N): ragged 2-D, and 3-D with K a block multiple
MATMUL_SHAPES = [((37, 29), 45), ((3, 7, 32), 40)]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tolerance = TOLERANCE[dtype]
    scale = max(1.0, expected.float().abs().max().item())
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=tolerance, atol=tolerance * scale
    )


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def run_with_grads(fn, *inputs: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """fn's output and the gradients of every tensor input, for a fixed random output gradient."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in inputs]
    out = fn(*leaves)
    out.backward(randn(*out.shape, dtype=out.dtype, seed=99))
    return out.detach(), [t.grad for t in leaves if t is not None]


def assert_kernel_ran(out: torch.Tensor, function: str) -> None:
    # The autograd node of the Triton path's Function: the torch fallback never creates it.
    assert type(out.grad_fn).__name__ == f"{function}Backward", type(out.grad_fn).__name__


def reference_activation(z: torch.Tensor, activation: str) -> torch.Tensor:
    return {
        "none": lambda: z,
        "gelu": lambda: F.gelu(z),
        "gelu_tanh": lambda: F.gelu(z, approximate="tanh"),
        "silu": lambda: F.silu(z),
    }[activation]()


def reference_linear_act(x, weight, bias, activation):
    return reference_activation(F.linear(x, weight, bias), activation)


def reference_swiglu_linear(x, gate_weight, up_weight):
    return F.silu(x @ gate_weight.T) * (x @ up_weight.T)


# ----------------------------------------------------------------------------
# kernels_enabled
# ----------------------------------------------------------------------------


def test_kernels_enabled_for_cpu_tensors_under_the_interpreter(monkeypatch):
    x = torch.zeros(4, 4)
    assert kernels_enabled(x, None, x.bfloat16().float())
    assert kernels_enabled(x.bfloat16()) and kernels_enabled(x.half())
    assert not kernels_enabled(x.double()) and not kernels_enabled(x.int())
    assert not kernels_enabled(x, x.bfloat16()), "mixed dtypes"
    assert not kernels_enabled() and not kernels_enabled(None)
    monkeypatch.setenv("HYPARALLEL_TRITON", "0")
    assert not kernels_enabled(x)
    monkeypatch.delenv("HYPARALLEL_TRITON")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not kernels_enabled(x), "CPU tensors need the interpreter"


# ----------------------------------------------------------------------------
# linear_act
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("x_shape, n_out", MATMUL_SHAPES, ids=["2d_ragged", "3d"])
def test_linear_act_matches_torch(dtype, activation, has_bias, x_shape, n_out):
    k = x_shape[-1]
    x = randn(*x_shape, dtype=dtype, seed=1)
    weight = randn(n_out, k, dtype=dtype, scale=k**-0.5, seed=2)
    bias = randn(n_out, dtype=dtype, seed=3) if has_bias else None
    assert kernels_enabled(x, weight, bias)

    out, grads = run_with_grads(lambda *a: linear_act(*a, activation=activation), x, weight, bias)
    expected, expected_grads = run_with_grads(
        lambda *a: reference_linear_act(*a, activation), x, weight, bias
    )

    assert out.shape == (*x_shape[:-1], n_out)
    assert_close(out, expected, dtype)
    assert len(grads) == (3 if has_bias else 2)
    for grad, expected_grad in zip(grads, expected_grads):
        assert_close(grad, expected_grad, dtype)


def test_linear_act_runs_the_kernel():
    x, weight = (
        randn(5, 16, dtype=torch.float32).requires_grad_(),
        randn(8, 16, dtype=torch.float32),
    )
    assert_kernel_ran(linear_act(x, weight, activation="gelu"), "_LinearAct")


def test_linear_act_non_contiguous_inputs():
    # x is a transposed view (strides (1, M)), weight a transposed (K, N) buffer: the kernel reads
    # strides.
    dtype = torch.float32
    x = randn(29, 37, dtype=dtype, seed=1).T
    weight = randn(29, 45, dtype=dtype, scale=29**-0.5, seed=2).T
    bias = randn(90, dtype=dtype, seed=3)[::2]
    assert not x.is_contiguous() and not weight.is_contiguous() and not bias.is_contiguous()
    out, grads = run_with_grads(lambda *a: linear_act(*a, activation="silu"), x, weight, bias)
    expected, expected_grads = run_with_grads(
        lambda *a: reference_linear_act(*a, "silu"), x, weight, bias
    )
    assert_close(out, expected, dtype)
    for grad, expected_grad in zip(grads, expected_grads):
        assert_close(grad, expected_grad, dtype)


def test_linear_act_without_grad_matches_and_saves_nothing():
    x, weight = randn(37, 29, dtype=torch.float32), randn(45, 29, dtype=torch.float32, seed=2)
    with torch.no_grad():
        out = linear_act(x, weight, activation="gelu_tanh")
    assert out.grad_fn is None
    assert_close(out, reference_linear_act(x, weight, None, "gelu_tanh"), torch.float32)


def test_linear_act_rejects_unknown_activation():
    with pytest.raises(ValueError, match="relu"):
        linear_act(torch.zeros(2, 4), torch.zeros(3, 4), activation="relu")


# ----------------------------------------------------------------------------
# swiglu and swiglu_linear
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(37, 45), (2, 5, 24)], ids=["2d_ragged", "3d"])
def test_swiglu_matches_torch(dtype, shape):
    gate, up = randn(*shape, dtype=dtype, scale=2.0, seed=1), randn(*shape, dtype=dtype, seed=2)
    assert kernels_enabled(gate, up)
    out, grads = run_with_grads(swiglu, gate, up)
    expected, expected_grads = run_with_grads(lambda g, u: F.silu(g) * u, gate, up)
    assert_close(out, expected, dtype)
    for grad, expected_grad in zip(grads, expected_grads):
        assert_close(grad, expected_grad, dtype)


def test_swiglu_non_contiguous_and_broadcast_inputs():
    dtype = torch.float32
    fused = randn(2, 5, 48, dtype=dtype, seed=1).requires_grad_()
    gate, up = fused.chunk(2, dim=-1)  # the usual (…, 2F) projection split: strided views
    out = swiglu(gate, up)
    assert_kernel_ran(out, "_SwiGLU")
    out.backward(torch.ones_like(out))
    reference_fused = fused.detach().clone().requires_grad_()
    reference_gate, reference_up = reference_fused.chunk(2, dim=-1)
    expected = F.silu(reference_gate) * reference_up
    expected.backward(torch.ones_like(expected))
    assert_close(out.detach(), expected.detach(), dtype)
    assert_close(fused.grad, reference_fused.grad, dtype)

    # up broadcast over rows
    gate, up = randn(6, 24, dtype=dtype, seed=3), randn(24, dtype=dtype, seed=4)
    _, grads = run_with_grads(swiglu, gate, up)
    _, expected_grads = run_with_grads(lambda g, u: F.silu(g) * u, gate, up)
    assert grads[1].shape == (24,)
    for grad, expected_grad in zip(grads, expected_grads):
        assert_close(grad, expected_grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("x_shape, n_out", MATMUL_SHAPES, ids=["2d_ragged", "3d"])
def test_swiglu_linear_matches_torch(dtype, x_shape, n_out):
    k = x_shape[-1]
    x = randn(*x_shape, dtype=dtype, seed=1)
    gate_weight = randn(n_out, k, dtype=dtype, scale=k**-0.5, seed=2)
    up_weight = randn(n_out, k, dtype=dtype, scale=k**-0.5, seed=3)
    assert kernels_enabled(x, gate_weight, up_weight)
    out, grads = run_with_grads(swiglu_linear, x, gate_weight, up_weight)
    expected, expected_grads = run_with_grads(reference_swiglu_linear, x, gate_weight, up_weight)
    assert out.shape == (*x_shape[:-1], n_out)
    assert_close(out, expected, dtype)
    for grad, expected_grad in zip(grads, expected_grads):
        assert_close(grad, expected_grad, dtype)


def test_swiglu_linear_runs_the_kernel():
    x = randn(5, 16, dtype=torch.float32).requires_grad_()
    assert_kernel_ran(
        swiglu_linear(x, randn(8, 16, dtype=torch.float32), randn(8, 16, dtype=torch.float32)),
        "_SwiGLULinear",
    )


# ----------------------------------------------------------------------------
# bias_dropout_residual
# ----------------------------------------------------------------------------


def dropout_inputs(shape, dtype, with_bias=True):
    # x + bias in [1, 3): a kept element changes the output by at least 1/(1-p) > 1, far above the
    # rounding of the residual, so `out == residual` marks exactly the dropped elements, even in
    # bf16.
    x = (1.0 + torch.rand(shape, generator=torch.Generator().manual_seed(1))).to(dtype)
    bias = (
        torch.rand(shape[-1], generator=torch.Generator().manual_seed(2)).to(dtype)
        if with_bias
        else None
    )
    return x, bias, randn(*shape, dtype=dtype, seed=3)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("shape", [(37, 45), (3, 7, 40)], ids=["2d_ragged", "3d"])
def test_bias_dropout_residual_without_dropout_is_exact_in_fp32(shape, with_bias):
    x, bias, residual = (
        randn(*shape, dtype=torch.float32, seed=1),
        None,
        randn(*shape, dtype=torch.float32, seed=3),
    )
    if with_bias:
        bias = randn(shape[-1], dtype=torch.float32, seed=2)
    expected = x + bias + residual if with_bias else x + residual
    for p, training in [(0.0, True), (0.5, False)]:
        out, grads = run_with_grads(
            lambda *a, p=p, training=training: bias_dropout_residual(a[0], a[1], a[2], p, training),
            x,
            bias,
            residual,
        )
        assert torch.equal(out, expected)
        grad_out = randn(*shape, dtype=torch.float32, seed=99)
        assert torch.equal(grads[0], grad_out) and torch.equal(grads[-1], grad_out)
        if with_bias:
            assert_close(grads[1], grad_out.reshape(-1, shape[-1]).sum(0), torch.float32)


@pytest.mark.parametrize("shape", [(37, 45), (3, 7, 40)], ids=["2d_ragged", "3d"])
def test_bias_dropout_residual_without_dropout_bf16(shape):
    dtype = torch.bfloat16
    x, bias, residual = (
        randn(*shape, dtype=dtype, seed=1),
        randn(shape[-1], dtype=dtype, seed=2),
        randn(*shape, dtype=dtype, seed=3),
    )
    out, grads = run_with_grads(
        lambda *a: bias_dropout_residual(*a, p=0.0, training=True), x, bias, residual
    )
    expected, expected_grads = run_with_grads(lambda a, b, r: a + b + r, x, bias, residual)
    # The kernel adds in fp32 and rounds once; torch rounds x + bias to bf16 first.
    assert_close(out, expected, dtype)
    for grad, expected_grad in zip(grads, expected_grads):
        assert_close(grad, expected_grad, dtype)


def test_bias_dropout_residual_non_contiguous_inputs():
    x = randn(45, 37, dtype=torch.float32, seed=1).T
    residual = randn(37, 90, dtype=torch.float32, seed=3)[:, ::2]
    bias = randn(45, dtype=torch.float32, seed=2)
    out = bias_dropout_residual(x, bias, residual, p=0.0, training=True)
    assert torch.equal(out, x + bias + residual)


def test_bias_dropout_residual_is_reproducible_by_seed():
    x, bias, residual = dropout_inputs((37, 45), torch.float32)
    first = bias_dropout_residual(x, bias, residual, p=0.3, training=True, seed=1234)
    assert torch.equal(
        first, bias_dropout_residual(x, bias, residual, p=0.3, training=True, seed=1234)
    )
    assert not torch.equal(
        first, bias_dropout_residual(x, bias, residual, p=0.3, training=True, seed=4321)
    )
    torch.manual_seed(7)
    drawn = bias_dropout_residual(x, bias, residual, p=0.3, training=True)
    torch.manual_seed(7)
    assert torch.equal(drawn, bias_dropout_residual(x, bias, residual, p=0.3, training=True))
    assert not torch.equal(drawn, bias_dropout_residual(x, bias, residual, p=0.3, training=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_dropout_residual_drops_a_fraction_p_and_scales_the_rest(dtype):
    p, shape = 0.3, (3, 64, 40)  # 7,680 elements over 30 blocks
    x, bias, residual = dropout_inputs(shape, dtype)
    assert kernels_enabled(x, bias, residual)
    out = bias_dropout_residual(x, bias, residual, p=p, training=True, seed=5)
    dropped = out == residual
    # Binomial standard deviation sqrt(p (1 - p) / n) = 0.005: a bound of 0.03 cannot fail by
    # chance.
    assert abs(dropped.float().mean().item() - p) < 0.03
    expected_kept = (residual.float() + (x.float() + bias.float()) / (1 - p)).to(dtype)
    assert_close(out[~dropped], expected_kept[~dropped], dtype)
    # The mask is not a function of the column or the row alone: offsets feed the generator.
    assert (
        dropped.reshape(-1, shape[-1]).any(0).all()
        and not dropped.reshape(-1, shape[-1]).all(0).any()
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_dropout_residual_backward_uses_the_forward_mask(dtype):
    p, shape = 0.4, (2, 37, 45)
    x, bias, residual = (t.requires_grad_() for t in dropout_inputs(shape, dtype))
    out = bias_dropout_residual(x, bias, residual, p=p, training=True, seed=11)
    assert_kernel_ran(out, "_BiasDropoutResidual")
    out.backward(torch.ones_like(out))
    dropped = out.detach() == residual.detach()
    assert 0 < dropped.sum() < dropped.numel()
    assert torch.equal(x.grad == 0, dropped)
    assert_close(x.grad[~dropped], torch.full_like(x.grad[~dropped], 1 / (1 - p)), dtype)
    assert torch.equal(residual.grad, torch.ones_like(residual))
    assert_close(bias.grad, x.grad.reshape(-1, shape[-1]).float().sum(0).to(dtype), dtype)


def test_bias_dropout_residual_with_p_one_keeps_only_the_residual():
    x, bias, residual = (t.requires_grad_() for t in dropout_inputs((37, 45), torch.float32))
    out = bias_dropout_residual(x, bias, residual, p=1.0, training=True, seed=3)
    assert torch.equal(out, residual.detach())
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(
        bias.grad, torch.zeros_like(bias)
    )


def test_bias_dropout_residual_rejects_bad_p():
    with pytest.raises(ValueError, match="between 0 and 1"):
        bias_dropout_residual(torch.zeros(2, 4), None, torch.zeros(2, 4), p=1.5, training=True)


# ----------------------------------------------------------------------------
# Fallbacks
# ----------------------------------------------------------------------------


def test_fallback_when_disabled_gives_the_torch_result(monkeypatch):
    monkeypatch.setenv("HYPARALLEL_TRITON", "0")
    x = randn(3, 7, 29, dtype=torch.float32, seed=1)
    weight, bias = (
        randn(45, 29, dtype=torch.float32, seed=2),
        randn(45, dtype=torch.float32, seed=3),
    )
    assert not kernels_enabled(x, weight, bias)
    x.requires_grad_()
    for activation in ACTIVATIONS:
        out = linear_act(x, weight, bias, activation)
        assert "_LinearAct" not in type(out.grad_fn).__name__
        assert torch.equal(out, reference_linear_act(x, weight, bias, activation))
    assert torch.equal(
        swiglu_linear(x, weight, weight * 2), reference_swiglu_linear(x, weight, weight * 2)
    )
    gate, up = (
        randn(37, 45, dtype=torch.float32, seed=4),
        randn(37, 45, dtype=torch.float32, seed=5),
    )
    assert torch.equal(swiglu(gate, up), F.silu(gate) * up)
    torch.manual_seed(0)
    out = bias_dropout_residual(gate, bias, up, p=0.3, training=True, seed=123)
    torch.manual_seed(0)
    # torch's dropout: the seed is not used
    assert torch.equal(out, up + F.dropout(gate + bias, 0.3))


def test_fallback_under_autocast_follows_autocast():
    x, weight = (
        randn(37, 29, dtype=torch.float32, seed=1),
        randn(45, 29, dtype=torch.float32, seed=2),
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_act(x, weight, activation="gelu")
        expected = F.gelu(F.linear(x, weight))
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_kernels_are_built_for_the_interpreter():
    # Device functions are plain functions until the first launch jits them (Note [kernels are
    # module-level functions jitted on first use]); with TRITON_INTERPRET=1 they become interpreted
    # functions.
    from triton.runtime.interpreter import InterpretedFunction

    kernels.linear_act(randn(4, 16, dtype=torch.float32), randn(4, 16, dtype=torch.float32))
    assert kernels._kernels().interpret
    assert isinstance(kernels._tile_ids, InterpretedFunction) and kernels.tl is not None
