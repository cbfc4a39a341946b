"""The exit-code table and the error types that map onto it.

Exit codes are part of the interface: AWS Batch retry strategies (`evaluateOnExit` in the job
definitions) and the Step Functions state machine act on them, and the README documents them.
Every step raises one of the `StepError` subclasses below for an expected failure; the CLI
(`pipeline_steps.__main__`) turns it into a one-line message and the matching exit code.
"""

from __future__ import annotations

import enum
import os


class ExitCode(enum.IntEnum):
    """Process exit codes of `python -m pipeline_steps <step>` (values follow BSD sysexits where one fits)."""

    OK = 0
    INTERNAL = 1  # a bug: unexpected exception, traceback printed; not retried
    USAGE = 2  # argparse's own code for a bad command line
    BAD_INPUT = 65  # EX_DATAERR: malformed data, too many bad records, missing input; not retried
    RETRYABLE = 75  # EX_TEMPFAIL: device/collective health failure, stuck-step watchdog; Batch retries
    BAD_CONFIG = 78  # EX_CONFIG: invalid flags/config, incompatible checkpoint; not retried
    GATE_FAILED = 79  # the new model failed the holdout quality gate; the current model stays
    NON_FINITE_LOSS = 80  # loss became NaN/Inf; stopped before the optimizer step; not retried


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


EXIT_CODE_FILE_ENV = "PIPELINE_EXIT_CODE_FILE"


def record_exit_code(code: int, environ: "os._Environ[str] | dict[str, str] | None" = None) -> None:
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
