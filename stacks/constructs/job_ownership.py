"""Which Batch jobs belong to this pipeline: the tags every submission carries (state machine and
canary), IAM statements that act only on jobs carrying them, and the same test as a Choice rule.

Jobs are tagged on creation, or not created (https://docs.aws.amazon.com/batch/latest/userguide/tag-resources.html);
a SubmitJob with tags is also authorized as batch:TagResource, and TerminateJob/CancelJob on the
job's tags, aws:ResourceTag (https://docs.aws.amazon.com/service-authorization/latest/reference/list_awsbatch.html).
A team's jobs also carry `team=<name>` (JobOwnership.of(stack, team)): its pipeline tags and stops
only those, and so may its people (stacks/constructs/team_access.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from aws_cdk import Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_stepfunctions as sfn

PIPELINE_TAG = "pipeline"
TEAM_TAG = "team"


@dataclass(frozen=True)
class JobOwnership:
    """`tags`: tag key -> value every job of this pipeline carries (keys plain words: they are
    JSONPath names in `owns`)."""

    stack: Stack
    tags: Mapping[str, str]

    @classmethod
    def of(cls, stack: Stack, team: str | None = None) -> "JobOwnership":
        """The pipeline's jobs, or with `team` that team's jobs only (jobs carry both tags)."""
        return cls(stack=stack, tags={PIPELINE_TAG: stack.stack_name, **({TEAM_TAG: team} if team else {})})

    def _jobs(self) -> str:
        # Job ids exist only at run time; the tag conditions are what scope the statement.
        return self.stack.format_arn(service="batch", resource="job", resource_name="*")

    def act_on_jobs(self, *actions: str) -> iam.PolicyStatement:
        """`actions` (batch:TerminateJob, batch:CancelJob) on this pipeline's jobs only."""
        return iam.PolicyStatement(actions=list(actions), resources=[self._jobs()], conditions={
            "StringEquals": {f"aws:ResourceTag/{key}": value for key, value in self.tags.items()}})

    def tag_on_submit(self) -> iam.PolicyStatement:
        """batch:TagResource for SubmitJob with exactly these tags (tag-on-create authorization)."""
        return iam.PolicyStatement(actions=["batch:TagResource"], resources=[self._jobs()], conditions={
            "StringEquals": {f"aws:RequestTag/{key}": value for key, value in self.tags.items()},
            "ForAllValues:StringEquals": {"aws:TagKeys": sorted(self.tags)}})

    def owns(self, record_path: str) -> sfn.Condition:
        """A DescribeJobs record at `record_path` (SDK integration: `Tags`) is one of this pipeline's
        jobs. IsPresent first: comparing a missing path (an untagged job) is a runtime error."""
        return sfn.Condition.and_(*(condition for key, value in self.tags.items() for condition in (
            sfn.Condition.is_present(f"{record_path}.Tags.{key}"),
            sfn.Condition.string_equals(f"{record_path}.Tags.{key}", value))))
