"""Moto patches that let the synthesized pipeline definition run end to end (moto 5.2.5).

Known gap, checked against moto 5.2.5: the Step Functions interpreter runs
`batch:submitJob.sync`, but `StateTaskServiceBatch._normalise_parameters/_normalise_response` are
the base-class no-ops, so Step Functions-cased parameters (`JobName`, ...) reach botocore
unconverted and the response is not converted back (`JobId`). The aws-sdk integration has the
same no-op hooks, so an S3 GetObject `Body` stays a stream and batch:describeJobs gets `Jobs`, and the `states:startExecution`
integration stops after serialising `Input` (`StateMachineArn` reaches botocore as is). We fill those hooks with the
conversions moto's base class already implements (`_to_boto_request` / `_from_boto_response`
against the botocore operation shapes). Moto also silently drops SubmitJob fields it does not
list (ShareIdentifier, SchedulingPriorityOverride, NodeOverrides); we let them through so they
reach botocore's validation and are recorded for assertions. And moto names aws-sdk errors with
the lower-case service ("s3.NoSuchKeyException") where Step Functions uses "S3.NoSuchKeyException"
(https://docs.aws.amazon.com/step-functions/latest/dg/supported-services-awssdk.html), so we add
the service-name bindings the definitions catch on.

Test hooks on the returned `BatchHooks`:
- `submitted`: every SubmitJob request as botocore received it (camelCase keys).
- `fail_job_definitions`: job definition names whose jobs end FAILED (moto's batch_simple marks all
  jobs SUCCEEDED unless MOTO_SIMPLE_BATCH_FAIL_AFTER is set; we set it per job).
- `running_job_definitions`: job definition names whose jobs stay RUNNING (the stall watchdog's
  subjects; TerminateJob then ends them FAILED, as on AWS).
- `runnable_job_definitions`: job definition names whose jobs stay RUNNABLE (no capacity; the
  queue-wait watchdog's subjects; CancelJob then ends them FAILED, as on AWS).
- `throttle_submits`: the next N SubmitJob calls raise TooManyRequestsException.
- `throttle_start_executions`: the next N states:startExecution calls raise ThrottlingException
  (and names the API refuses are refused in the integration too).
- `start_execution_faults`: (error code, performed) per next states:startExecution call: the call
  raises that error, after starting the execution when `performed` (a response lost on the way back).
- `fail_sns_subjects`: sns:publish tasks whose Subject contains one of these fail (InternalError);
  `sns_attempts` counts the attempts per listed subject.
- `before_put_current`: callables run (once each) just before the next aws-sdk s3:putObject of
  models/current.json: another run's publish landing between our read and our write.
- `instant_waits`: Wait states return at once (moto sleeps for real) and `waits` records the
  seconds each asked for; what a test checks is the state order and the waited duration.
  `on_wait(n)`, when set, runs as the n-th Wait ends (e.g. a heartbeat arriving during the waits).
- `run_job`: when set, called as run_job(job, submitted) instead of marking the job done: it runs
  the job (tests/e2e/local_batch.py), fills its attempts and returns whether it succeeded.
- `lambda_handler`: what a lambda:invoke task runs, in this process (moto would start the function
  in Docker); by default the failure classifier (pipeline_steps/diagnosis/handler.py: classify_failure,
  and its metric line into `lambda_stdout`). `lambda_events` / `lambda_results` record each call; an
  exception becomes the FunctionError response Lambda returns for an unhandled error. `fail_lambda`:
  raise instead.

`eventbridge_starts_executions()`: moto's EventBridge delivers to logs, SQS and event buses only;
this adds Step Functions targets, so a rule whose target is a state machine starts an execution
with the event as input (what EventBridge does: https://docs.aws.amazon.com/eventbridge/latest/userguide/eb-targets.html).
Remove this module when moto fills the hooks itself.
"""

from __future__ import annotations

import datetime
import json
import os

from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any, Callable, Iterator
from unittest import mock

import boto3
from botocore.exceptions import ClientError
from moto.batch.models import Job, JobStatus
from moto.batch_simple.models import BatchSimpleBackend
from moto.stepfunctions.models import StepFunctionBackend
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
    state_task_service_aws_sdk as aws_sdk_module,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
    state_task_service_batch as batch_module,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
    state_task_service_sfn as sfn_module,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
    state_task_service_sns as sns_module,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task import lambda_eval_utils
from moto.stepfunctions.parser.asl.component.state.wait.wait_function.wait_function import WaitFunction
from moto.stepfunctions.parser.backend.execution_worker import ExecutionWorker

PATCHED_FOR_MOTO = "5.2.5"


@dataclass
class BatchHooks:
    submitted: list[dict] = field(default_factory=list)
    fail_job_definitions: set[str] = field(default_factory=set)
    running_job_definitions: set[str] = field(default_factory=set)
    runnable_job_definitions: set[str] = field(default_factory=set)
    throttle_submits: int = 0
    throttled: int = 0
    throttle_start_executions: int = 0
    start_execution_faults: list[tuple[str, bool]] = field(default_factory=list)
    fail_sns_subjects: set[str] = field(default_factory=set)
    sns_attempts: dict[str, int] = field(default_factory=dict)
    before_put_current: list[Callable[[], None]] = field(default_factory=list)
    instant_waits: bool = False
    waits: list[int] = field(default_factory=list)
    on_wait: Callable[[int], None] | None = None
    run_job: Callable[[Any, list[dict]], bool] | None = None
    lambda_handler: Callable[[dict, Any], Any] | None = None
    fail_lambda: bool = False
    lambda_events: list[dict] = field(default_factory=list)
    lambda_results: list[Any] = field(default_factory=list)
    lambda_stdout: list[str] = field(default_factory=list)


def _iso_timestamps(value) -> None:
    """In place: datetimes in a response -> ISO 8601 strings, as Step Functions returns them."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in list(items):
        if isinstance(item, datetime.datetime):
            value[key] = item.astimezone(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
        else:
            _iso_timestamps(item)


def _client_error(code: str, status: int, operation: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status, "RequestId": "test-hook"}}, operation)


def _pascal(name: str) -> str:
    if "_" in name:
        return "".join(part.capitalize() for part in name.split("_"))
    return name[0].upper() + name[1:]


def _operation(service: str, action: str):
    model = boto3.session.Session().client(service, region_name="us-east-1").meta.service_model
    return model.operation_model(_pascal(action))


@contextmanager
def patched_moto_batch() -> Iterator[BatchHooks]:
    installed = version("moto")
    assert installed.startswith(PATCHED_FOR_MOTO.rsplit(".", 1)[0]), (
        f"moto {installed}: re-check the Batch integration gap this patch fills (written for {PATCHED_FOR_MOTO})")
    hooks = BatchHooks()
    service_cls = batch_module.StateTaskServiceBatch
    sdk_cls = aws_sdk_module.StateTaskServiceAwsSdk

    def normalise_parameters(self, parameters, boto_service_name=None, service_action_name=None):
        op = _operation(self._get_boto_service_name(boto_service_name), service_action_name or self.resource.api_action)
        self._to_boto_request(parameters, op.input_shape)

    def normalise_response(self, response, boto_service_name=None, service_action_name=None):
        op = _operation(self._get_boto_service_name(boto_service_name), service_action_name or self.resource.api_action)
        self._from_boto_response(response, op.output_shape)

    original_eval = service_cls._eval_service_task

    def eval_service_task(self, env, resource_runtime_part, normalised_parameters, state_credentials):
        if hooks.throttle_submits > 0:
            hooks.throttle_submits -= 1
            hooks.throttled += 1
            raise ClientError({"Error": {"Code": "TooManyRequestsException", "Message": "Too Many Requests"},
                               "ResponseMetadata": {"HTTPStatusCode": 429, "RequestId": "throttled"}}, "SubmitJob")
        hooks.submitted.append(dict(normalised_parameters))
        return original_eval(self, env, resource_runtime_part, normalised_parameters, state_credentials)

    original_finish = BatchSimpleBackend._mark_job_as_finished

    def mark_job_as_finished(self, include_start_attempt, job):
        if hooks.run_job is not None:
            self.backend._jobs[job.job_id] = job
            job.job_started_at = datetime.datetime.now()
            job.log_stream_name = job._stream_name
            job._mark_stopped(success=hooks.run_job(job, hooks.submitted))
            return
        if job.job_definition.name in hooks.runnable_job_definitions:
            self.backend._jobs[job.job_id] = job
            job.status = JobStatus.RUNNABLE
            return
        if job.job_definition.name in hooks.running_job_definitions:
            self.backend._jobs[job.job_id] = job
            job.job_started_at = datetime.datetime.now()
            job._start_attempt()
            job.status = "RUNNING"
            return
        fail = job.job_definition.name in hooks.fail_job_definitions
        with mock.patch.dict(os.environ, {"MOTO_SIMPLE_BATCH_FAIL_AFTER": "0"} if fail else {}):
            if not fail:
                os.environ.pop("MOTO_SIMPLE_BATCH_FAIL_AFTER", None)
            original_finish(self, include_start_attempt, job)

    original_terminate = Job.terminate

    def terminate(self, reason):
        # TerminateJob / CancelJob only flag the job for moto's Docker runner; a job these hooks
        # hold (RUNNING or RUNNABLE) ends FAILED with the reason, as on AWS.
        original_terminate(self, reason)
        if self.job_definition.name in hooks.running_job_definitions | hooks.runnable_job_definitions:
            self._mark_stopped(success=False)

    def sdk_normalise_parameters(self, parameters, boto_service_name=None, service_action_name=None):
        # Only Batch's botocore names differ (jobs, jobId); S3/CloudWatch names are already the
        # SDK's, and converting would re-encode the S3 Body blob.
        if self._get_boto_service_name(boto_service_name) == "batch":
            normalise_parameters(self, parameters, boto_service_name, service_action_name)

    def sdk_normalise_response(self, response, boto_service_name=None, service_action_name=None):
        # Streams -> strings (GetObject Body), botocore's member names -> the SDK integration's
        # (describeJobs: jobs/status -> Jobs/Status), timestamps -> ISO 8601 strings.
        if isinstance(response, dict):
            for key, value in list(response.items()):
                response[key] = self._from_boto_response_value(value)
        normalise_response(self, response, boto_service_name, service_action_name)
        _iso_timestamps(response)

    sdk_original_eval = sdk_cls._eval_service_task

    def sdk_eval_service_task(self, env, resource_runtime_part, normalised_parameters, state_credentials):
        if self._get_boto_service_action() == "put_object" and normalised_parameters.get("Key") == "models/current.json":
            while hooks.before_put_current:
                hooks.before_put_current.pop(0)()
        return sdk_original_eval(self, env, resource_runtime_part, normalised_parameters, state_credentials)

    sns_cls = sns_module.StateTaskServiceSns
    sns_original_eval = sns_cls._eval_service_task

    def sns_eval_service_task(self, env, resource_runtime_part, normalised_parameters, state_credentials):
        for subject in hooks.fail_sns_subjects:
            if subject in normalised_parameters.get("Subject", ""):
                hooks.sns_attempts[subject] = hooks.sns_attempts.get(subject, 0) + 1
                raise _client_error("InternalError", 500, "Publish")
        return sns_original_eval(self, env, resource_runtime_part, normalised_parameters, state_credentials)

    original_environment = ExecutionWorker._get_evaluation_environment

    def evaluation_environment(self):
        # $$.Execution.StartTime is an ISO 8601 string on AWS; moto leaves a datetime there,
        # which no intrinsic function can serialise.
        env = original_environment(self)
        execution = env.states.context_object.context_object_data["Execution"]
        if hasattr(execution["StartTime"], "isoformat"):
            execution["StartTime"] = execution["StartTime"].astimezone(datetime.timezone.utc).strftime(
                "%Y-%m-%dT%H:%M:%S.%fZ")
        return env

    original_wait_interval = WaitFunction._wait_interval

    def wait_interval(self, env, wait_seconds):
        if not hooks.instant_waits:
            return original_wait_interval(self, env, wait_seconds)
        hooks.waits.append(wait_seconds)
        if hooks.on_wait is not None:
            hooks.on_wait(len(hooks.waits))

    sfn_cls = sfn_module.StateTaskServiceSfn
    sfn_original_parameters = sfn_cls._normalise_parameters
    sfn_original_eval = sfn_cls._eval_service_task

    def sfn_eval_service_task(self, env, resource_runtime_part, normalised_parameters, state_credentials):
        if hooks.throttle_start_executions > 0:
            hooks.throttle_start_executions -= 1
            # moto names the task error "StepFunctions.<code>Exception"
            raise _client_error("Throttling", 400, "StartExecution")
        # moto's StartExecution API checks names, its Step Functions integration does not: apply
        # the same rules (StepFunctionBackend._validate_name) as the service's API would.
        name = normalised_parameters.get("name", "")
        if len(name) > 80:
            # the API code ValidationException, which Step Functions reports as StepFunctions.ValidationException
            raise _client_error("Validation", 400, "StartExecution")
        if any(c in name for c in [*StepFunctionBackend.invalid_chars_for_name,
                                   *StepFunctionBackend.invalid_unicodes_for_name]):
            raise _client_error("InvalidName", 400, "StartExecution")
        if hooks.start_execution_faults:
            code, performed = hooks.start_execution_faults.pop(0)
            if performed:
                sfn_original_eval(self, env, resource_runtime_part, normalised_parameters, state_credentials)
            raise _client_error(code, 500 if performed else 400, "StartExecution")
        return sfn_original_eval(self, env, resource_runtime_part, normalised_parameters, state_credentials)

    def sfn_normalise_parameters(self, parameters, boto_service_name=None, service_action_name=None):
        sfn_original_parameters(self, parameters, boto_service_name, service_action_name)  # Input -> JSON
        normalise_parameters(self, parameters, boto_service_name, service_action_name)

    def sfn_normalise_response(self, response, boto_service_name=None, service_action_name=None):
        # StartExecution returns startDate as a datetime, which moto cannot put in the state output.
        normalise_response(self, response, boto_service_name, service_action_name)
        if isinstance(response, dict):
            for key, value in list(response.items()):
                if hasattr(value, "isoformat"):
                    response[key] = value.isoformat()

    def classifier(event, region):
        # The function's handler minus its process-wide parts (boto3's default region, stdout): the
        # executions run on worker threads while the test's main thread prints.
        from pipeline_steps.diagnosis import handler

        result = handler.classify_failure(event, boto3.client("batch", region_name=region),
                                          boto3.client("logs", region_name=region))
        hooks.lambda_stdout.append(handler.metric_line(result, namespace="TrainiumEmbeddings", stage="test"))
        return result

    def invoke_lambda(parameters, region, state_credentials):
        event = json.loads(parameters.get("Payload") or b"{}")
        hooks.lambda_events.append(event)
        try:
            if hooks.fail_lambda:
                raise RuntimeError("test hook: fail_lambda")
            result = hooks.lambda_handler(event, None) if hooks.lambda_handler else classifier(event, region)
        except Exception as exc:  # noqa: BLE001 -- what Lambda reports for an unhandled error
            return {"StatusCode": 200, "FunctionError": "Unhandled",
                    "Payload": {"errorType": type(exc).__name__, "errorMessage": str(exc)}}
        hooks.lambda_results.append(result)
        return {"StatusCode": 200, "ExecutedVersion": "$LATEST", "Payload": result}

    supported = dict(batch_module._SUPPORTED_API_PARAM_BINDINGS)
    supported["submitjob"] = supported["submitjob"] | {"ShareIdentifier", "SchedulingPriorityOverride", "NodeOverrides"}
    error_names = {**aws_sdk_module._SERVICE_ERROR_NAMES, "s3": "S3", "cloudwatch": "CloudWatch", "batch": "Batch"}
    with mock.patch.object(aws_sdk_module, "_SERVICE_ERROR_NAMES", error_names), \
            mock.patch.object(service_cls, "_normalise_parameters", normalise_parameters), \
            mock.patch.object(service_cls, "_normalise_response", normalise_response), \
            mock.patch.object(service_cls, "_eval_service_task", eval_service_task), \
            mock.patch.object(sdk_cls, "_normalise_response", sdk_normalise_response), \
            mock.patch.object(sdk_cls, "_normalise_parameters", sdk_normalise_parameters), \
            mock.patch.object(sdk_cls, "_eval_service_task", sdk_eval_service_task), \
            mock.patch.object(sns_cls, "_eval_service_task", sns_eval_service_task), \
            mock.patch.object(sfn_cls, "_eval_service_task", sfn_eval_service_task), \
            mock.patch.object(WaitFunction, "_wait_interval", wait_interval), \
            mock.patch.object(ExecutionWorker, "_get_evaluation_environment", evaluation_environment), \
            mock.patch.object(sfn_cls, "_normalise_parameters", sfn_normalise_parameters), \
            mock.patch.object(sfn_cls, "_normalise_response", sfn_normalise_response), \
            mock.patch.object(BatchSimpleBackend, "_mark_job_as_finished", mark_job_as_finished), \
            mock.patch.object(Job, "terminate", terminate), \
            mock.patch.object(lambda_eval_utils, "_invoke_lambda_function", invoke_lambda), \
            mock.patch.object(batch_module, "_SUPPORTED_API_PARAM_BINDINGS", supported):
        yield hooks


@contextmanager
def eventbridge_starts_executions() -> Iterator[list[str]]:
    """Yields the list of errors met while delivering (S3's EventBridge hook swallows them)."""
    import json
    import uuid

    from moto.events.models import Rule
    from moto.utilities.arns import parse_arn

    errors: list[str] = []
    original = Rule.send_to_targets

    def send_to_targets(self, original_event, transform_input=True):
        machines = [t for t in self.targets if parse_arn(t["Arn"]).service == "states"]
        others = [t for t in self.targets if t not in machines]
        if others:  # moto's own delivery raises NotImplementedError on a state machine target
            saved, self.targets = self.targets, others
            try:
                original(self, original_event, transform_input)
            finally:
                self.targets = saved
        if not self.event_pattern.matches_event(original_event):
            return
        for target in machines:
            arn = parse_arn(target["Arn"])
            try:
                boto3.client("stepfunctions", region_name=arn.region).start_execution(
                    stateMachineArn=target["Arn"], name=str(uuid.uuid4()),
                    input=json.dumps(original_event, default=str))
            except Exception as exc:  # noqa: BLE001  reported to the test, never swallowed
                errors.append(f"{target['Arn']}: {exc!r}")

    with mock.patch.object(Rule, "send_to_targets", send_to_targets):
        yield errors
