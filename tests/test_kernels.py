"""The Triton kernels against torch, on the CPU under Triton's interpreter.

The checks live in tests/interpreter/kernel_checks.py and run in a pytest process of their own with
TRITON_INTERPRET=1 set from the start: Triton reads it when first imported, and the rest of the
suite must not run under the interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip(
    "triton", reason="triton is not installed: the kernel checks run under its CPU interpreter"
)


def test_kernels_match_torch_under_the_interpreter(repo):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(repo / "tests" / "interpreter" / "kernel_checks.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=repo,
        timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 60 and "failed" not in summary and "skipped" not in summary, summary
