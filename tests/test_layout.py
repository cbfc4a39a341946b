"""The code reads in one screen, in every package: no function is longer than a screen, and a module
docstring says what the module does and how to run it in a few lines (the layout of
aws-samples/aws-cdk-project-structure-python for the stacks; the same rule for the rest)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60
MAX_MODULE_DOCSTRING_LINES = 12
PACKAGES: tuple[str, ...] = ("app.py", "stacks", "pipeline_contract", "pipeline_steps", "pipeline_ops", "scripts",
                             "benchmarks")
"""Every shipped or operated package. The tests' own helpers are not held to it (a moto patch set
is one long context manager by design)."""


def modules_under(roots: tuple[str, ...]) -> list[Path]:
    paths: list[Path] = []
    for root in roots:
        path = REPO / root
        assert path.exists(), f"{root} does not exist; update the roots"
        paths += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return paths


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_sources_are_found():
    names = {path.relative_to(REPO).as_posix() for path in modules_under(PACKAGES)}
    assert {"app.py", "stacks/compute_stack.py", "pipeline_contract/steps.py", "pipeline_steps/steps/train.py",
            "pipeline_ops/cli.py"} <= names


def test_no_function_is_longer_than_a_screen():
    too_long = []
    for path in modules_under(PACKAGES):
        for node in ast.walk(_parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, (
        f"Functions longer than {MAX_FUNCTION_LINES} lines; split them into named parts:\n" + "\n".join(too_long))


def test_module_docstrings_are_short():
    """What the module builds or does, and how to run it; a reason or a pitfall belongs in a
    comment at the line it explains, or in docs/."""
    wordy = []
    for path in modules_under(PACKAGES):
        docstring = ast.get_docstring(_parse(path), clean=False) or ""
        lines = len(docstring.strip().splitlines())
        if lines > MAX_MODULE_DOCSTRING_LINES:
            wordy.append(f"{path.relative_to(REPO)}: {lines} lines")
    assert not wordy, (
        f"Module docstrings longer than {MAX_MODULE_DOCSTRING_LINES} lines; keep what the module does and how "
        "to run it, move reasons to comments at the code they explain or to docs/:\n" + "\n".join(wordy))
