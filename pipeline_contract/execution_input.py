"""The execution input of the training pipeline's state machine: the fields a run may set, with the
bounds AWS Batch puts on them, stated once for the stage config's checks, the state machine's input
checks and `trainium-runs start`. docs/orchestration.md, "Execution input", has the whole schema."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bounds:
    """An inclusive range, of integers when both ends are; str() is how a fix-it message states it
    ("2..10000")."""

    low: int | float
    high: int | float

    def __contains__(self, value: object) -> bool:
        integers = isinstance(self.low, int) and isinstance(self.high, int)
        kinds = (int,) if integers else (int, float)
        return isinstance(value, kinds) and not isinstance(value, bool) and self.low <= value <= self.high

    def __str__(self) -> str:
        return f"{self.low}..{self.high}"


ARRAY_SIZE = Bounds(2, 10_000)
"""Children of a Batch array job (https://docs.aws.amazon.com/batch/latest/userguide/array_jobs.html)."""
PRIORITY = Bounds(0, 9999)
"""SubmitJob schedulingPriorityOverride, higher first
(https://docs.aws.amazon.com/batch/latest/APIReference/API_SubmitJob.html)."""

# The fields. Every one but data_uri has a default (the state machine's Defaults state).
DATASET = "dataset"
VERSION = "version"
DATA_URI = "data_uri"
INIT_FROM = "init_from"
PREVIOUS_METRICS = "previous_metrics"
NUM_NODES = "num_nodes"
"""Nodes of the multi-node jobs: 1..the training compute environment's max nodes."""
SHARE = "share"
PRIORITY_FIELD = "priority"
EMBED_SHARDS = "embed_shards"
"""The embed array job's size (ARRAY_SIZE)."""
PREPARE_SHARDS = "prepare_shards"
"""The prepare shard array job's size (ARRAY_SIZE)."""
INTEGER_FIELDS = (NUM_NODES, EMBED_SHARDS, PREPARE_SHARDS, PRIORITY_FIELD)
"""Checked as integers (the state machine tells them from other numbers by their JSON text)."""
