"""The optional Slack channel (AWS Chatbot): a stage that names one gets a notifications-only channel
subscribed to the pipeline's topic; the default stages have none; a malformed id fails synth."""

from __future__ import annotations

from dataclasses import replace

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Annotations, Match, Template
from cdk_nag import AwsSolutionsChecks

from infra_synth import TEST_DIAGNOSIS_ASSET_HASH, TEST_IMAGE, cdk_json_context, stage_config
from stacks.config import SlackConfig
from stacks.stages import build_stage

CHATBOT = "AWS::Chatbot::SlackChannelConfiguration"


@pytest.fixture(scope="module")
def slack_pipeline() -> cdk.Stack:
    app = cdk.App(context=cdk_json_context())
    cfg = replace(stage_config("dev"), slack=SlackConfig(workspace_id="T07EA123LEP", channel_id="C0123ABCDEF"))
    stacks = build_stage(app, cfg, image_uri=TEST_IMAGE, diagnosis_asset_hash=TEST_DIAGNOSIS_ASSET_HASH)
    cdk.Aspects.of(app).add(AwsSolutionsChecks())
    return stacks["pipeline"]


def test_a_stage_with_slack_posts_the_topic_to_the_channel_read_only(slack_pipeline) -> None:
    template = Template.from_stack(slack_pipeline)
    (topic,) = template.find_resources("AWS::SNS::Topic")
    (config,) = template.find_resources(CHATBOT).values()
    props = config["Properties"]
    assert (props["SlackWorkspaceId"], props["SlackChannelId"]) == ("T07EA123LEP", "C0123ABCDEF")
    assert props["SnsTopicArns"] == [{"Ref": topic}]
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
