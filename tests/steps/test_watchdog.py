"""The stall watchdog ends a stuck process with the retryable exit code, and only a stuck one.

Each scenario runs in a child process: the watchdog ends its process with os._exit, and the
child's main thread blocks the way a hung collective does (waiting forever in C code).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline_steps.errors import ExitCode
from pipeline_steps.watchdog import Watchdog

REPO = Path(__file__).resolve().parents[2]


def run_child(body: str, timeout: float = 30.0) -> tuple[subprocess.CompletedProcess[str], float]:
    script = textwrap.dedent("""
        import logging, threading, time
        from pipeline_steps.watchdog import Watchdog
        logging.basicConfig(level=logging.INFO)
        hang_like_a_collective = threading.Event().wait   # blocks forever, like a stuck all_reduce
    """) + textwrap.dedent(body)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False)
    return proc, time.monotonic() - start


def test_exits_75_within_its_bound_when_the_step_stops_beating():
    proc, elapsed = run_child("""
        with Watchdog(timeout_s=1.0, what="training step") as wd:
            for step in range(5):
                time.sleep(0.1)
                wd.beat()
            print("last beat", flush=True)
            hang_like_a_collective()
        print("unreachable")
    """)
    assert proc.returncode == ExitCode.RETRYABLE == 75
    assert "last beat" in proc.stdout and "unreachable" not in proc.stdout
    assert "no training step completed for" in proc.stderr
    assert "(5 completed so far)" in proc.stderr
    # The stack dump shows where the main thread was stuck.
    assert "hang_like_a_collective" in proc.stderr or "wait" in proc.stderr
    # 0.5 s of beats + 1 s bound + ~1 s poll granularity + interpreter start-up.
    assert elapsed < 8.0


def test_does_not_fire_while_beats_arrive():
    proc, _ = run_child("""
        with Watchdog(timeout_s=0.5, what="training step") as wd:
            for step in range(15):       # 3 s in total, 6x the bound, beat every 0.2 s
                time.sleep(0.2)
                wd.beat()
        print("finished", wd.beats)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "finished 15" in proc.stdout
    assert "stall watchdog: no" not in proc.stderr


def test_startup_bound_applies_before_the_first_beat_and_on_stall_runs(tmp_path):
    marker = tmp_path / "partial-report.txt"
    proc, elapsed = run_child(f"""
        from pathlib import Path
        def write_partial_report(message):
            Path({str(marker)!r}).write_text(message)
        with Watchdog(timeout_s=60.0, startup_timeout_s=0.5, what="compile step",
                      on_stall=write_partial_report):
            hang_like_a_collective()
    """)
    assert proc.returncode == 75
    assert "no compile step has completed since the watchdog started" in proc.stderr
    assert elapsed < 8.0
    assert "exiting with code 75" in marker.read_text()


def test_disabled_with_a_non_positive_timeout():
    with Watchdog(timeout_s=0, what="debug session") as wd:
        wd.beat()
    assert not wd.enabled and wd._thread is None


def test_stops_cleanly_in_process():
    with Watchdog(timeout_s=5.0) as wd:
        wd.beat()
        assert wd.seconds_since_beat() < 1.0
        assert wd._thread is not None and wd._thread.is_alive()
    assert wd._thread is None


def test_cannot_start_twice():
    wd = Watchdog(timeout_s=5.0).start()
    try:
        with pytest.raises(RuntimeError, match="already started"):
            wd.start()
    finally:
        wd.stop()
