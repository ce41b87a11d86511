"""The fused Triton kernels against torch eager and torch.compile, in bf16, on one NVIDIA GPU.

Run: python benchmarks/gpu_kernels.py [--quick] [--no-compile]
For each kernel at transformer shapes (tokens x hidden, ffn 4x or 8/3x):
1. numerics on CUDA against the same torch reference in bf16 (the output and the gradient of every
   input: max abs error, and max error relative to the reference's largest value), plus the forward
   error of both against an fp32 reference computed from the same bf16 inputs, so the kernel's error
   can be read against torch's own;
2. forward and forward+backward times (triton.testing.do_bench, median ms; the forward with
   gradients enabled, as in training) of the Triton path, torch eager and torch.compile of the same
   torch reference, with the speedups. The first call of each shape includes Triton's autotuning, in
   do_bench's warmup.
Takes about 3-5 minutes on an H100/H200 (most of it compiling); --quick runs one shape per kernel
and --no-compile skips torch.compile. Exit status: 0 all checks pass, 1 a numerics check or a case
failed, 2 no CUDA device (or TRITON_INTERPRET / HYPARALLEL_TRITON=0 set, or no triton).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hyparallel import kernels

DTYPE = torch.bfloat16
# A bf16 result carries 8 significant bits: one rounding is up to 2**-8 (0.4%) of the value. The
# kernels and torch round different intermediates (the pre-activation, its gradient), and the
# gradients sum thousands of such terms, so 2% of the largest value flags a real error (a wrong term
# or mask is O(1)) and not rounding.
REL_TOLERANCE = 2e-2
DROPOUT_P = 0.1


@dataclass
class Case:
    kernel: str
    shape: str
    # leaves; those requiring grad are differentiated
    make_inputs: Callable[[], list[torch.Tensor | None]]
    fused: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    forward_flops: float = 0.0  # for TFLOP/s; 0 for memory-bound kernels
    # replaces the comparison with the reference
    check: Callable[[Case, list], list[str]] | None = None


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device="cuda") * scale).to(DTYPE).requires_grad_()


def activation(z: torch.Tensor, name: str) -> torch.Tensor:
    return (
        F.gelu(z, approximate="tanh")
        if name == "gelu_tanh"
        else F.gelu(z)
        if name == "gelu"
        else F.silu(z)
    )


def linear_act_case(tokens: int, hidden: int, ffn: int, act: str) -> Case:
    return Case(
        f"linear_act({act})",
        f"{tokens}x{hidden}->{ffn}",
        lambda: [randn(tokens, hidden), randn(ffn, hidden, scale=hidden**-0.5), randn(ffn)],
        lambda x, w, b: kernels.linear_act(x, w, b, act),
        lambda x, w, b: activation(F.linear(x, w, b), act),
        forward_flops=2.0 * tokens * hidden * ffn,
    )


def swiglu_linear_case(tokens: int, hidden: int, ffn: int) -> Case:
    return Case(
        "swiglu_linear",
        f"{tokens}x{hidden}->{ffn}",
        lambda: [
            randn(tokens, hidden),
            randn(ffn, hidden, scale=hidden**-0.5),
            randn(ffn, hidden, scale=hidden**-0.5),
        ],
        kernels.swiglu_linear,
        lambda x, wg, wu: F.silu(F.linear(x, wg)) * F.linear(x, wu),
        forward_flops=4.0 * tokens * hidden * ffn,
    )


def swiglu_case(tokens: int, ffn: int) -> Case:
    return Case(
        "swiglu",
        f"{tokens}x{ffn}",
        lambda: [randn(tokens, ffn, scale=2.0), randn(tokens, ffn)],
        kernels.swiglu,
        lambda gate, up: F.silu(gate) * up,
    )


def dropout_case(tokens: int, hidden: int) -> Case:
    return Case(
        f"bias_dropout_residual(p={DROPOUT_P})",
        f"{tokens}x{hidden}",
        lambda: [randn(tokens, hidden), randn(hidden), randn(tokens, hidden)],
        lambda x, b, r: kernels.bias_dropout_residual(x, b, r, DROPOUT_P, training=True),
        lambda x, b, r: r + F.dropout(x + b, DROPOUT_P, training=True),
        check=check_dropout,
    )


def cases(quick: bool) -> list[Case]:
    all_cases = [
        linear_act_case(4096, 4096, 16384, "gelu_tanh"),
        linear_act_case(8192, 8192, 32768, "gelu"),
        swiglu_linear_case(4096, 4096, 11008),
        swiglu_linear_case(8192, 8192, 22016),  # 8/3 x hidden
        swiglu_case(8192, 11008),
        swiglu_case(16384, 14336),
        dropout_case(8192, 4096),
        dropout_case(16384, 8192),
    ]
    return all_cases[::2] if quick else all_cases


# ----------------------------------------------------------------------------
# Numerics
# ----------------------------------------------------------------------------


def forward_backward(fn, inputs: list, grad_out: torch.Tensor | None) -> tuple[torch.Tensor, list]:
    leaves = [
        t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None
        for t in inputs
    ]
    out = fn(*leaves)
    if grad_out is not None:
        out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves if t is not None and t.requires_grad]


def errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    diff = (actual.float() - expected.float()).abs().max().item()
    return diff, diff / max(expected.float().abs().max().item(), 1e-30)


def check_against_reference(case: Case, inputs: list) -> list[str]:
    grad_out = torch.randn_like(case.reference(*inputs)).detach()
    out, grads = forward_backward(case.fused, inputs, grad_out)
    expected, expected_grads = forward_backward(case.reference, inputs, grad_out)
    names = ["out"] + [f"grad{i}" for i in range(len(grads))]
    failures, parts = [], []
    for name, actual, reference in zip(names, [out, *grads], [expected, *expected_grads]):
        abs_err, rel_err = errors(actual, reference)
        parts.append(f"{name} abs {abs_err:.2e} rel {rel_err:.2e}")
        if not rel_err <= REL_TOLERANCE:
            failures.append(
                f"{case.kernel} {case.shape}: {name} relative error {rel_err:.2e} > {REL_TOLERANCE}"
            )
    with torch.no_grad():
        exact = case.reference(*[t.float() if t is not None else None for t in inputs])
        _, fused_rel = errors(out, exact)
        _, torch_rel = errors(expected, exact)
    parts.append(f"| out vs fp32: triton {fused_rel:.2e}, torch bf16 {torch_rel:.2e}")
    print("    " + ", ".join(parts[:-1]) + " " + parts[-1], flush=True)
    return failures


def check_dropout(case: Case, inputs: list) -> list[str]:
    """torch draws a different mask: check p=0 against torch, then the mask's rate, scale and
    reuse."""
    x, bias, residual = (t.detach() for t in inputs)
    failures = []
    with torch.no_grad():
        plain = kernels.bias_dropout_residual(x, bias, residual, 0.0, training=True)
        _, rel_err = errors(plain, residual + (x + bias))
    # x + bias in [1, 3) so that a kept element always moves the output off the residual, even in
    # bf16.
    positive = (1.0 + 2.0 * torch.rand_like(x, dtype=torch.float32)).to(DTYPE).requires_grad_()
    out = kernels.bias_dropout_residual(positive, None, residual, DROPOUT_P, training=True, seed=17)
    out.backward(torch.ones_like(out))
    dropped = out.detach() == residual
    rate = dropped.float().mean().item()
    kept_scale = (positive.grad[~dropped].float() * (1 - DROPOUT_P)).sub(1).abs().max().item()
    mask_reused = torch.equal(positive.grad == 0, dropped)
    print(
        f"    p=0 vs torch rel {rel_err:.2e}; p={DROPOUT_P}: dropped {rate:.4f}, "
        f"kept grad scale error {kept_scale:.1e}, backward mask == forward mask: {mask_reused}",
        flush=True,
    )
    if rel_err > REL_TOLERANCE:
        failures.append(f"{case.kernel} {case.shape}: p=0 relative error {rel_err:.2e}")
    # 0.005 is about 100 binomial standard deviations at these sizes; the kept scale is 1/(1-p)
    # rounded to bf16.
    if abs(rate - DROPOUT_P) > 0.005 or kept_scale > 1e-2 or not mask_reused:
        failures.append(
            f"{case.kernel} {case.shape}: dropped {rate:.4f}, scale error {kept_scale:.1e}, mask"
            f" reused {mask_reused}"
        )
    return failures


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------


def time_ms(fn, inputs: list, backward: bool) -> float:
    from triton.testing import do_bench

    leaves = [t for t in inputs if t is not None and t.requires_grad]
    grad_out = torch.randn_like(fn(*inputs)).detach() if backward else None

    def step():
        out = fn(*inputs)
        if backward:
            out.backward(grad_out)

    return do_bench(step, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")


def measure(fn, inputs: list, backward: bool) -> float | None:
    try:
        return time_ms(fn, inputs, backward)
    except Exception:  # report it and go on: one GPU run should give every other number
        traceback.print_exc()
        return None


def speedup(times: dict, name: str) -> str:
    return (
        f"{times[name] / times['triton']:.2f}x" if times.get(name) and times.get("triton") else "-"
    )


def run_case(case: Case, use_compile: bool) -> tuple[list[str], list[str]]:
    inputs = case.make_inputs()
    assert kernels.kernels_enabled(*inputs), (
        f"{case.kernel}: the Triton path would not run for these inputs"
    )
    print(f"  {case.kernel} {case.shape}", flush=True)
    failures = (case.check or check_against_reference)(case, inputs)
    implementations = {"triton": case.fused, "eager": case.reference}
    if use_compile:
        implementations["compile"] = torch.compile(case.reference, dynamic=False)
    row = [case.kernel, case.shape]
    for backward in (False, True):
        times = {name: measure(fn, inputs, backward) for name, fn in implementations.items()}
        row += [
            f"{times[name]:.3f}" if times.get(name) else "-"
            for name in ("triton", "eager", "compile")
        ]
        row += [speedup(times, "eager"), speedup(times, "compile")]
        if not backward:
            tflops = (
                case.forward_flops / times["triton"] / 1e9
                if case.forward_flops and times["triton"]
                else 0
            )
            row.append(f"{tflops:.0f}" if tflops else "")
    print(
        "    " + "  ".join(f"{h.strip()} {v}" for h, v in zip(HEADER[2:], row[2:]) if v), flush=True
    )
    del inputs
    torch.cuda.empty_cache()
    return row, failures


HEADER = [
    "kernel",
    "shape",
    "fwd triton",
    "eager",
    "compile",
    "vs eager",
    "vs compile",
    "TFLOP/s",
    "fwd+bwd triton",
    "eager",
    "compile",
    "vs eager",
    "vs compile",
]


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    print(
        "times in ms (median); 'vs' = torch time / triton time, > 1 means the Triton kernel is"
        " faster"
    )
    for r in [HEADER, *rows]:
        print(
            "  ".join(
                str(c).rjust(w) if i > 1 else str(c).ljust(w)
                for i, (c, w) in enumerate(zip(r, widths))
            )
        )


def environment_problem() -> str | None:
    """Why the benchmark cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device found; this benchmark needs one NVIDIA GPU. Nothing was run."
    if kernels.interpreting() or os.environ.get("HYPARALLEL_TRITON") == "0":
        return "unset TRITON_INTERPRET and HYPARALLEL_TRITON to benchmark the compiled kernels."
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed."
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one shape per kernel")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    args = parser.parse_args()
    problem = environment_problem()
    if problem:
        print(f"gpu_kernels.py: {problem}", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__},"
        f" {DTYPE}"
    )
    start, rows, failures = time.perf_counter(), [], []
    for case in cases(args.quick):
        try:
            row, case_failures = run_case(case, use_compile=not args.no_compile)
        except Exception as error:  # a failed case is reported; the others still run
            traceback.print_exc()
            row, case_failures = (
                [case.kernel, case.shape],
                [f"{case.kernel} {case.shape}: {error!r}"],
            )
            torch.cuda.empty_cache()
        rows.append(row + ["-"] * (len(HEADER) - len(row)))
        failures += case_failures
    print_table(rows)
    print(f"total {time.perf_counter() - start:.0f} s")
    for failure in failures:
        print("FAILED:", failure)
    print("all checks passed" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
