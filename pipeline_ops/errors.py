"""The operator CLI's expected failures: each carries a fix-it message and the exit code
`trainium-runs` ends with (docs/operations.md lists them)."""

from __future__ import annotations


class OpsError(Exception):
    """An expected failure with a fix-it message and the CLI exit code it maps to."""

    exit_code = 1


class NotFoundError(OpsError):
    exit_code = 3


class ConfigError(OpsError):
    exit_code = 4


class CredentialsError(OpsError):
    exit_code = 5


class UsageError(OpsError):
    exit_code = 2


class ConflictError(OpsError):
    exit_code = 6
