"""The CDK app's layout: a module under stacks/ defines at most one construct or stack (the layout of
aws-samples/aws-cdk-project-structure-python: thin stacks, one small construct per file). The
function-length and docstring rules of every package: tests/test_layout.py."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_layout import modules_under

REPO = Path(__file__).resolve().parents[2]
CONSTRUCT_BASES = {"Construct", "Stack"}


def _cdk_modules() -> list[Path]:
    return modules_under(("app.py", "stacks"))


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_cdk_sources_are_found():
    names = {path.relative_to(REPO).as_posix() for path in _cdk_modules()}
    assert {"app.py", "stacks/compute_stack.py", "stacks/constructs/training_pipeline.py"} <= names


def test_one_construct_per_module():
    crowded = []
    for path in _cdk_modules():
        classes = [node.name for node in _parse(path).body if isinstance(node, ast.ClassDef)
                   and any(getattr(base, "id", getattr(base, "attr", None)) in CONSTRUCT_BASES for base in node.bases)]
        if len(classes) > 1:
            crowded.append(f"{path.relative_to(REPO)}: {', '.join(classes)}")
    assert not crowded, "One construct or stack per module; move the others to their own files:\n" + "\n".join(crowded)
