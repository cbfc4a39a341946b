"""Stage config validation: every bad value fails at synth time with a fix-it message."""

from __future__ import annotations

import dataclasses

import pytest

from stacks.config import (
    INSTANCE_TYPES,
    STAGES,
    ComputeConfig,
    NetworkConfig,
    Share,
    StageConfig,
    StorageConfig,
    get_stage,
)
from stacks.pipeline_config import PipelineConfig

AMIS = {"us-east-1": "ami-0123456789abcdef0"}


def test_stages_are_valid_and_frozen():
    assert set(STAGES) == {"dev", "prod"}
    dev = get_stage("dev")
    with pytest.raises(dataclasses.FrozenInstanceError):
        dev.name = "x"  # type: ignore[misc]
    assert isinstance(dev.pipeline, PipelineConfig)
    assert get_stage("prod").compute.training_instance_type == "trn1n.32xlarge"


def test_instance_table():
    assert INSTANCE_TYPES["trn1.32xlarge"].efa_interfaces == 8
    assert INSTANCE_TYPES["trn1n.32xlarge"].efa_interfaces == 16
    assert INSTANCE_TYPES["trn1.2xlarge"].efa_interfaces == 0
    assert (INSTANCE_TYPES["trn1.32xlarge"].neuron_devices, INSTANCE_TYPES["trn1.32xlarge"].neuron_cores) == (16, 32)
    assert (INSTANCE_TYPES["trn1.2xlarge"].neuron_devices, INSTANCE_TYPES["trn1.2xlarge"].vcpus) == (1, 8)


def test_unknown_stage():
    with pytest.raises(ValueError, match=r"Unknown stage 'qa'.*-c stage="):
        get_stage("qa")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"training_instance_type": "p4d.24xlarge"}, r"not in the EFA/Neuron instance table"),
        ({"training_instance_type": "trn1.2xlarge"}, r"has no EFA"),
        ({"single_node_instance_type": "inf2.xlarge"}, r"single_node_instance_type.*not in the EFA"),
        ({"max_nodes": 0}, r"max_nodes=0: must be >= 1"),
        ({"root_volume_gib": 30}, r"root_volume_gib=30: use >= 200"),
        ({"neuron_ami_ids": {"us-east-1": "ami-xyz"}}, r"not an AMI id.*infra_pin_ami"),
        ({"shares": (Share(identifier="a", weight=1), Share(identifier="a", weight=2))}, r"duplicate share"),
        ({"shares": (Share(identifier="bad-id", weight=1),)}, r"letters, digits"),
        ({"runnable_timeout_minutes": 5}, r">= 10 minutes"),
        ({"retry_attempts": 11}, r"1..10"),
        ({"shared_memory_gib": 400}, r"shared_memory_gib=400"),
        ({"min_neuron_driver_version": "latest"}, r"min_neuron_driver_version"),
        ({"log_retention_days": 42}, r"log_retention_days=42"),
    ],
)
def test_compute_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ComputeConfig(**{"neuron_ami_ids": AMIS, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fsx_storage_capacity_gib": 2000}, r"1200 or a multiple\s+of 2400"),
        ({"fsx_storage_capacity_gib": 3600}, r"PERSISTENT_2 accepts 1200 or a multiple"),
        ({"fsx_throughput_mbps_per_tib": 200}, r"125, 250, 500, 1000"),
        ({"cache_expiration_days": 0}, r"cache_expiration_days=0"),
    ],
)
def test_storage_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StorageConfig(**kwargs)


def test_storage_valid_capacities():
    for cap in (1200, 2400, 4800, 9600):
        assert StorageConfig(fsx_storage_capacity_gib=cap).fsx_storage_capacity_gib == cap


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vpc_id": "vpc-123"}, r"needs training_subnet_id and\s+training_availability_zone"),
        ({"training_subnet_id": "subnet-1"}, r"only used with vpc_id"),
        ({"vpc_endpoints": False, "nat_gateways": 0}, r"need VPC endpoints or NAT"),
        ({"private_subnet_mask": 28}, r"private_subnet_mask=28"),
        ({"flow_log_retention_days": 2}, r"flow_log_retention_days=2"),
    ],
)
def test_network_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NetworkConfig(**kwargs)


def test_missing_ami_for_region():
    stage = get_stage("dev")
    with pytest.raises(ValueError, match=r"no Neuron AMI pinned for region 'eu-north-1'.*infra_pin_ami"):
        stage.with_env(region="eu-north-1")


def test_stage_cross_checks():
    compute = ComputeConfig(neuron_ami_ids=AMIS, max_nodes=2)
    with pytest.raises(ValueError, match=r"default_num_nodes=4 exceeds\s+compute.max_nodes=2"):
        StageConfig(name="t", region="us-east-1", compute=compute, pipeline=PipelineConfig(default_num_nodes=4))
    with pytest.raises(ValueError, match=r"pipeline share 'research' is not one of compute.shares"):
        StageConfig(name="t", region="us-east-1", compute=compute, pipeline=PipelineConfig(experiments_share="research"))
    with pytest.raises(ValueError, match=r"availability zone 'us-west-2a' is not in region 'us-east-1'"):
        StageConfig(
            name="t", region="us-east-1", compute=compute, network=NetworkConfig(availability_zones=("us-west-2a",))
        )
    with pytest.raises(ValueError, match=r"12-digit"):
        StageConfig(name="t", region="us-east-1", account="42", compute=compute)


def test_default_azs_follow_region():
    stage = get_stage("dev").with_env(region="us-west-2")
    assert stage.availability_zones == ("us-west-2a", "us-west-2b")
    assert stage.training_availability_zone == "us-west-2a"
