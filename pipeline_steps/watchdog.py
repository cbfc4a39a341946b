"""In-process stall watchdog: exits 75 (ExitCode.RETRYABLE, which AWS Batch retries) when no step
completes within the bound; `timeout_s <= 0` disables it. Why and what it reports: docs/operations.md.

    with Watchdog(timeout_s=1800, what="training step", startup_timeout_s=3600) as watchdog:
        for batch in batches:
            train_step(batch)
            watchdog.beat()
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

from .errors import ExitCode, record_exit_code

log = logging.getLogger(__name__)

# How long the stall report (logging, stack dump, on_stall callback) may take before the process
# exits anyway: a handler stuck on a blocked stdout pipe must not defeat the watchdog.
REPORT_GRACE_S = 10.0


def _utc(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, tz=UTC).isoformat(timespec="seconds")


class Watchdog:
    """Ends the process with exit code 75 when `beat()` is not called for `timeout_s` seconds.

    timeout_s          bound between two beats (seconds); <= 0 disables the watchdog.
    what               what a beat means, for the message ("training step", "sanity check").
    startup_timeout_s  bound from entering the block to the first beat (default: timeout_s);
                       set it larger when the first step compiles graphs.
    on_stall           optional callable(message) run before exiting, e.g. to write a partial
                       report; it gets at most REPORT_GRACE_S together with the log and dump.
    exit_code          defaults to ExitCode.RETRYABLE (75); tests may pass another.
    """

    def __init__(
        self,
        timeout_s: float,
        what: str = "training step",
        *,
        startup_timeout_s: float | None = None,
        on_stall: Callable[[str], None] | None = None,
        exit_code: int = ExitCode.RETRYABLE,
    ) -> None:
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s if startup_timeout_s is not None else timeout_s)
        self.what = what
        self.on_stall = on_stall
        self.exit_code = int(exit_code)
        self.beats = 0
        self._started_mono = 0.0
        self._last_beat_mono = 0.0
        self._last_beat_wall: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    # ------------------------------------------------------------------ public API

    def start(self) -> Watchdog:
        if not self.enabled:
            log.info("stall watchdog for %s disabled (timeout_s=%s)", self.what, self.timeout_s)
            return self
        if self._thread is not None:
            raise RuntimeError("Watchdog already started")
        self._started_mono = self._last_beat_mono = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="stall-watchdog", daemon=True)
        self._thread.start()
        log.info("stall watchdog armed: exit %d if no %s completes within %.0f s (first within %.0f s)",
                 self.exit_code, self.what, self.timeout_s, self.startup_timeout_s)
        return self

    def beat(self) -> None:
        """Record that one unit of work (`what`) completed. Cheap: call it every step."""
        # Two plain attribute writes; the GIL makes each atomic and the reader tolerates a torn pair.
        self._last_beat_mono = time.monotonic()
        self._last_beat_wall = time.time()
        self.beats += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def seconds_since_beat(self) -> float:
        return time.monotonic() - self._last_beat_mono

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the watcher thread

    def _bound(self) -> float:
        return self.timeout_s if self.beats else self.startup_timeout_s

    def _run(self) -> None:
        while not self._stop.is_set():
            remaining = self._bound() - self.seconds_since_beat()
            if remaining <= 0:
                self._fire()
                return
            # Wake at most every second so a beat that arrived resets the deadline promptly,
            # and at least often enough to fire within ~1 s of the bound.
            self._stop.wait(min(remaining, 1.0))

    def _message(self) -> str:
        stalled_for = self.seconds_since_beat()
        if self.beats:
            last = (f"last {self.what} completed at {_utc(self._last_beat_wall or 0.0)} "
                    f"({self.beats} completed so far)")
        else:
            last = f"no {self.what} has completed since the watchdog started"
        return (f"stall watchdog: no {self.what} completed for {stalled_for:.1f} s "
                f"(bound {self._bound():.1f} s); {last}. A collective or the device is probably hung; "
                f"exiting with code {self.exit_code} so the job is retried.")

    def _report(self, message: str) -> None:
        # Straight to the stderr file descriptor first: works even when logging is unconfigured.
        try:
            os.write(sys.stderr.fileno(), (message + "\n").encode("ascii", "replace"))
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError):  # stderr closed or redirected to something without a fd
            pass
        log.error("%s", message)
        if self.on_stall is not None:
            try:
                self.on_stall(message)
            except Exception:  # the process exits next anyway; show why the report is missing
                log.exception("stall watchdog: on_stall callback failed")
        for handler in logging.getLogger().handlers:
            handler.flush()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass

    def _fire(self) -> None:
        # Exit from this thread: the main thread may be blocked in C++ (a hung collective) where no
        # exception reaches it. The entrypoint reads the recorded code, since torchrun itself exits 1.
        message = self._message()
        # The report may block (a handler stuck on a full pipe, an FSx write hanging in on_stall):
        # run it in its own thread and exit after a bounded grace period whatever happens.
        reporter = threading.Thread(target=self._report, args=(message,), name="stall-report", daemon=True)
        reporter.start()
        reporter.join(timeout=REPORT_GRACE_S)
        record_exit_code(self.exit_code)
        os._exit(self.exit_code)
