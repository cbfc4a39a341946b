"""The training pipeline state machine: input checks -> Prepare -> Sanity -> Compile -> Train ->
Validate -> gate -> Embed -> Export -> conditional publish, one Batch job per step on the fair-share
queues. docs/orchestration.md has the diagram, the execution-input contract and the reasons.
"""

from __future__ import annotations

from collections.abc import Mapping

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_batch as batch
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from pipeline_steps.contract import (
    GATE_REPORT, HEARTBEAT_NAMESPACE, PIPELINE_STEPS, RUN_ID_PARAMETER, PipelineStep, TeamPaths, run_key,
)
from stacks.constructs.input_checks import input_checks, input_rules, policy_shares
from stacks.constructs.job_definitions import JobDefinitionRef
from stacks.constructs.job_ownership import JobOwnership
from stacks.constructs.pipeline_states import PipelineStates
from stacks.constructs.prepare_states import SHARDS_FIELD, array_submit, prepare_submit
from stacks.constructs.publish import export_uri, publish
from stacks.constructs.quality_gate import gate, production_baseline
from stacks.constructs.retention import retention_days
from stacks.pipeline_config import PipelineConfig
from stacks.team_config import TeamConfig

# The only errors Step Functions retries: Batch API faults. Host faults and our retryable exit
# code are retried by the job definitions' retry strategies (evaluateOnExit); anything else is a
# real failure and goes to the one failure path.
BATCH_API_ERRORS: tuple[str, ...] = (
    "Batch.AWSBatchException",
    "Batch.ServerException",
    "Batch.TooManyRequestsException",
)
GATE_KEY_PATTERN = run_key("*", GATE_REPORT)  # a team's: runs/<team>/*/validation/gate.json
UNDELIVERED_NAMESPACE = f"{HEARTBEAT_NAMESPACE}/Pipeline"


def _has_fair_share(queue: batch.IJobQueue) -> bool:
    # Batch rejects ShareIdentifier on a queue without a scheduling policy and requires it on one
    # with a policy (SubmitJob API reference), so the field is emitted per queue.
    return queue.scheduling_policy is not None


def _check_wiring(config: PipelineConfig, *, queues: Mapping[str, batch.IJobQueue],
                  job_definitions: Mapping[str, JobDefinitionRef], max_nodes: int) -> None:
    for name in ("training", "single-node"):
        if name not in queues:
            raise ValueError(f"TrainingPipeline: queues has no {name!r} queue (got {sorted(queues)}).")
    for step in PIPELINE_STEPS:
        if step.name not in job_definitions:
            raise ValueError(
                f"TrainingPipeline: job_definitions has no {step.name!r} (got {sorted(job_definitions)})."
            )
    if max_nodes < config.default_num_nodes:
        raise ValueError(f"TrainingPipeline: max_nodes={max_nodes} < default_num_nodes={config.default_num_nodes}.")


class TrainingPipeline(Construct):
    """The Standard state machine of one team (`team` None: the default team of a stage without
    teams), its KMS-encrypted log group and its least-privilege role. A team's runs have the run id
    `<team>/<execution name>`, read and write only the team's paths (TeamPaths), submit with the
    team's share identifier and job tag, and its notifications carry the message attribute `team`.

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
        job_definitions: Mapping[str, JobDefinitionRef],
        topic: sns.ITopic,
        key: kms.IKey,
        classifier: lambda_.IFunction,
        max_nodes: int,
        queue_wait: Duration,
        ownership: JobOwnership,
        team: TeamConfig | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        _check_wiring(config, queues=queues, job_definitions=job_definitions, max_nodes=max_nodes)
        self._cfg = config
        self._team = team
        self._paths = team.paths if team else TeamPaths()
        self._shares = (team.share_identifier,) if team else policy_shares(queues["training"])
        self.gate_key_pattern = f"{self._paths.runs_prefix}*/{GATE_REPORT}"
        self._ownership = ownership
        self._queues = queues
        self._job_definitions = job_definitions
        self._bucket = artifacts_bucket
        self._data_bucket = data_bucket
        self._topic = topic
        self._classifier = classifier
        self._max_nodes = max_nodes
        self._queue_wait_minutes = int(queue_wait.to_minutes())
        self._states = PipelineStates(self, config=config, topic=topic, classifier=classifier,
                                      team=team.name if team else None)
        self.undelivered_states: list[str] = self._states.undelivered_states
        start = self._chain()

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
            timeout=Duration.minutes(sum(self.state_timeout_minutes(s) for s in PIPELINE_STEPS) + 60),
            tracing_enabled=True,
            logs=sfn.LogOptions(destination=self.log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
            comment="Embedding model training: input checks -> Prepare -> Sanity -> Compile -> Train -> Validate "
                    "-> gate -> Embed -> Export -> conditional publish",
        )
        self._grant(self.state_machine.role)

    # ---- the chain: defaults, input checks, baseline, the Batch steps in pipeline order, gate, publish
    def _chain(self) -> sfn.IChainable:
        """Builds every state and returns the first one (InputShape)."""
        states = self._states
        batch_states = {step.state: self._submit(step) for step in PIPELINE_STEPS}
        start, configured = self._configuration()
        checks = input_rules(self._shares, self._max_nodes, self._paths)
        configured.next(input_checks(states, checks, data_bucket=self._data_bucket, paths=self._paths,
                                     then=production_baseline(states, self._bucket, self._paths.current_model_key,
                                                              then=batch_states["Prepare"])))
        for earlier, later in zip(PIPELINE_STEPS, PIPELINE_STEPS[1:]):
            if later.state != "Embed":
                batch_states[earlier.state].next(batch_states[later.state])
        batch_states["Validate"].next(gate(states, self._bucket, passed=batch_states["Embed"]))
        batch_states["Export"].next(publish(states, self._bucket, self._paths.current_model_key))
        return start

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

    def state_timeout_minutes(self, step: PipelineStep) -> int:
        """The Batch state's TimeoutSeconds / 60, from its job definition's attempt timeout and
        retry attempts (the one source of both), the queue wait bound and the startup bound."""
        job_definition = self._job_definitions[step.name]
        if job_definition.timeout is None:
            raise ValueError(f"TrainingPipeline: job definition {step.name!r} has no attempt timeout; set one.")
        return self._cfg.state_timeout_minutes(
            attempt_minutes=int(job_definition.timeout.to_minutes()),
            attempts=job_definition.retry_attempts or 1,
            queue_wait_minutes=self._queue_wait_minutes)

    # ---- configuration: defaults merged with the execution input ----------------------------
    def _input_shape(self, then: sfn.IChainable) -> sfn.IChainable:
        """InputShape -> InputIsObject -> `then` | InputNotAnObject: a Pass state cannot catch, and
        merging or extending an input that is not a JSON object is a States.Runtime error that no
        Catch sees (https://docs.aws.amazon.com/step-functions/latest/dg/concepts-error-handling.html),
        so the input's type is decided first, by a Choice. The JSON text of an object, and only of
        an object, starts with '{': prefixed with 'x' and split at '{', its first part is 'x'. Only
        that boolean is kept, so an input near the 256 KiB payload limit cannot overflow here."""
        first_part = ("States.ArrayGetItem(States.StringSplit(States.Format('x{}', "
                      "States.JsonToString($$.Execution.Input)), '{'), 0)")
        shape = self._states.raw("InputShape", {
            "Type": "Pass",
            "Parameters": {f"{RUN_ID_PARAMETER}.$": self._run_id(),
                           "is_object.$": f"States.ArrayContains(States.Array({first_part}), 'x')"},
        })
        is_object = sfn.Choice(self, "InputIsObject")
        shape.next(is_object)
        is_object.when(sfn.Condition.boolean_equals("$.is_object", True), then)
        is_object.otherwise(self._states.fail_with(
            "InputNotAnObject", "InvalidInput",
            "States.Format('The execution input must be a JSON object with the run fields (version, data_uri, "
            "...: see Execution input in docs/orchestration.md); run {} got an array, a string, a number, a "
            "boolean or null (the execution history shows it). Start the run again with an object.', $.run_id)"))
        return shape

    def _configuration(self) -> tuple[sfn.IChainable, sfn.CustomState]:
        cfg = self._cfg
        defaults = sfn.Pass(self, "Defaults", result_path="$.defaults", result=sfn.Result.from_object({
            "dataset": "manual",
            "version": "",
            "data_uri": "",
            "previous_metrics": "",
            "num_nodes": cfg.default_num_nodes,
            "share": self._shares[0] if self._team else cfg.production_share,
            "priority": cfg.default_priority,
            "embed_shards": cfg.embed_array_size,
            SHARDS_FIELD: cfg.prepare_array_size,
        }))
        apply_defaults = self._states.raw("ApplyDefaults", {
            "Type": "Pass",
            "Parameters": {
                "run.$": "States.JsonMerge($.defaults, $$.Execution.Input, false)",
                f"{RUN_ID_PARAMETER}.$": self._run_id(),
                # With the data version, the order in which runs may publish.
                "started_at.$": "$$.Execution.StartTime",
                "problems": {"text": ""},
                "publish_conflicts": {"count": 0},
            },
        })
        defaults.next(apply_defaults)
        return self._input_shape(then=defaults), apply_defaults

    def _run_id(self) -> str:
        """The run id: the execution name, for a team `<team>/<execution name>` (TeamPaths.run_id)."""
        name = "$$.Execution.Name"
        return f"States.Format('{self._paths.run_id('{}')}', {name})" if self._team else name

    def _step_fields(self, step: PipelineStep) -> dict:
        """What one step adds to the SubmitJob request all steps share."""
        if step.state == "Validate":
            # The validate job definition runs with --gate-report-only (exit 0 on a failed gate:
            # the decision is data for the Choice) and uploads gate.json to gate_s3_uri itself,
            # because the FSx auto-export to S3 is asynchronous.
            return {"Parameters": {
                "gate_s3_uri.$":
                    f"States.Format('s3://{self._bucket.bucket_name}/{run_key('{}', GATE_REPORT)}', $.run_id)",
                "previous_metrics.$": "$.run.previous_metrics",
            }}
        if step.state == "Embed":
            return array_submit("$.run.embed_shards")
        if step.state == "Export":
            # The step uploads the export itself (files, then the _SUCCESS marker), so the pointer
            # written after it names a complete S3 copy; FSx auto-export would arrive later.
            return {"Parameters": {"export_s3_uri.$": export_uri(self._bucket)}}
        return prepare_submit(step.state)

    def _submit(self, step: PipelineStep) -> sfn.CustomState:
        cfg = self._cfg
        queue = self._queues["training"] if step.multi_node else self._queues["single-node"]
        params: dict = {
            "JobName": step.name,
            # By name: the latest ACTIVE revision (JobDefinitionRef says why).
            "JobDefinition": self._job_definitions[step.name].name,
            "SchedulingPriorityOverride.$": "$.run.priority",
            "Parameters": {
                f"{RUN_ID_PARAMETER}.$": "$.run_id",
                "data_uri.$": "$.run.data_uri",
                "init_from.$": "$.run.init_from",
            },
        }
        step_fields = self._step_fields(step)
        params["Parameters"].update(step_fields.pop("Parameters", {}))
        params.update(step_fields)
        if step.multi_node:
            # Sanity and Compile use the Train node count: the compile cache is keyed by world size.
            params["NodeOverrides"] = {"NumNodes.$": "$.run.num_nodes"}
        params["JobQueue"] = queue.job_queue_arn
        # What the stall and queue watchdogs, and this role's TerminateJob, recognise as ours.
        params["Tags"] = dict(self._ownership.tags)
        if _has_fair_share(queue):
            params["ShareIdentifier.$"] = "$.run.share"
        state = self._states.raw(step.state, {
            "Type": "Task",
            # Raw ASL: the CDK BatchSubmitJob task has no ShareIdentifier / SchedulingPriorityOverride,
            # which every submission to a fair-share queue needs
            # (https://docs.aws.amazon.com/step-functions/latest/dg/connect-batch.html).
            "Resource": "arn:aws:states:::batch:submitJob.sync",
            "Parameters": params,
            # Keep the state payload small (a multi-node DescribeJobs record is large).
            "ResultSelector": {"JobId.$": "$.JobId", "Status.$": "$.Status"},
            "ResultPath": f"$.jobs.{step.state}",
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
        state.add_catch(self._states.failure, errors=["States.ALL"], result_path=f"$.failure.{step.state}")
        return state

    def _grant(self, role: iam.IRole) -> None:
        stack = Stack.of(self)
        queue_arns = sorted({q.job_queue_arn for q in self._queues.values()}, key=str)
        job_definition_arns = [self._job_definitions[s.name].arn(self) for s in PIPELINE_STEPS]
        # SubmitJob is authorised on the queue and the job definition
        # (https://docs.aws.amazon.com/batch/latest/userguide/batch-supported-iam-actions-resources.html).
        role.add_to_principal_policy(iam.PolicyStatement(
            actions=["batch:SubmitJob"], resources=[*queue_arns, *job_definition_arns]))
        role.add_to_principal_policy(self._ownership.tag_on_submit())
        # .sync waits with DescribeJobs (no resource-level support) and stops a timed-out job
        # with TerminateJob: only the jobs this pipeline submitted (their tags)
        # (https://docs.aws.amazon.com/step-functions/latest/dg/batch-iam.html).
        role.add_to_principal_policy(iam.PolicyStatement(actions=["batch:DescribeJobs"], resources=["*"]))
        role.add_to_principal_policy(self._ownership.act_on_jobs("batch:TerminateJob"))
        role.add_to_principal_policy(iam.PolicyStatement(
            actions=["events:PutTargets", "events:PutRule", "events:DescribeRule"],
            resources=[stack.format_arn(service="events", resource="rule",
                                        resource_name="StepFunctionsGetEventsForBatchJobsRule")]))
        # ListData asks whether the run's data exists (ListObjectsV2 with MaxKeys 1): list only.
        role.add_to_principal_policy(iam.PolicyStatement(actions=["s3:ListBucket"],
                                                         resources=[self._data_bucket.bucket_arn]))
        self._bucket.grant_read(role, self._paths.current_model_key)
        self._bucket.grant_put(role, self._paths.current_model_key)
        self._bucket.grant_read(role, self.gate_key_pattern)
        self._topic.grant_publish(role)
        # The failure path's classifier, unqualified (no version or alias: no ARN wildcard).
        role.add_to_principal_policy(iam.PolicyStatement(actions=["lambda:InvokeFunction"],
                                                         resources=[self._classifier.function_arn]))

