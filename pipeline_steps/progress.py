"""Progress reporting: a live display on a terminal, plain periodic log lines elsewhere.

AWS Batch captures stdout/stderr into CloudWatch Logs, where a live progress bar becomes
thousands of carriage-return fragments; so the display is chosen once, from whether stderr is
a TTY, and both modes show the same fields (step, loss, tokens/s, ETA).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

log = logging.getLogger(__name__)


def format_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


class Progress:
    """`with Progress(total, "train", log_every=10) as p: p.update(step, loss=..., tokens_per_s=...)`.

    Only the main process should display (pass `enabled=False` elsewhere)."""

    def __init__(self, total: int, description: str, *, log_every: int = 10, enabled: bool = True,
                 live: bool | None = None, start_step: int = 0) -> None:
        self.total = max(1, total)
        self.description = description
        self.log_every = max(1, log_every)
        self.enabled = enabled
        self.live = sys.stderr.isatty() if live is None else live
        self.start_step = start_step
        self._t0 = time.monotonic()
        self._rich: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.enabled and self.live:
            from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(
                TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[status]}"), TimeRemainingColumn(), transient=False,
            )
            self._rich.__enter__()
            self._task = self._rich.add_task(self.description, total=self.total, completed=self.start_step,
                                             status="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rich is not None:
            self._rich.__exit__(*exc)

    def update(self, step: int, **fields: float) -> None:
        if not self.enabled:
            return
        status = "  ".join(f"{k}={v:.4g}" for k, v in fields.items())
        if self._rich is not None:
            self._rich.update(self._task, completed=step, status=status)
            return
        if step % self.log_every and step != self.total:
            return
        done = step - self.start_step
        elapsed = time.monotonic() - self._t0
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        log.info("%s step %d/%d  %s  eta %s", self.description, step, self.total, status, format_eta(eta))
