"""The raw-ASL states every part of the training pipeline builds on: S3 and SNS service tasks with
bounded retries, notifications that cannot change a run's outcome, and the one failure path.
Service integrations: https://docs.aws.amazon.com/step-functions/latest/dg/supported-services-awssdk.html
"""

from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks.pipeline_config import PipelineConfig

# A Task without TimeoutSeconds may wait as long as the execution itself may run
# (https://docs.aws.amazon.com/step-functions/latest/dg/state-task.html), so every S3/SNS task
# gets this per-attempt bound and retries.
SERVICE_TASK_TIMEOUT_SECONDS = 60
S3_TRANSIENT_ERRORS = ("States.Timeout", "S3.SdkClientException", "S3.S3Exception")
UNDELIVERED_SUFFIX = "Undelivered"


class PipelineStates:
    """Builds states in `scope` (the pipeline construct: state names are construct ids).

    Public: `scope`, `failure` (the failure path's first state) and `undelivered_states` (the Pass
    states a notification that could not be delivered leads to).
    """

    def __init__(self, scope: Construct, *, config: PipelineConfig, topic: sns.ITopic) -> None:
        self.scope = scope
        self._cfg = config
        self._topic = topic
        self.undelivered_states: list[str] = []
        self.failure = self._failure_path()

    # ---- failure path: one notification, then Fail ------------------------------------------
    def _failure_path(self) -> sfn.CustomState:
        failed = sfn.Fail(self.scope, "Failed", error="PipelineFailed",
                          cause="A pipeline step failed; see the SNS notification and the execution history.")
        notify_failure = self.sns_publish(
            "NotifyFailure",
            subject="Training pipeline run failed",
            # $.failure has one key, the failed state's name, holding {Error, Cause}; for a failed
            # Batch job the Cause is the DescribeJobs record (JobId, StatusReason, exit code).
            message="States.Format('Run {} failed. Failed step, error and cause: {}', $.run_id, States.JsonToString($.failure))",
        )
        notify_failure.add_catch(failed, errors=["States.ALL"], result_path="$.notify_error")
        notify_failure.next(failed)
        return notify_failure

    def fail_with(self, name: str, error: str, cause: str) -> sfn.CustomState:
        """A Pass that records {Error, Cause} under $.failure.<name>, then the failure path.
        `cause` is an intrinsic function or a JSONPath."""
        state = self.raw(name, {
            "Type": "Pass",
            "Parameters": {"Error": error, "Cause.$": cause},
            "ResultPath": f"$.failure.{name}",
        })
        state.next(self.failure)
        return state

    # ---- service tasks: a bounded attempt, retried --------------------------------------------
    def raw(self, name: str, state_json: dict) -> sfn.CustomState:
        return sfn.CustomState(self.scope, name, state_json=state_json)

    def service_retry(self, state: sfn.CustomState, errors: tuple[str, ...]) -> None:
        cfg = self._cfg
        state.add_retry(errors=list(errors), interval=Duration.seconds(cfg.retry_interval_seconds),
                        max_attempts=cfg.retry_max_attempts, backoff_rate=cfg.retry_backoff_rate,
                        max_delay=Duration.seconds(cfg.retry_max_delay_seconds), jitter_strategy=sfn.JitterType.FULL)

    def s3_task(self, name: str, action: str, parameters: dict, *, result_path: str,
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
        state = self.raw(name, state_json)
        self.service_retry(state, retry_errors)
        return state

    def sns_publish(self, name: str, *, subject: str, message: str) -> sfn.CustomState:
        state = self.raw(name, {
            "Type": "Task",
            "Resource": "arn:aws:states:::sns:publish",
            "Parameters": {"TopicArn": self._topic.topic_arn, "Subject": subject, "Message.$": message},
            # Keep the run data for the next state (None cannot be expressed: jsii drops it).
            "ResultPath": "$.notified",
            "TimeoutSeconds": SERVICE_TASK_TIMEOUT_SECONDS,
        })
        self.service_retry(state, ("States.TaskFailed", "States.Timeout"))
        return state

    def notify(self, name: str, end: sfn.IChainable, *, subject: str, message: str) -> sfn.CustomState:
        """A notification that cannot change the outcome: if it still fails after its retries,
        `<name>Undelivered` records the error (execution log; Monitoring alarms on it) and the run
        ends where it would have ended anyway."""
        notify = self.sns_publish(name, subject=subject, message=message)
        undelivered = self.raw(f"{name}{UNDELIVERED_SUFFIX}", {"Type": "Pass"})
        self.undelivered_states.append(undelivered.state_id)
        notify.add_catch(undelivered, errors=["States.ALL"], result_path="$.notify_error")
        notify.next(end)
        undelivered.next(end)
        return notify

