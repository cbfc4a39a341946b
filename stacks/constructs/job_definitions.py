"""AWS Batch job definitions for the pipeline steps, generated from the instance table and the
stage's TrainingConfig (docs/infrastructure.md): multi-node (sanity, compile, train) on the training
instance type, single-node (prepare, validate, embed as an array job, export, canary) on the small one.
Each command goes to the image entrypoint as `<step> --run-dir /fsx/runs/Ref::run_id ...`. Batch
parameters cannot be optional, so an optional flag defaults to "" and the entrypoint drops it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from aws_cdk import Duration, Size, Stack
from aws_cdk import aws_batch as batch
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from cdk_nag import NagPackSuppression, NagSuppressions
from constructs import Construct

from pipeline_steps.contract import (
    CANARY_JOB, EXPORT_DIR, FSX_CANARY, FSX_MOUNT_POINT, INSTANCE_TYPE_ENV, NPROC_PER_NODE_ENV, RUN_ID_PARAMETER,
    ExitCode, run_path,
)
from stacks.config import InstanceSpec, TrainingConfig
from stacks.constructs.secure_bucket import acknowledge_bucket_grants
from stacks.team_config import TeamConfig

RETRYABLE_EXIT_CODE = int(ExitCode.RETRYABLE)  # the only code Batch retries
RUN_DIR = run_path(f"Ref::{RUN_ID_PARAMETER}")

# EFA / Neuron collectives environment (AWS Neuron multi-node setup docs:
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/frameworks/torch/torch-neuronx/setup-trn1-multi-node-execution.html).
EFA_ENVIRONMENT: Mapping[str, str] = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "CCOM_SOCKET_IFNAME": "eth0",
    "MALLOC_ARENA_MAX": "64",
}


def training_arguments(training: TrainingConfig) -> list[str]:
    """The `train` step's arguments: the one definition both the Compile and the Train job run.
    Compile passes them through unchanged to `neuron_parallel_compile torchrun ... train` (only the
    trial's run dir and step count are appended), so every flag that shapes a graph -- preset
    (model and batch shape), precision, backend -- is the same in both by construction."""
    arguments = ["--run-dir", RUN_DIR, "--preset", training.preset, "--backend", "xla", "--init-from", "Ref::init_from"]
    return arguments + (["--bf16"] if training.bf16 else [])


# How long the Neuron runtime lets one graph execution run before failing it (default 30 s). A
# collective waits inside an execution for its slowest peer: every other rank's rendezvous after a
# checkpoint (an all-gather, torch_xla xla_model.xla_rendezvous) lasts as long as rank 0's write to
# FSx. 600 s as the Neuron training samples set it (aws-neuron-samples torch-neuronx/training/
# dp_bert_hf_pretrain/run_dp_bert_large_hf_pretrain_bf16_s128.sh, zero1_gpt2/run_clm.sh); a longer
# stall is the watchdog's (TrainConfig.stall_timeout_s, 30 min).
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/guides/configuration-guide.html
NEURON_RT_EXEC_TIMEOUT_S = 600


def training_environment(training: TrainingConfig, instance: InstanceSpec) -> dict[str, str]:
    """Environment of the Compile and Train containers that decides compiled graphs and numerics.
    NEURON_CC_FLAGS is hashed into every cache key (a different string = a cache miss) and targets
    the training instance type; stochastic rounding goes with bf16 and is off otherwise
    (TrainingConfig.precision). The cache location, NEURON_COMPILE_CACHE_URL_BASE, is in every job's
    environment (the compute stack's)."""
    return {"NEURON_CC_FLAGS": training.compiler_flags(instance),
            "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1" if training.bf16 else "0",
            "NEURON_RT_EXEC_TIMEOUT": str(NEURON_RT_EXEC_TIMEOUT_S)}


def multi_node_steps(training: TrainingConfig) -> Mapping[str, tuple[list[str], dict[str, str]]]:
    """Step -> (command, parameter defaults). "" = optional flag (dropped by the entrypoint)."""
    arguments = training_arguments(training)
    return {
        "sanity": (["sanity", "--run-dir", RUN_DIR, "--fsx-path", FSX_MOUNT_POINT], {}),
        "compile": (["compile", *arguments], {"init_from": ""}),
        "train": (["train", *arguments, "--max-steps", "Ref::max_steps"], {"init_from": "", "max_steps": ""}),
    }


PREPARE_UPLOAD_TIMEOUT_S = 1800
"""How long prepare waits for FSx for Lustre to import every file of an upload before it exits 75
(retried by Batch): automatic import from S3 is asynchronous, so the `_SUCCESS` event can arrive
before the upload is visible on /fsx
(https://docs.aws.amazon.com/fsx/latest/LustreGuide/autoimport-data-repo-dra.html)."""


def single_node_steps(training: TrainingConfig) -> Mapping[str, tuple[list[str], dict[str, str]]]:
    """Step -> (command, parameter defaults). Prepare tokenizes for the stage's training preset
    (vocabulary, length buckets): the same preset Compile and Train run. It runs as three jobs
    (stacks/constructs/prepare_states.py): the plan reads the flags, the array children and the
    finish read the plan; `shard_count` is the array size, passed like embed's."""
    shard_count = ["--run-dir", RUN_DIR, "--shard-count", "Ref::shard_count"]
    return {
        **SINGLE_NODE_STEPS,
        "prepare": (
            ["prepare", "--phase", "plan", "--run-dir", RUN_DIR, "--data", "Ref::data_uri", "--preset", training.preset,
             "--init-from", "Ref::init_from", "--upload-timeout", str(PREPARE_UPLOAD_TIMEOUT_S)],
            {"init_from": ""},
        ),
        "prepare-shards": (["prepare", "--phase", "shard", *shard_count], {"shard_count": ""}),
        "prepare-finish": (["prepare", "--phase", "finish", *shard_count], {"shard_count": ""}),
    }


SINGLE_NODE_STEPS: Mapping[str, tuple[list[str], dict[str, str]]] = {
    "validate": (
        ["validate", "--run-dir", RUN_DIR, "--previous-metrics", "Ref::previous_metrics",
         "--gate-report-only", "--gate-s3-uri", "Ref::gate_s3_uri"],
        {"previous_metrics": "", "gate_s3_uri": ""},
    ),
    # An array job: the shard index comes from AWS_BATCH_JOB_ARRAY_INDEX (Batch sets it on every
    # child), the count from the `shard_count` parameter: Batch sets no AWS_BATCH_JOB_ARRAY_SIZE and
    # rejects AWS_BATCH* environment overrides, so the state machine passes the array size as a
    # parameter (the same value as ArrayProperties.Size). Default "": the flag is dropped, and an
    # array child without a count fails with exit 78 instead of embedding the wrong slice.
    "embed": (
        ["embed", "--run-dir", RUN_DIR, "--checkpoint", "Ref::checkpoint", "--shard-count", "Ref::shard_count"],
        {"checkpoint": "", "shard_count": ""},
    ),
    # The published model in the sentence-transformers format, uploaded by the step itself to
    # export_s3_uri (files first, the _SUCCESS marker last) because the FSx auto-export to S3 is
    # asynchronous: the pointer written after this job names an export that is complete in S3.
    # --run-dir: the last Batch job of a run that passed the gate closes the run's MLflow run.
    "export": (
        ["export", "--run-dir", RUN_DIR, "--checkpoint", RUN_DIR, "--out", f"{RUN_DIR}/{EXPORT_DIR}",
         "--s3-uri", "Ref::export_s3_uri"],
        {"export_s3_uri": ""},
    ),
    # The canary: node-local sanity on the small instance type, outside the exported /fsx/runs.
    CANARY_JOB: (["sanity", "--run-dir", f"{FSX_CANARY}/Ref::{RUN_ID_PARAMETER}", "--fsx-path", FSX_MOUNT_POINT],
                 {RUN_ID_PARAMETER: "latest"}),
}


@dataclass(frozen=True)
class JobDefinitionRef:
    """What another stack needs of a job definition, with no cross-stack reference: its name and
    its attempt bounds. Every deploy that changes a job definition (a new image, any setting)
    registers a new revision, a new ARN, and CloudFormation refuses to change an export another
    stack imports
    (https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/intrinsic-function-reference-importvalue.html).
    The name is fixed and known at synth, and SubmitJob given a name without a revision runs the
    latest ACTIVE revision (https://docs.aws.amazon.com/batch/latest/APIReference/API_SubmitJob.html)."""

    name: str
    timeout: Duration
    retry_attempts: int

    def arn(self, scope: Construct, revision: str = "*") -> str:
        """The ARN of a revision. SubmitJob is authorised on the ARN of the revision it resolved,
        so a grant by name needs the `:*` wildcard
        (https://docs.aws.amazon.com/batch/latest/userguide/iam-example-restrict-job-submission.html)."""
        return Stack.of(scope).format_arn(service="batch", resource="job-definition",
                                          resource_name=f"{self.name}:{revision}")

    def event_pattern(self, scope: Construct) -> list[dict[str, str]]:
        """EventBridge pattern for `detail.jobDefinition` of Batch job state change events (the ARN
        with the revision): any revision of this job definition."""
        return [{"prefix": self.arn(scope, revision="")}]


@dataclass(frozen=True)
class TeamJobs:
    """One team's pipeline job definitions (team None: the default team of a stage without teams)
    and the log group its jobs write to."""

    team: TeamConfig | None
    refs: Mapping[str, JobDefinitionRef]
    log_group: logs.ILogGroup


def construct_name(step: str) -> str:
    """The construct id prefix of a step's job definition: "prepare-shards" -> "PrepareShards"."""
    return step.title().replace("-", "")


def device_list(spec: InstanceSpec) -> list[batch.Device]:
    """/dev/neuron0..D-1 (read, write) + /dev/infiniband/uverbs0..E-1 (read, write, mknod), with
    containerPath set: one merged list from the instance table."""
    rw = [batch.DevicePermission.READ, batch.DevicePermission.WRITE]
    devices = [
        batch.Device(host_path=f"/dev/neuron{i}", container_path=f"/dev/neuron{i}", permissions=rw)
        for i in range(spec.neuron_devices)
    ]
    devices += [
        batch.Device(
            host_path=f"/dev/infiniband/uverbs{i}",
            container_path=f"/dev/infiniband/uverbs{i}",
            permissions=[*rw, batch.DevicePermission.MKNOD],
        )
        for i in range(spec.efa_interfaces)
    ]
    return devices


def container_memory(spec: InstanceSpec) -> Size:
    """What a job may reserve: the instance memory minus headroom for the OS and ECS agent
    (Batch cannot place a job that asks for the full nominal memory)."""
    return Size.gibibytes(spec.memory_gib - max(4, spec.memory_gib // 16))


# From the instance table, never pasted: NPROC_PER_NODE (torchrun's processes per node) and
# INSTANCE_TYPE (the row `sanity` checks the host against; MLflow records it).
def _node_env(spec: InstanceSpec) -> dict[str, str]:
    return {NPROC_PER_NODE_ENV: str(spec.neuron_cores), INSTANCE_TYPE_ENV: spec.name}


# evaluateOnExit, first match wins
# (https://docs.aws.amazon.com/batch/latest/APIReference/API_EvaluateOnExit.html): retry host
# failures and the steps' retryable exit code 75, exit on everything else (docs/infrastructure.md:
# the exit-code contract, and why a graph the Neuron compiler rejects, 78, is not retried).
def retry_strategies() -> list[batch.RetryStrategy]:
    return [
        batch.RetryStrategy.of(batch.Action.RETRY, batch.Reason.custom(on_status_reason="Host EC2*")),
        batch.RetryStrategy.of(batch.Action.RETRY, batch.Reason.custom(on_exit_code=str(RETRYABLE_EXIT_CODE))),
        batch.RetryStrategy.of(batch.Action.EXIT, batch.Reason.custom(on_exit_code="*")),
    ]


class JobDefinitions(Construct):
    """Public attributes: job_definitions (dict step -> job definition; keys sanity, compile, train,
    prepare, prepare-shards, prepare-finish, validate, embed, export, canary), refs (the same keys
    -> JobDefinitionRef, named `<name_prefix>-<step>`), job_role, execution_role, log_group."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        name_prefix: str,
        image: ecs.ContainerImage,
        training: InstanceSpec,
        single_node: InstanceSpec,
        training_config: TrainingConfig,
        default_num_nodes: int,
        shared_memory_gib: int,
        single_node_shared_memory_gib: int,
        retry_attempts: int,
        train_timeout: Duration,
        compile_timeout: Duration,
        short_timeout: Duration,
        environment: Mapping[str, str],
        log_retention: logs.RetentionDays,
        log_key: kms.IKey,
        steps: Collection[str] | None = None,
    ) -> None:
        """`steps`: the job definitions to create (default: all, the pipeline's and the canary)."""
        super().__init__(scope, construct_id)
        self._steps = steps
        self.job_role = iam.Role(
            self, "JobRole", assumed_by=iam.ServicePrincipal("ecs-tasks.amazonaws.com"),
            description="Pipeline step containers: data read, artifacts and compile cache read/write",
        )
        self.execution_role = iam.Role(
            self, "ExecutionRole", assumed_by=iam.ServicePrincipal("ecs-tasks.amazonaws.com"),
            description="ECS agent: pull the training image, write container logs",
        )
        self.log_group = logs.LogGroup(self, "JobLogs", retention=log_retention, encryption_key=log_key)
        self.log_group.grant_write(self.execution_role)
        base_env = {"AWS_DEFAULT_REGION": Stack.of(self).region, **environment}
        self._name_prefix = name_prefix
        self.job_definitions: dict[str, batch.IJobDefinition] = {}
        self._multi_node_job_definitions(
            image=image, training=training, training_config=training_config, default_num_nodes=default_num_nodes,
            shared_memory_gib=shared_memory_gib, retry_attempts=retry_attempts, train_timeout=train_timeout,
            compile_timeout=compile_timeout, short_timeout=short_timeout, base_env=base_env)
        self._single_node_job_definitions(
            image=image, single_node=single_node, training_config=training_config,
            single_node_shared_memory_gib=single_node_shared_memory_gib, retry_attempts=retry_attempts,
            short_timeout=short_timeout, base_env=base_env)
        self._acknowledge_image_pull()
        self.refs = {step: JobDefinitionRef(name=self._name(step), timeout=job.timeout, retry_attempts=job.retry_attempts)
                     for step, job in self.job_definitions.items()}

    def _name(self, step: str) -> str:
        return f"{self._name_prefix}-{step}"

    def _selected(self, steps: Mapping[str, tuple[list[str], dict[str, str]]]
                  ) -> Mapping[str, tuple[list[str], dict[str, str]]]:
        return {k: v for k, v in steps.items() if self._steps is None or k in self._steps}

    def _multi_node_job_definitions(
        self, *, image: ecs.ContainerImage, training: InstanceSpec, training_config: TrainingConfig,
        default_num_nodes: int, shared_memory_gib: int, retry_attempts: int, train_timeout: Duration,
        compile_timeout: Duration, short_timeout: Duration, base_env: Mapping[str, str],
    ) -> None:
        for step, (command, parameters) in self._selected(multi_node_steps(training_config)).items():
            container = self._container(
                f"{step.capitalize()}Container", image=image, spec=training, command=command,
                environment={**base_env, **EFA_ENVIRONMENT, **_node_env(training),
                             **training_environment(training_config, training)},
                shared_memory_gib=shared_memory_gib,
            )
            job_definition = batch.MultiNodeJobDefinition(
                self, f"{step.capitalize()}JobDefinition",
                job_definition_name=self._name(step),
                instance_type=ec2.InstanceType(training.name),
                main_node=0,
                containers=[batch.MultiNodeContainer(container=container, start_node=0, end_node=default_num_nodes - 1)],
                parameters=parameters or None,
                retry_attempts=retry_attempts,
                retry_strategies=retry_strategies(),
                timeout={"train": train_timeout, "compile": compile_timeout}.get(step, short_timeout),
                propagate_tags=True,
            )
            cfn = job_definition.node.default_child
            assert isinstance(cfn, batch.CfnJobDefinition)
            # One open-ended node range ("0:"): the state machine sets NumNodes per submission
            # (NodeOverrides) and every node runs the same container.
            cfn.add_property_override("NodeProperties.NodeRangeProperties.0.TargetNodes", "0:")
            cfn.add_property_override("NodeProperties.NumNodes", default_num_nodes)
            self.job_definitions[step] = job_definition

    def _single_node_job_definitions(
        self, *, image: ecs.ContainerImage, single_node: InstanceSpec, training_config: TrainingConfig,
        single_node_shared_memory_gib: int, retry_attempts: int, short_timeout: Duration,
        base_env: Mapping[str, str],
    ) -> None:
        for step, (command, parameters) in self._selected(single_node_steps(training_config)).items():
            container = self._container(
                f"{construct_name(step)}Container", image=image, spec=single_node, command=command,
                environment={**base_env, **_node_env(single_node)},
                shared_memory_gib=single_node_shared_memory_gib,
            )
            self.job_definitions[step] = batch.EcsJobDefinition(
                self, f"{construct_name(step)}JobDefinition",
                job_definition_name=self._name(step),
                container=container,
                parameters=parameters or None,
                retry_attempts=retry_attempts,
                retry_strategies=retry_strategies(),
                timeout=short_timeout,
                propagate_tags=True,
            )

    def _acknowledge_image_pull(self) -> None:
        NagSuppressions.add_resource_suppressions(
            self.execution_role,
            [
                NagPackSuppression(
                    id="AwsSolutions-IAM5",
                    reason="ecr:GetAuthorizationToken has no resource-level permissions (it must be '*'); the image "
                    "pull actions themselves are scoped to the asset repository by the CDK image grant.",
                    applies_to=["Resource::*"],
                )
            ],
            apply_to_children=True,
        )

    def grant_bucket_access(self, *, read: Sequence[tuple[s3.IBucket, str]],
                            read_write: Sequence[tuple[s3.IBucket, str]]) -> None:
        """The job role reads and reads/writes (bucket, key pattern) pairs (least privilege through
        grants; KMS decrypt/encrypt on the buckets' keys comes with them)."""
        for bucket, keys in read:
            bucket.grant_read(self.job_role, keys)
        for bucket, keys in read_write:
            bucket.grant_read_write(self.job_role, keys)
        acknowledge_bucket_grants(
            self.job_role,
            reason="Generated by bucket.grant_read / grant_read_write: object-level actions need object ARNs "
            "with a wildcard (step outputs, gate reports, compile-cache entries have arbitrary keys): reads of "
            "a bucket's '/*', writes only below runs/, neuron/ (compile cache) and mlflow/ (the MLflow client's "
            "artifacts); the grant action groups (s3:GetObject*, s3:List*, kms:GenerateDataKey*, ...) are CDK's "
            "minimal sets.",
            # The bucket ARNs ("<XBucket.Arn>/...", or the cross-stack export when the account is set).
            objects_regex=r"/^Resource::(<|.*ExportsOutputFnGetAtt)(Data|Artifacts|Cache)Bucket[0-9A-F]+"
            r"(\.Arn>|Arn[0-9A-F]+)\/((runs|neuron|mlflow)\/)?\*$/g",
        )

    def _container(
        self, construct_id: str, *, image: ecs.ContainerImage, spec: InstanceSpec, command: list[str],
        environment: Mapping[str, str], shared_memory_gib: int,
    ) -> batch.EcsEc2ContainerDefinition:
        linux = batch.LinuxParameters(
            self, f"{construct_id}Linux",
            shared_memory_size=Size.gibibytes(shared_memory_gib),
            init_process_enabled=True,  # reap torchrun's children, forward signals on timeout
        )
        linux.add_devices(*device_list(spec))
        return batch.EcsEc2ContainerDefinition(
            self, construct_id,
            image=image,
            cpu=spec.vcpus,
            memory=container_memory(spec),
            command=command,
            environment=dict(environment),
            job_role=self.job_role,
            execution_role=self.execution_role,
            linux_parameters=linux,
            privileged=False,
            ulimits=[
                batch.Ulimit(name=batch.UlimitName.MEMLOCK, soft_limit=-1, hard_limit=-1),
                batch.Ulimit(name=batch.UlimitName.NOFILE, soft_limit=65535, hard_limit=65535),
            ],
            volumes=[batch.EcsVolume.host(name="fsx", host_path=FSX_MOUNT_POINT, container_path=FSX_MOUNT_POINT)],
            logging=ecs.LogDrivers.aws_logs(stream_prefix="step", log_group=self.log_group),
        )
