"""New data starts a run: S3 `incoming/<dataset>/<version>/_SUCCESS` -> EventBridge -> starter -> pipeline.

The Express "starter" state machine (no Lambda) names the run "<dataset>-<version>" (else, only when
the service refuses that name, "upload-<md5>"), so a data version starts at most one run and a
duplicate event is a no-op. docs/orchestration.md ("Upload contract") has the rules and limits.
"""

from __future__ import annotations

from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from aws_cdk import Duration

from pipeline_steps.contract import FSX_DATA
from stacks.constructs.log_delivery import encrypted_log_group, express_state_machine
from stacks.constructs.service_principals import events_role
from stacks.pipeline_config import PipelineConfig

# Transient StartExecution failures: throttling (https://docs.aws.amazon.com/step-functions/latest/apireference/CommonErrors.html),
# reported as StepFunctions.ThrottlingException, or as StepFunctions.SfnException when the SDK's
# model has no class for the error code; client-side faults; timeouts.
START_RETRY_ERRORS = ("StepFunctions.ThrottlingException", "StepFunctions.SfnException",
                      "StepFunctions.SdkClientException", "States.Timeout")
# The service's refusals of the name itself (StartExecution: InvalidName, and ValidationException
# for a name over 80 characters): it validated the name and started nothing. Only these may lead to
# the hashed name. Any other error may follow a start that happened (a response lost, then a retry
# refused), so a fallback there could start the same data version twice: the starter fails instead.
NAME_REFUSED_ERRORS = ("StepFunctions.InvalidNameException", "StepFunctions.ValidationException")


def execution_name(dataset: str, version: str) -> str:
    """What the starter names the run (the ASL below does the same with intrinsic functions)."""
    return f"{dataset}-{version}"


class RunTrigger(Construct):
    """Public: `rule`, `starter` (the Express state machine)."""

    def __init__(self, scope: Construct, construct_id: str, *, config: PipelineConfig,
                 data_bucket: s3.IBucket, pipeline: sfn.IStateMachine, key: kms.IKey) -> None:
        super().__init__(scope, construct_id)
        # EventBridge targets cannot set an execution name, and the name is what makes a start
        # idempotent (StartExecution with a used name fails with ExecutionAlreadyExists; names are
        # unique per state machine for 90 days:
        # https://docs.aws.amazon.com/step-functions/latest/apireference/API_StartExecution.html),
        # so the rule targets a starter that derives the name from the key with intrinsic functions.
        parse = self._parse_and_start(config, pipeline)
        self.starter = express_state_machine(
            self, "Starter", definition=parse, log_group=encrypted_log_group(self, "StarterLogs", key),
            comment="Starts one training pipeline run per uploaded dataset version (idempotent by name)")
        pipeline.grant_start_execution(self.starter)

        self.rule = events.Rule(
            self, "NewDataRule",
            enabled=config.trigger_enabled,
            description=f"{config.incoming_prefix}<dataset>/<version>/{config.success_marker} created -> training run",
            event_pattern=events.EventPattern(
                source=["aws.s3"],
                detail_type=["Object Created"],
                detail={
                    "bucket": {"name": [data_bucket.bucket_name]},
                    "object": {"key": [{"wildcard": f"{config.incoming_prefix}*/{config.success_marker}"}]},
                },
            ),
            targets=[targets.SfnStateMachine(self.starter, retry_attempts=8, role=events_role(
                self, "StartRole", description="EventBridge: start the starter state machine on new data"))],
        )

    def _parse_and_start(self, config: PipelineConfig, pipeline: sfn.IStateMachine) -> sfn.IChainable:
        """ParseKey -> DescribeUpload -> CheckKeyDepth -> StartPipeline (-> StartPipelineHashedName)."""
        depth = config.incoming_prefix.count("/")  # key segments before <dataset>

        parse = sfn.CustomState(self, "ParseKey", state_json={
            "Type": "Pass",
            "Parameters": {
                "key.$": "$.detail.object.key",
                "bucket.$": "$.detail.bucket.name",
                "parts.$": "States.StringSplit($.detail.object.key, '/')",
            },
        })
        describe = sfn.CustomState(self, "DescribeUpload", state_json={
            "Type": "Pass",
            "Parameters": {
                "key.$": "$.key",
                "bucket.$": "$.bucket",
                "depth.$": "States.ArrayLength($.parts)",
                "dataset.$": f"States.ArrayGetItem($.parts, {depth})",
                "version.$": f"States.ArrayGetItem($.parts, {depth + 1})",
            },
        })
        execution_input = {
            "dataset.$": "$.dataset",
            "version.$": "$.version",
            "data_uri.$": f"States.Format('{FSX_DATA}/{config.incoming_prefix}{{}}/{{}}', $.dataset, $.version)",
            "data_s3_uri.$": f"States.Format('s3://{{}}/{config.incoming_prefix}{{}}/{{}}/', $.bucket, $.dataset, $.version)",
            "source_key.$": "$.key",
        }
        already = sfn.Succeed(self, "AlreadyStarted", comment="A run for this upload exists: duplicate event.")
        start_hashed = self._start("StartPipelineHashedName", pipeline, execution_input,
                                   "States.Format('upload-{}', States.Hash(States.Format('{}/{}', $.dataset, $.version), 'MD5'))")
        start_hashed.add_catch(already, errors=["StepFunctions.ExecutionAlreadyExistsException"], result_path="$.error")
        start = self._start("StartPipeline", pipeline, execution_input, "States.Format('{}-{}', $.dataset, $.version)")
        start.add_catch(already, errors=["StepFunctions.ExecutionAlreadyExistsException"], result_path="$.error")
        # A readable name the service refuses is always refused, so each data version has exactly one
        # name it can ever start under: the readable one, or else the hashed one (valid by construction).
        start.add_catch(start_hashed, errors=list(NAME_REFUSED_ERRORS), result_path="$.error")
        started = sfn.Succeed(self, "Started")
        start.next(started)
        start_hashed.next(started)

        check = sfn.Choice(self, "CheckKeyDepth")
        # incoming/<dataset>/<version>/_SUCCESS exactly; a deeper or shallower marker is an upload error.
        check.when(sfn.Condition.number_equals("$.depth", depth + 3), start)
        check.otherwise(sfn.Fail(self, "UnexpectedKey", error="UnexpectedKey",
                                 cause=f"Expected {config.incoming_prefix}<dataset>/<version>/{config.success_marker}"))
        parse.next(describe)
        describe.next(check)
        return parse

    def _start(self, name: str, pipeline: sfn.IStateMachine, execution_input: dict, name_expr: str) -> sfn.CustomState:
        state = sfn.CustomState(self, name, state_json={
            "Type": "Task",
            "Resource": "arn:aws:states:::states:startExecution",
            "Parameters": {
                "StateMachineArn": pipeline.state_machine_arn,
                "Name.$": name_expr,
                "Input": execution_input,
            },
            "ResultPath": "$.started",
            "TimeoutSeconds": 30,
        })
        # At most 1+2+4+8+16+16 s of backoff per start: both starts fit the Express 5-minute limit.
        state.add_retry(errors=list(START_RETRY_ERRORS), interval=Duration.seconds(1), max_attempts=6,
                        backoff_rate=2.0, max_delay=Duration.seconds(16), jitter_strategy=sfn.JitterType.FULL)
        return state
