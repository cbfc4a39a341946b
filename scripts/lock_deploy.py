#!/usr/bin/env python3
"""Write deploy-constraints.txt: the exact versions (pip freeze of this venv) of everything the
`infra` and `ops` extras install, so a deploy synthesizes with the library versions the tests ran.

    .venv/bin/python scripts/lock_deploy.py            # rewrite deploy-constraints.txt
    .venv/bin/python scripts/lock_deploy.py --check    # exit 1 when a dependency is not pinned

`make cdk` installs the deploy venv with `pip install -c deploy-constraints.txt '.[infra,ops]'`;
`make test` keeps its own install (torch and the local extras are not part of a deploy).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "deploy-constraints.txt"
EXTRAS = ("infra", "ops")
HEADER = (
    "# Exact versions for deploys (`make cdk`): the dependency closure of the infra and ops extras,\n"
    "# from `pip freeze` of the tested venv. Regenerate: .venv/bin/python scripts/lock_deploy.py\n"
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def roots(pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    return [Requirement(req) for extra in EXTRAS for req in extras[extra]]


def closure(requirements: list[Requirement]) -> set[str]:
    """Canonical names of the installed distributions these requirements pull in, transitively."""
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req = todo.pop()
        if canonical(req.name) in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(canonical(req.name))
        todo += [Requirement(r) for r in metadata.distribution(req.name).requires or []]
    return seen


def pinned(text: str) -> dict[str, str]:
    """name -> version of the `name==version` lines."""
    pins = {}
    for line in text.splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and not line.startswith("#"):
            pins[canonical(name)] = version
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that every dependency is pinned")
    args = parser.parse_args(argv)
    needed = closure(roots())
    if args.check:
        missing = sorted(needed - set(pinned(LOCK.read_text())))
        if missing:
            print(f"{LOCK.name} does not pin {', '.join(missing)}; rerun scripts/lock_deploy.py", file=sys.stderr)
            return 1
        return 0
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True, capture_output=True, text=True
    ).stdout
    lines = sorted(f"{name}=={version}" for name, version in pinned(freeze).items() if name in needed)
    LOCK.write_text(HEADER + "\n".join(lines) + "\n")
    print(f"wrote {LOCK} ({len(lines)} pins)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
