"""Versions of the installed packages that decide numerics and compiled graphs.

Read from package metadata only, never by importing them: `prepare` records them for its
tracking run without paying for `import torch` (~0.9 GB RSS).
"""

from __future__ import annotations

import importlib.metadata

NUMERICS_PACKAGES = ("torch", "torch-xla", "torch-neuronx", "neuronx-cc", "libneuronxla")


def versions() -> dict[str, str | None]:
    """{package: installed version or None} for NUMERICS_PACKAGES (for reproducibility)."""
    out: dict[str, str | None] = {}
    for pkg in NUMERICS_PACKAGES:
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out
