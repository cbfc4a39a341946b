"""Versions of the installed packages that decide numerics and compiled graphs.

Read from package metadata only, never by importing them: `prepare` records them for its
tracking run without paying for `import torch` (~0.9 GB RSS). The image build checks the base
image's with `python -m pipeline_steps.packages --expect PKG==VERSION ...` (exit 78 on a mismatch).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata
import sys

from .contract import ExitCode

NUMERICS_PACKAGES = ("torch", "torch-xla", "torch-neuronx", "neuronx-cc", "libneuronxla")


def versions() -> dict[str, str | None]:
    """{package: installed version or None} for NUMERICS_PACKAGES (for reproducibility)."""
    return {pkg: _version(pkg) for pkg in NUMERICS_PACKAGES}


def mismatches(expected: dict[str, str]) -> list[str]:
    """What differs from `expected` ({package: version, `*` a wildcard}); local labels (+abc) are ignored."""
    found = {pkg: _version(pkg) for pkg in expected}
    return [f"{pkg} {found[pkg] or 'not installed'}, expected {want}" for pkg, want in expected.items()
            if not fnmatch.fnmatchcase((found[pkg] or "").split("+")[0], want)]


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline_steps.packages --expect neuronx-cc==2.24.8799.0 'torch==2.9.*'`: exit 78
    naming every package whose installed version differs."""
    parser = argparse.ArgumentParser(prog="python -m pipeline_steps.packages", description=main.__doc__)
    parser.add_argument("--expect", nargs="+", default=[], metavar="PKG==VERSION")
    args = parser.parse_args(argv)
    problems = mismatches(dict(spec.split("==", 1) for spec in args.expect))
    for problem in problems:
        print(f"packages: {problem} (pipeline_steps/contract.py NEURON_SDK)", file=sys.stderr)
    return int(ExitCode.BAD_CONFIG if problems else ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
