"""One deployment stage = the set of stacks built from one StageConfig."""

from __future__ import annotations

from aws_cdk import Duration, Environment, Stack, Tags
from constructs import Construct

from stacks.compute_stack import ComputeStack
from stacks.config import StageConfig
from stacks.network_stack import NetworkStack
from stacks.pipeline_stack import PipelineStack
from stacks.storage_stack import StorageStack


def build_stage(scope: Construct, cfg: StageConfig, *, image_uri: str | None = None,
                diagnosis_asset_hash: str | None = None) -> dict[str, Stack]:
    """Create the stage's stacks under `scope` and return them by role: "network", "storage",
    "compute", "pipeline". `image_uri` (a registry image) replaces the training image asset and
    `diagnosis_asset_hash` fixes the failure classifier code's asset hash (tests).
    Raises ValueError (with the fix-it) when the stage's AMI policy cannot be met, e.g. prod
    without a pinned Neuron AMI for its region."""
    env = Environment(account=cfg.account, region=cfg.region)
    prefix = f"{cfg.project}-{cfg.name}"
    network = NetworkStack(scope, f"{prefix}-Network", config=cfg, env=env,
                           description=f"{prefix}: VPC, training subnet, EFA/FSx security groups, endpoints")
    storage = StorageStack(scope, f"{prefix}-Storage", config=cfg, network=network, env=env,
                           description=f"{prefix}: KMS key, S3 buckets, FSx for Lustre (stateful, termination-protected)")
    compute = ComputeStack(scope, f"{prefix}-Compute", config=cfg, network=network, storage=storage, image_uri=image_uri,
                           env=env, description=f"{prefix}: AWS Batch on Trainium, job definitions, training image")
    stacks: dict[str, Stack] = {"network": network, "storage": storage, "compute": compute}
    stacks["pipeline"] = PipelineStack(
        scope, f"{prefix}-Pipeline", config=cfg.pipeline, stage=cfg.name, data_bucket=storage.data_bucket,
        artifacts_bucket=storage.artifacts_bucket, queues=compute.queues, teams=compute.teams,
        canary_job_definition=compute.canary, admin_principals=cfg.admin_principals,
        storage_stack_name=storage.stack_name, diagnosis_asset_hash=diagnosis_asset_hash,
        instance_types={"training": cfg.compute.training_instance_type,
                        "single-node": cfg.compute.single_node_instance_type},
        max_nodes=cfg.compute.max_nodes, queue_wait=Duration.minutes(cfg.compute.runnable_timeout_minutes),
        mlflow_tracking_server_arn=compute.mlflow.tracking_server_arn if compute.mlflow else None,
        slack=cfg.slack,
        env=env, description=f"{prefix}: training pipeline state machine, new-data trigger, canary, alarms, dashboard")
    for stack in stacks.values():
        Tags.of(stack).add("project", cfg.project)
        for key, value in cfg.tags.items():
            Tags.of(stack).add(key, value)
    return stacks
