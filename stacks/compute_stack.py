"""Compute stack: Batch compute environments, queues, job definitions, the training image and,
when the stage enables it, the SageMaker managed MLflow tracking server the jobs log to (here,
beside the job role it grants, so no stack depends back on this one).
Wiring only; the decisions live in stacks/constructs/trainium_compute.py, job_definitions.py and
mlflow_tracking.py."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from aws_cdk import CfnOutput, Duration, Stack
from aws_cdk import aws_ecs as ecs
from constructs import Construct

from pipeline_steps.contract import (
    CANARY_JOB, COMPILE_CACHE_BASE_ENV, PIPELINE_STEPS, RDZV_TIMEOUT_ENV, RUNS_PREFIX, STAGE_ENV, TEAM_ENV,
)
from stacks.config import StageConfig
from stacks.constructs.efa_launch_template import ProjectQuota
from stacks.constructs.job_definitions import JobDefinitions, TeamJobs
from stacks.constructs.log_encryption import log_encryption_key
from stacks.constructs.mlflow_tracking import MlflowTracking
from stacks.constructs.prefix_access import grant_prefixes
from stacks.constructs.retention import retention_days
from stacks.constructs.secure_bucket import acknowledge_bucket_grants
from stacks.constructs.trainium_compute import TrainiumCompute
from stacks.constructs.training_image import training_image_asset
from stacks.network_stack import NetworkStack
from stacks.storage_stack import StorageStack
from stacks.team_config import TeamConfig

# The Neuron compile cache's prefix in the cache bucket (NEURON_COMPILE_CACHE_URL_BASE); a team's
# is <prefix>/<team>.
COMPILE_CACHE_PREFIX = "neuron"
PIPELINE_STEP_NAMES = frozenset(step.name for step in PIPELINE_STEPS)


class ComputeStack(Stack):
    """Public attributes: queues (dict: "training", "single-node"; fair share decides between the
    teams' share identifiers, or without teams production and experiments, inside each queue),
    job_definitions (dict: "sanity", "compile", "train", "prepare", "prepare-shards", "prepare-finish",
    "validate", "embed", "export", "canary"; with teams, "canary" only), job_definition_refs (the same
    keys: what other stacks may use, by name), canary (its JobDefinitionRef), teams (a TeamJobs per
    team, or one for the default team: its job definition refs and log group), team_jobs (team name
    -> its JobDefinitions construct, with its job_role),
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
            shares=config.fair_shares,
            compute_reservation=config.compute_reservation,
            quotas=[ProjectQuota(t.project_id, t.fsx_quota_kib, t.paths.fsx_runs) for t in config.teams],
        )
        # Which AMI a deploy actually used (the resolved SSM value when unpinned).
        CfnOutput(self, "NeuronAmiId", value=self.compute.machine_image.get_image(self).image_id,
                  description="Neuron ECS AMI of the compute environments")
        self.queues = self.compute.queues
        self.compute_environments = self.compute.compute_environments
        self.share_identifiers = self.compute.share_identifiers
        self._jobs(config, storage)

    def _jobs(self, config: StageConfig, storage: StorageStack) -> None:
        """Without teams, "Jobs" holds every job definition (the default team's and the canary); with
        teams it holds the canary, and each team has its own job definitions, role and log group."""
        self._log_key = log_encryption_key(self, "LogsKey", description=f"{config.project}-{config.name}: Batch job logs")
        self.jobs = self._job_definitions(config, storage, None, steps={CANARY_JOB} if config.teams else None)
        self.team_jobs = {team.name: self._job_definitions(config, storage, team, steps=PIPELINE_STEP_NAMES)
                          for team in config.teams}
        self.job_definitions = self.jobs.job_definitions
        self.job_definition_refs = self.jobs.refs
        self.job_role = self.jobs.job_role
        self.job_log_group = self.jobs.log_group
        self.canary = self.jobs.refs[CANARY_JOB]
        self.teams = [TeamJobs(t, self.team_jobs[t.name].refs, self.team_jobs[t.name].log_group)
                      for t in config.teams] or [TeamJobs(None, self.jobs.refs, self.jobs.log_group)]
        for team in config.teams:
            self._grant_team(team, self.team_jobs[team.name], storage)
        if not config.teams:
            # Least privilege through grants (KMS decrypt/encrypt on the key comes with them). Steps
            # write only below runs/ (validate's gate report, export's upload); models/current.json is
            # written by the pipeline's Publish state alone.
            self.jobs.grant_bucket_access(
                read=[(storage.data_bucket, "*"), (storage.artifacts_bucket, "*")],
                read_write=[(storage.artifacts_bucket, f"{RUNS_PREFIX}*"),
                            (storage.cache_bucket, f"{COMPILE_CACHE_PREFIX}/*")])
        if self.mlflow is not None:
            for jobs in (self.jobs, *self.team_jobs.values()):
                self.mlflow.grant_access(jobs.job_role)

    def _grant_team(self, team: TeamConfig, jobs: JobDefinitions, storage: StorageStack) -> None:
        """A team's jobs read its uploads, read and write its runs and compile cache, read its
        published pointer; nothing of another team (stacks/constructs/prefix_access.py)."""
        paths = team.paths
        grant_prefixes(jobs.job_role, storage.data_bucket, read=[paths.incoming_prefix])
        grant_prefixes(jobs.job_role, storage.artifacts_bucket, read=[paths.models_prefix],
                       write=[paths.runs_prefix], delete=[paths.runs_prefix])
        grant_prefixes(jobs.job_role, storage.cache_bucket, write=[f"{COMPILE_CACHE_PREFIX}/{team.name}/"])
        acknowledge_bucket_grants(
            jobs.job_role,
            reason=f"Team {team.name}'s job role: objects below the team's own prefixes only (incoming/{team.name}/, "
            f"runs/{team.name}/, models/{team.name}/, neuron/{team.name}/; step outputs have arbitrary keys), listing "
            "conditioned on the same prefixes; kms:GenerateDataKey*/ReEncrypt* come from the key grants.",
            objects_regex=r"/^Resource::(<|.*ExportsOutputFnGetAtt)(Data|Artifacts|Cache)Bucket[0-9A-F]+"
            r"(\.Arn>|Arn[0-9A-F]+)\/(incoming|runs|models|neuron)\/[a-z0-9]+\/\*$/g")

    def _training_image(self, config: StageConfig, image_uri: str | None) -> tuple[ecs.ContainerImage, str]:
        # Tests inject a registry image so snapshots don't churn with the asset hash (which
        # includes the GIT_COMMIT build arg).
        if image_uri is None:
            asset = training_image_asset(self, "TrainingImage", git_commit=config.git_commit)
            return ecs.ContainerImage.from_docker_image_asset(asset), asset.image_uri
        return ecs.ContainerImage.from_registry(image_uri), image_uri

    def _job_definitions(self, config: StageConfig, storage: StorageStack, team: TeamConfig | None, *,
                         steps: Collection[str] | None) -> JobDefinitions:
        cfg = config.compute
        name = f"{config.project}-{config.name}" + (f"-{team.name}" if team else "")
        cache = COMPILE_CACHE_PREFIX + (f"/{team.name}" if team else "")
        # What pipeline_steps/tracking.py reads; INSTANCE_TYPE is set per job definition. A team's
        # runs go to the team's own experiment, tagged with the team.
        tracking_env = {"MLFLOW_EXPERIMENT_NAME": name, "TRAINING_IMAGE_URI": self.image_uri}
        if self.mlflow_tracking_uri is not None:
            tracking_env["MLFLOW_TRACKING_URI"] = self.mlflow_tracking_uri
        if team is not None:
            tracking_env[TEAM_ENV] = team.name
        return JobDefinitions(
            self,
            f"{team.construct_name}Jobs" if team else "Jobs",
            name_prefix=name,
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
                COMPILE_CACHE_BASE_ENV: storage.cache_bucket.s3_url_for_object(cache),
                # torchrun's rendezvous waits as long as a child node may take to start
                # (training_image/entrypoint.sh); the same startup budget as the state timeouts.
                RDZV_TIMEOUT_ENV: str(config.pipeline.startup_minutes * 60),
                **tracking_env,
            },
            log_retention=retention_days(cfg.log_retention_days),
            log_key=self._log_key,
            steps=steps,
        )
