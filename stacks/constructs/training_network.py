"""The training network: a VPC (new or existing) in one zone chosen by zone ID, with a cluster
placement group, the security groups of nodes (EFA), containers and FSx, VPC endpoints and flow
logs. Nodes and FSx share the one private training subnet; docs/infrastructure.md ("Why the network
looks the way it does") gives the reasons.
"""

from __future__ import annotations

import jsii
from aws_cdk import IStableStringProducer, Lazy, RemovalPolicy, Stack
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from constructs import Construct

from stacks.config import NetworkConfig
from stacks.constructs.checkov import skip_checkov
from stacks.constructs.log_encryption import log_encryption_key
from stacks.constructs.retention import retention_days
from stacks.constructs.service_principals import for_this_account

LUSTRE_PORTS: tuple[tuple[int, int], ...] = ((988, 988), (1018, 1023))
"""TCP port ranges FSx for Lustre (LNET) uses between clients and file servers."""

# Interface endpoints a Batch ECS node needs without NAT: image pull (ECR api + dkr; layers come
# from S3 through the gateway endpoint), the ECS agent (ecs, ecs-agent, ecs-telemetry), container
# logs (logs) and job-role credentials / boto3 (sts).
INTERFACE_ENDPOINTS: tuple[tuple[str, ec2.InterfaceVpcEndpointAwsService], ...] = (
    ("EcrApi", ec2.InterfaceVpcEndpointAwsService.ECR),
    ("EcrDocker", ec2.InterfaceVpcEndpointAwsService.ECR_DOCKER),
    ("Logs", ec2.InterfaceVpcEndpointAwsService.CLOUDWATCH_LOGS),
    ("Sts", ec2.InterfaceVpcEndpointAwsService.STS),
    ("Ecs", ec2.InterfaceVpcEndpointAwsService.ECS),
    ("EcsAgent", ec2.InterfaceVpcEndpointAwsService.ECS_AGENT),
    ("EcsTelemetry", ec2.InterfaceVpcEndpointAwsService.ECS_TELEMETRY),
)


@jsii.implements(IStableStringProducer)
class TrainingZone:
    """The training zone's name, which only CloudFormation knows: the subnets are placed by zone
    ID, and a zone ID has a different name in every account. `name` is a token for
    Fn::GetAtt <subnet>.AvailabilityZone, so whatever reads the zone's name (the network stack's
    availability_zones, the VPC L2's zone list) gets the real one at deploy time and the CDK never
    looks the account's zone names up."""

    def __init__(self) -> None:
        self.subnet: ec2.CfnSubnet | None = None
        self.name = Lazy.string(self)

    def produce(self) -> str:
        if self.subnet is None:
            raise ValueError("TrainingZone: no subnet has been placed in the training zone yet.")
        return self.subnet.attr_availability_zone


class TrainingNetwork(Construct):
    """Public attributes: vpc, training_subnet, training_subnets (SubnetSelection of the one
    training subnet), efa_security_group (nodes; EFA interfaces), container_security_group (the
    VPC's default group, imported), fsx_security_group,
    placement_group, endpoint_security_group (None when no interface endpoints). `zone` is told
    which subnet holds the training zone (new VPC only; an existing VPC's subnets come with their
    zone names from the lookup)."""

    def __init__(self, scope: Construct, construct_id: str, *, config: NetworkConfig, training_az_id: str,
                 zone: TrainingZone) -> None:
        super().__init__(scope, construct_id)
        # -- VPC ---------------------------------------------------------------------------
        if config.vpc_id is not None:
            self.vpc, self.training_subnet = self._existing_vpc(config)
        else:
            self.vpc, self.training_subnet = self._new_vpc(config, training_az_id, zone)
        self.training_subnets = ec2.SubnetSelection(subnets=[self.training_subnet])
        self._security_groups(config)

        # -- Placement group: all nodes of a job on one low-latency network spine ----------
        self.placement_group = ec2.PlacementGroup(
            self, "ClusterPlacementGroup", strategy=ec2.PlacementGroupStrategy.CLUSTER
        )
        self._endpoints(config)
        self._flow_logs(config)

    # -- builders ------------------------------------------------------------------------------
    def _security_groups(self, config: NetworkConfig) -> None:
        """Nodes (EFA), FSx and the containers' group: the VPC's default group, given its rules
        in a new VPC and taken as configured in an existing one."""
        # allow_all_outbound=False so the template states exactly what nodes may reach.
        self.efa_security_group = ec2.SecurityGroup(
            self,
            "EfaSecurityGroup",
            vpc=self.vpc,
            description="Trainium nodes and EFA interfaces: all traffic to and from itself",
            allow_all_outbound=False,
        )
        self.fsx_security_group = ec2.SecurityGroup(
            self,
            "FsxSecurityGroup",
            vpc=self.vpc,
            description="FSx for Lustre: LNET from Trainium nodes and between file servers",
            allow_all_outbound=False,
        )
        for low, high in LUSTRE_PORTS:
            port = _tcp(low, high)
            self.fsx_security_group.add_ingress_rule(self.fsx_security_group, port, "Lustre between file servers")
            self.fsx_security_group.add_egress_rule(self.fsx_security_group, port, "Lustre between file servers")
        # The EFA security group must allow all traffic in and out to itself
        # (https://docs.aws.amazon.com/batch/latest/userguide/efa.html).
        self._allow_cluster_traffic(self.efa_security_group, "EFA/collectives")
        if isinstance(self.vpc, ec2.Vpc):
            self.container_security_group = self._container_security_group(self.vpc)
        else:
            # Immutable: the stack adds no rule to a group it does not own; only FSx's side of
            # the Lustre rules is written (NetworkConfig.container_security_group_id).
            self.container_security_group = ec2.SecurityGroup.from_security_group_id(
                self, "ContainerSecurityGroup", str(config.container_security_group_id), mutable=False)
            self._allow_cluster_traffic(self.container_security_group, "Multi-node containers")

    def _endpoints(self, config: NetworkConfig) -> None:
        """The S3 gateway and the interface endpoints. New VPC only: an existing VPC usually has
        them, and a second endpoint with private DNS for the same service fails to create."""
        self.endpoint_security_group: ec2.SecurityGroup | None = None
        if config.vpc_id is None and config.vpc_endpoints:
            self.vpc.add_gateway_endpoint("S3", service=ec2.GatewayVpcEndpointAwsService.S3)
            self.endpoint_security_group = ec2.SecurityGroup(
                self,
                "EndpointSecurityGroup",
                vpc=self.vpc,
                description="Interface VPC endpoints: HTTPS from Trainium nodes and their containers",
                allow_all_outbound=False,
            )
            for clients in (self.efa_security_group, self.container_security_group):
                self.endpoint_security_group.add_ingress_rule(clients, ec2.Port.tcp(443), "HTTPS from nodes/containers")
            for endpoint_id, service in INTERFACE_ENDPOINTS:
                self.vpc.add_interface_endpoint(
                    endpoint_id,
                    service=service,
                    # One AZ is enough: every node is in the training subnet.
                    subnets=self.training_subnets,
                    security_groups=[self.endpoint_security_group],
                    open=False,
                    private_dns_enabled=True,
                )

    def _flow_logs(self, config: NetworkConfig) -> None:
        """VPC flow logs to a KMS-encrypted log group, delivered by a role only this account's flow
        logs may assume (https://docs.aws.amazon.com/vpc/latest/userguide/flow-logs-iam-role.html)."""
        flow_log_group = logs.LogGroup(
            self,
            "FlowLogGroup",
            retention=retention_days(config.flow_log_retention_days),
            removal_policy=RemovalPolicy.RETAIN,
            encryption_key=log_encryption_key(self, "FlowLogsKey", description=f"{self.node.path}: VPC flow logs"),
        )
        flow_log = ec2.FlowLog(
            self,
            "FlowLog",
            resource_type=ec2.FlowLogResourceType.from_vpc(self.vpc),
            destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_log_group),
            traffic_type=ec2.FlowLogTrafficType.ALL,
        )
        # The role the L2 creates, its trust scoped in place: a new role would replace the flow log
        # (DeliverLogsPermissionArn is create-only).
        scoped = for_this_account(self, "vpc-flow-logs.amazonaws.com", source_arn_pattern=Stack.of(self).format_arn(
            service="ec2", resource="vpc-flow-log", resource_name="*"))
        role = flow_log.iam_role.node.default_child
        assert isinstance(role, iam.CfnRole)
        role.add_property_override("AssumeRolePolicyDocument.Statement.0.Condition", scoped.policy_fragment.conditions)

    def _existing_vpc(self, config: NetworkConfig) -> tuple[ec2.IVpc, ec2.ISubnet]:
        """The VPC as the CLI looked it up (cdk.context.json) and its training subnet, which must
        be one of its private subnets. Until the lookup is answered the CDK hands out a
        placeholder VPC without your subnets, and the CLI synthesizes again with the answer."""
        vpc = ec2.Vpc.from_lookup(self, "Vpc", vpc_id=config.vpc_id)
        subnet_id = str(config.training_subnet_id)
        if vpc.vpc_id != config.vpc_id:
            return vpc, ec2.Subnet.from_subnet_attributes(self, "TrainingSubnet", subnet_id=subnet_id)
        private = {s.subnet_id: s for s in [*vpc.private_subnets, *vpc.isolated_subnets]}
        if subnet_id not in private:
            listed = ", ".join(f"{s.subnet_id} ({s.availability_zone})" for s in private.values()) or "none"
            raise ValueError(
                f"NetworkConfig.training_subnet_id={subnet_id!r} is not a private subnet of {config.vpc_id} "
                f"(its private subnets: {listed}). Nodes with several EFA interfaces get no public IP: choose a "
                "private subnet of that VPC in the training zone.")
        return vpc, private[subnet_id]

    def _new_vpc(self, config: NetworkConfig, training_az_id: str, zone: TrainingZone) -> tuple[ec2.Vpc, ec2.ISubnet]:
        """A one-zone VPC whose subnets name their zone by ID. The L2 takes zone names, which
        differ per account: it gets the zone's name as a token (TrainingZone), and every subnet's
        AvailabilityZone is replaced by AvailabilityZoneId. A literal zone ID in its place passes
        offline but fails `cdk synth` for a real account, where the CDK checks the names."""
        private_type = (
            ec2.SubnetType.PRIVATE_WITH_EGRESS if config.nat_gateways > 0 else ec2.SubnetType.PRIVATE_ISOLATED
        )
        subnets = [ec2.SubnetConfiguration(name="Private", subnet_type=private_type, cidr_mask=config.private_subnet_mask)]
        if config.nat_gateways > 0:
            subnets.insert(0, ec2.SubnetConfiguration(name="Public", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=24))
        vpc = ec2.Vpc(
            self,
            "Vpc",
            ip_addresses=ec2.IpAddresses.cidr(config.cidr),
            availability_zones=[zone.name],
            nat_gateways=config.nat_gateways,
            subnet_configuration=subnets,
            # Private DNS of the interface endpoints needs both.
            enable_dns_hostnames=True,
            enable_dns_support=True,
            # Strips the default group's allow-all rules; _container_security_group adds back
            # only what the containers need.
            restrict_default_security_group=True,
        )
        for subnet in [*vpc.public_subnets, *vpc.private_subnets, *vpc.isolated_subnets]:
            cfn = subnet.node.default_child
            assert isinstance(cfn, ec2.CfnSubnet)
            cfn.add_property_deletion_override("AvailabilityZone")
            cfn.add_property_override("AvailabilityZoneId", training_az_id)
        training_subnet = vpc.select_subnets(subnet_type=private_type).subnets[0]
        zone.subnet = training_subnet.node.default_child
        _acknowledge_restrict_handler(self)
        return vpc, training_subnet

    def _allow_cluster_traffic(self, group: ec2.ISecurityGroup, what: str) -> None:
        """All traffic within `group`, HTTPS out (interface endpoints, the S3 gateway, NAT when
        configured; nothing comes in from outside the VPC), Lustre both ways with FSx."""
        group.add_ingress_rule(group, ec2.Port.all_traffic(), f"{what}: all traffic from itself")
        group.add_egress_rule(group, ec2.Port.all_traffic(), f"{what}: all traffic to itself")
        group.add_egress_rule(ec2.Peer.any_ipv4(), ec2.Port.tcp(443), "HTTPS to AWS APIs")
        for low, high in LUSTRE_PORTS:
            port = _tcp(low, high)
            group.add_egress_rule(self.fsx_security_group, port, "Lustre client to FSx")
            group.add_ingress_rule(self.fsx_security_group, port, "Lustre from FSx")
            self.fsx_security_group.add_ingress_rule(group, port, f"Lustre from {what}")
            self.fsx_security_group.add_egress_rule(group, port, f"Lustre to {what}")

    def _container_security_group(self, vpc: ec2.Vpc) -> ec2.ISecurityGroup:
        """The VPC's default group, which multi-node containers' awsvpc interfaces get: torchrun's
        store, the Neuron root communicator and the collectives bootstrap talk container to
        container on it, and S3, ECR, the compile cache and MLflow are reached over HTTPS.
        Its rules are created after the custom resource that strips the default rules."""
        group = ec2.SecurityGroup.from_security_group_id(
            self, "ContainerSecurityGroup", vpc.vpc_default_security_group, allow_all_outbound=False, mutable=True
        )
        self._allow_cluster_traffic(group, "Multi-node containers")
        restrict = vpc.node.try_find_child("RestrictDefaultSecurityGroupCustomResource")
        assert restrict is not None, "restrict_default_security_group=True creates this custom resource"
        group.node.add_dependency(restrict)
        return group


def _acknowledge_restrict_handler(scope: Construct) -> None:
    """The Lambda function behind restrict_default_security_group (a CDK custom resource provider):
    CloudFormation calls it when the VPC is created, updated or deleted, and it only revokes the
    default group's rules through the EC2 API."""
    provider = Stack.of(scope).node.find_child("Custom::VpcRestrictDefaultSGCustomResourceProvider")
    skip_checkov(provider.node.find_child("Handler"), {
        "CKV_AWS_115": "Invoked by CloudFormation once per stack operation on the VPC; reserved concurrency would "
                       "only take capacity from the account's other functions.",
        "CKV_AWS_116": "A failed invocation fails the CloudFormation operation that waits for its response; a "
                       "dead-letter queue would keep an event nobody can replay (its response URL expires).",
        "CKV_AWS_117": "It calls only the regional EC2 API, at deploy time, to configure this VPC, which has no "
                       "EC2 interface endpoint (and in dev no NAT): from inside it the call could not reach the API.",
    })


def _tcp(low: int, high: int) -> ec2.Port:
    return ec2.Port.tcp(low) if low == high else ec2.Port.tcp_range(low, high)
