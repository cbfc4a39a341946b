"""AWS Batch job definitions, one per entry of the step table (pipeline_contract.BATCH_JOBS), from
the instance table and the stage's TrainingConfig (docs/infrastructure.md): a multi-node step on the
training instance type, every other one (single-node, array, the canary) on the small one. Each
command goes to the image entrypoint as `<step> --run-dir /fsx/runs/Ref::run_id ...`.
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

from pipeline_contract import (
    BATCH_JOBS,
    FSX_MOUNT_POINT,
    INSTANCE_TYPE_ENV,
    NPROC_PER_NODE_ENV,
    AttemptTimeout,
    ExitCode,
    InstanceSpec,
    PipelineStep,
)
from stacks.config import TrainingConfig
from stacks.constructs.secure_bucket import acknowledge_bucket_grants
from stacks.team_config import TeamConfig

RETRYABLE_EXIT_CODE = int(ExitCode.RETRYABLE)  # the only code Batch retries

# EFA / Neuron collectives environment (AWS Neuron multi-node setup docs:
# https://awsdocs-neuron.readthedocs-hosted.com/en/latest/frameworks/torch/torch-neuronx/setup-trn1-multi-node-execution.html).
EFA_ENVIRONMENT: Mapping[str, str] = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "CCOM_SOCKET_IFNAME": "eth0",
    "MALLOC_ARENA_MAX": "64",
}


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
    """Public attributes: job_definitions (dict step name -> job definition, for every entry of
    pipeline_contract.BATCH_JOBS: the pipeline's steps and the canary), refs (the same keys ->
    JobDefinitionRef, named `<name_prefix>-<step>`), job_role, execution_role, log_group."""

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
        timeouts: Mapping[AttemptTimeout, Duration],
        environment: Mapping[str, str],
        log_retention: logs.RetentionDays,
        log_key: kms.IKey,
        steps: Collection[str] | None = None,
    ) -> None:
        """`steps`: the job definitions to create (default: all, the pipeline's and the canary);
        `timeouts`: one attempt's bound per kind of step (PipelineStep.attempt_timeout)."""
        super().__init__(scope, construct_id)
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
        self._base_env = {"AWS_DEFAULT_REGION": Stack.of(self).region, **environment}
        self._name_prefix = name_prefix
        self._image, self._training, self._single_node = image, training, single_node
        self._training_config, self._default_num_nodes = training_config, default_num_nodes
        self._shared_memory_gib = {True: shared_memory_gib, False: single_node_shared_memory_gib}
        self._retry_attempts, self._timeouts = retry_attempts, timeouts
        self.job_definitions: dict[str, batch.IJobDefinition] = {
            step.name: self._multi_node(step) if step.multi_node else self._single_node_job(step)
            for step in BATCH_JOBS if steps is None or step.name in steps}
        self._acknowledge_image_pull()
        self.refs = {step: self._ref(step, job) for step, job in self.job_definitions.items()}

    def _name(self, step: str) -> str:
        return f"{self._name_prefix}-{step}"

    def _ref(self, step: str, job: batch.IJobDefinition) -> JobDefinitionRef:
        assert job.timeout is not None and job.retry_attempts is not None  # every job definition sets both
        return JobDefinitionRef(name=self._name(step), timeout=job.timeout, retry_attempts=int(job.retry_attempts))

    def _step_container(self, step: PipelineStep) -> batch.EcsEc2ContainerDefinition:
        """The step's container: multi-node ones with the EFA and the graph-deciding environment."""
        spec = self._training if step.multi_node else self._single_node
        environment = {**self._base_env}
        if step.multi_node:
            environment.update(EFA_ENVIRONMENT)
        environment.update(_node_env(spec))
        if step.multi_node:
            environment.update(training_environment(self._training_config, spec))
        return self._container(f"{step.state}Container", image=self._image, spec=spec,
                               command=step.job_command(self._training_config), environment=environment,
                               shared_memory_gib=self._shared_memory_gib[step.multi_node])

    def _multi_node(self, step: PipelineStep) -> batch.IJobDefinition:
        nodes = self._default_num_nodes
        job_definition = batch.MultiNodeJobDefinition(
            self, f"{step.state}JobDefinition",
            job_definition_name=self._name(step.name),
            instance_type=ec2.InstanceType(self._training.name),
            main_node=0,
            containers=[batch.MultiNodeContainer(container=self._step_container(step), start_node=0, end_node=nodes - 1)],
            parameters=dict(step.parameters) or None,
            retry_attempts=self._retry_attempts,
            retry_strategies=retry_strategies(),
            timeout=self._timeouts[step.attempt_timeout],
            propagate_tags=True,
        )
        cfn = job_definition.node.default_child
        assert isinstance(cfn, batch.CfnJobDefinition)
        # One open-ended node range ("0:"): the state machine sets NumNodes per submission
        # (NodeOverrides) and every node runs the same container.
        cfn.add_property_override("NodeProperties.NodeRangeProperties.0.TargetNodes", "0:")
        cfn.add_property_override("NodeProperties.NumNodes", nodes)
        return job_definition

    def _single_node_job(self, step: PipelineStep) -> batch.IJobDefinition:
        """A single-node job; an array step's too (the state machine makes the array at submission)."""
        return batch.EcsJobDefinition(
            self, f"{step.state}JobDefinition",
            job_definition_name=self._name(step.name),
            container=self._step_container(step),
            parameters=dict(step.parameters) or None,
            retry_attempts=self._retry_attempts,
            retry_strategies=retry_strategies(),
            timeout=self._timeouts[step.attempt_timeout],
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
