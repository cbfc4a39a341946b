"""The CDK app reads in one screen: no function in app.py or stacks/ is longer than a screen, and a
module under stacks/ defines at most one construct or stack (the layout of
aws-samples/aws-cdk-project-structure-python: thin stacks, one small construct per file)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 60
CONSTRUCT_BASES = {"Construct", "Stack"}


def _cdk_modules() -> list[Path]:
    return [REPO / "app.py", *sorted((REPO / "stacks").rglob("*.py"))]


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_cdk_sources_are_found():
    names = {path.relative_to(REPO).as_posix() for path in _cdk_modules()}
    assert {"app.py", "stacks/compute_stack.py", "stacks/constructs/training_pipeline.py"} <= names


def test_no_function_is_longer_than_a_screen():
    too_long = []
    for path in _cdk_modules():
        for node in ast.walk(_parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, (
        f"Functions longer than {MAX_FUNCTION_LINES} lines; split them into named builders:\n" + "\n".join(too_long))


def test_one_construct_per_module():
    crowded = []
    for path in _cdk_modules():
        classes = [node.name for node in _parse(path).body if isinstance(node, ast.ClassDef)
                   and any(getattr(base, "id", getattr(base, "attr", None)) in CONSTRUCT_BASES for base in node.bases)]
        if len(classes) > 1:
            crowded.append(f"{path.relative_to(REPO)}: {', '.join(classes)}")
    assert not crowded, "One construct or stack per module; move the others to their own files:\n" + "\n".join(crowded)
