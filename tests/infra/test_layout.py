"""The CDK app reads in one screen: no function in app.py or stacks/ is longer than a screen, a
module under stacks/ defines at most one construct or stack (the layout of
aws-samples/aws-cdk-project-structure-python: thin stacks, one small construct per file), and a
module docstring says what the module does and how to run it in a few lines."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 60
CONSTRUCT_BASES = {"Construct", "Stack"}
MAX_MODULE_DOCSTRING_LINES = 12
# Files or packages (relative to the repository) whose module docstrings must stay short.
DOCSTRING_ROOTS: tuple[str, ...] = ("app.py", "stacks", "pipeline_ops", "pipeline_steps")


def _modules_under(roots: tuple[str, ...]) -> list[Path]:
    paths: list[Path] = []
    for root in roots:
        path = REPO / root
        assert path.exists(), f"{root} does not exist; update the roots"
        paths += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return paths


def _cdk_modules() -> list[Path]:
    return _modules_under(("app.py", "stacks"))


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


def test_module_docstrings_are_short():
    """What the module builds or does, and how to run it; a reason or a pitfall belongs in a
    comment at the line it explains, or in docs/."""
    wordy = []
    for path in _modules_under(DOCSTRING_ROOTS):
        docstring = ast.get_docstring(_parse(path), clean=False) or ""
        lines = len(docstring.strip().splitlines())
        if lines > MAX_MODULE_DOCSTRING_LINES:
            wordy.append(f"{path.relative_to(REPO)}: {lines} lines")
    assert not wordy, (
        f"Module docstrings longer than {MAX_MODULE_DOCSTRING_LINES} lines; keep what the module does and how "
        "to run it, move reasons to comments at the code they explain or to docs/:\n" + "\n".join(wordy))
