"""The Trainium instance table, the Neuron SDK release and the AWS values the stage configs check."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pipeline_contract.execution_input import Bounds


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
            name="trn1.32xlarge",
            vcpus=128,
            memory_gib=512,
            neuron_devices=16,
            neuron_cores=32,
            efa_interfaces=8,
            compiler_target="trn1",
        ),
        "trn1n.32xlarge": InstanceSpec(
            name="trn1n.32xlarge",
            vcpus=128,
            memory_gib=512,
            neuron_devices=16,
            neuron_cores=32,
            efa_interfaces=16,
            compiler_target="trn1n",
        ),
        "trn1.2xlarge": InstanceSpec(
            name="trn1.2xlarge",
            vcpus=8,
            memory_gib=32,
            neuron_devices=1,
            neuron_cores=2,
            efa_interfaces=0,
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
            f"{sorted(INSTANCE_TYPES)} or add a row to pipeline_contract.INSTANCE_TYPES "
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
        return (
            f"{image_name} was built {built}, before Neuron driver {sdk.driver} ({sdk.driver_released}) that "
            f"the training image (Neuron SDK {sdk.release}) needs; pin a newer AMI"
        )
    return None


# ---- AWS values the stage configs check ----------------------------------------------------------

SHARE_WEIGHT = Bounds(0.0001, 999.9999)
"""A fair-share identifier's weight factor (ComputeConfig's shares, TeamConfig.weight):
https://docs.aws.amazon.com/batch/latest/APIReference/API_ShareAttributes.html"""
SHARE_IDENTIFIER_RE = re.compile(r"^[A-Za-z0-9_]{1,255}$")
"""A Batch fair-share identifier (ComputeConfig's shares, PipelineConfig's production/experiments
shares): https://docs.aws.amazon.com/batch/latest/APIReference/API_ShareAttributes.html"""
LOG_RETENTION_DAYS: tuple[int, ...] = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1827, 3653)
"""Log retentions a stage may configure (every *log_retention_days): values CloudWatch Logs accepts
(https://docs.aws.amazon.com/AmazonCloudWatchLogs/latest/APIReference/API_PutRetentionPolicy.html)
that stacks/constructs/retention.py maps to CDK's RetentionDays."""
