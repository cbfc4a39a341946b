"""Stand-in dependencies for the pipeline stack tests: a stack with the buckets, key, fair-share
queues and job definitions the real storage/compute stacks provide (same attribute names), so the
pipeline tests stay fast and independent of the Trainium compute details."""

from __future__ import annotations

from aws_cdk import App, Environment, Size, Stack
from aws_cdk import aws_batch as batch
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from aws_cdk.assertions import Template

from stacks.pipeline_config import PipelineConfig
from stacks.pipeline_stack import PipelineStack

ENV = Environment(account="123456789012", region="us-east-1")
IMAGE = "public.ecr.aws/neuron/pytorch-training-neuronx:2.9.0-neuronx-py312-sdk2.30.0-ubuntu24.04"
JOB_DEFINITIONS = ("prepare", "sanity", "compile", "train", "validate", "embed", "canary")


class StandInDependencies(Stack):
    """key, data_bucket, artifacts_bucket, queues (fair share), job_definitions."""

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
                       for name in ("production", "experiments", "single-node")}
        image = ecs.ContainerImage.from_registry(IMAGE)
        self.job_definitions = {
            name: batch.EcsJobDefinition(self, f"Job-{name}", container=batch.EcsEc2ContainerDefinition(
                self, f"Container-{name}", image=image, cpu=1, memory=Size.gibibytes(2)))
            for name in JOB_DEFINITIONS}


def build(config: PipelineConfig | None = None) -> tuple[PipelineStack, StandInDependencies]:
    app = App()
    deps = StandInDependencies(app, "Deps")
    stack = PipelineStack(app, "Pipeline", config=config or PipelineConfig(), stage="dev",
                          data_bucket=deps.data_bucket, artifacts_bucket=deps.artifacts_bucket,
                          queues=deps.queues, job_definitions=deps.job_definitions, env=ENV)
    return stack, deps


def template(config: PipelineConfig | None = None) -> Template:
    return Template.from_stack(build(config)[0])
