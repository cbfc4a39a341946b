"""The failure path's classifier: a small Lambda function that ships only pipeline_steps.diagnosis
(the classifier and its reviewed rules.toml) and reads the failed job's log streams.

Least privilege: batch:DescribeJobs and batch:ListJobs (no resource-level permissions), and
logs:GetLogEvents on the job log group only; it writes its own KMS-encrypted log group, where its
embedded-metric-format lines become the PipelineFailures metric (dimensions Stage, Class).
The state machine catches any failure of it (stacks/constructs/pipeline_states.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from aws_cdk import AssetHashType, Duration
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from constructs import Construct

from pipeline_contract import HEARTBEAT_NAMESPACE
from pipeline_steps.diagnosis.handler import CLASS_DIMENSION, METRIC_NAME, STAGE_DIMENSION
from stacks.constructs.checkov import skip_checkov
from stacks.constructs.log_delivery import encrypted_log_group

REPO_ROOT = Path(__file__).resolve().parents[2]
HANDLER = "pipeline_steps.diagnosis.handler.handler"
# The function's code: the package marker and the diagnosis subpackage, nothing else of the repo.
CODE_EXCLUDE = ["*", ".*", "!pipeline_steps", "!pipeline_steps/__init__.py", "!pipeline_steps/diagnosis",
                "!pipeline_steps/diagnosis/*.py", "!pipeline_steps/diagnosis/rules.toml",
                "!pipeline_steps/diagnosis/log_model.json.gz"]
TIMEOUT_SECONDS = 120
"""Describing a 100-node job and reading 100 log tails takes well under a minute."""


def function_code(asset_hash: str | None = None) -> lambda_.Code:
    """The function's code asset; `asset_hash` fixes its hash (tests: snapshots that do not
    change with every rule)."""
    if asset_hash is None:
        return lambda_.Code.from_asset(str(REPO_ROOT), exclude=CODE_EXCLUDE)
    return lambda_.Code.from_asset(str(REPO_ROOT), exclude=CODE_EXCLUDE, asset_hash=asset_hash,
                                   asset_hash_type=AssetHashType.CUSTOM)


class FailureDiagnosis(Construct):
    """Public: `function`, `failures_by_class` (one line per class of the stage's failed runs)."""

    def __init__(self, scope: Construct, construct_id: str, *, stage: str, job_log_groups: Sequence[logs.ILogGroup],
                 key: kms.IKey, log_retention_days: int, asset_hash: str | None = None) -> None:
        """`job_log_groups`: where the pipeline's jobs log (one per team)."""
        super().__init__(scope, construct_id)
        role = iam.Role(self, "Role", assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
                        description="Failure classifier: reads failed Batch jobs and their log streams")
        log_group = encrypted_log_group(self, "Logs", key, days=log_retention_days)
        log_group.grant_write(role)
        # DescribeJobs/ListJobs have no resource-level permissions
        # (https://docs.aws.amazon.com/batch/latest/userguide/batch-supported-iam-actions-resources.html).
        role.add_to_principal_policy(iam.PolicyStatement(actions=["batch:DescribeJobs", "batch:ListJobs"],
                                                         resources=["*"]))
        for job_log_group in job_log_groups:
            job_log_group.grant(role, "logs:GetLogEvents")
        self.function = lambda_.Function(
            self, "Function", runtime=lambda_.Runtime.PYTHON_3_14, architecture=lambda_.Architecture.ARM_64,
            handler=HANDLER, code=function_code(asset_hash), role=role, log_group=log_group,
            timeout=Duration.seconds(TIMEOUT_SECONDS), memory_size=512,
            environment={"METRIC_NAMESPACE": HEARTBEAT_NAMESPACE, "STAGE": stage}, environment_encryption=key,
            description="Classifies a failed pipeline run from its job logs (pipeline_steps/diagnosis)")
        key.grant_decrypt(role)
        skip_checkov(self.function, {
            "CKV_AWS_116": "Invoked synchronously by the state machine, which catches its failures; a dead-letter "
                           "queue applies to asynchronous invocations only",
            "CKV_AWS_117": "Calls only the Batch and CloudWatch Logs APIs and reaches no resource in the VPC",
            "CKV_AWS_115": "At most one invocation per failed run; reserved concurrency would take capacity from "
                           "the account's unreserved pool for nothing",
        })
        self.failures_by_class = cw.MathExpression(
            expression=f"SEARCH('{{{HEARTBEAT_NAMESPACE},{STAGE_DIMENSION},{CLASS_DIMENSION}}} "
                       f"MetricName=\"{METRIC_NAME}\" {STAGE_DIMENSION}=\"{stage}\"', 'Sum', 3600)",
            using_metrics={}, label="failed runs by class", period=Duration.hours(1))
