"""Shards of an AWS Batch array job: which slice a child owns, and cleanup after a killed writer.

Shared by the array steps (`embed`, `prepare --phase shard`). Shard i of n owns the contiguous
slice [i*N//n, (i+1)*N//n) of N work items, so the assignment is deterministic and every item is
owned exactly once. The index defaults to AWS_BATCH_JOB_ARRAY_INDEX, which Batch sets on every
array child; the count to AWS_BATCH_JOB_ARRAY_SIZE, which Batch does NOT set (and it rejects
AWS_BATCH* overrides), so the job definitions pass --shard-count from a parameter
(https://docs.aws.amazon.com/batch/latest/userguide/array_jobs.html).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .errors import BadConfigError

log = logging.getLogger(__name__)


def shard_bounds(num_items: int, shard_index: int, shard_count: int) -> tuple[int, int]:
    """[start, end) of shard `shard_index`: contiguous, sizes differ by at most one."""
    return shard_index * num_items // shard_count, (shard_index + 1) * num_items // shard_count


def resolve_shard(shard_index: int | None, shard_count: int | None,
                  environ: dict[str, str] | os._Environ = os.environ) -> tuple[int, int]:
    """Flags win; else AWS Batch array variables; else shard 0 of 1."""
    env_index, env_size = environ.get("AWS_BATCH_JOB_ARRAY_INDEX"), environ.get("AWS_BATCH_JOB_ARRAY_SIZE")
    try:
        index = shard_index if shard_index is not None else int(env_index) if env_index else None
        count = shard_count if shard_count is not None else int(env_size) if env_size else None
    except ValueError as exc:
        raise BadConfigError(f"AWS_BATCH_JOB_ARRAY_INDEX/SIZE must be integers: {exc}") from None
    if index is not None and count is None:
        raise BadConfigError(
            f"shard index {index} given (flag or AWS_BATCH_JOB_ARRAY_INDEX) but no shard count: AWS Batch "
            "does not export the array size, so pass --shard-count N or set AWS_BATCH_JOB_ARRAY_SIZE "
            "in the job's environment"
        )
    index, count = (0 if index is None else index), (1 if count is None else count)
    if count < 1 or not 0 <= index < count:
        raise BadConfigError(f"need 0 <= shard index < shard count, got index {index}, count {count}")
    return index, count


def remove_stale_temps(path: Path) -> None:
    """Temp files left by a writer killed mid-write (fileio.atomic_path names them .<name>.*.tmp)."""
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        log.warning("removing %s left by an interrupted writer", tmp)
        tmp.unlink(missing_ok=True)
