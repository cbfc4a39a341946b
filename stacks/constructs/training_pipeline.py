"""The training pipeline state machine: input checks -> Prepare -> Sanity -> Compile -> Train ->
Validate -> gate -> Embed -> Export -> conditional publish. docs/orchestration.md has the diagram and reasons.

Every Batch step is a raw-ASL `CustomState` on `arn:aws:states:::batch:submitJob.sync` because the
CDK `BatchSubmitJob` task has no `ShareIdentifier` / `SchedulingPriorityOverride`, which every
submission to a fair-share queue needs
(https://docs.aws.amazon.com/step-functions/latest/dg/connect-batch.html).

Execution input (defaults from PipelineConfig, merged by States.JsonMerge, input wins):
    {"dataset": str (default "manual"), "version": str (required: runs publish in version order),
     "data_uri": "/fsx/data/incoming/<dataset>/<version>" (required; must hold objects),
     "init_from": "/fsx/runs/<run>" (default: the published model, else "" = from scratch),
     "num_nodes": int, "share": str, "priority": int, "embed_shards": int, "prepare_shards": int}
Every field is checked before any Batch job; a bad input ends in one notification listing each
field to fix. "share" must be a share identifier of the training queue's fair-share policy (Batch
would accept an undefined identifier with the default weight); production and experiment runs go
to the same training queue, where the shares' weights decide. The gate baseline is always the published model's metrics, whatever init_from says.
The run id is the execution name; every job gets it as the Batch parameter `run_id`, so all steps
of one run share /fsx/runs/<run_id>.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_batch as batch
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks.constructs.prepare_states import (MAX_ARRAY_SIZE, MIN_ARRAY_SIZE, PREPARE_STATES, SHARDS_FIELD,
                                              SHARDS_FIX, prepare_submit)
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
EXPORT_PREFIX = "runs/{}/export/"  # the run id goes in; written by the Export job (--s3-uri)
GATE_KEY_PATTERN = "runs/*/validation/gate.json"


@dataclass(frozen=True)
class BatchStep:
    """One Batch state: its name, job definition key and whether it runs on the training queue."""

    name: str
    job_definition: str
    multi_node: bool


STEPS: tuple[BatchStep, ...] = (
    *(BatchStep(name, job_definition, False) for name, job_definition in PREPARE_STATES),
    BatchStep("Sanity", "sanity", True),
    BatchStep("Compile", "compile", True),
    BatchStep("Train", "train", True),
    BatchStep("Validate", "validate", False),
    BatchStep("Embed", "embed", False),
    BatchStep("Export", "export", False),
)


def _has_fair_share(queue: batch.IJobQueue) -> bool:
    # Batch rejects ShareIdentifier on a queue without a scheduling policy and requires it on one
    # with a policy (SubmitJob API reference), so the field is emitted per queue.
    return queue.scheduling_policy is not None


def _policy_shares(queue: batch.IJobQueue) -> tuple[str, ...]:
    """The share identifiers the queue's fair-share policy defines (what the input check accepts)."""
    policy = queue.scheduling_policy
    if not isinstance(policy, batch.FairshareSchedulingPolicy) or not policy.shares:
        raise ValueError("TrainingPipeline: the training queue needs a fair-share policy with shares; every "
                         "submission names a share identifier.")
    return tuple(share.share_identifier for share in policy.shares)


@dataclass(frozen=True)
class InputRule:
    """One check of the execution input: the field, when it is valid, and what to tell the user."""

    field: str
    valid: sfn.Condition
    fix: str


def _plain_name(path: str) -> sfn.Condition:
    # Choice rules have only '*' wildcards: a non-empty string without '/' or spaces.
    return sfn.Condition.and_(
        sfn.Condition.is_string(path), sfn.Condition.not_(sfn.Condition.string_equals(path, "")),
        sfn.Condition.not_(sfn.Condition.string_matches(path, "*/*")),
        sfn.Condition.not_(sfn.Condition.string_matches(path, "* *")))


def _integer_in(path: str, text_path: str, low: int, high: int) -> sfn.Condition:
    # A comparison on a value of the wrong type is false, not an error, so IsNumeric guards the
    # range; the JSON text of an integer has no '.' or exponent.
    return sfn.Condition.and_(
        sfn.Condition.is_numeric(path),
        sfn.Condition.number_greater_than_equals(path, low), sfn.Condition.number_less_than_equals(path, high),
        *(sfn.Condition.not_(sfn.Condition.string_matches(text_path, f"*{c}*")) for c in ".eE"))


# data_uri = /fsx/data/<k1>/.../<kn>; the S3 prefix "<k1>/.../<kn>/" is rebuilt from the path's
# parts (intrinsic functions have no substring), for n = 1..MAX_DATA_DEPTH.
MAX_DATA_DEPTH = 8
# A Task without TimeoutSeconds may wait as long as the execution itself may run
# (https://docs.aws.amazon.com/step-functions/latest/dg/state-task.html), so every S3/SNS task
# gets this per-attempt bound and retries.
SERVICE_TASK_TIMEOUT_SECONDS = 60
S3_TRANSIENT_ERRORS = ("States.Timeout", "S3.SdkClientException", "S3.S3Exception")
# A failed conditional write is HTTP 412 PreconditionFailed, an error the S3 SDK model does not
# name, which Step Functions reports as S3.S3Exception
# (https://docs.aws.amazon.com/step-functions/latest/dg/supported-services-awssdk.html).
S3_CONFLICT_ERRORS = ("S3.S3Exception",)
MAX_PUBLISH_CONFLICTS = 5
UNDELIVERED_SUFFIX = "Undelivered"
UNDELIVERED_NAMESPACE = "TrainiumEmbeddings/Pipeline"


class TrainingPipeline(Construct):
    """The Standard state machine, its KMS-encrypted log group and its least-privilege role.

    Public attributes: `state_machine`, `log_group`, `undelivered_states` (the Pass states a
    notification that could not be delivered leads to) and `undelivered_metric` (their count in
    the execution log; Monitoring alarms on it).
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: PipelineConfig,
        artifacts_bucket: s3.IBucket,
        data_bucket: s3.IBucket,
        queues: Mapping[str, batch.IJobQueue],
        job_definitions: Mapping[str, batch.IJobDefinition],
        topic: sns.ITopic,
        key: kms.IKey,
        max_nodes: int,
        queue_wait: Duration,
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
        if max_nodes < config.default_num_nodes:
            raise ValueError(f"TrainingPipeline: max_nodes={max_nodes} < default_num_nodes={config.default_num_nodes}.")
        self._cfg = config
        self._queues = queues
        self._job_definitions = job_definitions
        self._bucket = artifacts_bucket
        self._data_bucket = data_bucket
        self._topic = topic
        self._max_nodes = max_nodes
        self._queue_wait_minutes = int(queue_wait.to_minutes())
        self.undelivered_states: list[str] = []

        self._failure = self._failure_path()
        batch_states = {step.name: self._submit(step) for step in STEPS}
        start, configured = self._configuration()
        configured.next(self._input_checks(then=self._baseline(then=batch_states["Prepare"])))
        for earlier, later in zip(STEPS, STEPS[1:]):
            if later.name != "Embed":
                batch_states[earlier.name].next(batch_states[later.name])
        batch_states["Validate"].next(self._gate(passed=batch_states["Embed"]))
        batch_states["Export"].next(self._publish())

        self.log_group = logs.LogGroup(
            self, "ExecutionLogs",
            encryption_key=key,
            retention=retention_days(config.log_retention_days),
            removal_policy=RemovalPolicy.RETAIN,
        )
        self.undelivered_metric = self._count_undelivered()
        self.state_machine = sfn.StateMachine(
            self, "StateMachine",
            definition_body=sfn.DefinitionBody.from_chainable(start),
            state_machine_type=sfn.StateMachineType.STANDARD,
            # Whole-run bound: every Batch state's budget plus an hour for the S3/SNS states.
            timeout=Duration.minutes(sum(self.state_timeout_minutes(s) for s in STEPS) + 60),
            tracing_enabled=True,
            logs=sfn.LogOptions(destination=self.log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
            comment="Embedding model training: input checks -> Prepare -> Sanity -> Compile -> Train -> Validate "
                    "-> gate -> Embed -> Export -> conditional publish",
        )
        self._grant(self.state_machine.role)

    def _count_undelivered(self) -> cw.Metric:
        """A metric of the execution log: one per entered `*Undelivered` state. Execution logs
        (level ALL) are JSON events whose `type` is the history event type and whose
        `details.name` is the state name
        (https://docs.aws.amazon.com/step-functions/latest/dg/cw-logs.html,
        https://docs.aws.amazon.com/step-functions/latest/apireference/API_StateEnteredEventDetails.html)."""
        name = f"{Stack.of(self).stack_name}-NotificationsUndelivered"
        entered = [logs.FilterPattern.all(logs.FilterPattern.string_value("$.type", "=", "PassStateEntered"),
                                          logs.FilterPattern.string_value("$.details.name", "=", state))
                   for state in self.undelivered_states]
        logs.MetricFilter(self, "UndeliveredNotifications", log_group=self.log_group,
                          filter_pattern=logs.FilterPattern.any(*entered),
                          metric_namespace=UNDELIVERED_NAMESPACE, metric_name=name, metric_value="1")
        return cw.Metric(namespace=UNDELIVERED_NAMESPACE, metric_name=name, statistic="Sum",
                         period=Duration.minutes(5))

    def state_timeout_minutes(self, step: BatchStep) -> int:
        """The Batch state's TimeoutSeconds / 60, from its job definition's attempt timeout and
        retry attempts (the one source of both), the queue wait bound and the startup bound."""
        job_definition = self._job_definitions[step.job_definition]
        if job_definition.timeout is None:
            raise ValueError(f"TrainingPipeline: job definition {step.job_definition!r} has no attempt timeout; set one.")
        return self._cfg.state_timeout_minutes(
            attempt_minutes=int(job_definition.timeout.to_minutes()),
            attempts=job_definition.retry_attempts or 1,
            queue_wait_minutes=self._queue_wait_minutes)

    # ---- failure path: one notification, then Fail ------------------------------------------
    def _failure_path(self) -> sfn.CustomState:
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
        return notify_failure

    def _fail_with(self, name: str, error: str, cause: str) -> sfn.CustomState:
        """A Pass that records {Error, Cause} under $.failure.<name>, then the failure path.
        `cause` is an intrinsic function or a JSONPath."""
        state = self._raw(name, {
            "Type": "Pass",
            "Parameters": {"Error": error, "Cause.$": cause},
            "ResultPath": f"$.failure.{name}",
        })
        state.next(self._failure)
        return state

    # ---- configuration: defaults merged with the execution input ----------------------------
    def _configuration(self) -> tuple[sfn.Pass, sfn.CustomState]:
        cfg = self._cfg
        defaults = sfn.Pass(self, "Defaults", result_path="$.defaults", result=sfn.Result.from_object({
            "dataset": "manual",
            "version": "",
            "data_uri": "",
            "previous_metrics": "",
            "num_nodes": cfg.default_num_nodes,
            "share": cfg.production_share,
            "priority": cfg.default_priority,
            "embed_shards": cfg.embed_array_size,
            SHARDS_FIELD: cfg.prepare_array_size,
        }))
        apply_defaults = self._raw("ApplyDefaults", {
            "Type": "Pass",
            "Parameters": {
                "run.$": "States.JsonMerge($.defaults, $$.Execution.Input, false)",
                "run_id.$": "$$.Execution.Name",
                # With the data version, the order in which runs may publish.
                "started_at.$": "$$.Execution.StartTime",
                "problems": {"text": ""},
                "publish_conflicts": {"count": 0},
            },
        })
        defaults.next(apply_defaults)
        return defaults, apply_defaults

    # ---- input checks: every field, then the data, before any Batch job ----------------------
    def input_rules(self) -> list[InputRule]:
        run = "$.run"
        shares = _policy_shares(self._queues["training"])
        return [
            InputRule("dataset", _plain_name(f"{run}.dataset"),
                      "dataset: a non-empty name without slashes or spaces, e.g. catalog"),
            InputRule("version", _plain_name(f"{run}.version"),
                      "version: the data version, e.g. 2026-01-05 (versions must sort as strings: "
                      "a run never replaces a model of a later version)"),
            InputRule("data_uri", sfn.Condition.and_(
                sfn.Condition.is_string(f"{run}.data_uri"),
                sfn.Condition.string_matches(f"{run}.data_uri", "/fsx/data/*"),
                sfn.Condition.not_(sfn.Condition.string_matches(f"{run}.data_uri", "*..*")),
                sfn.Condition.not_(sfn.Condition.string_matches(f"{run}.data_uri", "* *"))),
                "data_uri: the upload directory /fsx/data/incoming/<dataset>/<version> "
                "(which is s3://<data bucket>/incoming/<dataset>/<version>/)"),
            InputRule("init_from", sfn.Condition.or_(
                sfn.Condition.is_not_present(f"{run}.init_from"),
                sfn.Condition.and_(sfn.Condition.is_string(f"{run}.init_from"), sfn.Condition.or_(
                    sfn.Condition.string_equals(f"{run}.init_from", ""),
                    sfn.Condition.string_matches(f"{run}.init_from", "/fsx/runs/*")))),
                "init_from: a run directory /fsx/runs/<run id>, or an empty string to train from scratch"),
            InputRule("num_nodes", _integer_in(f"{run}.num_nodes", "$.checks.num_nodes", 1, self._max_nodes),
                      f"num_nodes: an integer 1..{self._max_nodes} (the max nodes of the training compute environment)"),
            InputRule("embed_shards", _integer_in(f"{run}.embed_shards", "$.checks.embed_shards", 2, 10_000),
                      "embed_shards: an integer 2..10000 (the size of a Batch array job)"),
            InputRule(SHARDS_FIELD, _integer_in(f"{run}.{SHARDS_FIELD}", f"$.checks.{SHARDS_FIELD}", MIN_ARRAY_SIZE,
                                                MAX_ARRAY_SIZE), SHARDS_FIX),
            InputRule("priority", _integer_in(f"{run}.priority", "$.checks.priority", 0, 9999),
                      "priority: an integer 0..9999 (Batch schedulingPriorityOverride)"),
            InputRule("share", sfn.Condition.or_(*(sfn.Condition.string_equals(f"{run}.share", s) for s in shares)),
                      f"share: one of the fair-share identifiers of the training queue ({', '.join(shares)})"),
        ]

    def _input_checks(self, *, then: sfn.IChainable) -> sfn.IChainable:
        """PrepareInputChecks -> Check_<field> (Invalid_<field> appends the fix) ... -> InputValid
        -> LocateData -> DataPrefix_<depth> -> ListData -> DataFound -> `then`. One failure
        notification lists every field to fix; the data is looked up only for a valid input."""
        checks = self._raw("PrepareInputChecks", {
            "Type": "Pass",
            # Integers are told from other numbers by their JSON text.
            "Parameters": {f"{name}.$": f"States.JsonToString($.run.{name})"
                           for name in ("num_nodes", "embed_shards", SHARDS_FIELD, "priority")},
            "ResultPath": "$.checks",
        })
        rules = self.input_rules()
        choices = [sfn.Choice(self, f"Check_{rule.field}") for rule in rules]
        input_valid = sfn.Choice(self, "InputValid")
        checks.next(choices[0])
        for rule, choice, following in zip(rules, choices, [*choices[1:], input_valid]):
            assert not set(rule.fix) & set("'{}\\"), f"{rule.field}: the fix text is an intrinsic-function literal"
            flag = self._raw(f"Invalid_{rule.field}", {
                "Type": "Pass",
                "Parameters": {"text.$": f"States.Format('{{}}{rule.fix}; ', $.problems.text)"},
                "ResultPath": "$.problems",
            })
            choice.when(rule.valid, following)
            choice.otherwise(flag)
            flag.next(following)

        locate = self._raw("LocateData", {
            "Type": "Pass",
            "Parameters": {
                "parts.$": "States.StringSplit($.run.data_uri, '/')",
                "depth.$": "States.ArrayLength(States.StringSplit($.run.data_uri, '/'))",
            },
            "ResultPath": "$.data",
        })
        input_valid.when(sfn.Condition.string_equals("$.problems.text", ""), locate)
        input_valid.otherwise(self._fail_with(
            "InvalidInput", "InvalidInput",
            "States.Format('The execution input has problems, fix them and start the run again: {}', $.problems.text)"))

        depth = sfn.Choice(self, "DataDepth")
        locate.next(depth)
        list_data = self._s3_task("ListData", "listObjectsV2", {
            "Bucket": self._data_bucket.bucket_name, "Prefix.$": "$.data.prefix", "MaxKeys": 1,
        }, result_selector={"key_count.$": "$.KeyCount"}, result_path="$.data.listing")
        for n in range(1, MAX_DATA_DEPTH + 1):
            parts = ", ".join(f"States.ArrayGetItem($.data.parts, {i})" for i in range(2, n + 2))
            prefix = self._raw(f"DataPrefix_{n}", {
                "Type": "Pass",
                "Parameters": {"parts.$": "$.data.parts",
                               "prefix.$": f"States.Format('{'{}/' * n}', {parts})"},
                "ResultPath": "$.data",
            })
            depth.when(sfn.Condition.number_equals("$.data.depth", n + 2), prefix)
            prefix.next(list_data)
        depth.otherwise(self._fail_with(
            "DataPathDepth", "InvalidInput",
            f"States.Format('data_uri {{}}: use a directory 1..{MAX_DATA_DEPTH} levels below /fsx/data, e.g. "
            f"/fsx/data/incoming/<dataset>/<version>', $.run.data_uri)"))
        list_data.add_catch(self._failure, errors=["States.ALL"], result_path="$.failure.ListData")

        found = sfn.Choice(self, "DataFound")
        list_data.next(found)
        found.when(sfn.Condition.number_greater_than("$.data.listing.key_count", 0), then)
        found.otherwise(self._fail_with(
            "NoData", "InvalidInput",
            f"States.Format('No objects under s3://{self._data_bucket.bucket_name}/{{}} (data_uri {{}}): upload the "
            f"data first, the _SUCCESS marker last, or fix data_uri.', $.data.prefix, $.run.data_uri)"))
        return checks

    # ---- the production baseline: always read, so every run is gated against production ------
    def _baseline(self, *, then: sfn.IChainable) -> sfn.IChainable:
        read_current = self._s3_task("ReadCurrentModel", "getObject", {
            "Bucket": self._bucket.bucket_name, "Key": CURRENT_MODEL_KEY,
        }, result_selector={"pointer.$": "States.StringToJson($.Body)"}, result_path="$.current")
        # A run starts from the published model unless the input names init_from; its gate
        # baseline is always the published model's metrics (ApplyBaseline: input wins for the
        # start, production wins for the baseline).
        use_current = self._raw("UseCurrentModel", {
            "Type": "Pass",
            "Parameters": {
                "start": {"init_from.$": "$.current.pointer.checkpoint"},
                "gate": {"previous_metrics.$":
                         "States.Format('/fsx/runs/{}/validation/metrics.json', $.current.pointer.run_id)"},
            },
            "ResultPath": "$.baseline",
        })
        no_model = self._raw("NoProductionModel", {
            "Type": "Pass", "Result": {"start": {"init_from": ""}, "gate": {"previous_metrics": ""}},
            "ResultPath": "$.baseline",
        })
        apply_baseline = self._raw("ApplyBaseline", {
            "Type": "Pass",
            "Parameters": {
                "run.$": "States.JsonMerge(States.JsonMerge($.baseline.start, $.run, false), $.baseline.gate, false)",
                "run_id.$": "$.run_id",
                "started_at.$": "$.started_at",
                "publish_conflicts.$": "$.publish_conflicts",
            },
        })
        # First deploy: no pointer yet (S3 returns NoSuchKey because the role may list the bucket).
        read_current.add_catch(no_model, errors=["S3.NoSuchKeyException"], result_path="$.current")
        read_current.add_catch(self._failure, errors=["States.ALL"], result_path="$.failure.ReadCurrentModel")
        pointer_valid = sfn.Choice(self, "CurrentModelValid")
        read_current.next(pointer_valid)
        pointer_valid.when(sfn.Condition.and_(
            sfn.Condition.is_string("$.current.pointer.checkpoint"),
            sfn.Condition.is_string("$.current.pointer.run_id")), use_current)
        pointer_valid.otherwise(self._fail_with(
            "MalformedCurrentModel", "MalformedDocument",
            f"States.Format('s3://{self._bucket.bucket_name}/{CURRENT_MODEL_KEY} needs string fields checkpoint and "
            f"run_id (a pointer written by Publish); fix or restore the object, then start the run again. Got: {{}}', "
            f"States.JsonToString($.current.pointer))"))
        use_current.next(apply_baseline)
        no_model.next(apply_baseline)
        apply_baseline.next(then)
        return read_current

    # ---- the gate: validate wrote gate.json to S3 (--gate-s3-uri); read it, decide visibly ----
    def _gate(self, *, passed: sfn.IChainable) -> sfn.IChainable:
        read_gate = self._s3_task("ReadGate", "getObject", {
            "Bucket": self._bucket.bucket_name,
            "Key.$": "States.Format('runs/{}/validation/gate.json', $.run_id)",
        }, result_selector={"report.$": "States.StringToJson($.Body)"}, result_path="$.gate")
        read_gate.add_catch(self._failure, errors=["States.ALL"], result_path="$.failure.ReadGate")
        report_valid = sfn.Choice(self, "GateReportValid")
        read_gate.next(report_valid)
        gate = sfn.Choice(self, "GatePassed")
        report_valid.when(sfn.Condition.and_(
            sfn.Condition.is_boolean("$.gate.report.passed"), sfn.Condition.is_present("$.gate.report.metrics")), gate)
        report_valid.otherwise(self._fail_with(
            "MalformedGateReport", "MalformedDocument",
            "States.Format('runs/{}/validation/gate.json needs a boolean passed and a metrics object (written by "
            "the validate step); got: {}', $.run_id, States.JsonToString($.gate.report))"))
        # A rejected model is the gate doing its job, not a broken pipeline: the execution
        # succeeds (so the ExecutionsFailed alarm means "something is broken"), the end state's
        # name says what happened, and the notification carries the report.
        rejected = self._notify(
            "NotifyGateFailed", sfn.Succeed(self, "ModelRejected"),
            subject="Training pipeline: model rejected by the quality gate",
            message="States.Format('Run {} trained a model that failed the quality gate; the current model stays. Gate report: {}', $.run_id, States.JsonToString($.gate.report))",
        )
        gate.when(sfn.Condition.boolean_equals("$.gate.report.passed", True), passed)
        gate.otherwise(rejected)
        return read_gate

    # ---- publish: conditional, so an older run never replaces a newer model -----------------
    def _publish(self) -> sfn.IChainable:
        """ReadPublishedModel -> NewerModelPublished? -> (ModelSuperseded | PointerRecord[Replace]
        -> Publish[Replacement]). The write is conditional on what was read (If-None-Match: * for
        the first model, If-Match: <ETag> to replace one), so a run that published in between
        makes the write fail with 412 and the decision is taken again on the new pointer."""
        bucket = self._bucket.bucket_name
        done = sfn.Succeed(self, "Done")
        published = self._notify(
            "NotifyPublished", done,
            subject="Training pipeline: new model published",
            message="States.Format('Run {} published models/current.json. Gate report: {}', $.run_id, States.JsonToString($.gate.report))",
        )
        superseded = self._notify(
            "NotifySuperseded", sfn.Succeed(self, "ModelSuperseded"),
            subject="Training pipeline: model not published, a newer one is live",
            message="States.Format('Run {} (data version {}) passed the gate but was not published: "
                    "models/current.json already holds run {} of data version {}.', $.run_id, $.run.version, "
                    "$.latest.pointer.run_id, $.latest.pointer.data_version)",
        )
        read_latest = self._s3_task("ReadPublishedModel", "getObject", {"Bucket": bucket, "Key": CURRENT_MODEL_KEY},
                                    result_selector={"pointer.$": "States.StringToJson($.Body)", "etag.$": "$.ETag"},
                                    result_path="$.latest")
        first_record, first_write = self._pointer_write("PointerRecord", "Publish", {"IfNoneMatch": "*"})
        replace_record, replace_write = self._pointer_write(
            "PointerRecordReplace", "PublishReplacement", {"IfMatch.$": "$.latest.etag"})
        read_latest.add_catch(first_record, errors=["S3.NoSuchKeyException"], result_path="$.latest")
        read_latest.add_catch(self._failure, errors=["States.ALL"], result_path="$.failure.ReadPublishedModel")

        newer = sfn.Choice(self, "NewerModelPublished")
        read_latest.next(newer)
        latest_version, latest_started = "$.latest.pointer.data_version", "$.latest.pointer.started_at"
        newer.when(sfn.Condition.and_(sfn.Condition.is_string(latest_version),
                                      sfn.Condition.string_greater_than_json_path(latest_version, "$.run.version")),
                   superseded)
        newer.when(sfn.Condition.and_(sfn.Condition.is_string(latest_version),
                                      sfn.Condition.string_equals_json_path(latest_version, "$.run.version"),
                                      sfn.Condition.is_timestamp(latest_started),
                                      sfn.Condition.timestamp_greater_than_json_path(latest_started, "$.started_at")),
                   superseded)
        newer.otherwise(replace_record)

        # Another run published between our read and our write: count, read again, decide again.
        conflict = self._raw("PublishConflict", {
            "Type": "Pass",
            "Parameters": {"count.$": "States.MathAdd($.publish_conflicts.count, 1)"},
            "ResultPath": "$.publish_conflicts",
        })
        again = sfn.Choice(self, "PublishAgain")
        conflict.next(again)
        again.when(sfn.Condition.number_less_than("$.publish_conflicts.count", MAX_PUBLISH_CONFLICTS), read_latest)
        again.otherwise(self._fail_with(
            "PublishConflicts", "PublishFailed",
            f"States.Format('models/current.json changed or refused the write {MAX_PUBLISH_CONFLICTS} times; last "
            f"error: {{}}', States.JsonToString($.publish_error))"))
        for write in (first_write, replace_write):
            write.add_catch(conflict, errors=list(S3_CONFLICT_ERRORS), result_path="$.publish_error")
            write.add_catch(self._failure, errors=["States.ALL"], result_path=f"$.failure.{write.state_id}")
            write.next(published)
        return read_latest

    def _pointer_write(self, record_name: str, write_name: str, condition: dict) -> tuple[sfn.CustomState, sfn.CustomState]:
        """The pointer to the new current model, built as JSON data (no string templating), and
        its conditional write as one object."""
        bucket = self._bucket.bucket_name
        record = self._raw(record_name, {
            "Type": "Pass",
            "Parameters": {
                "run_id.$": "$.run_id",
                # A run dir: checkpoint.resolve() picks its newest verified checkpoint.
                "checkpoint.$": "States.Format('/fsx/runs/{}', $.run_id)",
                "checkpoint_s3_uri.$": "States.Format('s3://" + bucket + "/runs/{}/checkpoints/', $.run_id)",
                "embeddings_uri.$": "States.Format('/fsx/runs/{}/embeddings', $.run_id)",
                # sentence-transformers folders (query/, product/, export.json), complete when
                # <export_uri>_SUCCESS exists (the Export job writes it last).
                "export_uri.$": self._export_uri(),
                "metrics.$": "$.gate.report.metrics",  # the flat metric dict (validate reads it back)
                "dataset.$": "$.run.dataset",
                "data_version.$": "$.run.version",
                "started_at.$": "$.started_at",
                "published_at.$": "$$.State.EnteredTime",
            },
            "ResultPath": "$.pointer",
        })
        write = self._s3_task(write_name, "putObject", {
            "Bucket": bucket,
            "Key": CURRENT_MODEL_KEY,
            "ContentType": "application/json",
            # The SDK integration takes the body as a string.
            "Body.$": "States.JsonToString($.pointer)",
            **condition,
        }, result_path="$.published", retry_errors=("States.Timeout", "S3.SdkClientException"))
        record.next(write)
        return record, write

    # ---- helpers -------------------------------------------------------------------------------
    def _export_uri(self) -> str:
        return f"States.Format('s3://{self._bucket.bucket_name}/{EXPORT_PREFIX}', $.run_id)"

    def _raw(self, name: str, state_json: dict) -> sfn.CustomState:
        return sfn.CustomState(self, name, state_json=state_json)

    def _service_retry(self, state: sfn.CustomState, errors: tuple[str, ...]) -> None:
        cfg = self._cfg
        state.add_retry(errors=list(errors), interval=Duration.seconds(cfg.retry_interval_seconds),
                        max_attempts=cfg.retry_max_attempts, backoff_rate=cfg.retry_backoff_rate,
                        max_delay=Duration.seconds(cfg.retry_max_delay_seconds), jitter_strategy=sfn.JitterType.FULL)

    def _s3_task(self, name: str, action: str, parameters: dict, *, result_path: str,
                 result_selector: dict | None = None,
                 retry_errors: tuple[str, ...] = S3_TRANSIENT_ERRORS) -> sfn.CustomState:
        state_json = {
            "Type": "Task",
            "Resource": f"arn:aws:states:::aws-sdk:s3:{action}",
            "Parameters": parameters,
            "ResultPath": result_path,
            "TimeoutSeconds": SERVICE_TASK_TIMEOUT_SECONDS,
        }
        if result_selector is not None:
            state_json["ResultSelector"] = result_selector
        state = self._raw(name, state_json)
        self._service_retry(state, retry_errors)
        return state

    def _sns_publish(self, name: str, *, subject: str, message: str) -> sfn.CustomState:
        state = self._raw(name, {
            "Type": "Task",
            "Resource": "arn:aws:states:::sns:publish",
            "Parameters": {"TopicArn": self._topic.topic_arn, "Subject": subject, "Message.$": message},
            # Keep the run data for the next state (None cannot be expressed: jsii drops it).
            "ResultPath": "$.notified",
            "TimeoutSeconds": SERVICE_TASK_TIMEOUT_SECONDS,
        })
        self._service_retry(state, ("States.TaskFailed", "States.Timeout"))
        return state

    def _notify(self, name: str, end: sfn.IChainable, *, subject: str, message: str) -> sfn.CustomState:
        """A notification that cannot change the outcome: if it still fails after its retries,
        `<name>Undelivered` records the error (execution log; Monitoring alarms on it) and the run
        ends where it would have ended anyway."""
        notify = self._sns_publish(name, subject=subject, message=message)
        undelivered = self._raw(f"{name}{UNDELIVERED_SUFFIX}", {"Type": "Pass"})
        self.undelivered_states.append(undelivered.state_id)
        notify.add_catch(undelivered, errors=["States.ALL"], result_path="$.notify_error")
        notify.next(end)
        undelivered.next(end)
        return notify

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
        extra = prepare_submit(step.name)
        params["Parameters"].update(extra.pop("Parameters", {}))
        params.update(extra)
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
        if step.name == "Export":
            # The step uploads the export itself (files, then the _SUCCESS marker), so the pointer
            # written after it names a complete S3 copy; FSx auto-export would arrive later.
            params["Parameters"]["export_s3_uri.$"] = self._export_uri()
        state = self._raw(step.name, {
            "Type": "Task",
            "Resource": "arn:aws:states:::batch:submitJob.sync",
            "Parameters": params,
            # Keep the state payload small (a multi-node DescribeJobs record is large).
            "ResultSelector": {"JobId.$": "$.JobId", "Status.$": "$.Status"},
            "ResultPath": f"$.jobs.{step.name}",
            "TimeoutSeconds": self.state_timeout_minutes(step) * 60,
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
        # ListData asks whether the run's data exists (ListObjectsV2 with MaxKeys 1): list only.
        role.add_to_principal_policy(iam.PolicyStatement(actions=["s3:ListBucket"],
                                                         resources=[self._data_bucket.bucket_arn]))
        self._bucket.grant_read(role, CURRENT_MODEL_KEY)
        self._bucket.grant_put(role, CURRENT_MODEL_KEY)
        self._bucket.grant_read(role, GATE_KEY_PATTERN)
        self._topic.grant_publish(role)

