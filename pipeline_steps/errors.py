"""The error types that map onto the exit-code table (`ExitCode`, defined in pipeline_contract/).

Every step raises one of the `StepError` subclasses below for an expected failure; the CLI
(`pipeline_steps.__main__`) turns it into a one-line message and the matching exit code.
"""

from __future__ import annotations

import os

from pipeline_contract import EXIT_CODE_FILE_ENV, ExitCode

__all__ = ["EXIT_CODE_FILE_ENV", "BadConfigError", "BadInputError", "ExitCode", "GateFailedError", "NonFiniteLossError",
           "RetryableError", "StepError", "record_exit_code"]


class StepError(Exception):
    """An expected failure with a message a user can act on."""

    exit_code: ExitCode = ExitCode.INTERNAL


class BadInputError(StepError, ValueError):
    exit_code = ExitCode.BAD_INPUT


class BadConfigError(StepError, ValueError):
    exit_code = ExitCode.BAD_CONFIG


class RetryableError(StepError, RuntimeError):
    exit_code = ExitCode.RETRYABLE


class GateFailedError(StepError):
    exit_code = ExitCode.GATE_FAILED


class NonFiniteLossError(StepError, FloatingPointError):
    exit_code = ExitCode.NON_FINITE_LOSS


def record_exit_code(code: int, environ: os._Environ[str] | dict[str, str] | None = None) -> None:
    """Leave this process's exit code where the container entrypoint can find it.

    torchrun exits 1 whenever a worker fails, whatever the worker's code (checked with torch 2.9),
    which would turn a retryable 75 into a non-retried 1. So each worker records its code in the
    node-local file named by $PIPELINE_EXIT_CODE_FILE and `training_image/entrypoint.sh` exits with
    it. The first failing rank wins (O_EXCL): later ranks usually fail *because* of the first.
    """
    path = (os.environ if environ is None else environ).get(EXIT_CODE_FILE_ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as fh:
        fh.write(f"{int(code)}\n")
