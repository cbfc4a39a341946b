"""Facts the infrastructure (stacks/) and the steps share: the Trainium instance table.

Pure Python, no torch: `cdk synth` imports it through stacks/config.py on machines without torch,
and the steps read the same rows at run time. The launch templates' EFA interfaces, the job
definitions' device lists, NPROC_PER_NODE and INSTANCE_TYPE, the user-data health checks and
`sanity`'s expected device counts are all derived from `INSTANCE_TYPES`, so they cannot drift.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

INSTANCE_TYPE_ENV = "INSTANCE_TYPE"
"""Set by every job definition to its instance type (a key of INSTANCE_TYPES)."""


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


INSTANCE_TYPES: Mapping[str, InstanceSpec] = MappingProxyType(
    {
        "trn1.32xlarge": InstanceSpec(
            name="trn1.32xlarge", vcpus=128, memory_gib=512, neuron_devices=16, neuron_cores=32, efa_interfaces=8
        ),
        "trn1n.32xlarge": InstanceSpec(
            name="trn1n.32xlarge", vcpus=128, memory_gib=512, neuron_devices=16, neuron_cores=32, efa_interfaces=16
        ),
        "trn1.2xlarge": InstanceSpec(
            name="trn1.2xlarge", vcpus=8, memory_gib=32, neuron_devices=1, neuron_cores=2, efa_interfaces=0
        ),
    }
)


def instance_spec(name: str, where: str) -> InstanceSpec:
    """The row for `name`, or a ValueError naming `where` the value came from and the fix."""
    if name not in INSTANCE_TYPES:
        raise ValueError(
            f"{where}={name!r} is not in the EFA/Neuron instance table; use one of "
            f"{sorted(INSTANCE_TYPES)} or add a row to pipeline_steps.contract.INSTANCE_TYPES "
            "(EFA interfaces, Neuron devices/cores, vCPUs, memory)."
        )
    return INSTANCE_TYPES[name]
