"""Who may do what in a stage with teams, proven on the synthesized policies: each request below is
evaluated (tests/infra/iam_eval.py) as the role that would make it -- a team's role, the platform
admin role, a team's Batch job role, a team's pipeline (state machine) role -- against the role's
identity policies and the bucket's resource policy. Team search's principal is the one asking;
team ads is "another team". The test ids are the table docs/operations.md ("Teams") cites.
"""

from __future__ import annotations

import re

import pytest

from iam_eval import Request, Stage, decide, may_assume, statement_applies
from infra_synth import ADMIN_ROLE, TEAM_ROLES, TEST_ACCOUNT

PIPELINE, STORAGE, COMPUTE = "TrnEmbed-dev-Pipeline", "TrnEmbed-dev-Storage", "TrnEmbed-dev-Compute"
# The role under test: (stack, logical id prefix) of each role that acts for a team or the platform.
ROLES = {"search-role": (PIPELINE, "SearchRole"), "ads-role": (PIPELINE, "AdsRole"), "admin-role": (PIPELINE, "AdminRole"),
         "search-jobs": (COMPUTE, "SearchJobsJobRole"), "search-pipeline": (PIPELINE, "SearchTrainingPipelineStateMachineRole")}
TLS = {"aws:SecureTransport": "true"}


def tags(prefix: str, team: str | None, pipeline: str = PIPELINE) -> dict:
    out = {f"aws:{prefix}Tag/pipeline": pipeline}
    return out | ({f"aws:{prefix}Tag/team": team} if team else {})


def submit_tags(team: str) -> dict:
    return tags("Request", team) | {"aws:TagKeys": ["pipeline", "team"]}


# (role, action, resource ({data}, {artifacts}, {cache} bucket ARNs, {sm:team}, {exec:team},
# {logs:team}, {job}, {jobdef:team}, {queue}, {stack:name}), request context, decision).
ALLOW, DENY = "Allow", "ImplicitDeny"
CASES = [
    # -- a team's principals: upload (starts its run), read its runs and model, stop its runs and jobs
    ("search-role", "s3:PutObject", "{data}/incoming/search/catalog/v1/_SUCCESS", TLS, ALLOW),
    ("search-role", "s3:GetObject", "{artifacts}/runs/search/catalog-v1/validation/gate.json", TLS, ALLOW),
    ("search-role", "s3:GetObject", "{artifacts}/models/search/current.json", TLS, ALLOW),
    ("search-role", "s3:ListBucket", "{artifacts}", TLS | {"s3:prefix": "runs/search/"}, ALLOW),
    ("search-role", "s3:DeleteObject", "{artifacts}/runs/search/catalog-v0/checkpoints/step-1.pt", TLS, ALLOW),
    ("search-role", "states:StartExecution", "{sm:search}", {}, ALLOW),
    ("search-role", "states:DescribeExecution", "{exec:search}", {}, ALLOW),
    ("search-role", "states:StopExecution", "{exec:search}", {}, ALLOW),
    ("search-role", "batch:TerminateJob", "{job}", tags("Resource", "search"), ALLOW),
    ("search-role", "batch:CancelJob", "{job}", tags("Resource", "search"), ALLOW),
    ("search-role", "logs:GetLogEvents", "{logs:search}", {}, ALLOW),
    ("search-role", "cloudformation:DescribeStacks", "{stack:TrnEmbed-dev-Pipeline}", {}, ALLOW),
    # -- ... and nothing of another team, no pointer writes, no direct job submission
    ("search-role", "s3:PutObject", "{data}/incoming/ads/catalog/v1/_SUCCESS", TLS, DENY),
    ("search-role", "s3:GetObject", "{data}/incoming/ads/catalog/v1/pairs/part-0.parquet", TLS, DENY),
    ("search-role", "s3:GetObject", "{artifacts}/runs/ads/catalog-v1/validation/gate.json", TLS, DENY),
    ("search-role", "s3:GetObject", "{artifacts}/models/ads/current.json", TLS, DENY),
    ("search-role", "s3:ListBucket", "{artifacts}", TLS | {"s3:prefix": "runs/ads/"}, DENY),
    ("search-role", "s3:ListBucket", "{artifacts}", TLS, DENY),
    ("search-role", "s3:DeleteObject", "{artifacts}/runs/ads/catalog-v1/checkpoints/step-1.pt", TLS, DENY),
    ("search-role", "s3:PutObject", "{artifacts}/models/search/current.json", TLS, DENY),
    ("search-role", "states:StartExecution", "{sm:ads}", {}, DENY),
    ("search-role", "states:DescribeExecution", "{exec:ads}", {}, DENY),
    ("search-role", "states:StopExecution", "{exec:ads}", {}, DENY),
    ("search-role", "batch:TerminateJob", "{job}", tags("Resource", "ads"), DENY),
    ("search-role", "batch:CancelJob", "{job}", tags("Resource", "ads"), DENY),
    ("search-role", "batch:TerminateJob", "{job}", tags("Resource", None), DENY),  # the canary: no team tag
    ("search-role", "batch:SubmitJob", "{jobdef:search}", {}, DENY),
    ("search-role", "logs:GetLogEvents", "{logs:ads}", {}, DENY),
    ("ads-role", "s3:GetObject", "{artifacts}/runs/search/catalog-v1/validation/gate.json", TLS, DENY),
    ("ads-role", "states:StopExecution", "{exec:search}", {}, DENY),
    ("ads-role", "batch:TerminateJob", "{job}", tags("Resource", "search"), DENY),
    # -- the platform admin: every team's pipeline, jobs and artifacts; still no pointer writes
    ("admin-role", "states:StartExecution", "{sm:ads}", {}, ALLOW),
    ("admin-role", "states:StopExecution", "{exec:search}", {}, ALLOW),
    ("admin-role", "batch:TerminateJob", "{job}", tags("Resource", "ads"), ALLOW),
    ("admin-role", "batch:CancelJob", "{job}", tags("Resource", None), ALLOW),
    ("admin-role", "s3:GetObject", "{artifacts}/models/ads/current.json", TLS, ALLOW),
    ("admin-role", "s3:PutObject", "{data}/incoming/search/catalog/v2/_SUCCESS", TLS, ALLOW),
    ("admin-role", "logs:GetLogEvents", "{logs:ads}", {}, ALLOW),
    ("admin-role", "s3:PutObject", "{artifacts}/models/ads/current.json", TLS, DENY),
    ("admin-role", "batch:TerminateJob", "{job}", tags("Resource", None, pipeline="another-pipeline"), DENY),
    ("admin-role", "batch:SubmitJob", "{jobdef:ads}", {}, DENY),
    # -- a team's jobs: its uploads, its runs, its cache and pointer; nothing of another team
    ("search-jobs", "s3:GetObject", "{data}/incoming/search/catalog/v1/pairs/part-0.parquet", TLS, ALLOW),
    ("search-jobs", "s3:PutObject", "{artifacts}/runs/search/catalog-v1/export/query/model.safetensors", TLS, ALLOW),
    ("search-jobs", "s3:DeleteObject", "{artifacts}/runs/search/catalog-v1/export/_SUCCESS", TLS, ALLOW),
    ("search-jobs", "s3:GetObject", "{artifacts}/models/search/current.json", TLS, ALLOW),
    ("search-jobs", "s3:PutObject", "{cache}/neuron/search/neuronxcc-2.24/MODULE_1/model.neff", TLS, ALLOW),
    ("search-jobs", "s3:ListBucket", "{artifacts}", TLS | {"s3:prefix": "runs/search/catalog-v1/"}, ALLOW),
    ("search-jobs", "s3:GetObject", "{data}/incoming/ads/catalog/v1/pairs/part-0.parquet", TLS, DENY),
    ("search-jobs", "s3:PutObject", "{artifacts}/runs/ads/catalog-v1/validation/gate.json", TLS, DENY),
    ("search-jobs", "s3:GetObject", "{artifacts}/runs/ads/catalog-v1/validation/gate.json", TLS, DENY),
    ("search-jobs", "s3:PutObject", "{artifacts}/models/search/current.json", TLS, DENY),
    ("search-jobs", "s3:GetObject", "{cache}/neuron/ads/neuronxcc-2.24/MODULE_1/model.neff", TLS, DENY),
    ("search-jobs", "s3:ListBucket", "{artifacts}", TLS | {"s3:prefix": "runs/ads/"}, DENY),
    # -- a team's pipeline: its job definitions, its tags, its jobs, its pointer
    ("search-pipeline", "batch:SubmitJob", "{jobdef:search}", {}, ALLOW),
    ("search-pipeline", "batch:SubmitJob", "{queue}", {}, ALLOW),
    ("search-pipeline", "batch:TagResource", "{job}", submit_tags("search"), ALLOW),
    ("search-pipeline", "batch:TerminateJob", "{job}", tags("Resource", "search"), ALLOW),
    ("search-pipeline", "s3:PutObject", "{artifacts}/models/search/current.json", TLS, ALLOW),
    ("search-pipeline", "batch:SubmitJob", "{jobdef:ads}", {}, DENY),
    ("search-pipeline", "batch:TagResource", "{job}", submit_tags("ads"), DENY),
    ("search-pipeline", "batch:TerminateJob", "{job}", tags("Resource", "ads"), DENY),
    ("search-pipeline", "s3:PutObject", "{artifacts}/models/ads/current.json", TLS, DENY),
]


@pytest.fixture(scope="module")
def stage(teams_templates) -> Stage:
    return Stage(teams_templates, account=TEST_ACCOUNT, region="us-east-1")


def resource(stage: Stage, pattern: str) -> str:
    buckets = {name: f"arn:aws:s3:::{stage.physical(STORAGE, stage.logical_id(STORAGE, prefix, 'AWS::S3::Bucket'))}"
               for name, prefix in (("data", "DataBucket"), ("artifacts", "ArtifactsBucket"), ("cache", "CacheBucket"))}
    values = dict(buckets, job=f"arn:aws:batch:us-east-1:{TEST_ACCOUNT}:job/0b1c2d3e-5f60-4a7b-8c9d-0e1f2a3b4c5d",
                  queue=stage.physical(COMPUTE, stage.logical_id(COMPUTE, "ComputeTrainingQueue", "AWS::Batch::JobQueue")))
    for team in ("search", "ads"):
        machine = stage.logical_id(PIPELINE, f"{team.capitalize()}TrainingPipelineStateMachine",
                                   "AWS::StepFunctions::StateMachine")
        values[f"sm:{team}"] = stage.physical(PIPELINE, machine)
        values[f"exec:{team}"] = f"arn:aws:states:us-east-1:{TEST_ACCOUNT}:execution:{machine}:catalog-v1"
        group = stage.logical_id(COMPUTE, f"{team.capitalize()}JobsJobLogs", "AWS::Logs::LogGroup")
        values[f"logs:{team}"] = f"arn:aws:logs:us-east-1:{TEST_ACCOUNT}:log-group:{group}:log-stream:step/default/x"
        values[f"jobdef:{team}"] = f"arn:aws:batch:us-east-1:{TEST_ACCOUNT}:job-definition/TrnEmbed-dev-{team}-train:3"
    values["stack:TrnEmbed-dev-Pipeline"] = f"arn:aws:cloudformation:us-east-1:{TEST_ACCOUNT}:stack/TrnEmbed-dev-Pipeline/1"
    return re.sub(r"\{([^}]+)\}", lambda match: values[match.group(1)], pattern)


@pytest.mark.parametrize("role, action, pattern, context, expected", CASES,
                         ids=[f"{c[0]} {'allows' if c[4] == ALLOW else 'denies'} {c[1]} {c[2]}"
                              + (f" {dict((k, v) for k, v in c[3].items() if k != 'aws:SecureTransport')}"
                                 if set(c[3]) - {"aws:SecureTransport"} else "") for c in CASES])
def test_each_role_may_do_what_its_team_may_and_nothing_of_another_team(stage, role, action, pattern, context,
                                                                         expected):
    stack, prefix = ROLES[role]
    logical_id = stage.logical_id(stack, prefix, "AWS::IAM::Role")
    request = Request(action, resource(stage, pattern), context)
    bucket = request.resource.split("/", 1)[0] if action.startswith("s3:") else None
    decision = decide(stage.identity_statements(stack, logical_id), request,
                      principal_arn=stage.physical(stack, logical_id, "Arn"),
                      resource_policy=stage.bucket_policy_statements(bucket) if bucket else ())
    assert decision == expected, f"{role}: {request} -> {decision}"


@pytest.mark.parametrize("principal, role, allowed", [
    (TEAM_ROLES["search"], "search-role", True), (TEAM_ROLES["search"], "ads-role", False),
    (TEAM_ROLES["search"], "admin-role", False), (TEAM_ROLES["ads"], "ads-role", True),
    (ADMIN_ROLE, "admin-role", True), (ADMIN_ROLE, "search-role", False)])
def test_only_a_teams_principals_assume_its_role(stage, principal, role, allowed):
    stack, prefix = ROLES[role]
    assert may_assume(stage.trust_statements(stack, stage.logical_id(stack, prefix, "AWS::IAM::Role")),
                      principal) is allowed


def test_the_bucket_policy_still_refuses_plain_http_to_a_team(stage):
    # The evaluator applies resource-policy Denies: the same read as above, without TLS, is refused.
    stack, prefix = ROLES["search-role"]
    logical_id = stage.logical_id(stack, prefix, "AWS::IAM::Role")
    request = Request("s3:GetObject", resource(stage, "{artifacts}/models/search/current.json"),
                      {"aws:SecureTransport": "false"})
    bucket = request.resource.split("/", 1)[0]
    assert decide(stage.identity_statements(stack, logical_id), request, principal_arn="x",
                  resource_policy=stage.bucket_policy_statements(bucket)) == "ExplicitDeny"


# ---- the evaluator itself ----------------------------------------------------------------------
@pytest.mark.parametrize("statement, request_, applies", [
    ({"Action": "s3:Get*", "Resource": "arn:aws:s3:::b/runs/a/*"}, Request("S3:GetObject", "arn:aws:s3:::b/runs/a/x"), True),
    ({"Action": "s3:Get*", "Resource": "arn:aws:s3:::b/runs/a/*"}, Request("s3:GetObject", "arn:aws:s3:::b/runs/ab/x"), False),
    ({"NotAction": "s3:*", "Resource": "*"}, Request("s3:GetObject", "x"), False),
    ({"Action": "*", "Resource": "arn:aws:s3:::b/?"}, Request("s3:GetObject", "arn:aws:s3:::b/xy"), False),
    ({"Action": "s3:ListBucket", "Resource": "*", "Condition": {"StringLike": {"s3:prefix": ["runs/a/*", "m/*"]}}},
     Request("s3:ListBucket", "b", {"s3:prefix": "m/x"}), True),
    ({"Action": "s3:ListBucket", "Resource": "*", "Condition": {"StringLike": {"s3:prefix": ["runs/a/*"]}}},
     Request("s3:ListBucket", "b"), False),  # the key absent: not matched
    ({"Action": "b:T", "Resource": "*", "Condition": {"StringEquals": {"aws:ResourceTag/t": "a", "aws:ResourceTag/p": "p"}}},
     Request("b:T", "j", {"aws:ResourceTag/t": "a"}), False),  # every key must match
    ({"Action": "b:T", "Resource": "*", "Condition": {"ForAllValues:StringEquals": {"aws:TagKeys": ["p", "t"]}}},
     Request("b:T", "j", {"aws:TagKeys": ["p", "x"]}), False),
    ({"Action": "b:T", "Resource": "*", "Condition": {"Null": {"aws:ResourceTag/t": "true"}}}, Request("b:T", "j"), True),
])
def test_the_evaluator_matches_statements_as_iam_does(statement, request_, applies):
    assert statement_applies(statement, request_) is applies


def test_the_evaluator_lets_an_explicit_deny_win():
    allow = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
    deny = {"Effect": "Deny", "Principal": "*", "Action": "s3:*", "Resource": "*",
            "Condition": {"Bool": {"aws:SecureTransport": "false"}}}
    request = Request("s3:GetObject", "arn:aws:s3:::b/k", {"aws:SecureTransport": "false"})
    assert decide([allow], request, resource_policy=[deny]) == "ExplicitDeny"
    assert decide([], Request("s3:GetObject", "k")) == "ImplicitDeny"
