"""Step `diagnose`: why a job failed, from its log files (one per node), exit code and status reason.

Prints the class (docs/operations.md, "Why a run failed"), whether a retry can help, the evidence
lines with node and line number, a suggestion and a documentation link; `--json` prints
{"class", "retryable", "evidence", "suggestion", "docs", ...}. Imports neither AWS nor torch.
Exit 0 whatever the class; 65 for a log file it cannot read, 78 for an invalid --rules file.

Local:  python -m pipeline_steps diagnose --log node0.log --log node1.log --exit-code 75 --json
AWS:    trainium-runs why [RUN] reads the failed job's log streams and prints the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .diagnosis import NodeLog, classify, load_rules
from .errors import BadConfigError, BadInputError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline_steps diagnose", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log", action="append", default=[], type=Path, metavar="FILE",
                        help="a node's log (repeat for each node, main node first; '-' reads stdin)")
    parser.add_argument("--exit-code", type=int, help="the job's exit code")
    parser.add_argument("--status-reason", help="AWS Batch's status reason (or the container's reason)")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    parser.add_argument("--rules", type=Path, help="another rules file (default: the packaged rules)")
    return parser


def _read(path: Path, node: str) -> NodeLog:
    if str(path) == "-":
        return NodeLog.from_text(node, sys.stdin.read())
    try:
        return NodeLog.from_text(node, path.read_text(encoding="utf-8", errors="replace"))
    except OSError as exc:
        raise BadInputError(f"cannot read --log {path}: {exc.strerror or exc}") from exc


def _node_names(paths: list[Path]) -> list[str]:
    """A node is named by its file's name; by the path as given when two files share a name."""
    names = [p.name if str(p) != "-" else "stdin" for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.log and args.exit_code is None and not args.status_reason:
        raise BadConfigError("nothing to diagnose: give --log FILE (per node), --exit-code or --status-reason")
    try:
        rules = load_rules(args.rules)
    except (OSError, ValueError) as exc:
        raise BadConfigError(f"--rules: {exc}") from exc
    logs = [_read(path, node) for path, node in zip(args.log, _node_names(args.log))]
    diagnosis = classify(logs, exit_code=args.exit_code, status_reason=args.status_reason, rules=rules)
    print(json.dumps(diagnosis.as_dict(), indent=2) if args.json else diagnosis.text())
    return 0
