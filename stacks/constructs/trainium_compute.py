"""AWS Batch managed EC2 compute environments (training: multi-node, placement group; single-node),
the fair-share scheduling policy and one job queue per compute environment, on the Neuron AMI.
Comments mark where the CDK L2 needs an escape hatch; docs/infrastructure.md ("Fair share that
decides", "Pinning the Neuron AMI") gives the reasons for the queue layout and the AMI policy.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import Annotations, Duration
from aws_cdk import aws_batch as batch
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from cdk_nag import NagPackSuppression, NagSuppressions
from constructs import Construct

from stacks.config import ComputeConfig, InstanceSpec, NeuronAmi, Share
from stacks.constructs.efa_launch_template import EfaLaunchTemplate, ProjectQuota

# Queue name -> its compute environment's key: one fair-share queue each, so production and
# experiment runs share the training queue and the shares' weights decide between them
# (docs/infrastructure.md, "Fair share that decides").
QUEUES: dict[str, str] = {"training": "training", "single-node": "single-node"}


UNPINNED_AMI_WARNING_ID = "trnembed:unpinnedNeuronAmi"


def neuron_machine_image(scope: Construct, ami: NeuronAmi, region: str) -> ec2.IMachineImage:
    """The compute environments' image. Pinned: that id. Unpinned: the SSM parameter as a template
    parameter (no lookup, no cdk.context.json: synth stays offline and deterministic; CloudFormation
    resolves it at each deploy) plus a synth warning that the AMI floats until pinned."""
    if ami.image_id is not None:
        return ec2.MachineImage.generic_linux({region: ami.image_id})
    assert ami.ssm_parameter is not None
    Annotations.of(scope).add_warning_v2(
        UNPINNED_AMI_WARNING_ID,
        f"Neuron AMI not pinned for {region}: the compute environments follow AWS's recommended image "
        f"(SSM {ami.ssm_parameter}, resolved at each deploy). The user data refuses hosts with an old "
        f"Neuron driver, but pin it before production: scripts/infra_pin_ami.sh {region}, then commit "
        "stacks/neuron_amis.json.",
    )
    return ec2.MachineImage.from_ssm_parameter(ami.ssm_parameter)


class TrainiumCompute(Construct):
    """Public attributes: launch_templates and compute_environments (dicts keyed "training",
    "single-node"), instance_role, scheduling_policy, queues (dict keyed "training",
    "single-node"), share_identifiers, machine_image."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ComputeConfig,
        ami: NeuronAmi,
        region: str,
        vpc: ec2.IVpc,
        subnets: ec2.SubnetSelection,
        node_security_group: ec2.ISecurityGroup,
        placement_group: ec2.IPlacementGroup,
        fsx_dns_name: str,
        fsx_mount_name: str,
        shares: Sequence[Share],
        compute_reservation: int,
        quotas: Sequence[ProjectQuota] = (),
    ) -> None:
        """`shares` and `compute_reservation`: the fair-share policy's (StageConfig.fair_shares,
        .compute_reservation); `quotas`: the teams' FSx project quotas every host applies at boot."""
        super().__init__(scope, construct_id)
        self.instance_role = self._instance_role()
        self.machine_image = neuron_machine_image(self, ami, region)
        # An image override with type ECS_AL2023: Batch has no Neuron image type.
        image = batch.EcsMachineImage(image=self.machine_image, image_type=batch.EcsMachineImageType.ECS_AL2023)

        self.launch_templates: dict[str, EfaLaunchTemplate] = {}
        self.compute_environments: dict[str, batch.ManagedEc2EcsComputeEnvironment] = {}
        # The longest attempt of the jobs each environment runs (training: sanity, compile, train).
        training_hours = max(config.train_attempt_timeout_hours, config.compile_attempt_timeout_hours,
                             config.short_attempt_timeout_hours)
        for key, spec, max_instances, placement, longest_job in (
            ("training", config.training, config.max_nodes, placement_group, Duration.hours(training_hours)),
            ("single-node", config.single_node, config.single_node_max_instances, None,
             Duration.hours(config.short_attempt_timeout_hours)),
        ):
            self._compute_environment(
                key, spec=spec, max_instances=max_instances, placement_group=placement, config=config,
                longest_job=longest_job,
                image=image, vpc=vpc, subnets=subnets, node_security_group=node_security_group,
                fsx_dns_name=fsx_dns_name, fsx_mount_name=fsx_mount_name, quotas=quotas,
            )

        self.share_identifiers = tuple(share.identifier for share in shares)
        self.scheduling_policy = self._fair_share_policy(config, shares, compute_reservation)
        self.queues = self._queues(config)

    def _instance_role(self) -> iam.Role:
        role = iam.Role(
            self,
            "InstanceRole",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            description="Batch ECS container instances (ECS agent registration, image pull)",
            managed_policies=[
                iam.ManagedPolicy.from_aws_managed_policy_name("service-role/AmazonEC2ContainerServiceforEC2Role")
            ],
        )
        NagSuppressions.add_resource_suppressions(
            role,
            [
                NagPackSuppression(
                    id="AwsSolutions-IAM4",
                    reason="AmazonEC2ContainerServiceforEC2Role is the AWS-maintained policy the ECS agent on Batch "
                    "container instances needs (register, poll, pull); a hand copy would drift from the agent.",
                    applies_to=["Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AmazonEC2ContainerServiceforEC2Role"],
                )
            ],
        )
        return role

    def _fair_share_policy(self, config: ComputeConfig, shares: Sequence[Share],
                           compute_reservation: int) -> batch.FairshareSchedulingPolicy:
        """The shares' weights decide between the teams (or production and experiment runs) in each queue."""
        return batch.FairshareSchedulingPolicy(
            self,
            "FairSharePolicy",
            shares=[batch.Share(share_identifier=s.identifier, weight_factor=s.weight) for s in shares],
            share_decay=Duration.seconds(config.share_decay_seconds),
            compute_reservation=compute_reservation,
        )

    def _queues(self, config: ComputeConfig) -> dict[str, batch.JobQueue]:
        """One fair-share queue per compute environment; jobs stuck RUNNABLE are cancelled."""
        stuck = [
            batch.JobStateTimeLimitAction(
                max_time=Duration.minutes(config.runnable_timeout_minutes),
                reason=reason,
                action=batch.JobStateTimeLimitActionsAction.CANCEL,
                state=batch.JobStateTimeLimitActionsState.RUNNABLE,
            )
            for reason in (
                batch.JobStateTimeLimitActionsReason.INSUFFICIENT_INSTANCE_CAPACITY,
                batch.JobStateTimeLimitActionsReason.COMPUTE_ENVIRONMENT_MAX_RESOURCE,
                batch.JobStateTimeLimitActionsReason.JOB_RESOURCE_REQUIREMENT,
            )
        ]
        queues: dict[str, batch.JobQueue] = {}
        for name, ce_key in QUEUES.items():
            construct_name = "".join(part.capitalize() for part in name.split("-"))
            queues[name] = batch.JobQueue(
                self,
                f"{construct_name}Queue",
                compute_environments=[
                    batch.OrderedComputeEnvironment(compute_environment=self.compute_environments[ce_key], order=1)
                ],
                # At creation: a queue created without a fair-share policy cannot get one later
                # (https://docs.aws.amazon.com/batch/latest/APIReference/API_CreateJobQueue.html).
                scheduling_policy=self.scheduling_policy,
                job_state_time_limit_actions=stuck,
            )
        return queues

    def _compute_environment(
        self, key: str, *, spec: InstanceSpec, max_instances: int, placement_group: ec2.IPlacementGroup | None,
        config: ComputeConfig, longest_job: Duration, image: batch.EcsMachineImage,
        vpc: ec2.IVpc, subnets: ec2.SubnetSelection, node_security_group: ec2.ISecurityGroup, fsx_dns_name: str, fsx_mount_name: str,
        quotas: Sequence[ProjectQuota],
    ) -> None:
        prefix = "".join(part.capitalize() for part in key.split("-"))
        template = EfaLaunchTemplate(
            self, f"{prefix}LaunchTemplate", spec=spec, security_group=node_security_group,
            root_volume_gib=config.root_volume_gib, root_volume_throughput_mibps=config.root_volume_throughput_mibps,
            root_volume_iops=config.root_volume_iops, min_driver=config.min_neuron_driver_version,
            fsx_dns_name=fsx_dns_name, fsx_mount_name=fsx_mount_name, quotas=quotas,
        )
        has_interfaces = bool(template.interfaces)
        ce = batch.ManagedEc2EcsComputeEnvironment(
            self,
            f"{prefix}ComputeEnvironment",
            vpc=vpc,
            vpc_subnets=subnets,
            instance_types=[ec2.InstanceType(spec.name)],
            use_optimal_instance_classes=False,  # else the L2 adds "optimal" to the instance types
            minv_cpus=0,
            maxv_cpus=spec.vcpus * max_instances,  # the L2 default 256 is two trn1.32xlarge
            spot=False,  # multi-node parallel jobs do not run on Spot
            placement_group=placement_group,
            launch_template=template.launch_template,
            # With EFA interfaces the group lives on the interfaces: Batch rejects a compute
            # environment with security groups when its launch template declares network
            # interfaces, and the L2 would otherwise create a default group (aws/aws-cdk#21577,
            # fixed by #21579 allowing []); the SecurityGroupIds property is removed below.
            security_groups=[] if has_interfaces else [node_security_group],
            images=[image],
            instance_role=self.instance_role,
            # Batch must not pick images itself: the AMI is the config's (pinned, or the SSM
            # parameter CloudFormation re-resolves on each deploy).
            update_to_latest_image_version=False,
            # A deploy that replaces the instances (a new AMI or launch template version) is an
            # infrastructure update: new jobs start on new instances, and running jobs keep their
            # old ones for update_timeout, then are terminated unless they finished
            # (https://docs.aws.amazon.com/batch/latest/userguide/updating-compute-environments.html).
            # The Batch default, 30 minutes, would kill a 72-hour training job: wait as long as
            # the longest attempt of the jobs this environment runs.
            replace_compute_environment=False,
            terminate_on_update=False,
            update_timeout=longest_job,
        )
        cfn = ce.node.default_child
        assert isinstance(cfn, batch.CfnComputeEnvironment)
        # The L2 renders only the template id, i.e. $Default, so template edits would never roll
        # out: pin the version to the template's LatestVersionNumber.
        cfn.add_property_override(
            "ComputeResources.LaunchTemplate.Version", template.launch_template.latest_version_number
        )
        if has_interfaces:
            cfn.add_property_deletion_override("ComputeResources.SecurityGroupIds")
        self.launch_templates[key] = template
        self.compute_environments[key] = ce
