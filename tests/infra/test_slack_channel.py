"""The optional Slack channel (AWS Chatbot): a stage that names one gets a notifications-only channel
subscribed to the pipeline's topic and to the topic of EventBridge's chat renderings; the default
stages have none; a malformed id fails synth. (The state machines' chat renderings:
test_pipeline_stack.py and test_pipeline_execution.py.)"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Annotations, Match, Template
from cdk_nag import AwsSolutionsChecks

from scripts.stage_synth import TEST_DIAGNOSIS_ASSET_HASH, TEST_IMAGE, cdk_json_context, stage_config
from stacks.config import SlackConfig
from stacks.stages import build_stage
from tests.chatbot_notification import custom_notification_content

CHATBOT = "AWS::Chatbot::SlackChannelConfiguration"


@pytest.fixture(scope="module")
def slack_pipeline() -> cdk.Stack:
    app = cdk.App(context=cdk_json_context())
    dev = stage_config("dev")
    cfg = replace(dev, slack=SlackConfig(workspace_id="T07EA123LEP", channel_id="C0123ABCDEF"),
                  pipeline=replace(dev.pipeline, canary_interval_minutes=60))
    stacks = build_stage(app, cfg, image_uri=TEST_IMAGE, diagnosis_asset_hash=TEST_DIAGNOSIS_ASSET_HASH)
    cdk.Aspects.of(app).add(AwsSolutionsChecks())
    return stacks["pipeline"]


def test_a_stage_with_slack_posts_the_topic_to_the_channel_read_only(slack_pipeline) -> None:
    template = Template.from_stack(slack_pipeline)
    topics = [{"Ref": lid} for lid in template.find_resources("AWS::SNS::Topic")]
    (config,) = template.find_resources(CHATBOT).values()
    props = config["Properties"]
    assert (props["SlackWorkspaceId"], props["SlackChannelId"]) == ("T07EA123LEP", "C0123ABCDEF")
    assert sorted(map(json.dumps, props["SnsTopicArns"])) == sorted(map(json.dumps, topics))
    assert {"Ref": slack_pipeline.get_logical_id(slack_pipeline.slack.chat_topic.node.default_child)} in topics
    assert props["GuardrailPolicies"][0]["Fn::Join"][1][-1] == ":iam::aws:policy/CloudWatchReadOnlyAccess"
    assert (props["LoggingLevel"], props["UserRoleRequired"]) == ("ERROR", False)
    # The channel role may do nothing: no inline or managed policy names it.
    role = props["IamRoleArn"]["Fn::GetAtt"][0]
    assert not template.find_resources("AWS::IAM::Role")[role]["Properties"].get("ManagedPolicyArns")
    attached = [p for p in template.find_resources("AWS::IAM::Policy").values()
                if {"Ref": role} in p["Properties"]["Roles"]]
    assert attached == []
    template.has_resource_properties("Custom::LogRetention", {
        "LogGroupName": "/aws/chatbot/" + props["ConfigurationName"], "LogGroupRegion": "us-east-1"})
    errors = Annotations.from_stack(slack_pipeline).find_error("*", Match.string_like_regexp(r"AwsSolutions-.*"))
    assert errors == []


def _filled(transformer: dict) -> str:
    """An input template as EventBridge fills it (escaped, inside a JSON template) for a sample event."""
    paths = transformer["InputPathsMap"]
    return re.sub(r"<([\w-]+)>", lambda m: f"value of {paths[m.group(1)]}", transformer["InputTemplate"])


def test_eventbridge_notifications_reach_email_as_text_and_the_channel_as_custom_notifications(slack_pipeline) -> None:
    # EventBridge cannot publish one rendering per protocol: the text goes to the alert topic (e-mail),
    # the custom notification to the topic only the channel subscribes to.
    template = Template.from_stack(slack_pipeline)
    alerts, chat = ({"Ref": slack_pipeline.get_logical_id(t.node.default_child)}
                    for t in (slack_pipeline.topic, slack_pipeline.slack.chat_topic))
    rules = {lid: r["Properties"]["Targets"] for lid, r in template.find_resources("AWS::Events::Rule").items()
             if any(t["Arn"] == chat for t in r["Properties"].get("Targets", []))}
    assert sorted(re.sub(r"[0-9A-F]{8}$", "", lid) for lid in rules) == ["CanaryFailedRule", "JobEventsRunnableTimeoutRule"]
    for targets in rules.values():
        text, chat_target = targets
        assert (text["Arn"], chat_target["Arn"], text["RoleArn"]) == (alerts, chat, chat_target["RoleArn"])
        paths = text["InputTransformer"]["InputPathsMap"]
        assert chat_target["InputTransformer"]["InputPathsMap"] == paths
        content = custom_notification_content(json.loads(_filled(chat_target["InputTransformer"])))
        assert content["description"] == json.loads(_filled(text["InputTransformer"]))
        assert "value of $.detail.statusReason" in content["description"]


def test_the_default_stages_have_no_slack_channel(dev_templates, prod_templates) -> None:
    for templates in (dev_templates, prod_templates):
        templates["pipeline"].resource_count_is(CHATBOT, 0)


@pytest.mark.parametrize("workspace_id, channel_id, message", [
    ("my-team", "C0123ABCDEF", r"workspace_id='my-team' is not a Slack workspace ID.*Chatbot console"),
    ("T07EA123LEP", "#alerts", r"channel_id='#alerts' is not a Slack channel ID.*Copy link"),
    ("T07EA123LEP", "c0123abcdef", r"channel_id='c0123abcdef'"),
])
def test_a_malformed_slack_id_fails_with_the_fix(workspace_id: str, channel_id: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(stage_config("dev"), slack=SlackConfig(workspace_id=workspace_id, channel_id=channel_id))
