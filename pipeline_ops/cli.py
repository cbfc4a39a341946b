# PYTHON_ARGCOMPLETE_OK
"""trainium-runs: start, watch and stop training pipeline runs on AWS, and see what they cost.

    trainium-runs [--stage dev] [--team T] start --data-uri incoming/[T/]<dataset>/<version>/ [--base-model RUN]
    trainium-runs [--team T] status [RUN] | runs [--max 10] | buckets | stop RUN | cost [--max 20] | --version
    trainium-runs [--team T] logs RUN STEP [--follow] [--node N] | why [RUN]

RUN is the run id (the execution name) or an execution ARN; `--json` for scripts. In a stage with
teams every command acts on one team's pipeline (--team, env TRAINIUM_TEAM). docs/operations.md
explains each command, the stack outputs and prices it reads, and the exit codes: 0 ok, 1 AWS API
error, 2 usage, 3 unknown run/log/job, 4 wrong stage, 5 no credentials, 6 run name taken.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from pipeline_contract import CHECKPOINTS_DIR, DEFAULT_PROJECT, FSX_DATA, execution_input, run_path
from pipeline_steps import cost as cost_lib
from pipeline_steps.cli_common import autocomplete, version_line

from . import runs
from .commands import cmd_buckets, cmd_cost, cmd_logs, cmd_runs, cmd_start, cmd_status, cmd_stop, cmd_why
from .context import Context
from .errors import CredentialsError, OpsError
from .rendering import (
    render_buckets,
    render_cost,
    render_logs,
    render_runs,
    render_start,
    render_status,
    render_stop,
    render_why,
)

COMMANDS: dict[str, tuple[Callable[..., dict[str, Any]], Callable[[Any, dict[str, Any]], None]]] = {
    "start": (cmd_start, render_start), "status": (cmd_status, render_status), "runs": (cmd_runs, render_runs),
    "logs": (cmd_logs, render_logs), "stop": (cmd_stop, render_stop), "buckets": (cmd_buckets, render_buckets),
    "why": (cmd_why, render_why), "cost": (cmd_cost, render_cost),
}


def _common(suppress: bool) -> argparse.ArgumentParser:
    """Global options, accepted before or after the command. The subcommands' copy has no
    defaults (SUPPRESS) so an option given before the command is not reset by the subparser."""
    common = argparse.ArgumentParser(add_help=False)

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    common.add_argument("--stage", default=default(os.environ.get("TRAINIUM_STAGE", "dev")),
                        help="stage name (stacks/config.py STAGES; env TRAINIUM_STAGE; default dev)")
    common.add_argument("--project", default=default(DEFAULT_PROJECT), help="StageConfig.project (stack name prefix)")
    common.add_argument("--team", default=default(os.environ.get("TRAINIUM_TEAM") or None),
                        help="the team whose pipeline to act on, in a stage with teams (env TRAINIUM_TEAM)")
    common.add_argument("--region", default=default(None), help="AWS region (default: the AWS config/env)")
    common.add_argument("--profile", default=default(None), help="AWS profile")
    common.add_argument("--state-machine-arn", default=default(None), help="skip the stack lookup")
    common.add_argument("--json", action="store_true", default=default(False), help="machine-readable output")
    common.add_argument("--price", action="append", metavar="TYPE=USD", default=default(None), type=_price,
                        help="on-demand USD/hour for an instance type (repeatable; overrides the table)")
    common.add_argument("--offline-prices", action="store_true", default=default(False),
                        help="price with the committed table only (no AWS Price List API call)")
    common.add_argument("--training-instance-type", default=default(None))
    common.add_argument("--single-node-instance-type", default=default(None))
    return common


def _positive(kind: type, what: str):
    """An argparse type: `kind(text)` > 0, else a usage error (exit 2) saying `what` was expected."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


_positive_int = _positive(int, "a whole number >= 1")
_positive_float = _positive(float, "a number of seconds > 0")


def _price(text: str) -> str:
    try:
        cost_lib.parse_overrides([text])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


STEP_NAMES = tuple(s.lower() for s in runs.BATCH_STATES)


def build_parser() -> argparse.ArgumentParser:
    common = _common(suppress=True)
    parser = argparse.ArgumentParser(prog="trainium-runs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, parents=[_common(suppress=False)])
    parser.add_argument("--version", action="version", version=version_line("trainium-runs"))
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", parents=[common], help="start a run")
    start.add_argument("--data-uri", required=True,
                       help="incoming/<dataset>/<version>/ (a key in the stage's data bucket), "
                            f"s3://<data bucket>/incoming/<dataset>/<version>/ or {FSX_DATA}/incoming/<dataset>/<version>")
    start.add_argument("--base-model", default=None,
                       help=f"run id, {run_path('<run>')}[/{CHECKPOINTS_DIR}/...] to start from ('' = from scratch; "
                            "default: the published model)")
    start.add_argument("--nodes", type=_positive_int, default=None, help="nodes for sanity/compile/train")
    start.add_argument("--share", default=None, help="fair-share identifier (production | experiments)")
    start.add_argument("--priority", type=int, default=None)
    start.add_argument("--embed-shards", type=_positive_int, default=None)
    start.add_argument("--prepare-shards", type=_positive_int, default=None,
                       help=f"children of the prepare array job ({execution_input.ARRAY_SIZE}; the prepared data is the same "
                            "for any count)")
    start.add_argument("--name", default=None, help="run id (default <dataset>-<version>-<UTC time>)")
    status = sub.add_parser("status", parents=[common], help="one run in detail (default: the latest)")
    status.add_argument("run", nargs="?", default=None)
    recent = sub.add_parser("runs", parents=[common], help="recent runs")
    recent.add_argument("--max", type=_positive_int, default=10)
    logs = sub.add_parser("logs", parents=[common], help="the main node's log of a step")
    logs.add_argument("run")
    logs.add_argument("step", type=str.lower, choices=STEP_NAMES, help=" | ".join(STEP_NAMES))
    logs.add_argument("--lines", type=_positive_int, default=200)
    logs.add_argument("--head", action="store_true", help="from the start of the stream (default: the end)")
    logs.add_argument("--index", type=int, default=0, help="array child for embed")
    logs.add_argument("--node", type=int, default=None, help="node N of a multi-node step (default: the main node)")
    logs.add_argument("--follow", "-f", action="store_true",
                      help="keep printing new lines until the job ends (like tail -f)")
    logs.add_argument("--interval", type=_positive_float, default=5.0, help="seconds between reads with --follow")
    why = sub.add_parser("why", parents=[common],
                         help="why a run failed: class, evidence and a fix (default: the latest failed run)")
    why.add_argument("run", nargs="?", default=None)
    sub.add_parser("buckets", parents=[common], help="the stage's (or team's) buckets and prefixes")
    cost = sub.add_parser("cost", parents=[common], help="compute cost per team of its latest runs")
    cost.add_argument("--max", type=_positive_int, default=20, help="latest runs per team")
    stop = sub.add_parser("stop", parents=[common], help="stop a running run")
    stop.add_argument("run")
    stop.add_argument("--cause", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError, ProfileNotFound
    from rich.console import Console

    parser = build_parser()
    autocomplete(parser)
    try:
        args = parser.parse_args(argv)  # usage errors end here, before any credential lookup
    except SystemExit as exc:  # --help/--version (0) or a usage error (2): returned, like every other code
        return int(exc.code or 0)
    command, render = COMMANDS[args.command]
    err = Console(stderr=True, soft_wrap=True)  # one line per error: scripts grep it
    try:
        out = command(Context(args), args)
    except (NoCredentialsError, PartialCredentialsError) as exc:
        err.print(f"error: no AWS credentials ({exc}). Configure them (aws configure / aws sso login / "
                  "AWS_PROFILE) and retry.", markup=False)
        return CredentialsError.exit_code
    except ProfileNotFound as exc:
        err.print(f"error: {exc}", markup=False)
        return CredentialsError.exit_code
    except ValueError as exc:  # a bad --price
        err.print(f"error: {exc}", markup=False)
        return 2
    except OpsError as exc:
        err.print(f"error: {exc}", markup=False)
        return exc.exit_code
    except ClientError as exc:
        err.print(f"error: AWS: {exc}", markup=False)
        return 1
    if args.json:
        # `logs --follow --json` printed one object per line: its summary is one line too
        print(json.dumps(out, indent=None if getattr(args, "follow", False) else 2, default=str))
    else:
        render(Console(), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
