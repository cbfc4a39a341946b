"""The sanity step's results: one Check per check, a rank's Report (run, time and log each check)
and sanity.json, rank 0's summary of every rank (pipeline_steps/steps/sanity.py writes them)."""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import distributed
from .errors import ExitCode
from .fileio import read_json

log = logging.getLogger("pipeline_steps.sanity")  # the step's name: operators and the failure rules read it

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


@dataclass
class Check:
    name: str
    status: str
    expected: Any = None
    actual: Any = None
    seconds: float = 0.0
    detail: str = ""

    def line(self) -> str:
        text = f"{self.status.upper():<7} {self.name:<18} {self.seconds * 1000:9.1f} ms"
        if self.status == FAILED:
            text += f"  expected {self.expected}, actual {self.actual}"
        return text + (f"  ({self.detail})" if self.detail else "")


@dataclass
class Report:
    rank: int
    local_rank: int
    world_size: int
    backend: str
    host: str = field(default_factory=socket.gethostname)
    started_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    checks: list[Check] = field(default_factory=list)
    current: str | None = None  # the check in progress, for the watchdog's report
    raised: set[str] = field(default_factory=set)  # checks that ended in an exception, not a wrong value

    def run(self, name: str, fn: Callable[[], Check]) -> Check:
        """Run one check, time it, and record an exception from the device or a collective as a
        failure of that check (the next checks still run and show how far the damage goes)."""
        self.current = name
        start = time.perf_counter()
        try:
            check = fn()
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            check = Check(name, FAILED, expected="completes", actual="raised", detail=f"{type(exc).__name__}: {exc}")
            self.raised.add(name)
        check.seconds = round(time.perf_counter() - start, 6)
        self.checks.append(check)
        self.current = None
        (log.error if check.status == FAILED else log.info)("%s", check.line())
        return check

    def skip(self, name: str, reason: str) -> Check:
        return self.run(name, lambda: Check(name, SKIPPED, detail=reason))

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAILED]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "local_rank": self.local_rank, "world_size": self.world_size,
            "backend": self.backend, "host": self.host, "started_at": self.started_at,
            "status": FAILED if self.failed else PASSED,
            "checks": [asdict(c) for c in self.checks],
        }


def summary(report: Report, extra: dict[str, Any], failed_ranks: list[int] | None, out_dir: Path,
             seconds: float) -> dict[str, Any]:
    """sanity.json: rank 0's checks plus, for every failed rank, the names of its failed checks
    (read from its rank file: the run dir is on shared FSx in production)."""
    failures: dict[str, Any] = {}
    for r in failed_ranks or []:
        path = out_dir / f"rank-{r}.json"
        try:
            failures[str(r)] = [c for c in read_json(path)["checks"] if c["status"] == FAILED]
        except (OSError, ValueError, KeyError) as exc:
            failures[str(r)] = f"unreadable {path}: {exc}"
    if failed_ranks is None:  # the aggregation itself was skipped: collectives are broken
        failures[str(report.rank)] = [asdict(c) for c in report.failed]
    failed = bool(report.failed or failed_ranks)
    return {
        "status": FAILED if failed else PASSED,
        "exit_code": int(ExitCode.RETRYABLE if failed else ExitCode.OK),
        "world_size": report.world_size,
        "backend": report.backend,
        "host": report.host,
        "started_at": report.started_at,
        "seconds": round(seconds, 3),
        "failed_ranks": failed_ranks,
        "failures_by_rank": failures,
        "checks": [asdict(c) for c in report.checks],
        **extra,
        "versions": distributed.versions(),
    }
