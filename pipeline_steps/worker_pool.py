"""Worker processes for the independent pieces of `prepare` (the pair files to validate, the chunks
of pairs to tokenise): one per CPU this process may use, at most MAX_WORKERS. A piece names its
inputs (files, small values), so a worker needs none of the parent's state: `prepare` starts them
before it reads the catalog, by fork (in milliseconds, sharing the parent's modules;
https://docs.python.org/3/library/multiprocessing.html#contexts-and-start-methods). Results come
back in the order the pieces were given. Measured in docs/data.md, "Scale"."""

from __future__ import annotations

import collections
import contextlib
import gc
import math
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

MAX_WORKERS = 4
"""Workers at most, whatever the CPUs: each holds its own chunks of pairs and encoder caches (100-300
MB measured), and reading the catalog stays one process's work (docs/data.md, "Scale")."""
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cpus() -> int:
    """CPUs this process may use: its affinity, bounded by its cgroup's CPU quota when it has one
    (a container's --cpus, an AWS Batch job's vCPUs on a larger instance)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return cpus if quota is None else min(cpus, quota)


def _cgroup_cpu_quota() -> int | None:
    """Whole CPUs of the cgroup v2 quota (`cpu.max`: "<quota> <period>" or "max <period>"), or None
    without one: no limit, cgroup v1, or no cgroup file."""
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def worker_count() -> int:
    return min(available_cpus(), MAX_WORKERS)


Pool = ProcessPoolExecutor | None
"""A pool of workers, or None: the caller does the work itself."""


TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"
"""The tokenizers library's switch for its thread pool: off in the workers, which are one per CPU
already (and the library turns it off in a child forked after the parent used it, with a warning)."""


@contextlib.contextmanager
def worker_pool(workers: int) -> Iterator[Pool]:
    """A pool of `workers` processes (None below 2), started now: forked on Linux, spawned
    elsewhere (where fork is unsafe). The parent's objects are frozen out of the collector while
    the pool lives, so the workers' collections do not copy the pages they share with the parent
    (https://docs.python.org/3/library/gc.html#gc.freeze)."""
    if workers < 2:
        yield None
        return
    gc.freeze()
    before = os.environ.get(TOKENIZERS_PARALLELISM)
    os.environ[TOKENIZERS_PARALLELISM] = "false"  # the workers' environment, fixed as they start
    try:
        context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            pool.submit(int).result()  # starts every worker (a forking pool starts them all at its first job)
            _restore(before)
            yield pool
    finally:
        _restore(before)
        gc.unfreeze()


def _restore(value: str | None) -> None:
    if value is None:
        os.environ.pop(TOKENIZERS_PARALLELISM, None)
    else:
        os.environ[TOKENIZERS_PARALLELISM] = value


def ordered_map(pool: Pool, fn: Callable[[Item], Result], items: Iterable[Item],
                window: int) -> Iterator[tuple[Item, Result]]:
    """(item, fn(item)) for each item, in order: computed by the pool's workers, at most `window`
    items ahead of the caller (which bounds the results held in memory), or here without a pool."""
    if pool is None:
        yield from ((item, fn(item)) for item in items)
        return
    pending: collections.deque[tuple[Item, Any]] = collections.deque()
    for item in items:
        pending.append((item, pool.submit(fn, item)))
        if len(pending) > window:
            item, future = pending.popleft()
            yield item, future.result()
    while pending:
        item, future = pending.popleft()
        yield item, future.result()
