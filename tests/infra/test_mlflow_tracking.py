"""The MLflow tracking server construct in a small test stack: server, artifact store, IAM."""

from __future__ import annotations

import pytest
from aws_cdk import App, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from aws_cdk.assertions import Match, Template

from pipeline_fixtures import ENV
from stacks.constructs.mlflow_tracking import MlflowTracking


@pytest.fixture(scope="module")
def template() -> Template:
    stack = Stack(App(), "MlflowTest", env=ENV)
    bucket = s3.Bucket(stack, "Artifacts")
    job_role = iam.Role(stack, "JobRole", assumed_by=iam.ServicePrincipal("ecs-tasks.amazonaws.com"))
    tracking = MlflowTracking(stack, "Mlflow", name="TrnEmbed-dev", artifacts_bucket=bucket)
    tracking.grant_access(job_role)
    return Template.from_stack(stack)


def test_server_stores_artifacts_under_the_prefix(template):
    template.has_resource_properties("AWS::SageMaker::MlflowTrackingServer", {
        "TrackingServerName": "TrnEmbed-dev",
        "TrackingServerSize": "Small",
        "ArtifactStoreUri": {"Fn::Join": ["", ["s3://", {"Ref": Match.any_value()}, "/mlflow"]]},
        "RoleArn": {"Fn::GetAtt": [Match.string_like_regexp("MlflowServerRole"), "Arn"]},
    })


def test_server_role_is_for_sagemaker_and_job_role_may_log(template):
    template.has_resource_properties("AWS::IAM::Role", {"AssumeRolePolicyDocument": {"Statement": [
        Match.object_like({"Principal": {"Service": "sagemaker.amazonaws.com"}})]}})
    template.has_resource_properties("AWS::IAM::Policy", {
        "Roles": [{"Ref": Match.string_like_regexp("JobRole")}],
        "PolicyDocument": {"Statement": Match.array_with([Match.object_like({
            "Action": "sagemaker-mlflow:*",
            "Resource": {"Fn::GetAtt": [Match.string_like_regexp("MlflowServer"), "TrackingServerArn"]}})])},
    })
    # The client writes run artifacts itself: below the server's artifact prefix only.
    template.has_resource_properties("AWS::IAM::Policy", {
        "Roles": [{"Ref": Match.string_like_regexp("JobRole")}],
        "PolicyDocument": {"Statement": Match.array_with([Match.object_like({
            "Action": Match.array_with(["s3:PutObject"]),
            "Resource": Match.array_with([{"Fn::Join": ["", [Match.any_value(), "/mlflow/*"]]}])})])},
    })


def test_bad_size_is_a_fix_it_error():
    stack = Stack(App(), "Bad", env=ENV)
    with pytest.raises(ValueError, match="Small, Medium, Large"):
        MlflowTracking(stack, "Mlflow", name="x", artifacts_bucket=s3.Bucket(stack, "B"), size="Huge")
