"""Who may do what in a stage with teams: one role per team, assumed by the team's principals, and
the platform's admin role. docs/operations.md ("Teams") lists each permission and the test that
evaluates it (tests/infra/test_team_access.py).

A team's role may upload to its incoming prefix (the _SUCCESS marker starts its run), start, watch
and stop its own pipeline's executions, read its runs, logs and published model, delete its runs
(which frees its FSx quota: the runs association imports deletions), and terminate or cancel the
Batch jobs tagged with its team; nothing of another team. The admin role does the same for every
team. Nobody but the pipeline's Publish state writes a model pointer, and nobody submits jobs.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from pipeline_steps.contract import INCOMING_PREFIX, MODELS_PREFIX, RUNS_PREFIX
from stacks.constructs.job_ownership import JobOwnership
from stacks.constructs.prefix_access import grant_prefixes
from stacks.team_config import TeamConfig

# No resource-level permissions (Service Authorization Reference: Batch, CloudWatch, Price List).
_UNSCOPED_READS = ("batch:DescribeJobs", "batch:ListJobs", "cloudwatch:GetMetricData", "pricing:GetProducts")


def operate(role: iam.Role, *, state_machines: Sequence[sfn.IStateMachine], log_groups: Sequence[logs.ILogGroup],
            ownership: JobOwnership, stack_names: Sequence[str]) -> None:
    """What `trainium-runs` does, on these pipelines only: read the stage's stack outputs; start,
    list, describe and stop executions; read the jobs' logs; stop the jobs `ownership` names."""
    stack = Stack.of(role)
    role.add_to_policy(iam.PolicyStatement(actions=["cloudformation:DescribeStacks"], resources=[
        stack.format_arn(service="cloudformation", resource="stack", resource_name=f"{name}/*") for name in stack_names]))
    machines = [machine.state_machine_arn for machine in state_machines]
    role.add_to_policy(iam.PolicyStatement(
        actions=["states:StartExecution", "states:ListExecutions", "states:DescribeStateMachine"], resources=machines))
    # Execution ARNs are the state machine's name and the execution's
    # (https://docs.aws.amazon.com/service-authorization/latest/reference/list_awsstepfunctions.html).
    role.add_to_policy(iam.PolicyStatement(
        actions=["states:DescribeExecution", "states:GetExecutionHistory", "states:StopExecution"],
        resources=[stack.format_arn(service="states", resource="execution", arn_format=ArnFormat.COLON_RESOURCE_NAME,
                                    resource_name=f"{machine.state_machine_name}:*") for machine in state_machines]))
    role.add_to_policy(ownership.act_on_jobs("batch:TerminateJob", "batch:CancelJob"))
    role.add_to_policy(iam.PolicyStatement(actions=list(_UNSCOPED_READS), resources=["*"]))
    for log_group in log_groups:
        log_group.grant(role, "logs:GetLogEvents", "logs:FilterLogEvents")


def team_role(scope: Construct, construct_id: str, *, team: TeamConfig, state_machine: sfn.IStateMachine,
              data_bucket: s3.IBucket, artifacts_bucket: s3.IBucket, log_group: logs.ILogGroup,
              ownership: JobOwnership, stack_names: Sequence[str]) -> iam.Role:
    """The role `team`'s principals assume."""
    paths = team.paths
    role = iam.Role(scope, construct_id, assumed_by=iam.CompositePrincipal(*map(iam.ArnPrincipal, team.principals)),
                    description=f"Team {team.name}: its uploads, runs, jobs and published model, no other team's")
    operate(role, state_machines=[state_machine], log_groups=[log_group], ownership=ownership, stack_names=stack_names)
    grant_prefixes(role, data_bucket, write=[paths.incoming_prefix])
    grant_prefixes(role, artifacts_bucket, read=[paths.runs_prefix, paths.models_prefix], delete=[paths.runs_prefix])
    return role


def admin_role(scope: Construct, construct_id: str, *, principals: Sequence[str],
               state_machines: Sequence[sfn.IStateMachine], data_bucket: s3.IBucket, artifacts_bucket: s3.IBucket,
               log_groups: Sequence[logs.ILogGroup], ownership: JobOwnership, stack_names: Sequence[str]) -> iam.Role:
    """The platform team's role: every team's pipeline, jobs, uploads, runs and models. Assumed by
    `principals`, or, when there are none, by whoever the account's IAM policies allow (the role
    trusts the account)."""
    trust = iam.CompositePrincipal(*map(iam.ArnPrincipal, principals)) if principals else iam.AccountRootPrincipal()
    role = iam.Role(scope, construct_id, assumed_by=trust,
                    description="Platform admin: every team's runs, jobs, uploads and models")
    operate(role, state_machines=state_machines, log_groups=log_groups, ownership=ownership, stack_names=stack_names)
    grant_prefixes(role, data_bucket, write=[INCOMING_PREFIX])
    grant_prefixes(role, artifacts_bucket, read=[RUNS_PREFIX, MODELS_PREFIX], delete=[RUNS_PREFIX])
    return role
