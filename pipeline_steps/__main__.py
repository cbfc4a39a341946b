# PYTHON_ARGCOMPLETE_OK
"""The CLI: `python -m pipeline_steps <step> [args]` (installed as `pipeline-steps`).

Each step lives in its own module with a `main(argv) -> int | None`; this dispatcher imports only
the step asked for, so `sanity` never pays for tokenizers and `--help` is instant. Expected
failures (`StepError`) become one clear line on stderr and the exit code from `errors.ExitCode`;
anything else is a bug and keeps its traceback (exit 1). `--version` prints the package version;
`eval "$(register-python-argcomplete pipeline-steps)"` completes step names.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path

from .completion import autocomplete, version_line
from .errors import ExitCode, StepError, record_exit_code

STEPS: dict[str, tuple[str, str]] = {
    "prepare": ("pipeline_steps.prepare", "validate records, train the tokenizer, write static-shape shards + holdout"
                                          " (--phase plan|shard|finish: as an array job)"),
    "sanity": ("pipeline_steps.sanity", "device and collective health checks (run before spending trn1 hours)"),
    "compile": ("pipeline_steps.aot_compile", "ahead-of-time compile: trace every training graph once"),
    "train": ("pipeline_steps.train", "DDP / XLA training with resumable, portable checkpoints"),
    "validate": ("pipeline_steps.validate", "holdout metrics, BM25 baseline and the quality gate"),
    "embed": ("pipeline_steps.embed", "sharded batch inference of the catalog to Parquet"),
    "export": ("pipeline_steps.export", "the towers as sentence-transformers folders for serving"),
    "run-local": ("pipeline_steps.run_local", "the whole chain on this machine (demo data by default)"),
    "parity": ("pipeline_steps.parity", "train two backends over several seeds; compare metric means and spread"),
    "diagnose": ("pipeline_steps.diagnose", "why a job failed: class, evidence and a fix from its node logs"),
}


def _usage() -> str:
    lines = ["usage: python -m pipeline_steps [--version] <step> [--help] [args]", "", "steps:"]
    lines += [f"  {name:<10} {desc}" for name, (_, desc) in STEPS.items()]
    lines += ["", "exit codes: " + ", ".join(f"{c.value}={c.name.lower()}" for c in ExitCode)]
    return "\n".join(lines)


# The pipeline's steps (a child run each of the pipeline's MLflow run); run-local and diagnose are tools.
TRACKED_STEPS = frozenset(STEPS) - {"run-local", "diagnose"}


def _run_dir_of(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "--run-dir" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--run-dir="):
            return arg.split("=", 1)[1]
    return None


def _track_failure(step: str, args: list[str], error: str, exit_code: int) -> None:
    """A failed pipeline step leaves a FAILED child run with its error (tracking never raises)."""
    run_dir = _run_dir_of(args)
    if step in TRACKED_STEPS and run_dir:
        from . import tracking

        tracking.log_failure(step, Path(run_dir), error=error, exit_code=int(exit_code))


def completion_parser() -> argparse.ArgumentParser:
    """The step names as an argparse tree, for shell completion only: the steps parse their own flags."""
    parser = argparse.ArgumentParser(prog="pipeline-steps")
    parser.add_argument("--version", action="version", version=version_line("pipeline-steps"))
    sub = parser.add_subparsers(dest="step")
    for name, (_, desc) in STEPS.items():
        sub.add_parser(name, help=desc)
    return parser


def configure_logging() -> None:
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
    logging.basicConfig(
        level=os.environ.get("PIPELINE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
        stream=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    autocomplete(completion_parser())
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage(), file=sys.stdout if argv else sys.stderr)
        return ExitCode.OK if argv else ExitCode.USAGE
    if argv[0] == "--version":
        print(version_line("pipeline-steps"))
        return ExitCode.OK
    step, rest = argv[0], argv[1:]
    if step not in STEPS:
        print(f"unknown step {step!r}\n\n{_usage()}", file=sys.stderr)
        return ExitCode.USAGE
    configure_logging()
    module = importlib.import_module(STEPS[step][0])
    try:
        code = int(module.main(rest) or ExitCode.OK)
    except SystemExit as exc:
        # argparse's usage errors (exit 2): recorded too, or torchrun would turn them into 1.
        if exc.code not in (0, None):
            record_exit_code(exc.code if isinstance(exc.code, int) else ExitCode.USAGE)
        raise
    except StepError as exc:
        logging.getLogger(f"pipeline_steps.{step}").error("%s (exit %d: %s)", exc, exc.exit_code,
                                                          exc.exit_code.name.lower())
        code = int(exc.exit_code)
        _track_failure(step, rest, f"{type(exc).__name__}: {exc}", code)
    except Exception as exc:
        # A bug: keep the traceback, but still tell the entrypoint it was not retryable.
        record_exit_code(ExitCode.INTERNAL)
        _track_failure(step, rest, f"{type(exc).__name__}: {exc}", ExitCode.INTERNAL)
        raise
    if code:
        record_exit_code(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
