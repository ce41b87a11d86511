"""The kernel checks run under Triton's interpreter: the suite's clean environment, with
TRITON_INTERPRET=1 kept."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def clean_launch_environment(clean_launch_environment):
    """tests/conftest.py's (Note [the suite's environment]), but this process was started to
    interpret kernels."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        yield
