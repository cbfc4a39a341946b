"""The package's layout: steps are thin entry points in pipeline_steps/steps/ over library modules,
every step of the step table has one, and no step imports another."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from setuptools import find_packages

from pipeline_steps import __main__ as cli

PACKAGE = Path(cli.__file__).parent
STEP_MODULES = {module for module, _ in cli.STEPS.values()}


def imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, anywhere in it (lazy imports inside functions too), as
    absolute names: `from . import tokenization` -> pipeline_steps.tokenization, `from .trainer import X` ->
    pipeline_steps.trainer."""
    package = cli.__package__
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([package, *filter(None, [base])])
            found.add(base)
            # `from pipeline_steps import train` names a module, not an attribute.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_no_step_module_imports_another_step() -> None:
    """Shared machinery (trainer, inference, S3 access) lives in library modules; a step that needs
    another step's code is a sign it belongs in one. run-local and parity run the other steps through
    the CLI (a subprocess, or __main__'s registry), not by importing them."""
    offenders = {}
    for module in sorted(STEP_MODULES):
        path = PACKAGE / "steps" / f"{module.rpartition('.')[2]}.py"
        steps_imported = sorted((imported_modules(path) & STEP_MODULES) - {module})
        if steps_imported:
            offenders[module] = steps_imported
    assert offenders == {}


def test_every_step_has_a_module_with_a_main() -> None:
    """The CLI registry comes from the step table (pipeline_contract.PIPELINE_STEPS) plus the tools;
    each entry is a module of pipeline_steps/steps/ with a `main(argv)`."""
    from pipeline_contract import BATCH_JOBS

    assert {job.command for job in BATCH_JOBS} <= set(cli.STEPS)
    for module, _ in cli.STEPS.values():
        assert module.startswith("pipeline_steps.steps.")
        tree = ast.parse((PACKAGE / "steps" / f"{module.rpartition('.')[2]}.py").read_text("utf-8"))
        assert "main" in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, module


def test_the_package_ships_no_benchmark() -> None:
    """The benchmark needs the peers' libraries (transformers, sentence-transformers), which the
    training image does not install: it lives in benchmarks/, outside the package."""
    assert "bench" not in cli.STEPS
    uses_peers = sorted(p.name for p in PACKAGE.glob("*.py")
                        if {"transformers", "sentence_transformers"} & {m.split(".")[0] for m in imported_modules(p)})
    assert uses_peers == []
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text("utf-8"))
    shipped = find_packages(PACKAGE.parent, include=pyproject["tool"]["setuptools"]["packages"]["find"]["include"])
    assert "pipeline_steps" in shipped and not [p for p in shipped if p.startswith("benchmarks")]
