"""The training pipeline state machine: Prepare -> Sanity -> Compile -> Train -> Validate -> gate -> Embed -> Publish.

Every Batch step is a raw-ASL `CustomState` on `arn:aws:states:::batch:submitJob.sync` because the
CDK `BatchSubmitJob` task has no `ShareIdentifier` / `SchedulingPriorityOverride`, which every
submission to a fair-share queue needs (DESIGN.md section 5;
https://docs.aws.amazon.com/step-functions/latest/dg/connect-batch.html).

Execution input (every field optional; defaults come from PipelineConfig, merged by the first two
Pass states with States.JsonMerge, input wins):
    {"dataset": str, "version": str, "data_uri": "/fsx/data/incoming/<dataset>/<version>",
     "init_from": "/fsx/runs/<run>" (default: the published model, else "" = from scratch),
     "num_nodes": int, "share": str, "priority": int, "embed_shards": int}
"share" must be a share identifier of the training queue's fair-share policy (CheckShare fails the
run otherwise: Batch would accept an undefined identifier with the default weight); production
and experiment runs go to the same training queue, where the shares' weights decide.
The run id is the execution name; every job gets it as the Batch parameter `run_id`, so all steps
of one run share /fsx/runs/<run_id>.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_batch as batch
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks.constructs.retention import retention_days
from stacks.pipeline_config import PipelineConfig

# The only errors Step Functions retries: Batch API faults. Host faults and our retryable exit
# code are retried by the job definitions' retry strategies (evaluateOnExit); anything else is a
# real failure and goes to the one failure path.
BATCH_API_ERRORS: tuple[str, ...] = (
    "Batch.AWSBatchException",
    "Batch.ServerException",
    "Batch.TooManyRequestsException",
)
CURRENT_MODEL_KEY = "models/current.json"
GATE_KEY_PATTERN = "runs/*/validation/gate.json"


@dataclass(frozen=True)
class BatchStep:
    """One Batch state: its name, job definition key and whether it runs on the training queue."""

    name: str
    job_definition: str
    multi_node: bool


STEPS: tuple[BatchStep, ...] = (
    BatchStep("Prepare", "prepare", False),
    BatchStep("Sanity", "sanity", True),
    BatchStep("Compile", "compile", True),
    BatchStep("Train", "train", True),
    BatchStep("Validate", "validate", False),
    BatchStep("Embed", "embed", False),
)


def _has_fair_share(queue: batch.IJobQueue) -> bool:
    # Batch rejects ShareIdentifier on a queue without a scheduling policy and requires it on one
    # with a policy (SubmitJob API reference), so the field is emitted per queue.
    return queue.scheduling_policy is not None


def _policy_shares(queue: batch.IJobQueue) -> tuple[str, ...]:
    """The share identifiers the queue's fair-share policy defines (what CheckShare accepts)."""
    policy = queue.scheduling_policy
    if not isinstance(policy, batch.FairshareSchedulingPolicy) or not policy.shares:
        raise ValueError("TrainingPipeline: the training queue needs a fair-share policy with shares; every "
                         "submission names a share identifier.")
    return tuple(share.share_identifier for share in policy.shares)


class TrainingPipeline(Construct):
    """The Standard state machine, its KMS-encrypted log group and its least-privilege role.

    Public attributes: `state_machine`, `log_group`.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: PipelineConfig,
        artifacts_bucket: s3.IBucket,
        queues: Mapping[str, batch.IJobQueue],
        job_definitions: Mapping[str, batch.IJobDefinition],
        topic: sns.ITopic,
        key: kms.IKey,
    ) -> None:
        super().__init__(scope, construct_id)
        for name in ("training", "single-node"):
            if name not in queues:
                raise ValueError(f"TrainingPipeline: queues has no {name!r} queue (got {sorted(queues)}).")
        for step in STEPS:
            if step.job_definition not in job_definitions:
                raise ValueError(
                    f"TrainingPipeline: job_definitions has no {step.job_definition!r} (got {sorted(job_definitions)})."
                )
        self._cfg = config
        self._queues = queues
        self._job_definitions = job_definitions
        self._bucket = artifacts_bucket
        self._topic = topic

        # ---- failure path: one notification, then Fail --------------------------------------
        failed = sfn.Fail(self, "Failed", error="PipelineFailed",
                          cause="A pipeline step failed; see the SNS notification and the execution history.")
        notify_failure = self._sns_publish(
            "NotifyFailure",
            subject="Training pipeline run failed",
            # $.failure has one key, the failed state's name, holding {Error, Cause}; for a failed
            # Batch job the Cause is the DescribeJobs record (JobId, StatusReason, exit code).
            message="States.Format('Run {} failed. Failed step, error and cause: {}', $.run_id, States.JsonToString($.failure))",
        )
        notify_failure.add_catch(failed, errors=["States.ALL"], result_path="$.notify_error")
        notify_failure.next(failed)
        self._failure = notify_failure

        # ---- configuration: defaults merged with the execution input -------------------------
        defaults = sfn.Pass(self, "Defaults", result_path="$.defaults", result=sfn.Result.from_object({
            "dataset": "manual",
            "version": "manual",
            "data_uri": "",
            "previous_metrics": "",
            "num_nodes": config.default_num_nodes,
            "share": config.production_share,
            "priority": config.default_priority,
            "embed_shards": config.embed_array_size,
        }))
        apply_defaults = self._raw("ApplyDefaults", {
            "Type": "Pass",
            "Parameters": {
                "run.$": "States.JsonMerge($.defaults, $$.Execution.Input, false)",
                "run_id.$": "$$.Execution.Name",
            },
        })

        # ---- the share must be one the training queue's policy defines -------------------------
        shares = _policy_shares(queues["training"])
        check_share = sfn.Choice(self, "CheckShare")
        check_share.when(
            sfn.Condition.not_(sfn.Condition.or_(*[sfn.Condition.string_equals("$.run.share", s) for s in shares])),
            sfn.Fail(self, "UnknownShare", error="UnknownShare",
                     cause=f"Input 'share' must be one of the fair-share identifiers {list(shares)}."))

        # ---- incremental training: init_from from the input, else the published model --------
        read_current = self._raw("ReadCurrentModel", {
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:s3:getObject",
            "Parameters": {"Bucket": artifacts_bucket.bucket_name, "Key": CURRENT_MODEL_KEY},
            "ResultSelector": {"pointer.$": "States.StringToJson($.Body)"},
            "ResultPath": "$.current",
        })
        # The published model is the starting point and its holdout metrics the gate's baseline.
        use_current = self._raw("UseCurrentModel", {
            "Type": "Pass",
            "Parameters": {
                "init_from.$": "$.current.pointer.checkpoint",
                "previous_metrics.$": "States.Format('/fsx/runs/{}/validation/metrics.json', $.current.pointer.run_id)",
            },
            "ResultPath": "$.baseline",
        })
        from_scratch = self._raw("TrainFromScratch", {
            "Type": "Pass", "Result": {"init_from": "", "previous_metrics": ""}, "ResultPath": "$.baseline",
        })
        apply_baseline = self._raw("ApplyBaseline", {
            "Type": "Pass",
            "Parameters": {"run.$": "States.JsonMerge($.run, $.baseline, false)", "run_id.$": "$.run_id"},
        })
        # First deploy: no pointer yet (S3 returns NoSuchKey because the role may list the bucket).
        read_current.add_catch(from_scratch, errors=["S3.NoSuchKeyException"], result_path="$.current")
        read_current.add_catch(notify_failure, errors=["States.ALL"], result_path="$.failure.ReadCurrentModel")

        batch_states = {step.name: self._submit(step) for step in STEPS}

        has_init_from = sfn.Choice(self, "InitFromGiven")
        has_init_from.when(sfn.Condition.is_present("$.run.init_from"), batch_states["Prepare"])
        has_init_from.otherwise(read_current)
        read_current.next(use_current)
        use_current.next(apply_baseline)
        from_scratch.next(apply_baseline)
        apply_baseline.next(batch_states["Prepare"])

        # ---- the gate: validate wrote gate.json to S3 (--gate-s3-uri); read it, decide visibly -
        read_gate = self._raw("ReadGate", {
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:s3:getObject",
            "Parameters": {
                "Bucket": artifacts_bucket.bucket_name,
                "Key.$": "States.Format('runs/{}/validation/gate.json', $.run_id)",
            },
            "ResultSelector": {"report.$": "States.StringToJson($.Body)"},
            "ResultPath": "$.gate",
        })
        read_gate.add_catch(notify_failure, errors=["States.ALL"], result_path="$.failure.ReadGate")

        notify_rejected = self._sns_publish(
            "NotifyGateFailed",
            subject="Training pipeline: model rejected by the quality gate",
            message="States.Format('Run {} trained a model that failed the quality gate; the current model stays. Gate report: {}', $.run_id, States.JsonToString($.gate.report))",
        )
        notify_rejected.add_catch(notify_failure, errors=["States.ALL"], result_path="$.failure.NotifyGateFailed")
        # A rejected model is the gate doing its job, not a broken pipeline: the execution
        # succeeds (so the ExecutionsFailed alarm means "something is broken"), the end state's
        # name says what happened, and the notification carries the report.
        notify_rejected.next(sfn.Succeed(self, "ModelRejected"))

        gate = sfn.Choice(self, "GatePassed")
        # Anything but an explicit boolean true (missing field, malformed report) is a rejection.
        gate.when(sfn.Condition.and_(sfn.Condition.is_boolean("$.gate.report.passed"),
                                     sfn.Condition.boolean_equals("$.gate.report.passed", True)),
                  batch_states["Embed"])
        gate.otherwise(notify_rejected)

        # ---- publish: the pointer to the new current model, then notify ----------------------
        # The pointer is built as JSON data (no string templating), then written as one object.
        pointer = self._raw("PointerRecord", {
            "Type": "Pass",
            "Parameters": {
                "run_id.$": "$.run_id",
                # A run dir: checkpoint.resolve() picks its newest verified checkpoint.
                "checkpoint.$": "States.Format('/fsx/runs/{}', $.run_id)",
                "checkpoint_s3_uri.$": "States.Format('s3://" + artifacts_bucket.bucket_name + "/runs/{}/checkpoints/', $.run_id)",
                "embeddings_uri.$": "States.Format('/fsx/runs/{}/embeddings', $.run_id)",
                "metrics.$": "$.gate.report.metrics",  # the flat metric dict (validate reads it back)
                "dataset.$": "$.run.dataset",
                "data_version.$": "$.run.version",
                "published_at.$": "$$.State.EnteredTime",
            },
            "ResultPath": "$.pointer",
        })
        publish = self._raw("Publish", {
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:s3:putObject",
            "Parameters": {
                "Bucket": artifacts_bucket.bucket_name,
                "Key": CURRENT_MODEL_KEY,
                "ContentType": "application/json",
                # The SDK integration takes the body as a string.
                "Body.$": "States.JsonToString($.pointer)",
            },
            "ResultPath": "$.published",
        })
        pointer.next(publish)
        publish.add_catch(notify_failure, errors=["States.ALL"], result_path="$.failure.Publish")
        notify_published = self._sns_publish(
            "NotifyPublished",
            subject="Training pipeline: new model published",
            message="States.Format('Run {} published models/current.json. Gate report: {}', $.run_id, States.JsonToString($.gate.report))",
        )
        notify_published.add_catch(notify_failure, errors=["States.ALL"], result_path="$.failure.NotifyPublished")

        # ---- the chain -------------------------------------------------------------------------
        defaults.next(apply_defaults)
        apply_defaults.next(check_share)
        check_share.otherwise(has_init_from)
        batch_states["Prepare"].next(batch_states["Sanity"])
        batch_states["Sanity"].next(batch_states["Compile"])
        batch_states["Compile"].next(batch_states["Train"])
        batch_states["Train"].next(batch_states["Validate"])
        batch_states["Validate"].next(read_gate)
        read_gate.next(gate)
        batch_states["Embed"].next(pointer)
        publish.next(notify_published)
        notify_published.next(sfn.Succeed(self, "Done"))

        # ---- the state machine -------------------------------------------------------------------
        self.log_group = logs.LogGroup(
            self, "ExecutionLogs",
            encryption_key=key,
            retention=retention_days(config.log_retention_days),
            removal_policy=RemovalPolicy.RETAIN,
        )
        total_minutes = sum(config.timeout_minutes(s.name) for s in STEPS)
        self.state_machine = sfn.StateMachine(
            self, "StateMachine",
            definition_body=sfn.DefinitionBody.from_chainable(defaults),
            state_machine_type=sfn.StateMachineType.STANDARD,
            # Whole-run bound: every step's budget plus an hour for the S3/SNS states.
            timeout=Duration.minutes(total_minutes + 60),
            tracing_enabled=True,
            logs=sfn.LogOptions(destination=self.log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
            comment="Embedding model training: Prepare -> Sanity -> Compile -> Train -> Validate -> gate -> Embed -> Publish",
        )
        self._grant(self.state_machine.role)

    # ---- helpers -------------------------------------------------------------------------------
    def _raw(self, name: str, state_json: dict) -> sfn.CustomState:
        return sfn.CustomState(self, name, state_json=state_json)

    def _sns_publish(self, name: str, *, subject: str, message: str) -> sfn.CustomState:
        return self._raw(name, {
            "Type": "Task",
            "Resource": "arn:aws:states:::sns:publish",
            "Parameters": {"TopicArn": self._topic.topic_arn, "Subject": subject, "Message.$": message},
            # Keep the run data for the next state (None cannot be expressed: jsii drops it).
            "ResultPath": "$.notified",
        })

    def _submit(self, step: BatchStep) -> sfn.CustomState:
        cfg = self._cfg
        queue = self._queues["training"] if step.multi_node else self._queues["single-node"]
        params: dict = {
            "JobName": step.name.lower(),
            "JobDefinition": self._job_definitions[step.job_definition].job_definition_arn,
            "SchedulingPriorityOverride.$": "$.run.priority",
            "Parameters": {
                "run_id.$": "$.run_id",
                "data_uri.$": "$.run.data_uri",
                "init_from.$": "$.run.init_from",
            },
        }
        if step.multi_node:
            # Sanity and Compile use the Train node count: the compile cache is keyed by world size.
            params["NodeOverrides"] = {"NumNodes.$": "$.run.num_nodes"}
        params["JobQueue"] = queue.job_queue_arn
        if _has_fair_share(queue):
            params["ShareIdentifier.$"] = "$.run.share"
        if step.name == "Validate":
            # The validate job definition runs with --gate-report-only (exit 0 on a failed gate:
            # the decision is data for the Choice) and uploads gate.json to gate_s3_uri itself,
            # because the FSx auto-export to S3 is asynchronous.
            params["Parameters"]["gate_s3_uri.$"] = (
                "States.Format('s3://" + self._bucket.bucket_name + "/runs/{}/validation/gate.json', $.run_id)")
            params["Parameters"]["previous_metrics.$"] = "$.run.previous_metrics"
        if step.name == "Embed":
            params["ArrayProperties"] = {"Size.$": "$.run.embed_shards"}
            # Batch exposes only AWS_BATCH_JOB_ARRAY_INDEX; the shard count travels as a parameter.
            params["Parameters"]["shard_count.$"] = "States.Format('{}', $.run.embed_shards)"
        state = self._raw(step.name, {
            "Type": "Task",
            "Resource": "arn:aws:states:::batch:submitJob.sync",
            "Parameters": params,
            # Keep the state payload small (a multi-node DescribeJobs record is large).
            "ResultSelector": {"JobId.$": "$.JobId", "Status.$": "$.Status"},
            "ResultPath": f"$.jobs.{step.name}",
            "TimeoutSeconds": cfg.timeout_minutes(step.name) * 60,
        })
        state.add_retry(
            errors=list(BATCH_API_ERRORS),
            interval=Duration.seconds(cfg.retry_interval_seconds),
            max_attempts=cfg.retry_max_attempts,
            backoff_rate=cfg.retry_backoff_rate,
            max_delay=Duration.seconds(cfg.retry_max_delay_seconds),
            jitter_strategy=sfn.JitterType.FULL,
        )
        # The failed state's name becomes the key, so the one notification names the step.
        state.add_catch(self._failure, errors=["States.ALL"], result_path=f"$.failure.{step.name}")
        return state

    def _grant(self, role: iam.IRole) -> None:
        stack = Stack.of(self)
        queue_arns = sorted({q.job_queue_arn for q in self._queues.values()}, key=str)
        job_definition_arns = [self._job_definitions[s.job_definition].job_definition_arn for s in STEPS]
        # SubmitJob is authorised on the queue and the job definition
        # (https://docs.aws.amazon.com/batch/latest/userguide/batch-supported-iam-actions-resources.html).
        role.add_to_principal_policy(iam.PolicyStatement(
            actions=["batch:SubmitJob"], resources=[*queue_arns, *job_definition_arns]))
        # .sync waits with DescribeJobs (no resource-level support) and stops a timed-out job
        # with TerminateJob; job ids only exist at run time
        # (https://docs.aws.amazon.com/step-functions/latest/dg/batch-iam.html).
        role.add_to_principal_policy(iam.PolicyStatement(actions=["batch:DescribeJobs"], resources=["*"]))
        role.add_to_principal_policy(iam.PolicyStatement(
            actions=["batch:TerminateJob"],
            resources=[stack.format_arn(service="batch", resource="job", resource_name="*")]))
        role.add_to_principal_policy(iam.PolicyStatement(
            actions=["events:PutTargets", "events:PutRule", "events:DescribeRule"],
            resources=[stack.format_arn(service="events", resource="rule",
                                        resource_name="StepFunctionsGetEventsForBatchJobsRule")]))
        self._bucket.grant_read(role, CURRENT_MODEL_KEY)
        self._bucket.grant_put(role, CURRENT_MODEL_KEY)
        self._bucket.grant_read(role, GATE_KEY_PATTERN)
        self._topic.grant_publish(role)

