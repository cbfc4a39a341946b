"""Stage config validation: every bad value fails at synth time with a fix-it message."""

from __future__ import annotations

import dataclasses
import json

import pytest

from stacks.config import (
    INSTANCE_TYPES,
    NEURON_AMI_SSM_PARAMETER,
    PINNED_AMIS_FILE,
    STAGES,
    ComputeConfig,
    NetworkConfig,
    NeuronAmi,
    Share,
    StageConfig,
    StorageConfig,
    get_stage,
    load_pinned_amis,
    zone_id_prefix,
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
        ({"train_attempt_timeout_hours": 121},
         r"121 hours is longer than a deploy can wait for a running job .*use <= 120 hours"),
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
        ({"vpc_id": "vpc-123"}, r"needs training_subnet_id"),
        ({"vpc_id": "vpc-123", "training_subnet_id": "subnet-1"},
         r"needs container_security_group_id='sg-...': the VPC's default security group.*allows all traffic from itself"),
        ({"vpc_id": "vpc-123", "training_subnet_id": "subnet-1", "container_security_group_id": "default"},
         r"got 'default'"),
        ({"container_security_group_id": "sg-0123456789abcdef0"}, r"only used with vpc_id"),
        ({"training_az_id": "us-east-1a"}, r"training_az_id='us-east-1a' is not a zone ID.*describe-instance-type-offerings"),
        ({"training_subnet_id": "subnet-1"}, r"only used with vpc_id"),
        ({"vpc_endpoints": False, "nat_gateways": 0}, r"need VPC endpoints or NAT"),
        ({"private_subnet_mask": 28}, r"private_subnet_mask=28"),
        ({"flow_log_retention_days": 2}, r"flow_log_retention_days=2"),
    ],
)
def test_network_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NetworkConfig(**kwargs)


def test_prod_requires_a_pinned_ami_with_the_fix_it():
    stage = get_stage("prod").with_env(region="eu-north-1")  # importable and constructible ...
    with pytest.raises(ValueError, match=r"no Neuron AMI pinned for region 'eu-north-1'.*"
                                         r"scripts/infra_pin_ami.sh eu-north-1.*commit stacks/neuron_amis.json"):
        stage.neuron_ami  # ... but it cannot be built
    assert get_stage("prod").compute.allow_unpinned_ami is False


def test_pinned_ami_wins_over_the_floating_policy():
    compute = ComputeConfig(neuron_ami_ids=AMIS, allow_unpinned_ami=True)
    stage = StageConfig(name="t", region="us-east-1", compute=compute)
    assert stage.neuron_ami == NeuronAmi(image_id="ami-0123456789abcdef0")
    assert stage.neuron_ami.pinned


def test_dev_follows_the_ssm_parameter_until_pinned():
    stage = get_stage("dev").with_env(region="eu-north-1")
    assert stage.compute.allow_unpinned_ami
    assert stage.neuron_ami == NeuronAmi(ssm_parameter=NEURON_AMI_SSM_PARAMETER)
    assert NEURON_AMI_SSM_PARAMETER == "/aws/service/ecs/optimized-ami/amazon-linux-2023/neuron/recommended/image_id"


def test_neuron_ami_is_exactly_one_of_id_or_parameter():
    with pytest.raises(ValueError, match="exactly one"):
        NeuronAmi()
    with pytest.raises(ValueError, match="exactly one"):
        NeuronAmi(image_id="ami-0123456789abcdef0", ssm_parameter=NEURON_AMI_SSM_PARAMETER)


def test_committed_pin_file_is_what_the_stages_use():
    assert PINNED_AMIS_FILE.name == "neuron_amis.json" and PINNED_AMIS_FILE.exists()
    pins = load_pinned_amis()
    assert dict(get_stage("dev").compute.neuron_ami_ids) == dict(pins) == dict(get_stage("prod").compute.neuron_ami_ids)
    # Only ids the pin script wrote (with name and date), never hand-made placeholders.
    for region, entry in json.loads(PINNED_AMIS_FILE.read_text()).items():
        assert set(entry) >= {"image_id", "image_name", "pinned_at"}, region
        assert entry["image_name"].startswith("al2023-ami-ecs-neuron-hvm-"), entry


def test_pin_file_loader(tmp_path):
    path = tmp_path / "pins.json"
    path.write_text(json.dumps({"us-west-2": {"image_id": "ami-0123456789abcdef0", "pinned_at": "2026-05-20",
                                              "image_name": "al2023-ami-ecs-neuron-hvm-2023.0.20260515-kernel-6.1-x86_64"}}))
    assert dict(load_pinned_amis(path)) == {"us-west-2": "ami-0123456789abcdef0"}
    # Built before the Neuron driver of the training image's SDK release: it cannot run the image.
    path.write_text(json.dumps({"us-west-2": {"image_id": "ami-0123456789abcdef0", "pinned_at": "2026-01-20",
                                              "image_name": "al2023-ami-ecs-neuron-hvm-2023.0.20260115-kernel-6.1-x86_64"}}))
    with pytest.raises(ValueError, match=r"us-west-2: .*built 2026-01-15, before Neuron driver 2.27.*infra_pin_ami.sh"):
        load_pinned_amis(path)
    path.write_text(json.dumps({"us-west-2": "ami-0123456789abcdef0"}))
    with pytest.raises(ValueError, match=r"needs non-empty image_id, image_name and pinned_at.*infra_pin_ami.sh us-west-2"):
        load_pinned_amis(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="cannot read the Neuron AMI pins"):
        load_pinned_amis(path)


def test_stage_cross_checks():
    compute = ComputeConfig(neuron_ami_ids=AMIS, max_nodes=2)
    with pytest.raises(ValueError, match=r"default_num_nodes=4 exceeds\s+compute.max_nodes=2"):
        StageConfig(name="t", region="us-east-1", compute=compute, pipeline=PipelineConfig(default_num_nodes=4))
    with pytest.raises(ValueError, match=r"pipeline share 'research' is not one of compute.shares"):
        StageConfig(name="t", region="us-east-1", compute=compute, pipeline=PipelineConfig(experiments_share="research"))
    with pytest.raises(ValueError, match=r"training_az_id='usw2-az4' is not a zone of region 'us-east-1'.*'use1-'"):
        StageConfig(name="t", region="us-east-1", compute=compute, network=NetworkConfig(training_az_id="usw2-az4"))
    with pytest.raises(ValueError, match=r"12-digit"):
        StageConfig(name="t", region="us-east-1", account="42", compute=compute)


def test_training_zone_is_required_by_id_with_the_lookup_command():
    stage = get_stage("dev")
    with pytest.raises(ValueError, match=r"no training zone.*describe-instance-type-offerings --location-type "
                                         r"availability-zone-id.*--region us-east-1.*-c training_az_id="):
        _ = stage.training_az_id
    assert stage.with_env(training_az_id="use1-az6").training_az_id == "use1-az6"
    assert stage.with_env(region="ap-southeast-2", training_az_id="apse2-az1").training_az_id == "apse2-az1"
    with pytest.raises(ValueError, match=r"not a zone of region 'us-west-2'"):
        stage.with_env(region="us-west-2", training_az_id="use1-az6")


@pytest.mark.parametrize(("region", "prefix"), [("us-east-1", "use1"), ("ap-southeast-2", "apse2"),
                                                ("eu-central-1", "euc1"), ("ap-northeast-1", "apne1")])
def test_zone_id_prefix(region, prefix):
    assert zone_id_prefix(region) == prefix


def test_mlflow_defaults_prod_managed_dev_file_store():
    assert get_stage("prod").pipeline.mlflow_tracking == "managed" and get_stage("prod").pipeline.mlflow_managed
    assert get_stage("dev").pipeline.mlflow_tracking is None
    assert PipelineConfig().mlflow_tracking is None and PipelineConfig().mlflow_server_size == "Small"


def test_managed_mlflow_needs_egress():
    compute = ComputeConfig(neuron_ami_ids=AMIS)
    with pytest.raises(ValueError, match=r"mlflow_tracking='managed' needs internet egress.*nat_gateways>=1"):
        StageConfig(name="t", region="us-east-1", compute=compute, network=NetworkConfig(nat_gateways=0),
                    pipeline=PipelineConfig(mlflow_tracking="managed"))
    # A URI is the operator's business (e.g. a server reachable through the VPC endpoints).
    StageConfig(name="t", region="us-east-1", compute=compute, network=NetworkConfig(nat_gateways=0),
                pipeline=PipelineConfig(mlflow_tracking="https://mlflow.example.internal"))


def test_git_commit_validation():
    stage = get_stage("dev")
    assert stage.git_commit == "unknown"
    assert stage.with_env(git_commit="0123abc").git_commit == "0123abc"
    with pytest.raises(ValueError, match=r"git_commit='HEAD': a hex commit id"):
        stage.with_env(git_commit="HEAD")


def _accepts(make) -> bool:
    try:
        make()
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("days", [1, 7, 30, 42, 365, 366, 3653, 0])
def test_every_log_retention_is_checked_against_the_cloudwatch_values(days):
    """The compute, network and pipeline configs accept the same retention values, the ones
    stacks/constructs/retention.py can turn into a log group's retention (a 42 used to pass the
    pipeline config and fail later, in retention_days)."""
    from stacks.constructs.retention import _BY_DAYS

    compute = _accepts(lambda: ComputeConfig(neuron_ami_ids=AMIS, log_retention_days=days))
    network = _accepts(lambda: NetworkConfig(flow_log_retention_days=days))
    pipeline = _accepts(lambda: PipelineConfig(log_retention_days=days))
    assert compute == network == pipeline == (days in _BY_DAYS)


def test_retention_table_is_the_contract_table():
    from pipeline_steps import contract
    from stacks.constructs.retention import _BY_DAYS

    assert tuple(sorted(_BY_DAYS)) == contract.LOG_RETENTION_DAYS


@pytest.mark.parametrize("identifier", ["production", "team_1", "x" * 255, "x" * 256, "has-dash", "has space", ""])
def test_share_identifiers_are_checked_alike_in_the_compute_and_pipeline_configs(identifier):
    compute = _accepts(lambda: ComputeConfig(neuron_ami_ids=AMIS, shares=(Share(identifier=identifier, weight=1),)))
    pipeline = _accepts(lambda: PipelineConfig(experiments_share=identifier))
    assert compute == pipeline


# ---- teams ------------------------------------------------------------------------------------------
def _team(**kwargs):
    from stacks.team_config import TeamConfig

    return TeamConfig(**{"name": "search", "fsx_quota_gib": 100,
                         "principals": ("arn:aws:iam::123456789012:role/search",), **kwargs})


def test_every_team_problem_is_reported_at_once_with_its_fix():
    teams = (_team(name="Search-ML", weight=0), _team(compute_reservation=120, principals=("search-role",)),
             _team(name="ads", fsx_quota_gib=5000, principals=()))
    with pytest.raises(ValueError) as raised:
        dataclasses.replace(get_stage("dev"), teams=teams, admin_principals=("root",))
    message = str(raised.value)
    for expected in ("name 'Search-ML': use 2-24 lowercase letters and digits", "weight=0: Batch accepts",
                     "compute_reservation=120: a percentage", "principal 'search-role' is not an IAM role ARN",
                     "ads: principals: name at least one IAM role ARN", "FSx quotas add up to 5200 GiB, more than the "
                     "file system's 1200 GiB", "admin principal 'root' is not an IAM role ARN"):
        assert expected in message
    assert message.count("\n  - ") == 7


def test_a_team_is_defined_once():
    with pytest.raises(ValueError, match="team 'search' is defined 2 times"):
        dataclasses.replace(get_stage("dev"), teams=(_team(), _team()))


def test_a_stage_without_teams_keeps_its_shares_and_one_default_team():
    dev = get_stage("dev")
    assert dev.team_list == (None,) and dev.fair_shares == dev.compute.shares
    assert dev.compute_reservation == dev.compute.compute_reservation


def test_teams_are_the_fair_shares_and_the_largest_reservation_wins():
    cfg = dataclasses.replace(get_stage("dev"), teams=(_team(weight=1, compute_reservation=20),
                                                       _team(name="ads", weight=3, compute_reservation=5)))
    assert [(s.identifier, s.weight) for s in cfg.fair_shares] == [("search", 1), ("ads", 3)]
    assert cfg.compute_reservation == 20
    assert len({t.project_id for t in cfg.teams}) == 2 and _team().project_id == _team().project_id
    assert _team(fsx_quota_gib=1.5).fsx_quota_kib == 1572864  # lfs setquota -B takes KiB
