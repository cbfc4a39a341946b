"""The raw-ASL states every part of the training pipeline builds on: S3 and SNS service tasks with
bounded retries, notifications that cannot change a run's outcome (text for e-mail, a custom
notification for Slack: notifications.py), and the one failure path (classify the failure, then
notify: the classifier can fail, the notification still goes out).
Service integrations: https://docs.aws.amazon.com/step-functions/latest/dg/supported-services-awssdk.html
"""

from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks.constructs.notifications import compose, publish_state
from stacks.pipeline_config import PipelineConfig

# A Task without TimeoutSeconds may wait as long as the execution itself may run
# (https://docs.aws.amazon.com/step-functions/latest/dg/state-task.html), so every S3/SNS task
# gets this per-attempt bound and retries.
SERVICE_TASK_TIMEOUT_SECONDS = 60
S3_TRANSIENT_ERRORS = ("States.Timeout", "S3.SdkClientException", "S3.S3Exception")
UNDELIVERED_SUFFIX = "Undelivered"
# Lambda's transient invoke errors (https://docs.aws.amazon.com/step-functions/latest/dg/bp-lambda-serviceexception.html).
LAMBDA_TRANSIENT_ERRORS = ("Lambda.ServiceException", "Lambda.AWSLambdaException", "Lambda.SdkClientException",
                           "Lambda.TooManyRequestsException")
DIAGNOSIS_TIMEOUT_SECONDS = 180


class PipelineStates:
    """Builds states in `scope` (the pipeline construct: state names are construct ids).

    Public: `scope`, `failure` (the failure path's first state) and `undelivered_states` (the Pass
    states a notification that could not be delivered leads to). `classifier`: the failure path's
    classifier function (stacks/constructs/failure_diagnosis.py). `team`: every notification
    carries it as the SNS message attribute `team`, so a team subscribes to its own runs only (a
    subscription filter policy, https://docs.aws.amazon.com/sns/latest/dg/sns-subscription-filter-policies.html).
    """

    def __init__(self, scope: Construct, *, config: PipelineConfig, topic: sns.ITopic,
                 classifier: lambda_.IFunction, team: str | None = None) -> None:
        self.scope = scope
        self._team = team
        self._cfg = config
        self._topic = topic
        self._classifier = classifier
        self.undelivered_states: list[str] = []
        self.failure = self._failure_path()

    # ---- failure path: classify, one notification, then Fail ----------------------------------
    def _failure_path(self) -> sfn.CustomState:
        """DiagnoseFailure -> NotifyFailureMessage -> NotifyFailure -> Failed; returns DiagnoseFailure."""
        failed = sfn.Fail(self.scope, "Failed", error="PipelineFailed",
                          cause="A pipeline step failed; see the SNS notification and the execution history.")
        # $.failure has one key, the failed state's name, holding {Error, Cause}; for a failed
        # Batch job the Cause is the DescribeJobs record (JobId, StatusReason, exit code). The raw
        # failure is always in the e-mail, whatever the classifier said or whether it ran; the chat
        # gets the diagnosis only (a bounded text: handler.CHAT_DESCRIPTION_CHARS).
        notify_failure = self.sns_publish(
            "NotifyFailure", subject_path="$.diagnosis.subject", then=failed, on_error=failed,
            text="States.Format('Run {} failed. {}Raw failure (failed step, error and cause): {}', "
                 "$.run_id, $.diagnosis.text, States.JsonToString($.failure))",
            content={"title.$": "$.diagnosis.subject", "description.$": "$.diagnosis.chat.description",
                     "nextSteps.$": "$.diagnosis.chat.nextSteps", "keywords.$": "$.diagnosis.chat.keywords"})
        return self._diagnose(then=notify_failure)

    def _diagnose(self, then: sfn.CustomState) -> sfn.CustomState:
        """DiagnoseFailure: the classifier function on the state input; any error of it (after the
        transient-error retries) leads to DiagnosisUnavailable, which says so and keeps the run's
        own Error and Cause for the notification."""
        diagnose = self.raw("DiagnoseFailure", {
            "Type": "Task",
            "Resource": "arn:aws:states:::lambda:invoke",
            "Parameters": {"FunctionName": self._classifier.function_arn, "Payload.$": "$"},
            "ResultSelector": {"class.$": "$.Payload.class", "subject.$": "$.Payload.subject",
                               "text.$": "$.Payload.text", "chat.$": "$.Payload.chat"},
            "ResultPath": "$.diagnosis",
            "TimeoutSeconds": DIAGNOSIS_TIMEOUT_SECONDS,
        })
        self.service_retry(diagnose, LAMBDA_TRANSIENT_ERRORS)
        unavailable = self.raw("DiagnosisUnavailable", {
            "Type": "Pass",
            "Parameters": {
                "class": "unclassified",
                "subject": "Training pipeline run failed",
                "text.$": "States.Format('(The automatic classification failed: {}.) ', $.diagnosis_error.Error)",
                "chat": {
                    "description.$": "States.Format('The automatic classification failed ({}): the raw error and "
                                     "cause are in the e-mail notification and the execution history.', "
                                     "$.diagnosis_error.Error)",
                    "nextSteps.$": "States.Array(States.Format('`trainium-runs why {}` classifies the failure "
                                   "from the job logs', $.run_id))",
                    "keywords": ["unclassified"],
                },
            },
            "ResultPath": "$.diagnosis",
        })
        diagnose.add_catch(unavailable, errors=["States.ALL"], result_path="$.diagnosis_error")
        diagnose.next(then)
        unavailable.next(then)
        return diagnose

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

    def sns_publish(self, name: str, *, text: str, then: sfn.IChainable, on_error: sfn.IChainable,
                    subject: str | None = None, subject_path: str | None = None,
                    content: dict | None = None) -> sfn.CustomState:
        """`<name>Message` (notifications.compose: `text`, a path or intrinsic, and the chat's
        `content`, by default `subject` over the text) -> `<name>`, the publish: retried, then
        `on_error`, else `then`. `subject` as is, or the state input's `subject_path`. Returns the first."""
        message = compose(self.scope, name, text=text, content=content, title=subject)
        subject_field = {"Subject": subject} if subject_path is None else {"Subject.$": subject_path}
        # ResultPath keeps the run data for the next state (None cannot be expressed: jsii drops it).
        state = publish_state(self.scope, name, self._topic.topic_arn, fields={**subject_field, **self._team_attribute()},
                              result_path="$.notified", timeout_seconds=SERVICE_TASK_TIMEOUT_SECONDS)
        self.service_retry(state, ("States.TaskFailed", "States.Timeout"))
        state.add_catch(on_error, errors=["States.ALL"], result_path="$.notify_error")
        message.next(state)
        state.next(then)
        return message

    def _team_attribute(self) -> dict:
        if self._team is None:
            return {}
        return {"MessageAttributes": {"team": {"DataType": "String", "StringValue": self._team}}}

    def notify(self, name: str, end: sfn.IChainable, *, subject: str, message: str) -> sfn.CustomState:
        """A notification that cannot change the outcome: if it still fails after its retries,
        `<name>Undelivered` records the error (execution log; Monitoring alarms on it) and the run
        ends where it would have ended anyway."""
        undelivered = self.raw(f"{name}{UNDELIVERED_SUFFIX}", {"Type": "Pass"})
        self.undelivered_states.append(undelivered.state_id)
        undelivered.next(end)
        return self.sns_publish(name, subject=subject, text=message, then=end, on_error=undelivered)

