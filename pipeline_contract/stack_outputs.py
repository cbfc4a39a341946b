"""The stack names and outputs `trainium-runs` reads: the stacks write them, the CLI finds a stage's
resources by them (stack `<project>-<stage>-<role>`)."""

from __future__ import annotations

DEFAULT_PROJECT = "TrnEmbed"
"""StageConfig.project's default: the prefix of every stack name and the CLI's --project default."""


def stack_name(project: str, stage: str, role: str) -> str:
    """`<project>-<stage>-<role>`, role one of "Network", "Storage", "Compute", "Pipeline"."""
    return f"{project}-{stage}-{role}"


# The Storage stack's
DATA_BUCKET_OUTPUT = "DataBucketName"
ARTIFACTS_BUCKET_OUTPUT = "ArtifactsBucketName"
# The Pipeline stack's
STATE_MACHINE_OUTPUT = "StateMachineArn"
"""A team's is `<Team>StateMachineArn` (TeamConfig.construct_name + this)."""
TRAINING_INSTANCE_TYPE_OUTPUT = "TrainingInstanceType"
SINGLE_NODE_INSTANCE_TYPE_OUTPUT = "SingleNodeInstanceType"
MLFLOW_TRACKING_SERVER_OUTPUT = "MlflowTrackingServerArn"
