"""What a step with an array size field (pipeline_contract.PipelineStep.array_size_field) adds to
its SubmitJob request: the shard count as the `shard_count` parameter and, for an array step, the
Batch array of that size (Prepare's shard phase, Embed). docs/orchestration.md has the flow."""

from __future__ import annotations

from typing import Any

from pipeline_contract import Launcher, PipelineStep


def array_fields(step: PipelineStep) -> dict[str, Any]:
    """The SubmitJob fields for the integer at `$.run.<step.array_size_field>` in the state input."""
    if step.array_size_field is None:
        return {}
    size_path = f"$.run.{step.array_size_field}"
    # The Batch integration passes SubmitJob's fields through, so the size can be a JSONPath
    # ("Size.$": https://docs.aws.amazon.com/step-functions/latest/dg/connect-batch.html). Batch sets
    # AWS_BATCH_JOB_ARRAY_INDEX on each child but not the size, so the size also travels as a
    # (string) parameter (https://docs.aws.amazon.com/batch/latest/userguide/array_jobs.html).
    fields: dict[str, Any] = {"Parameters": {"shard_count.$": f"States.Format('{{}}', {size_path})"}}
    if step.launcher is Launcher.ARRAY:
        fields["ArrayProperties"] = {"Size.$": size_path}
    return fields
