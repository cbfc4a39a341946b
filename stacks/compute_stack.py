"""Compute stack: Batch compute environments, queues, job definitions, the training image and,
when the stage enables it, the SageMaker managed MLflow tracking server the jobs log to (here,
beside the job role it grants, so no stack depends back on this one).
Wiring only; the decisions live in stacks/constructs/trainium_compute.py, job_definitions.py and
mlflow_tracking.py."""

from __future__ import annotations

from typing import Any

from aws_cdk import CfnOutput, Duration, Stack
from aws_cdk import aws_ecs as ecs
from constructs import Construct

from pipeline_steps.contract import COMPILE_CACHE_BASE_ENV, RDZV_TIMEOUT_ENV, RUNS_PREFIX, STAGE_ENV
from stacks.config import StageConfig
from stacks.constructs.job_definitions import JobDefinitions
from stacks.constructs.log_encryption import log_encryption_key
from stacks.constructs.mlflow_tracking import MlflowTracking
from stacks.constructs.retention import retention_days
from stacks.constructs.trainium_compute import TrainiumCompute
from stacks.constructs.training_image import training_image_asset
from stacks.network_stack import NetworkStack
from stacks.storage_stack import StorageStack

# The Neuron compile cache's prefix in the cache bucket (NEURON_COMPILE_CACHE_URL_BASE).
COMPILE_CACHE_PREFIX = "neuron"


class ComputeStack(Stack):
    """Public attributes: queues (dict: "training", "single-node"; fair share decides between the
    production and experiments share identifiers inside the training queue),
    job_definitions (dict: "sanity", "compile", "train", "prepare", "prepare-shards", "prepare-finish",
    "validate", "embed", "export", "canary"), job_definition_refs (the same keys: what other stacks
    may use, by name),
    share_identifiers (tuple[str, ...]), compute_environments (dict: "training", "single-node"),
    job_role, job_log_group, image (ecs.ContainerImage), image_uri, compute, jobs (the constructs),
    mlflow (MlflowTracking, or None unless pipeline.mlflow_tracking == "managed"),
    mlflow_tracking_uri (the jobs' MLFLOW_TRACKING_URI, or None)."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: StageConfig,
        network: NetworkStack,
        storage: StorageStack,
        image_uri: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        cfg = config.compute
        self.image, self.image_uri = self._training_image(config, image_uri)
        self.mlflow: MlflowTracking | None = None
        self.mlflow_tracking_uri = config.pipeline.mlflow_tracking
        if config.pipeline.mlflow_managed:
            self.mlflow = MlflowTracking(self, "Mlflow", name=f"{config.project}-{config.name}",
                                         artifacts_bucket=storage.artifacts_bucket,
                                         size=config.pipeline.mlflow_server_size)
            self.mlflow_tracking_uri = self.mlflow.tracking_server_arn
        self.compute = TrainiumCompute(
            self,
            "Compute",
            config=cfg,
            ami=config.neuron_ami,
            region=config.region,
            vpc=network.vpc,
            subnets=network.training_subnets,
            node_security_group=network.efa_security_group,
            placement_group=network.placement_group,
            fsx_dns_name=storage.file_system.dns_name,
            fsx_mount_name=storage.file_system.mount_name,
        )
        self.jobs = self._job_definitions(config, storage)
        # Which AMI a deploy actually used (the resolved SSM value when unpinned).
        CfnOutput(self, "NeuronAmiId", value=self.compute.machine_image.get_image(self).image_id,
                  description="Neuron ECS AMI of the compute environments")
        self.queues = self.compute.queues
        self.compute_environments = self.compute.compute_environments
        self.share_identifiers = self.compute.share_identifiers
        self.job_definitions = self.jobs.job_definitions
        self.job_definition_refs = self.jobs.refs
        self.job_role = self.jobs.job_role
        self.job_log_group = self.jobs.log_group

        # Least privilege through grants (KMS decrypt/encrypt on the key comes with them). Steps write
        # only below runs/ (validate's gate report, export's upload); models/current.json is written
        # by the pipeline's Publish state alone.
        self.jobs.grant_bucket_access(
            read=[(storage.data_bucket, "*"), (storage.artifacts_bucket, "*")],
            read_write=[(storage.artifacts_bucket, f"{RUNS_PREFIX}*"),
                        (storage.cache_bucket, f"{COMPILE_CACHE_PREFIX}/*")])
        if self.mlflow is not None:
            self.mlflow.grant_access(self.job_role)

    def _training_image(self, config: StageConfig, image_uri: str | None) -> tuple[ecs.ContainerImage, str]:
        # Tests inject a registry image so snapshots don't churn with the asset hash (which
        # includes the GIT_COMMIT build arg).
        if image_uri is None:
            asset = training_image_asset(self, "TrainingImage", git_commit=config.git_commit)
            return ecs.ContainerImage.from_docker_image_asset(asset), asset.image_uri
        return ecs.ContainerImage.from_registry(image_uri), image_uri

    def _job_definitions(self, config: StageConfig, storage: StorageStack) -> JobDefinitions:
        cfg = config.compute
        # What pipeline_steps/tracking.py reads; INSTANCE_TYPE is set per job definition.
        tracking_env = {"MLFLOW_EXPERIMENT_NAME": f"{config.project}-{config.name}",
                        "TRAINING_IMAGE_URI": self.image_uri}
        if self.mlflow_tracking_uri is not None:
            tracking_env["MLFLOW_TRACKING_URI"] = self.mlflow_tracking_uri
        return JobDefinitions(
            self,
            "Jobs",
            name_prefix=f"{config.project}-{config.name}",
            image=self.image,
            training=cfg.training,
            single_node=cfg.single_node,
            training_config=config.training,
            default_num_nodes=config.pipeline.default_num_nodes,
            shared_memory_gib=cfg.shared_memory_gib,
            single_node_shared_memory_gib=cfg.single_node_shared_memory_gib,
            retry_attempts=cfg.retry_attempts,
            train_timeout=Duration.hours(cfg.train_attempt_timeout_hours),
            compile_timeout=Duration.hours(cfg.compile_attempt_timeout_hours),
            short_timeout=Duration.hours(cfg.short_attempt_timeout_hours),
            environment={
                STAGE_ENV: config.name,
                COMPILE_CACHE_BASE_ENV: storage.cache_bucket.s3_url_for_object(COMPILE_CACHE_PREFIX),
                # torchrun's rendezvous waits as long as a child node may take to start
                # (training_image/entrypoint.sh); the same startup budget as the state timeouts.
                RDZV_TIMEOUT_ENV: str(config.pipeline.startup_minutes * 60),
                **tracking_env,
            },
            log_retention=retention_days(cfg.log_retention_days),
            log_key=log_encryption_key(self, "LogsKey", description=f"{config.project}-{config.name}: Batch job logs"),
        )
