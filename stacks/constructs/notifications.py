"""Notifications that read well in e-mail and in a Slack channel (AWS Chatbot).

Chatbot posts AWS service events it knows and messages in its custom-notification format
(https://docs.aws.amazon.com/chatbot/latest/adminguide/custom-notifs.html); a plain-text message it
does not post. A state machine publishes once with MessageStructure=json: each protocol receives its
own key, the others "default" (https://docs.aws.amazon.com/sns/latest/api/API_Publish.html).
Chatbot's topic subscription is protocol https (endpoint https://global.sns-api.chatbot.amazonaws.com),
so it receives "https", the custom notification; e-mail, SQS and Lambda subscribers the text.
EventBridge targets cannot set MessageStructure: their chat rendering goes to a topic that only
the channel subscribes to (`event_targets`).
"""

from __future__ import annotations

from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

MESSAGE_SUFFIX = "Message"
NOTIFICATION_PATH = "$.notification"
CHAT_TEXT_TYPE = "client-markdown"  # the only one Chatbot supports: the chat client's own markdown


def custom_notification(content: dict) -> dict:
    """A Chatbot custom notification around `content` (title, description, nextSteps, keywords)."""
    return {"version": "1.0", "source": "custom", "content": {"textType": CHAT_TEXT_TYPE, **content}}


def compose(scope: Construct, name: str, *, text: str, content: dict | None = None,
            title: str | None = None) -> sfn.CustomState:
    """`<name>Message`, a Pass that leaves both renderings at $.notification: `text` (an intrinsic
    function or a path: the e-mail) and `chat`, the custom notification of `content` (ASL
    Parameters), by default `title` over the same text."""
    content = content if content is not None else {"title": title, "description.$": text}
    return sfn.CustomState(scope, f"{name}{MESSAGE_SUFFIX}", state_json={
        "Type": "Pass",
        "Parameters": {"text.$": text, "chat": custom_notification(content)},
        "ResultPath": NOTIFICATION_PATH,
    })


def publish_state(scope: Construct, name: str, topic_arn: str, *, fields: dict, result_path: str,
                  timeout_seconds: int) -> sfn.CustomState:
    """`name`, the sns:publish Task of what `compose` left, with the Subject (and any other `fields`):
    the text to e-mail (and every protocol without its own key), the custom notification to https.
    Step Functions serializes the Message object, as for CDK's SnsPublish with
    message_per_subscription_type
    (https://docs.aws.amazon.com/cdk/api/v2/python/aws_cdk.aws_stepfunctions_tasks/SnsPublishJsonPathProps.html)."""
    text = f"{NOTIFICATION_PATH}.text"
    message = {"default.$": text, "email.$": text, "https.$": f"States.JsonToString({NOTIFICATION_PATH}.chat)"}
    return sfn.CustomState(scope, name, state_json={
        "Type": "Task",
        "Resource": "arn:aws:states:::sns:publish",
        "Parameters": {"TopicArn": topic_arn, "MessageStructure": "json", "Message": message, **fields},
        "ResultPath": result_path,
        "TimeoutSeconds": timeout_seconds,
    })


def event_targets(topic: sns.ITopic, chat_topic: sns.ITopic | None, role: iam.IRole, *,
                  title: str, text: str) -> list[events.IRuleTarget]:
    """An EventBridge rule's targets: `text` (with EventField placeholders) to `topic`, and with a
    `chat_topic`, the custom notification of `title` over the same text to it: a JSON input template,
    in which EventBridge escapes the variables' values (all but the raw event's:
    https://docs.aws.amazon.com/eventbridge/latest/userguide/eb-transform-target-input.html)."""
    out: list[events.IRuleTarget] = [targets.SnsTopic(topic, role=role, message=events.RuleTargetInput.from_text(text))]
    if chat_topic is not None:
        chat = custom_notification({"title": title, "description": text})
        out.append(targets.SnsTopic(chat_topic, role=role, message=events.RuleTargetInput.from_object(chat)))
    return out
