#!/usr/bin/env python3
"""Check that Node.js is installed and recent enough for the CDK, before a long `make demo` starts.

The CDK's Python library runs its constructs in Node.js (jsii), so synthesis fails without it; the
CDK supports the active Node.js LTS releases (https://docs.aws.amazon.com/cdk/v2/guide/node-versions.html).
Standard library only: it runs before .venv exists.

    python3 scripts/check_node.py        # exit 0, or 1 with what to install
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

MIN_MAJOR = 20  # jsii still runs on 20 (with an end-of-life banner the Makefile silences)
SUPPORTED_MAJOR = 22  # the oldest Node.js release jsii supports today
FIX = (
    f"install Node.js {MIN_MAJOR} or later (an LTS release, https://nodejs.org/en/download, "
    "or your package manager, e.g. `sudo apt-get install nodejs`), then rerun"
)


def node_problem(node: str | None) -> str | None:
    """What is wrong with the Node.js at `node` (a path, or None when absent), or None when it is fine."""
    if node is None:
        return f"Node.js not found on PATH: the CDK (jsii) needs it to synthesize the templates; {FIX}"
    result = subprocess.run([node, "--version"], capture_output=True, text=True, check=False)
    match = re.match(r"v(\d+)\.", result.stdout.strip())
    if result.returncode or not match:
        return f"`{node} --version` did not print a version ({result.stdout.strip() or result.stderr.strip()!r}); {FIX}"
    if int(match.group(1)) < MIN_MAJOR:
        return f"Node.js {result.stdout.strip()} at {node} is older than {MIN_MAJOR}; {FIX}"
    return None


def node_warning(node: str) -> str | None:
    """A note for a Node.js that works but is past its end of life."""
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < SUPPORTED_MAJOR:
        return f"Node.js {version} works but is past its end of life; Node.js {SUPPORTED_MAJOR} or later is supported"
    return None


def main() -> int:
    node = shutil.which("node")
    problem = node_problem(node)
    if problem or node is None:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    warning = node_warning(node)
    if warning:
        print(f"note: {warning}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
