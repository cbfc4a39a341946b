"""Stand-in dependencies for the pipeline stack tests: a stack with the buckets, key, fair-share
queues and job definitions the real storage/compute stacks provide (same attribute names), so the
pipeline tests stay fast and independent of the Trainium compute details."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace

from aws_cdk import App, Duration, Environment, Stack
from aws_cdk import aws_batch as batch
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk.assertions import Template

from infra_synth import TEST_DIAGNOSIS_ASSET_HASH
from stacks.constructs.job_definitions import JobDefinitionRef, TeamJobs
from stacks.pipeline_config import PipelineConfig
from stacks.pipeline_stack import PipelineStack
from stacks.team_config import TeamConfig

ENV = Environment(account="123456789012", region="us-east-1")
JOB_DEFINITIONS = ("prepare", "prepare-shards", "prepare-finish", "sanity", "compile", "train", "validate", "embed",
                   "export", "canary")
# Attempt timeouts like the compute stack's defaults (train 72 h, compile 12 h, the rest 4 h).
ATTEMPT_HOURS = {"train": 72, "compile": 12}
MAX_NODES = 4
QUEUE_WAIT = Duration.minutes(240)


class StandInDependencies(Stack):
    """key, data_bucket, artifacts_bucket, queues (fair share), job_definitions (by name), job_log_group."""

    def __init__(self, scope, construct_id: str) -> None:
        super().__init__(scope, construct_id, env=ENV)
        self.key = kms.Key(self, "Key", enable_key_rotation=True)
        self.data_bucket = s3.Bucket(self, "Data", encryption_key=self.key, event_bridge_enabled=True)
        self.artifacts_bucket = s3.Bucket(self, "Artifacts", encryption_key=self.key)
        policy = batch.FairshareSchedulingPolicy(self, "Policy", shares=[
            batch.Share(share_identifier="production", weight_factor=1),
            batch.Share(share_identifier="experiments", weight_factor=3)])
        ce = batch.UnmanagedComputeEnvironment(self, "Ce", unmanagedv_cpus=4)
        self.queues = {name: batch.JobQueue(self, f"Queue-{name}", scheduling_policy=policy,
                                            compute_environments=[batch.OrderedComputeEnvironment(
                                                compute_environment=ce, order=1)])
                       for name in ("training", "single-node")}
        # The pipeline refers to job definitions by name (the compute stack's are <stage prefix>-<step>).
        self.job_definitions = {name: JobDefinitionRef(name=name, timeout=Duration.hours(ATTEMPT_HOURS.get(name, 4)),
                                                       retry_attempts=3)
                                for name in JOB_DEFINITIONS}
        self.job_log_group = logs.LogGroup(self, "JobLogs", encryption_key=self.key)


# A team whose pipeline the teams tests add beside the default one (its job definitions: <team>-<step>).
TEAM = TeamConfig(name="search", fsx_quota_gib=100, principals=(f"arn:aws:iam::{ENV.account}:role/search",))


def build(config: PipelineConfig | None = None, team: TeamConfig | None = None
          ) -> tuple[PipelineStack, StandInDependencies]:
    """The pipeline stack on the stand-in dependencies: the default team's pipeline, or `team`'s."""
    app = App()
    deps = StandInDependencies(app, "Deps")
    refs = {step: replace(ref, name=f"{team.name}-{step}") for step, ref in deps.job_definitions.items()} \
        if team else deps.job_definitions
    stack = PipelineStack(app, "Pipeline", config=config or PipelineConfig(), stage="dev",
                          data_bucket=deps.data_bucket, artifacts_bucket=deps.artifacts_bucket, queues=deps.queues,
                          teams=[TeamJobs(team, refs, deps.job_log_group)],
                          canary_job_definition=deps.job_definitions["canary"],
                          instance_types={"training": "trn1.32xlarge", "single-node": "trn1.2xlarge"},
                          max_nodes=MAX_NODES, queue_wait=QUEUE_WAIT, diagnosis_asset_hash=TEST_DIAGNOSIS_ASSET_HASH,
                          env=ENV)
    return stack, deps


def template(config: PipelineConfig | None = None) -> Template:
    return Template.from_stack(build(config)[0])


# ---- synthesized once per test session (a synth costs ~30 s of jsii start-up and CDK work) ------
# Short retry intervals and watchdog bounds so the moto executions that exercise retries and the
# watchdog's polls stay fast; the template assertions check the same values come from the config.
TEST_CONFIG = PipelineConfig(retry_interval_seconds=1, retry_max_delay_seconds=2, retry_max_attempts=3,
                             startup_minutes=5, stall_timeout_minutes=5, first_heartbeat_minutes=16)


@functools.lru_cache(maxsize=2)
def synthesized(team: TeamConfig | None = None) -> "Synthesized":
    """The stand-in stage's pipeline (the default team's, or `team`'s), synthesized once."""
    stack, deps = build(TEST_CONFIG, team)
    return Synthesized(stack=stack, deps=deps, template=Template.from_stack(stack),
                       deps_template=Template.from_stack(deps).to_json())


@dataclass
class Synthesized:
    stack: PipelineStack
    deps: StandInDependencies
    template: Template
    deps_template: dict

    def logical_id(self, construct) -> str:
        child = getattr(construct.node, "default_child", None) or construct
        return Stack.of(construct).get_logical_id(child)

    def state_machine(self, construct_path_fragment: str) -> tuple[str, dict]:
        """(logical id, DefinitionString Fn::Join parts) of the state machine whose id contains the fragment."""
        for logical_id, res in self.template.find_resources("AWS::StepFunctions::StateMachine").items():
            if logical_id.startswith(construct_path_fragment):
                return logical_id, res["Properties"]["DefinitionString"]
        raise KeyError(construct_path_fragment)

    def definition(self, fragment: str, values: dict[str, str]) -> dict:
        """The ASL with every Ref/GetAtt/ImportValue replaced by `values` (keyed by logical id or
        "<logical id>.<attribute>") or a pseudo parameter. Unresolved references raise KeyError."""
        _, definition = self.state_machine(fragment)
        exports = {out["Export"]["Name"]: out["Value"]
                   for out in self.deps_template.get("Outputs", {}).values() if "Export" in out}
        pseudo = {"AWS::Region": ENV.region, "AWS::AccountId": ENV.account, "AWS::Partition": "aws",
                  "AWS::URLSuffix": "amazonaws.com"}

        def resolve(token) -> str:
            if isinstance(token, str):
                return token
            if "Ref" in token:
                return pseudo.get(token["Ref"]) or values[token["Ref"]]
            if "Fn::GetAtt" in token:
                logical_id, attribute = token["Fn::GetAtt"]
                return values[f"{logical_id}.{attribute}"]
            if "Fn::ImportValue" in token:
                return resolve(exports[token["Fn::ImportValue"]])
            if "Fn::Join" in token:
                sep, parts = token["Fn::Join"]
                return sep.join(resolve(p) for p in parts)
            raise KeyError(f"unsupported token {token}")

        return json.loads(resolve(definition))
