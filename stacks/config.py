"""Typed stage configuration: one frozen `StageConfig` per stage ("dev", "prod"), chosen by app.py
(`-c stage=NAME`, which may also override the account/region). Plain data, validated in
`__post_init__` with fix-it `ValueError`s, so a bad value fails at synth time on a laptop instead of
half-way through a CloudFormation deployment. Neuron AMI pins: the committed stacks/neuron_amis.json
(`scripts/infra_pin_ami.sh <region>`; `ComputeConfig.neuron_ami_ids`, `StageConfig.neuron_ami`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

from pipeline_steps import contract
from pipeline_steps.config import PRESETS
from pipeline_steps.contract import InstanceSpec
from stacks.pipeline_config import PipelineConfig
from stacks.team_config import TeamConfig, check_teams


# The instance table lives in pipeline_steps.contract (pure Python), the one source of EFA interface
# counts, Neuron devices and cores: the launch templates, the job definitions' device lists, the
# user-data checks and NPROC_PER_NODE are generated from it, and `sanity` checks hosts against it.
INSTANCE_TYPES = contract.INSTANCE_TYPES

_AMI_RE = re.compile(r"^ami-[0-9a-f]{8}([0-9a-f]{9})?$")
# AWS's current recommended ECS-optimized AL2023 Neuron AMI, per region (public SSM parameter).
NEURON_AMI_SSM_PARAMETER = "/aws/service/ecs/optimized-ami/amazon-linux-2023/neuron/recommended/image_id"
PINNED_AMIS_FILE = Path(__file__).with_name("neuron_amis.json")
_AZ_ID_RE = re.compile(r"^[a-z]{2,}[0-9]+-az[0-9]+$")
_SG_ID_RE = re.compile(r"^sg-([0-9a-f]{8}|[0-9a-f]{17})$")
# Zone IDs start with an abbreviation of their region: us-east-1 -> use1, ap-southeast-2 -> apse2
# (https://docs.aws.amazon.com/global-infrastructure/latest/regions/az-ids.html).
_REGION_WORDS = {"north": "n", "south": "s", "east": "e", "west": "w", "central": "c", "northeast": "ne",
                 "southeast": "se", "northwest": "nw", "southwest": "sw", "gov": "g"}
_AZ_ID_HOWTO = (
    "List the zone IDs that offer the training instance type with `aws ec2 describe-instance-type-offerings "
    "--location-type availability-zone-id --filters Name=instance-type,Values=<type> --region <region> "
    "--query 'InstanceTypeOfferings[].Location'` and pass one with `-c training_az_id=<zone id>`."
)
_VERSION_RE = re.compile(r"^\d+(\.\d+){1,3}$")
# FSx for Lustre PERSISTENT_2: storage 1200 GiB or a multiple of 2400 GiB; throughput per TiB one
# of 125/250/500/1000 MB/s. https://docs.aws.amazon.com/fsx/latest/APIReference/API_CreateFileSystem.html
_FSX_P2_THROUGHPUTS = (125, 250, 500, 1000)
LOG_RETENTION_DAYS = contract.LOG_RETENTION_DAYS
# The longest a compute environment update waits for running jobs before it terminates them
# (UpdatePolicy jobExecutionTimeoutMinutes: 1..7200,
# https://docs.aws.amazon.com/batch/latest/APIReference/API_UpdatePolicy.html).
MAX_UPDATE_GRACE_MINUTES = 7200


def zone_id_prefix(region: str) -> str | None:
    """The prefix of `region`'s zone IDs ("us-east-1" -> "use1"), or None for a region name with a
    word this table does not know (then only the zone ID's format is checked)."""
    area, *words, number = region.split("-")
    if not all(w in _REGION_WORDS for w in words):
        return None
    return area + "".join(_REGION_WORDS[w] for w in words) + number


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class NetworkConfig:
    """VPC layout. Multi-interface (EFA) instances get no public IP, so nodes live in private
    subnets and reach AWS APIs through VPC endpoints and/or NAT."""

    vpc_id: str | None = None
    """Use an existing VPC (looked up with Vpc.from_lookup: needs credentials once and a committed
    cdk.context.json afterwards). None = create a new VPC."""
    training_subnet_id: str | None = None
    """With vpc_id: the private subnet (in the training AZ) for nodes and FSx. Required then;
    synthesis checks it against the looked-up VPC."""
    container_security_group_id: str | None = None
    """With vpc_id: the VPC's default security group (sg-...). Required then. Multi-node containers
    get the compute environment's security groups or, when it has none, the VPC's default group
    (https://docs.aws.amazon.com/batch/latest/userguide/mnp-ce.html); the training compute
    environment has none (its group sits on the EFA interfaces), so this group carries torchrun's
    store and the collectives bootstrap between containers. In a new VPC the stack writes those
    rules; a group it does not own it never changes, so naming it here states that it allows all
    traffic from itself and HTTPS out (docs/infrastructure.md, "Existing VPC")."""
    training_az_id: str | None = None
    """Zone ID (e.g. use1-az6, not a name like us-east-1a) of the one zone that holds the nodes,
    FSx, the placement group and the endpoints. A zone ID is the same physical zone in every
    account; names are shuffled per account, and trn1/trn1n exist only in some zones. No default:
    set it per deployment with `-c training_az_id=...` (app.py), choosing a zone that offers the
    training instance type (`aws ec2 describe-instance-type-offerings --location-type
    availability-zone-id`, docs/infrastructure.md). With vpc_id, training_subnet_id must be in it."""
    cidr: str = "10.42.0.0/16"
    private_subnet_mask: int = 20
    """/20 = 4091 usable addresses: every EFA interface takes one, so 32 trn1n nodes need 512."""
    nat_gateways: int = 0
    """0 = no internet egress at all (endpoints only); 1+ adds public subnets and NAT."""
    vpc_endpoints: bool = True
    """Gateway (S3) and interface endpoints for ECR, logs, STS, ECS so nodes work without NAT."""
    flow_log_retention_days: int = 90

    def __post_init__(self) -> None:
        if self.vpc_id is not None:
            if not self.training_subnet_id:
                raise ValueError(
                    f"NetworkConfig.vpc_id={self.vpc_id!r} needs training_subnet_id (a private subnet in the "
                    "training zone training_az_id)."
                )
            if self.container_security_group_id is None or not _SG_ID_RE.match(self.container_security_group_id):
                raise ValueError(
                    f"NetworkConfig.vpc_id={self.vpc_id!r} needs container_security_group_id='sg-...': the VPC's "
                    "default security group, which AWS Batch gives multi-node containers. The stack does not "
                    "change a group it does not own: first make sure it allows all traffic from itself and HTTPS "
                    "out (aws ec2 describe-security-group-rules --filters Name=group-id,Values=<sg id>), then name "
                    f"it (got {self.container_security_group_id!r})."
                )
        elif self.training_subnet_id is not None or self.container_security_group_id is not None:
            raise ValueError("NetworkConfig.training_subnet_id and container_security_group_id are only used with "
                             "vpc_id; remove them or set vpc_id.")
        if self.vpc_id is None and not self.vpc_endpoints and self.nat_gateways < 1:
            raise ValueError(
                "NetworkConfig: nodes in private subnets need VPC endpoints or NAT to pull images and "
                "send logs; set vpc_endpoints=True or nat_gateways>=1."
            )
        if self.training_az_id is not None and not _AZ_ID_RE.match(self.training_az_id):
            raise ValueError(
                f"NetworkConfig.training_az_id={self.training_az_id!r} is not a zone ID; use an ID like 'use1-az6' "
                f"(zone names like 'us-east-1a' differ per account). {_AZ_ID_HOWTO}"
            )
        if not 16 <= self.private_subnet_mask <= 24:
            raise ValueError(
                f"NetworkConfig.private_subnet_mask={self.private_subnet_mask}: use 16..24; every EFA "
                "interface consumes one private IP."
            )
        if self.flow_log_retention_days not in LOG_RETENTION_DAYS:
            raise ValueError(
                f"NetworkConfig.flow_log_retention_days={self.flow_log_retention_days}: use a CloudWatch Logs "
                f"value {LOG_RETENTION_DAYS}."
            )
        if self.nat_gateways < 0:
            raise ValueError(f"NetworkConfig.nat_gateways={self.nat_gateways}: must be >= 0.")


@dataclass(frozen=True, kw_only=True)
class StorageConfig:
    """Buckets and FSx for Lustre (PERSISTENT_2, Lustre 2.15, LZ4)."""

    fsx_storage_capacity_gib: int = 1200
    """PERSISTENT_2 SSD: 1200 or a multiple of 2400 GiB."""
    fsx_throughput_mbps_per_tib: int = 250
    """PERSISTENT_2: 125, 250, 500 or 1000 MB/s per TiB of storage."""
    fsx_automatic_backup_retention_days: int = 7
    noncurrent_version_expiration_days: int = 30
    """Old object versions in the data/artifacts buckets (versioning protects against overwrites;
    M5 lost files to unversioned shared storage) are deleted after this many days."""
    cache_expiration_days: int = 60
    """Neuron compile-cache entries expire; a cold entry is recompiled at the next run."""
    access_log_expiration_days: int = 365

    def __post_init__(self) -> None:
        cap = self.fsx_storage_capacity_gib
        if not (cap == 1200 or (cap > 0 and cap % 2400 == 0)):
            raise ValueError(
                f"StorageConfig.fsx_storage_capacity_gib={cap}: PERSISTENT_2 accepts 1200 or a multiple "
                "of 2400 GiB (2400, 4800, 7200, ...)."
            )
        if self.fsx_throughput_mbps_per_tib not in _FSX_P2_THROUGHPUTS:
            raise ValueError(
                f"StorageConfig.fsx_throughput_mbps_per_tib={self.fsx_throughput_mbps_per_tib}: "
                f"PERSISTENT_2 accepts one of {_FSX_P2_THROUGHPUTS} MB/s/TiB."
            )
        if not 0 <= self.fsx_automatic_backup_retention_days <= 90:
            raise ValueError("StorageConfig.fsx_automatic_backup_retention_days: use 0..90 (0 disables backups).")
        for name in ("noncurrent_version_expiration_days", "cache_expiration_days", "access_log_expiration_days"):
            if getattr(self, name) < 1:
                raise ValueError(f"StorageConfig.{name}={getattr(self, name)}: must be >= 1 day.")


@dataclass(frozen=True, kw_only=True)
class Share:
    """A fair-share identifier and its weight (lower weight = larger share of the queue)."""

    identifier: str
    weight: float


@dataclass(frozen=True, kw_only=True)
class ComputeConfig:
    """AWS Batch compute environments, queues and job definitions. The training nodes launch
    On-Demand: into open On-Demand Capacity Reservations created in the stage's placement group
    when there are some, else into plain On-Demand capacity, where a launch can fail for
    insufficient capacity (the job then waits RUNNABLE until runnable_timeout_minutes cancels it).
    docs/infrastructure.md ("Reserved capacity") says why there is no setting for a targeted
    reservation or a Capacity Block."""

    training_instance_type: str = contract.DEFAULT_TRAINING_INSTANCE_TYPE
    max_nodes: int = 4
    """Largest multi-node job (and the CE's max vCPUs = vCPUs x max_nodes). The account's Running
    On-Demand Trn instances quota (vCPUs, per region) must cover `training_vcpus_needed`."""
    single_node_instance_type: str = contract.DEFAULT_SINGLE_NODE_INSTANCE_TYPE
    single_node_max_instances: int = 4
    neuron_ami_ids: Mapping[str, str] = field(default_factory=dict)
    """Region -> pinned ECS-optimized AL2023 Neuron AMI id. The stages read it from the committed
    stacks/neuron_amis.json, which `scripts/infra_pin_ami.sh <region>` writes from SSM
    NEURON_AMI_SSM_PARAMETER (with the image name and the date it was pinned). A pinned id changes
    only in a reviewed commit, so every deploy of the stage launches the same image."""
    allow_unpinned_ami: bool = False
    """AMI policy when `neuron_ami_ids` has no pin for the stage's region:
    False (prod): synth fails with the fix-it (pin with scripts/infra_pin_ami.sh, commit the file).
    True (dev): the compute environments use the SSM parameter NEURON_AMI_SSM_PARAMETER, resolved
    by CloudFormation at each deploy (a template parameter: synth stays offline and deterministic,
    the template names the parameter), so the AMI follows AWS's recommended image until pinned;
    synth adds a warning saying so. What makes a floating AMI safe enough for dev is the user
    data's fail-fast check (`min_neuron_driver_version`, EFA/Neuron device counts): a host whose
    Neuron driver is too old for the training image (the ECS Neuron AMIs built from 20251015 to
    ~2026-01 pinned driver 2.21) shuts itself down before the ECS agent starts, so no job ever
    runs on it -- jobs wait RUNNABLE instead, and the queue's time limit cancels and reports them."""
    min_neuron_driver_version: str = contract.NEURON_SDK.driver
    """User data refuses hosts with an older aws-neuronx-dkms: the driver of the Neuron SDK release
    the training image comes from (contract.NEURON_SDK; ECS AMIs 20251015..~2026-01 pinned 2.21)."""
    root_volume_gib: int = 200
    """gp3 root volume; the Neuron DLC alone is tens of GB and the ECS AMI default is 30 GB."""
    root_volume_throughput_mibps: int = 1000
    """gp3 throughput of the root volume (125..1000 MiB/s). Every node pulls and unpacks the
    multi-GB training image onto it before its container starts, and child nodes start only
    after the main node runs: at gp3's default 125 MiB/s the pull alone eats much of the startup
    budget (PipelineConfig.startup_minutes). gp3 allows 0.25 MiB/s per provisioned IOPS."""
    root_volume_iops: int = 4000
    """gp3 IOPS of the root volume (3000..16000, >= 4 x throughput in MiB/s)."""
    shared_memory_gib: int = 64
    """/dev/shm of multi-node (training instance) containers: torchrun workers and the data loader
    exchange tensors through it; Docker's 64 MB default is far too small."""
    single_node_shared_memory_gib: int = 8
    """/dev/shm of single-node (small instance) containers."""
    shares: tuple[Share, ...] = (Share(identifier="production", weight=1.0), Share(identifier="experiments", weight=3.0))
    share_decay_seconds: int = 3600
    compute_reservation: int = 10
    """Percent of the CE reserved for share identifiers that are not currently active."""
    runnable_timeout_minutes: int = 240
    """Cancel jobs stuck RUNNABLE (no capacity, misconfigured CE) after this long."""
    retry_attempts: int = 3
    train_attempt_timeout_hours: int = 72
    compile_attempt_timeout_hours: int = 12
    short_attempt_timeout_hours: int = 4
    """Batch attempt timeouts (the job definitions'): train, compile, and the rest (sanity,
    prepare, validate, embed, canary). Each pipeline state waits for all retry_attempts of its job,
    so its timeout is derived from these (TrainingPipeline.state_timeout_minutes). A deploy that
    replaces a compute environment's instances (a new AMI or launch template) lets the jobs running
    on them finish for as long as the longest attempt there (the UpdatePolicy), so an attempt may
    last at most MAX_UPDATE_GRACE_MINUTES."""
    log_retention_days: int = 365

    def __post_init__(self) -> None:
        spec = self._check_instances_and_ami()
        self._check_fair_share()
        self._check_jobs_and_volumes(spec)

    def _check_instances_and_ami(self) -> InstanceSpec:
        """Instance types, node counts, AMI pins, driver version, root volume size; returns the
        training instance's spec."""
        spec = contract.instance_spec(self.training_instance_type, "ComputeConfig.training_instance_type")
        if spec.efa_interfaces < 1:
            raise ValueError(
                f"ComputeConfig.training_instance_type={self.training_instance_type!r} has no EFA; multi-node "
                "training needs trn1.32xlarge or trn1n.32xlarge (use it as single_node_instance_type instead)."
            )
        contract.instance_spec(self.single_node_instance_type, "ComputeConfig.single_node_instance_type")
        if self.max_nodes < 1:
            raise ValueError(f"ComputeConfig.max_nodes={self.max_nodes}: must be >= 1 (nodes per multi-node job).")
        if self.single_node_max_instances < 1:
            raise ValueError(f"ComputeConfig.single_node_max_instances={self.single_node_max_instances}: must be >= 1.")
        for region, ami in self.neuron_ami_ids.items():
            if not _AMI_RE.match(ami):
                raise ValueError(
                    f"ComputeConfig.neuron_ami_ids[{region!r}]={ami!r} is not an AMI id (ami-xxxxxxxx[xxxxxxxxx]); "
                    "run scripts/infra_pin_ami.sh REGION to print the current one."
                )
        if not _VERSION_RE.match(self.min_neuron_driver_version):
            raise ValueError(f"ComputeConfig.min_neuron_driver_version={self.min_neuron_driver_version!r}: use e.g. '2.27'.")
        if self.root_volume_gib < 200:
            raise ValueError(
                f"ComputeConfig.root_volume_gib={self.root_volume_gib}: use >= 200; the Neuron training image "
                "does not fit the ECS AMI's default 30 GB."
            )
        return spec

    def _check_fair_share(self) -> None:
        if not self.shares:
            raise ValueError("ComputeConfig.shares: at least one fair-share identifier is required.")
        ids = [s.identifier for s in self.shares]
        if len(set(ids)) != len(ids):
            raise ValueError(f"ComputeConfig.shares: duplicate share identifiers {ids}.")
        for s in self.shares:
            if not contract.SHARE_IDENTIFIER_RE.match(s.identifier):
                raise ValueError(f"ComputeConfig.shares: {s.identifier!r} must be 1-255 letters, digits or '_'.")
            if not 0.0001 <= s.weight <= 999.9999:
                raise ValueError(f"ComputeConfig.shares: weight of {s.identifier!r} must be in 0.0001..999.9999.")
        if not 0 <= self.share_decay_seconds <= 604800:
            raise ValueError("ComputeConfig.share_decay_seconds: use 0..604800 (one week).")
        if not 0 <= self.compute_reservation <= 99:
            raise ValueError("ComputeConfig.compute_reservation: a percentage 0..99.")

    def _check_jobs_and_volumes(self, spec: InstanceSpec) -> None:
        """Queue and retry limits, gp3 root volume, attempt timeouts, shared memory, log retention."""
        if self.runnable_timeout_minutes < 10:
            raise ValueError(
                "ComputeConfig.runnable_timeout_minutes: Batch requires >= 10 minutes for jobStateTimeLimitActions."
            )
        if not 1 <= self.retry_attempts <= 10:
            raise ValueError(f"ComputeConfig.retry_attempts={self.retry_attempts}: Batch accepts 1..10.")
        if not 125 <= self.root_volume_throughput_mibps <= 1000 or not 3000 <= self.root_volume_iops <= 16000:
            raise ValueError(
                f"ComputeConfig.root_volume_throughput_mibps={self.root_volume_throughput_mibps} / root_volume_iops="
                f"{self.root_volume_iops}: gp3 takes 125..1000 MiB/s and 3000..16000 IOPS."
            )
        if self.root_volume_iops * 0.25 < self.root_volume_throughput_mibps:
            raise ValueError(
                f"ComputeConfig.root_volume_iops={self.root_volume_iops}: gp3 needs >= 4 IOPS per MiB/s of "
                f"throughput; use >= {self.root_volume_throughput_mibps * 4} for {self.root_volume_throughput_mibps} MiB/s."
            )
        if min(self.train_attempt_timeout_hours, self.compile_attempt_timeout_hours, self.short_attempt_timeout_hours) < 1:
            raise ValueError("ComputeConfig attempt timeouts must be >= 1 hour.")
        longest = max(self.train_attempt_timeout_hours, self.compile_attempt_timeout_hours, self.short_attempt_timeout_hours)
        if longest * 60 > MAX_UPDATE_GRACE_MINUTES:
            raise ValueError(
                f"ComputeConfig attempt timeouts: {longest} hours is longer than a deploy can wait for a running job "
                f"before replacing its instance (Batch UpdatePolicy jobExecutionTimeoutMinutes <= "
                f"{MAX_UPDATE_GRACE_MINUTES}); use <= {MAX_UPDATE_GRACE_MINUTES // 60} hours per attempt (a retried "
                "train attempt resumes from its last checkpoint)."
            )
        for name, gib, inst in (
            ("shared_memory_gib", self.shared_memory_gib, spec),
            ("single_node_shared_memory_gib", self.single_node_shared_memory_gib, INSTANCE_TYPES[self.single_node_instance_type]),
        ):
            if not 1 <= gib <= inst.memory_gib // 2:
                raise ValueError(
                    f"ComputeConfig.{name}={gib}: use 1..{inst.memory_gib // 2} GiB (half of {inst.name}'s "
                    f"{inst.memory_gib} GiB); /dev/shm counts against the container's memory."
                )
        if self.log_retention_days not in LOG_RETENTION_DAYS:
            raise ValueError(
                f"ComputeConfig.log_retention_days={self.log_retention_days}: use a CloudWatch Logs value {LOG_RETENTION_DAYS}."
            )

    @property
    def training(self) -> InstanceSpec:
        return INSTANCE_TYPES[self.training_instance_type]

    @property
    def single_node(self) -> InstanceSpec:
        return INSTANCE_TYPES[self.single_node_instance_type]

    @property
    def training_vcpus_needed(self) -> int:
        """vCPUs of the largest training job: what the Trn On-Demand vCPU quota must allow."""
        return self.training.vcpus * self.max_nodes

    @property
    def share_identifiers(self) -> tuple[str, ...]:
        return tuple(s.identifier for s in self.shares)


@dataclass(frozen=True, kw_only=True)
class NeuronAmi:
    """The image a stage's compute environments launch: exactly one of a pinned AMI id, or the
    SSM parameter CloudFormation resolves at deploy time (unpinned stages that allow it)."""

    image_id: str | None = None
    ssm_parameter: str | None = None

    def __post_init__(self) -> None:
        if (self.image_id is None) == (self.ssm_parameter is None):
            raise ValueError("NeuronAmi: set exactly one of image_id (pinned) or ssm_parameter.")

    @property
    def pinned(self) -> bool:
        return self.image_id is not None


def load_pinned_amis(path: Path = PINNED_AMIS_FILE) -> Mapping[str, str]:
    """Region -> AMI id from the committed pin file
    {"<region>": {"image_id": "ami-...", "image_name": "...", "pinned_at": "YYYY-MM-DD"}}.
    A malformed file is a ValueError naming the file and the fix."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the Neuron AMI pins ({exc}); restore it from git or rerun "
                         "scripts/infra_pin_ami.sh REGION.") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object region -> pin; rerun scripts/infra_pin_ami.sh REGION.")
    pins: dict[str, str] = {}
    for region, entry in data.items():
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) and entry[k]
                                                  for k in ("image_id", "image_name", "pinned_at")):
            raise ValueError(f"{path}: entry {region!r} needs non-empty image_id, image_name and pinned_at; "
                             f"rerun scripts/infra_pin_ami.sh {region}.")
        problem = contract.ami_driver_problem(entry["image_name"])
        if problem:
            raise ValueError(f"{path}: {region}: {problem}: rerun scripts/infra_pin_ami.sh {region}.")
        pins[region] = entry["image_id"]
    return MappingProxyType(pins)


# ---------------------------------------------------------------------------------------------
# Training run (what Compile and Train share)
# ---------------------------------------------------------------------------------------------
PRECISIONS = ("bf16", "fp32")


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """How the Compile and Train jobs run the `train` step. Both job definitions are rendered from
    these values (stacks/constructs/job_definitions.py training_arguments / training_environment):
    the Neuron persistent cache keys every graph by a hash of the graph AND of the compiler flags,
    so a Train job whose preset, precision or NEURON_CC_FLAGS differ from Compile's finds nothing
    in the cache and recompiles everything.
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-features/neuron-caching.html"""

    preset: str = "base"
    """Model/batch shape preset (pipeline_steps/config.py PRESETS); decides every traced graph."""
    precision: str = "bf16"
    """bf16 (the trn1 default): weights cast to bfloat16 (`train --bf16`) with stochastic rounding
    (NEURON_RT_STOCHASTIC_ROUNDING_EN=1), the way Neuron trains in full bf16; without the variable
    the runtime rounds to nearest and small updates vanish. fp32: no cast, stochastic rounding off.
    A trn1.32xlarge peaks at 3,040 BF16 vs 760 FP32 TFLOPS, and since Neuron SDK 2.27 the compiler
    no longer casts fp32 matmuls to bf16 by itself (--auto-cast=none), so fp32 really runs fp32.
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/appnotes/torch-neuronx/migration-from-xla-downcast-bf16.html
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-features/rounding-modes.html
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trn1-arch.html
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/index.html"""
    neuron_cc_flags: str = "--model-type transformer --optlevel 1"
    """NEURON_CC_FLAGS of Compile and Train (the same string, or the cache misses), after the
    `--target` the training instance type decides (`compiler_flags`): transformer-specific
    optimisations, optimisation level 1 ("core performance optimizations ... while also minimizing
    compile time"; the default is 2).
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/compiler/neuronx-cc/api-reference-guide/neuron-compiler-cli-reference-guide.html"""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"TrainingConfig.preset={self.preset!r}: use one of {sorted(PRESETS)}.")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainingConfig.precision={self.precision!r}: use one of {PRECISIONS} "
                             "(bf16 with stochastic rounding is the trn1 default).")
        if "cache_dir" in self.neuron_cc_flags:
            raise ValueError(
                "TrainingConfig.neuron_cc_flags must not set --cache_dir: it would override the stage's "
                "versioned compile cache (NEURON_COMPILE_CACHE_URL, from the cache bucket) that Compile "
                "fills and Train reads; remove it."
            )
        if "--target" in self.neuron_cc_flags:
            raise ValueError(f"TrainingConfig.neuron_cc_flags={self.neuron_cc_flags!r} must not set --target: the "
                             "job definitions add the training instance type's target (trn1 or trn1n); remove it.")
        if any(ch in self.neuron_cc_flags for ch in "\"'$`\n"):
            raise ValueError(f"TrainingConfig.neuron_cc_flags={self.neuron_cc_flags!r}: plain flags only "
                             "(no quotes, $, backquotes or newlines); the value is passed as is.")

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"

    def compiler_flags(self, instance: InstanceSpec) -> str:
        """NEURON_CC_FLAGS for graphs run on `instance`: its compiler target, then neuron_cc_flags."""
        return f"--target {instance.compiler_target} {self.neuron_cc_flags}".strip()


# ---------------------------------------------------------------------------------------------
# Slack (optional): the notification topic in a Slack channel through AWS Chatbot
# ---------------------------------------------------------------------------------------------
_SLACK_WORKSPACE_RE = re.compile(r"^T[0-9A-Z]{8,20}$")
_SLACK_CHANNEL_RE = re.compile(r"^[CG][0-9A-Z]{8,20}$")


@dataclass(frozen=True, kw_only=True)
class SlackConfig:
    """Where AWS Chatbot posts the pipeline's notifications (stacks/constructs/slack_channel.py).
    Authorize the workspace once in the Chatbot console (https://console.aws.amazon.com/chatbot/),
    which shows its ID; invite @aws to the channel. docs/operations.md, "Slack"."""

    workspace_id: str
    """The Slack workspace (team) ID, e.g. T07EA123LEP."""
    channel_id: str
    """The channel ID (public C..., private G...), the last part of the channel's Copy link URL."""

    def __post_init__(self) -> None:
        if not _SLACK_WORKSPACE_RE.match(self.workspace_id):
            raise ValueError(
                f"SlackConfig.workspace_id={self.workspace_id!r} is not a Slack workspace ID (T followed by 8-20 "
                "capital letters or digits): authorize the workspace in the AWS Chatbot console and copy the "
                "Workspace ID it shows.")
        if not _SLACK_CHANNEL_RE.match(self.channel_id):
            raise ValueError(
                f"SlackConfig.channel_id={self.channel_id!r} is not a Slack channel ID (C or G followed by 8-20 "
                "capital letters or digits, not the channel name): in Slack, open the channel's details or "
                "right-click it, Copy link, and take the last part of the URL.")


# ---------------------------------------------------------------------------------------------
# Stage
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StageConfig:
    """Everything that differs between deployments of the same code."""

    name: str
    """Stage name; prefixes stack names ("<Project>-<name>-Network")."""
    region: str
    """Default region; app.py overrides it from the CDK environment (CDK_DEFAULT_REGION) when set."""
    account: str | None = None
    """None = environment-agnostic account (app.py fills it from CDK_DEFAULT_ACCOUNT when set)."""
    project: str = "TrnEmbed"
    network: NetworkConfig = field(default_factory=NetworkConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    tags: Mapping[str, str] = field(default_factory=dict)
    slack: SlackConfig | None = None
    """Optional: post the notifications to this Slack channel through AWS Chatbot."""
    teams: tuple[TeamConfig, ...] = ()
    """Teams sharing the stage (stacks/team_config.py): each gets its own pipeline, prefixes, FSx
    quota, job role, share identifier and access role. Empty: one default team, the stage's
    layout before teams (docs/operations.md, "Teams")."""
    admin_principals: tuple[str, ...] = ()
    """With teams: IAM role ARNs that may assume the platform admin role (every team's runs, jobs
    and artifacts). Empty: the account's own IAM policies decide who may (the role trusts the account)."""
    git_commit: str = "unknown"
    """Commit the training image is built from (Docker build arg GIT_COMMIT, baked into the image's
    env; MLflow logs it with every step). app.py fills it from `git rev-parse HEAD`; it never
    reaches a template directly, only the image asset's build args (and so its hash)."""

    def __post_init__(self) -> None:
        if not re.match(r"^([0-9a-f]{7,40}|unknown)$", self.git_commit):
            raise ValueError(
                f"StageConfig.git_commit={self.git_commit!r}: a hex commit id (git rev-parse HEAD) or 'unknown'."
            )
        if not re.match(r"^[a-z][a-z0-9-]{0,15}$", self.name):
            raise ValueError(f"StageConfig.name={self.name!r}: lowercase letters, digits and '-', max 16 chars.")
        if not re.match(r"^[A-Za-z][A-Za-z0-9]{0,23}$", self.project):
            raise ValueError(f"StageConfig.project={self.project!r}: letters and digits, max 24 chars.")
        if not re.match(r"^[a-z]{2}(-[a-z]+)+-\d$", self.region):
            raise ValueError(f"StageConfig.region={self.region!r}: not an AWS region name (e.g. us-east-1).")
        if self.account is not None and not re.match(r"^\d{12}$", self.account):
            raise ValueError(f"StageConfig.account={self.account!r}: a 12-digit AWS account id or None.")
        zone, prefix = self.network.training_az_id, zone_id_prefix(self.region)
        if zone is not None and prefix is not None and not zone.startswith(f"{prefix}-"):
            raise ValueError(
                f"Stage {self.name!r}: training_az_id={zone!r} is not a zone of region {self.region!r} (its zone "
                f"IDs start with '{prefix}-'). {_AZ_ID_HOWTO}"
            )
        if self.pipeline.default_num_nodes > self.compute.max_nodes:
            raise ValueError(
                f"Stage {self.name!r}: pipeline.default_num_nodes={self.pipeline.default_num_nodes} exceeds "
                f"compute.max_nodes={self.compute.max_nodes}; raise max_nodes or lower the default."
            )
        check_teams(self.teams, fsx_capacity_gib=self.storage.fsx_storage_capacity_gib,
                    admin_principals=self.admin_principals)
        for share in () if self.teams else (self.pipeline.production_share, self.pipeline.experiments_share):
            if share not in self.compute.share_identifiers:
                raise ValueError(
                    f"Stage {self.name!r}: pipeline share {share!r} is not one of compute.shares "
                    f"{self.compute.share_identifiers}."
                )

        if self.pipeline.mlflow_managed and self.network.vpc_id is None and self.network.nat_gateways < 1:
            # The sagemaker-mlflow plugin calls https://<region>.experiments.sagemaker.aws; the stage's
            # VPC endpoints do not cover it, so without NAT every step would only warn and skip tracking.
            raise ValueError(
                f"Stage {self.name!r}: pipeline.mlflow_tracking='managed' needs internet egress from the "
                "private subnets to reach the SageMaker MLflow endpoint; set network.nat_gateways>=1, or "
                "use mlflow_tracking=None (run-local file store) for this stage."
            )

    @property
    def team_list(self) -> tuple[TeamConfig | None, ...]:
        """The stage's teams, or (None,): the one default team of a stage without teams."""
        return self.teams or (None,)

    @property
    def fair_shares(self) -> tuple[Share, ...]:
        """The scheduling policy's shares: one per team (its name, its weight), else ComputeConfig.shares."""
        return tuple(Share(identifier=t.share_identifier, weight=t.weight) for t in self.teams) or self.compute.shares

    @property
    def compute_reservation(self) -> int:
        """The policy's one computeReservation: the largest a team asks for, else ComputeConfig's."""
        asked = [t.compute_reservation for t in self.teams if t.compute_reservation is not None]
        return max(asked) if asked else self.compute.compute_reservation

    @property
    def training_az_id(self) -> str:
        """The training zone's ID; a ValueError with the fix-it when the deployment did not set it
        (checked when the network stack is built, so other stages and tests stay importable)."""
        if self.network.training_az_id is None:
            raise ValueError(
                f"Stage {self.name!r}: no training zone. Zone names map to different physical zones in every "
                f"account and trn1/trn1n exist only in some zones, so the zone is chosen by ID per deployment. "
                f"{_AZ_ID_HOWTO.replace('<region>', self.region)}"
            )
        return self.network.training_az_id

    @property
    def neuron_ami(self) -> NeuronAmi:
        """The AMI policy resolved for this stage's region (build_stage calls it first, so an
        unpinned prod fails synth before any stack exists). Not checked in __post_init__: an
        unpinned stage must stay importable (tests, other stages, the pin script's first run)."""
        pinned = self.compute.neuron_ami_ids.get(self.region)
        if pinned is not None:
            return NeuronAmi(image_id=pinned)
        if self.compute.allow_unpinned_ami:
            return NeuronAmi(ssm_parameter=NEURON_AMI_SSM_PARAMETER)
        raise ValueError(
            f"Stage {self.name!r}: no Neuron AMI pinned for region {self.region!r}, and this stage requires a "
            f"pin (compute.allow_unpinned_ami=False). Fix: run `scripts/infra_pin_ami.sh {self.region}` (needs "
            f"AWS credentials; reads SSM {NEURON_AMI_SSM_PARAMETER}), review the image name it prints, then "
            f"commit stacks/neuron_amis.json. Pinned regions: {sorted(self.compute.neuron_ami_ids) or 'none'}."
        )

    def with_env(self, *, account: str | None = None, region: str | None = None,
                 git_commit: str | None = None, training_az_id: str | None = None) -> StageConfig:
        """A copy targeting another account/region/zone, or built from another commit (validated again)."""
        network = replace(self.network, training_az_id=training_az_id) if training_az_id else self.network
        return replace(self, account=account or self.account, region=region or self.region,
                       git_commit=git_commit or self.git_commit, network=network)


# ECS-optimized AL2023 Neuron AMI pins, from the committed file (empty until someone with AWS
# credentials runs scripts/infra_pin_ami.sh REGION and commits it). Synth never looks them up.
PINNED_NEURON_AMIS: Mapping[str, str] = load_pinned_amis()

STAGES: Mapping[str, StageConfig] = MappingProxyType(
    {
        "dev": StageConfig(
            name="dev",
            region="us-east-1",
            network=NetworkConfig(nat_gateways=0, flow_log_retention_days=30),
            storage=StorageConfig(fsx_storage_capacity_gib=1200, fsx_throughput_mbps_per_tib=125),
            compute=ComputeConfig(
                training_instance_type="trn1.32xlarge",
                max_nodes=2,
                neuron_ami_ids=PINNED_NEURON_AMIS,
                # dev may follow AWS's recommended AMI until a pin is committed (synth warns).
                allow_unpinned_ami=True,
                runnable_timeout_minutes=120,
            ),
            # No MLflow server in dev: runs log to DIR/mlruns (mlflow_tracking=None), and dev has no NAT.
            pipeline=PipelineConfig(canary_interval_minutes=None),
            tags={"stage": "dev"},
        ),
        "prod": StageConfig(
            name="prod",
            region="us-east-1",
            network=NetworkConfig(nat_gateways=1),
            storage=StorageConfig(fsx_storage_capacity_gib=4800, fsx_throughput_mbps_per_tib=500),
            compute=ComputeConfig(
                training_instance_type="trn1n.32xlarge",
                max_nodes=8,
                neuron_ami_ids=PINNED_NEURON_AMIS,  # prod requires a pin for its region
            ),
            # A managed MLflow server (~always-on cost) so every prod run is comparable in one place;
            # dev keeps each run's own file store (DIR/mlruns, exported to S3) and pays nothing.
            pipeline=PipelineConfig(default_num_nodes=4, mlflow_tracking="managed"),
            tags={"stage": "prod"},
        ),
    }
)


def get_stage(name: str) -> StageConfig:
    """The named stage, or a ValueError listing the valid names."""
    if name not in STAGES:
        raise ValueError(f"Unknown stage {name!r}: use -c stage=<one of {sorted(STAGES)}> (stacks/config.py STAGES).")
    return STAGES[name]
