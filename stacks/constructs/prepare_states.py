"""The Prepare states of the training pipeline: plan -> array of shards -> finish.

`prepare` runs as three Batch jobs (pipeline_steps/prepare_shards.py):

    Prepare        job definition "prepare"         prepare --phase plan: inputs, catalog, tokenizer, units
    PrepareShards  job definition "prepare-shards"  an array job; child i validates and tokenises its units
    PrepareFinish  job definition "prepare-finish"  prepare --phase finish: counts, threshold, outputs

The array size is the execution input's `prepare_shards` (default PipelineConfig.prepare_array_size),
checked like every other field before any job: Batch accepts 2..10,000 children
(https://docs.aws.amazon.com/batch/latest/userguide/array_jobs.html). The Step Functions Batch
integration passes SubmitJob's request fields through, so ArrayProperties.Size can come from the
state input with a JSONPath ("Size.$"; https://docs.aws.amazon.com/step-functions/latest/dg/connect-batch.html).
Batch sets AWS_BATCH_JOB_ARRAY_INDEX on each child but not the array size, so the size also travels
as the `shard_count` parameter (a string: Batch parameters are strings). The shard count decides
only which child does which unit, never the outputs, so any count gives the same prepared data.
"""

from __future__ import annotations

from typing import Any

PREPARE_STATES: tuple[tuple[str, str], ...] = (
    ("Prepare", "prepare"),
    ("PrepareShards", "prepare-shards"),
    ("PrepareFinish", "prepare-finish"),
)
"""(state name, job definition key), in pipeline order."""
SHARDS_FIELD = "prepare_shards"
MIN_ARRAY_SIZE, MAX_ARRAY_SIZE = 2, 10_000
SHARDS_FIX = (f"{SHARDS_FIELD}: an integer {MIN_ARRAY_SIZE}..{MAX_ARRAY_SIZE} (the size of the Batch array job "
              f"that validates and tokenises the pairs)")


def array_submit(size_path: str) -> dict[str, Any]:
    """The SubmitJob fields of an array job whose size is the integer at `size_path` in the state
    input, with that size as the `shard_count` parameter."""
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
