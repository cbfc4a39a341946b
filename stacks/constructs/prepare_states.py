"""What the Prepare states add to their SubmitJob requests: Prepare (--phase plan) -> PrepareShards
(an array job, one child per shard of the pair input) -> PrepareFinish (--phase finish). The array
size is the execution input's `prepare_shards`; docs/orchestration.md has the flow."""

from __future__ import annotations

from typing import Any

SHARDS_FIELD = "prepare_shards"
MIN_ARRAY_SIZE, MAX_ARRAY_SIZE = 2, 10_000  # what Batch accepts for an array job
SHARDS_FIX = (f"{SHARDS_FIELD}: an integer {MIN_ARRAY_SIZE}..{MAX_ARRAY_SIZE} (the size of the Batch array job "
              f"that validates and tokenises the pairs)")


def array_submit(size_path: str) -> dict[str, Any]:
    """The SubmitJob fields of an array job whose size is the integer at `size_path` in the state
    input, with that size as the `shard_count` parameter."""
    # The Batch integration passes SubmitJob's fields through, so the size can be a JSONPath
    # ("Size.$": https://docs.aws.amazon.com/step-functions/latest/dg/connect-batch.html). Batch sets
    # AWS_BATCH_JOB_ARRAY_INDEX on each child but not the size, so the size also travels as a
    # (string) parameter (https://docs.aws.amazon.com/batch/latest/userguide/array_jobs.html).
    return {"ArrayProperties": {"Size.$": size_path},
            "Parameters": {"shard_count.$": f"States.Format('{{}}', {size_path})"}}


def prepare_submit(state_name: str) -> dict[str, Any]:
    """What a Prepare state adds to its SubmitJob request: the array for PrepareShards; the shard
    count for PrepareFinish too (its error names the shards to rerun)."""
    size_path = f"$.run.{SHARDS_FIELD}"
    if state_name == "PrepareShards":
        return array_submit(size_path)
    if state_name == "PrepareFinish":
        return {"Parameters": array_submit(size_path)["Parameters"]}
    return {}
