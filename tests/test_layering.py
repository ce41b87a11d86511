"""Imports flow one way: nothing upstream of the runtime imports torch.distributed, and the kernels are a leaf."""

from __future__ import annotations

import ast
import subprocess
import sys

UPSTREAM = ["planner", "graph", "models", "kernels", "schema.py", "cluster.py", "_yaml.py", "errors.py"]


def imported_modules(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_upstream_code_never_imports_torch_distributed(repo):
    package = repo / "hyparallel"
    files = [
        p
        for entry in UPSTREAM
        for p in ((package / entry).rglob("*.py") if (package / entry).is_dir() else [package / entry])
    ]
    assert len(files) >= 8
    for path in files:
        bad = [m for m in imported_modules(path) if m.startswith("torch.distributed")]
        assert not bad, f"{path.relative_to(repo)} imports {bad}"


def test_kernels_import_nothing_else_of_hyparallel(repo):
    files = sorted((repo / "hyparallel" / "kernels").rglob("*.py"))
    assert files
    for path in files:
        ours = [m for m in imported_modules(path) if m.split(".")[0] == "hyparallel"]
        bad = [m for m in ours if not m.startswith(("hyparallel.kernels", "hyparallel.errors"))]
        assert not bad, f"{path.relative_to(repo)} imports {bad}"


def test_package_imports_without_triton_or_cuda():
    # Lazy accelerator imports: importing hyparallel must not pull in triton.
    code = "import sys, hyparallel; assert not sys.modules.get('triton'), 'triton imported at package import'"
    subprocess.run([sys.executable, "-c", code], check=True)
