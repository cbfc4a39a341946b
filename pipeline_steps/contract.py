"""The contract between the infrastructure (stacks/), the image (training_image/) and the steps.

Every fact two of those layers must agree on is written here once: the pipeline's steps, the FSx
paths, the run directory's layout, the exit codes, the environment the job definitions set, the
heartbeat metric names, the Trainium instance table, the Neuron SDK release and the AWS values the
stage configs check.
Pure Python, no torch: `cdk synth` imports it (through stacks/config.py) on machines without torch.
The copies that cannot import it are pinned by tests: the entrypoint's (shell) by
tests/infra/test_training_image.py, the README's tables by tests/steps/test_contract.py.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

# ---- Pipeline steps ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineStep:
    """One Batch step of the pipeline state machine."""

    name: str
    """The job definition key and Batch job name."""
    multi_node: bool
    """A multi-node job on the training instance type; else single-node on the small one."""
    command: str = ""
    """The CLI step it runs (`python -m pipeline_steps <command>`); default: the name."""

    def __post_init__(self) -> None:
        if not self.command:
            object.__setattr__(self, "command", self.name)

    @property
    def state(self) -> str:
        """Its Step Functions state name ("Train" for "train", "PrepareShards" for "prepare-shards")."""
        return "".join(part.capitalize() for part in self.name.split("-"))


PIPELINE_STEPS: tuple[PipelineStep, ...] = (
    PipelineStep("prepare", multi_node=False),  # --phase plan: catalog, tokenizer, units of the pairs
    PipelineStep("prepare-shards", multi_node=False, command="prepare"),  # array job: --phase shard
    PipelineStep("prepare-finish", multi_node=False, command="prepare"),  # --phase finish: counts, outputs
    PipelineStep("sanity", multi_node=True),
    PipelineStep("compile", multi_node=True),
    PipelineStep("train", multi_node=True),
    PipelineStep("validate", multi_node=False),
    PipelineStep("embed", multi_node=False),
    PipelineStep("export", multi_node=False),
)
"""In pipeline order. Read by the state machine, the job definitions and `trainium-runs`."""

CANARY_JOB = "canary"
"""Job definition key (and Batch job name) of the scheduled sanity canary; not a pipeline state."""

# ---- FSx for Lustre paths ------------------------------------------------------------------------

FSX_MOUNT_POINT = "/fsx"
"""Where the user data mounts FSx on every node and the job definitions bind-mount it."""
FSX_DATA = f"{FSX_MOUNT_POINT}/data"
"""Linked to the data bucket's root (FSx data repository association); the steps read input here."""
FSX_RUNS = f"{FSX_MOUNT_POINT}/runs"
"""Linked to the artifacts bucket's RUNS_PREFIX; every run's directory is FSX_RUNS/<run id>."""
FSX_CANARY = f"{FSX_MOUNT_POINT}/canary"
"""The canary's run directories: on FSx, outside the exported FSX_RUNS."""
RUNS_PREFIX = "runs/"
"""Key prefix in the artifacts bucket that FSX_RUNS is linked to (the state machine reads it)."""
INCOMING_PREFIX = "incoming/"
"""Key prefix of uploads in the data bucket (PipelineConfig.incoming_prefix's default)."""
FSX_INCOMING = f"{FSX_DATA}/{INCOMING_PREFIX.rstrip('/')}"
"""Uploads as the steps see them: FSX_INCOMING/<dataset>/<version>."""
MODELS_PREFIX = "models/"
"""Key prefix of the published model pointers in the artifacts bucket (TeamPaths.current_model_key)."""


@dataclass(frozen=True)
class TeamPaths:
    """Where one team's uploads, runs and published model live. `team` None is the one default team
    of a stage without teams: incoming/, runs/, models/current.json, as before teams existed. A
    named team has the same layout with `<team>/` after each top-level prefix, in the same buckets
    and FSx trees (the file system's two data repository associations link whole prefixes)."""

    team: str | None = None

    def _within(self, prefix: str) -> str:
        return f"{prefix}{self.team}/" if self.team else prefix

    @property
    def incoming_prefix(self) -> str:
        """Data bucket prefix of the team's uploads: <this><dataset>/<version>/_SUCCESS starts a run."""
        return self._within(INCOMING_PREFIX)

    @property
    def runs_prefix(self) -> str:
        """Artifacts bucket prefix of the team's runs (linked to fsx_runs)."""
        return self._within(RUNS_PREFIX)

    @property
    def models_prefix(self) -> str:
        return self._within(MODELS_PREFIX)

    @property
    def current_model_key(self) -> str:
        """The team's published model pointer in the artifacts bucket (written by Publish only)."""
        return self.models_prefix + "current.json"

    @property
    def fsx_incoming(self) -> str:
        return f"{FSX_INCOMING}/{self.team}" if self.team else FSX_INCOMING

    @property
    def fsx_runs(self) -> str:
        """The team's runs directory on FSx: its project quota's directory."""
        return f"{FSX_RUNS}/{self.team}" if self.team else FSX_RUNS

    def run_id(self, execution_name: str) -> str:
        """The run id of the team's execution: `<team>/<name>`, so run_path/run_key land in the
        team's directories and two teams' runs of the same name never share a heartbeat series."""
        return f"{self.team}/{execution_name}" if self.team else execution_name

# ---- The run directory ---------------------------------------------------------------------------
# Paths inside one run directory (FSX_RUNS/<run id> on AWS, any DIR locally), relative to it: what a
# step writes and a later step, the state machine or an operator reads. The artifacts bucket holds
# them under RUNS_PREFIX<run id>/ (FSx auto-export; validate and export also upload theirs).

PREPARED_DIR = "prepared"
"""prepare's outputs (tokenizer, catalog, pairs): every later step reads them."""
PREPARE_REPORT = f"{PREPARED_DIR}/prepare.json"
"""Written last by prepare; its status "ok" marks a complete set."""
COMPILE_DIR = "compile"
COMPILE_REPORT = f"{COMPILE_DIR}/compile.json"
"""compile's report (graphs traced, shapes); run-local reads it."""
COMPILE_CACHE_DIR = f"{COMPILE_DIR}/xla_cache"
"""The graphs compile traces and train (backend xla) reuses."""
CHECKPOINTS_DIR = "checkpoints"
"""train's step-<n>.pt + manifests; the published pointer's checkpoint_s3_uri is its S3 copy."""
TRAIN_DIR = "train"
TRAIN_METRICS = f"{TRAIN_DIR}/metrics.jsonl"
"""One line per optimizer step; train's MLflow curves come from it."""
TRAIN_SUMMARY = f"{TRAIN_DIR}/summary.json"
"""train's final numbers (loss, tokens/s, checkpoint); run-local and parity read it."""
VALIDATION_DIR = "validation"
VALIDATION_METRICS = f"{VALIDATION_DIR}/metrics.json"
"""validate's metrics: the next run's --previous-metrics once this run's model is published."""
GATE_REPORT = f"{VALIDATION_DIR}/gate.json"
"""validate's gate decision; the state machine reads its S3 copy (run_key(run id, GATE_REPORT))."""
EMBEDDINGS_DIR = "embeddings"
"""embed's parquet shards and manifest; the published pointer's embeddings_uri."""
EMBEDDINGS_MANIFEST = "manifest.json"
"""In embed's output directory (EMBEDDINGS_DIR unless --out), written once every shard is done."""
EXPORT_DIR = "export"
"""export's sentence-transformers folders; uploaded to run_key(run id, EXPORT_DIR) + "/"."""


def run_path(run_id: str, *parts: str) -> str:
    """FSX_RUNS/<run_id>[/parts]: a run directory, or a path in it, as the Batch jobs see it.
    `run_id` may be a placeholder: "Ref::run_id" (job definitions), "{}" (States.Format)."""
    return "/".join((FSX_RUNS, run_id, *parts))


def run_key(run_id: str, *parts: str) -> str:
    """RUNS_PREFIX<run_id>/parts: the same path's key in the artifacts bucket."""
    return RUNS_PREFIX + "/".join((run_id, *parts))


# ---- Exit codes ----------------------------------------------------------------------------------


class ExitCode(enum.IntEnum):
    """Process exit codes of `python -m pipeline_steps <step>` (values follow BSD sysexits where one
    fits). The job definitions' retry strategies retry RETRYABLE only; the entrypoint exits BAD_CONFIG
    on a bad command line; the README documents the table."""

    OK = 0
    INTERNAL = 1  # a bug: unexpected exception, traceback printed; not retried
    USAGE = 2  # argparse's own code for a bad command line
    BAD_INPUT = 65  # EX_DATAERR: malformed data, too many bad records, missing input; not retried
    RETRYABLE = 75  # EX_TEMPFAIL: device/collective health failure, stuck-step watchdog; Batch retries
    BAD_CONFIG = 78  # EX_CONFIG: invalid flags/config, incompatible checkpoint; not retried
    GATE_FAILED = 79  # the new model failed the holdout quality gate; the current model stays
    NON_FINITE_LOSS = 80  # loss became NaN/Inf; stopped before the optimizer step; not retried


# ---- Batch parameters and container environment --------------------------------------------------

RUN_ID_PARAMETER = "run_id"
"""Batch parameter with the run id (= execution name): `--run-dir FSX_RUNS/Ref::run_id` in the job
definitions, set by the state machine, read from job events by the stall watchdog."""
INSTANCE_TYPE_ENV = "INSTANCE_TYPE"
"""Set by every job definition to its instance type (a key of INSTANCE_TYPES); sanity and MLflow read it."""
NPROC_PER_NODE_ENV = "NPROC_PER_NODE"
"""Set by every job definition to the NeuronCores per node; the entrypoint's torchrun --nproc_per_node."""
RDZV_TIMEOUT_ENV = "TORCHRUN_RDZV_TIMEOUT_SECONDS"
"""Set by the compute stack (PipelineConfig.startup_minutes); the entrypoint's torchrun rendezvous bound."""
STAGE_ENV = "PIPELINE_STAGE"
"""Set by the compute stack to the stage name; the heartbeat's Stage dimension."""
RUN_ID_ENV = "PIPELINE_RUN_ID"
"""Exported by the entrypoint: --run-dir below FSX_RUNS (`<team>/<name>` for a team's run), else its
basename; the heartbeat's RunId and MLflow's run tag."""
EXIT_CODE_FILE_ENV = "PIPELINE_EXIT_CODE_FILE"
"""Exported by the entrypoint for torchrun steps: where the first failing rank records its ExitCode."""
TEAM_ENV = "PIPELINE_TEAM"
"""Set by a team's job definitions to the team's name; MLflow tags the pipeline's runs with it."""
COMPILE_CACHE_BASE_ENV = "NEURON_COMPILE_CACHE_URL_BASE"
"""Set by the compute stack to the S3 compile cache; pipeline_steps.distributed derives the cache URL."""

# ---- Heartbeat metrics (CloudWatch EMF) ----------------------------------------------------------

HEARTBEAT_NAMESPACE = "TrainiumEmbeddings"
"""Namespace pipeline_steps.heartbeat publishes in; the stall alarm and the dashboard read it."""
HEARTBEAT_STEP_METRIC = "TrainStep"
"""The optimizer step just completed: the progress the stall alarm watches."""
HEARTBEAT_LOSS_METRIC = "TrainLoss"
"""Training loss of that step (dashboard, `trainium-runs status`)."""
HEARTBEAT_THROUGHPUT_METRIC = "TokensPerSecond"
"""Training throughput of all ranks (dashboard, `trainium-runs status`)."""
HEARTBEAT_STAGE_DIMENSION = "Stage"
"""Dimension with the stage name (STAGE_ENV)."""
HEARTBEAT_RUN_DIMENSION = "RunId"
"""Dimension with the run id (RUN_ID_ENV); the per-job stall alarm filters on it."""

# ---- Trainium instance table ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class InstanceSpec:
    """What a Trainium instance type brings to a node. Sources (AWS Neuron docs): devices, vCPUs and
    memory https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trn1-arch.html,
    EFA devices https://awsdocs-neuron.readthedocs-hosted.com/en/latest/frameworks/torch/torch-neuronx/setup-trn1-multi-node-execution.html"""

    name: str
    vcpus: int
    memory_gib: int
    neuron_devices: int
    """/dev/neuron0..N-1: one per Trainium chip."""
    neuron_cores: int
    """NeuronCores = torchrun --nproc_per_node (one rank per core)."""
    efa_interfaces: int
    """EFA network cards = /dev/infiniband/uverbs0..N-1; 0 = no EFA (no interfaces declared)."""
    compiler_target: str
    """neuronx-cc `--target`: the instance family the graphs are compiled for (`trn1n` is a target
    of its own since neuronx-cc 2.5.0.28,
    https://awsdocs-neuron.readthedocs-hosted.com/en/latest/release-notes/compiler/neuronx-cc/index.html)."""


INSTANCE_TYPES: Mapping[str, InstanceSpec] = MappingProxyType(
    {
        "trn1.32xlarge": InstanceSpec(
            name="trn1.32xlarge", vcpus=128, memory_gib=512, neuron_devices=16, neuron_cores=32, efa_interfaces=8,
            compiler_target="trn1",
        ),
        "trn1n.32xlarge": InstanceSpec(
            name="trn1n.32xlarge", vcpus=128, memory_gib=512, neuron_devices=16, neuron_cores=32, efa_interfaces=16,
            compiler_target="trn1n",
        ),
        "trn1.2xlarge": InstanceSpec(
            name="trn1.2xlarge", vcpus=8, memory_gib=32, neuron_devices=1, neuron_cores=2, efa_interfaces=0,
            compiler_target="trn1",
        ),
    }
)
"""Launch templates' EFA interfaces, job definitions' devices and NPROC_PER_NODE, user-data checks,
`sanity`'s expected device counts."""

DEFAULT_TRAINING_INSTANCE_TYPE = "trn1.32xlarge"
"""ComputeConfig's default for multi-node steps; `trainium-runs` assumes it when a stack has no output."""
DEFAULT_SINGLE_NODE_INSTANCE_TYPE = "trn1.2xlarge"
"""ComputeConfig's default for single-node steps and the canary; `trainium-runs` likewise."""


def instance_spec(name: str, where: str) -> InstanceSpec:
    """The row for `name`, or a ValueError naming `where` the value came from and the fix."""
    if name not in INSTANCE_TYPES:
        raise ValueError(
            f"{where}={name!r} is not in the EFA/Neuron instance table; use one of "
            f"{sorted(INSTANCE_TYPES)} or add a row to pipeline_steps.contract.INSTANCE_TYPES "
            "(EFA interfaces, Neuron devices/cores, vCPUs, memory)."
        )
    return INSTANCE_TYPES[name]


# ---- The Neuron SDK release ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class NeuronSdk:
    """One Neuron SDK release: the training image, the compiler in it and the host driver it needs.
    The Dockerfile's FROM and compiler check, the user data's driver floor (ComputeConfig) and the
    AMI pins (scripts/infra_pin_ami.sh, stacks/neuron_amis.json) follow it; one test keeps them
    together (tests/infra/test_training_image.py)."""

    release: str
    training_image: str
    """The release's PyTorch training DLC (training_image/Dockerfile FROM)."""
    torch: str
    """The PyTorch line of the image (torch, torch-xla; torch-neuronx 2.9.0.x); the local pins follow it."""
    neuronx_cc: str
    """The compiler in the image (checked when the image is built); the compile cache is keyed by it."""
    driver: str
    """aws-neuronx-dkms of the release (major.minor): hosts with an older driver refuse to start."""
    driver_released: str
    """When that driver shipped (YYYY-MM-DD): an ECS Neuron AMI built earlier cannot carry it."""


NEURON_SDK = NeuronSdk(
    # PyTorch/XLA training is supported through 2.29.x and not from 2.30.0 on
    # (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/announcements/neuron2.x/announce-no-support-pytorch-xla-training.html);
    # 2.29.1 (2026-05-01) is the last release before it: neuronx-cc 2.24.5133.0 -> 2.24.8799.0
    # (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.29.1/release-notes/2.29.1.html), image tag in
    # the DLC release table (https://github.com/aws-neuron/deep-learning-containers#pytorch-training-neuronx),
    # driver 2.27.4.0 with 2.29.0 on 2026-04-09
    # (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.29.0/release-notes/releasecontent.html).
    release="2.29.1",
    training_image="public.ecr.aws/neuron/pytorch-training-neuronx:2.9.0-neuronx-py312-sdk2.29.1-ubuntu24.04",
    torch="2.9",
    neuronx_cc="2.24.8799.0",
    driver="2.27",
    driver_released="2026-04-09",
)

_AMI_BUILD_DATE = re.compile(r"\.(\d{4})(\d{2})(\d{2})(?=-|$)")


def ami_build_date(image_name: str) -> str | None:
    """YYYY-MM-DD from an ECS-optimized AMI name (al2023-ami-ecs-neuron-hvm-2023.0.20260415-kernel-6.1-x86_64)."""
    found = _AMI_BUILD_DATE.search(image_name)
    return "-".join(found.groups()) if found else None


def ami_driver_problem(image_name: str, sdk: NeuronSdk = NEURON_SDK) -> str | None:
    """Why an ECS Neuron AMI cannot run the SDK's image, or None. The AMI build installs the
    newest aws-neuronx-dkms of its day (aws/amazon-ecs-ami scripts/enable-ecs-agent-inferentia-support.sh),
    so an AMI built before the SDK's driver shipped has an older one."""
    built = ami_build_date(image_name)
    if built is None:
        return f"{image_name!r} has no build date in its name: cannot tell its Neuron driver"
    if built < sdk.driver_released:
        return (f"{image_name} was built {built}, before Neuron driver {sdk.driver} ({sdk.driver_released}) that "
                f"the training image (Neuron SDK {sdk.release}) needs; pin a newer AMI")
    return None


# ---- AWS values the stage configs check ----------------------------------------------------------

SHARE_IDENTIFIER_RE = re.compile(r"^[A-Za-z0-9_]{1,255}$")
"""A Batch fair-share identifier (ComputeConfig's shares, PipelineConfig's production/experiments
shares): https://docs.aws.amazon.com/batch/latest/APIReference/API_ShareAttributes.html"""
LOG_RETENTION_DAYS: tuple[int, ...] = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1827, 3653)
"""Log retentions a stage may configure (every *log_retention_days): values CloudWatch Logs accepts
(https://docs.aws.amazon.com/AmazonCloudWatchLogs/latest/APIReference/API_PutRetentionPolicy.html)
that stacks/constructs/retention.py maps to CDK's RetentionDays."""
