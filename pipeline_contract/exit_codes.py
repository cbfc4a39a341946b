"""The exit codes of `python -m pipeline_steps <step>`: AWS Batch retry strategies and the state
machine act on them; the README's exit-code table lists them."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit codes of `python -m pipeline_steps <step>` (values follow BSD sysexits where one
    fits). The job definitions' retry strategies retry RETRYABLE only; the entrypoint exits BAD_CONFIG
    on a bad command line; the README documents the table."""

    OK = 0
    INTERNAL = 1  # a bug: unexpected exception, traceback printed; not retried
    USAGE = 2  # argparse's own code for a bad command line
    BAD_INPUT = 65  # EX_DATAERR: malformed data, too many bad records, missing input; not retried
    RETRYABLE = 75  # EX_TEMPFAIL: device/collective health failure, stuck-step watchdog; Batch retries
    BAD_CONFIG = 78  # EX_CONFIG: invalid flags/config, incompatible checkpoint; not retried
    GATE_FAILED = 79  # the new model failed the holdout quality gate; the current model stays
    NON_FINITE_LOSS = 80  # loss became NaN/Inf; stopped before the optimizer step; not retried
