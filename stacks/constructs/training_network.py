"""The training network: VPC (new or existing), one training subnet/AZ, cluster placement group,
EFA and FSx security groups, VPC endpoints and flow logs.

Facts this encodes (../shared/DESIGN.md section 5):
- Instances with several network interfaces get no public IP, so nodes sit in private subnets and
  reach AWS APIs through VPC endpoints (and/or NAT).
- The EFA security group must allow all traffic in and out to itself
  (https://docs.aws.amazon.com/batch/latest/userguide/efa.html).
- FSx for Lustre needs TCP 988 and 1018-1023 from its clients and itself (the FSx docs list
  1018-1023; older guides and templates say 1021-1023, which this range contains):
  https://docs.aws.amazon.com/fsx/latest/LustreGuide/limit-access-security-groups.html
- One AZ, one cluster placement group, FSx in the same subnet.
"""

from __future__ import annotations

from aws_cdk import RemovalPolicy
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_logs as logs
from constructs import Construct

from stacks.config import NetworkConfig
from stacks.constructs.retention import retention_days

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


class TrainingNetwork(Construct):
    """Public attributes: vpc, training_subnet, training_subnets (SubnetSelection of the one
    training subnet), efa_security_group (nodes; EFA interfaces), fsx_security_group,
    placement_group, endpoint_security_group (None when no interface endpoints)."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: NetworkConfig,
        availability_zones: tuple[str, ...],
    ) -> None:
        super().__init__(scope, construct_id)
        training_az = availability_zones[0]

        # -- VPC ---------------------------------------------------------------------------
        if config.vpc_id is not None:
            # Only when configured: a lookup needs credentials once, then cdk.context.json.
            self.vpc = ec2.Vpc.from_lookup(self, "Vpc", vpc_id=config.vpc_id)
            self.training_subnet = ec2.Subnet.from_subnet_attributes(
                self,
                "TrainingSubnet",
                subnet_id=str(config.training_subnet_id),
                availability_zone=training_az,
            )
        else:
            private_type = (
                ec2.SubnetType.PRIVATE_WITH_EGRESS if config.nat_gateways > 0 else ec2.SubnetType.PRIVATE_ISOLATED
            )
            subnets = [ec2.SubnetConfiguration(name="Private", subnet_type=private_type, cidr_mask=config.private_subnet_mask)]
            if config.nat_gateways > 0:
                subnets.insert(0, ec2.SubnetConfiguration(name="Public", subnet_type=ec2.SubnetType.PUBLIC, cidr_mask=24))
            self.vpc = ec2.Vpc(
                self,
                "Vpc",
                ip_addresses=ec2.IpAddresses.cidr(config.cidr),
                availability_zones=list(availability_zones),
                nat_gateways=config.nat_gateways,
                subnet_configuration=subnets,
                # Private DNS of the interface endpoints needs both.
                enable_dns_hostnames=True,
                enable_dns_support=True,
                restrict_default_security_group=True,
            )
            self.training_subnet = self.vpc.select_subnets(
                subnet_type=private_type, availability_zones=[training_az]
            ).subnets[0]
        self.training_subnets = ec2.SubnetSelection(subnets=[self.training_subnet])

        # -- Security groups ---------------------------------------------------------------
        # allow_all_outbound=False so the template states exactly what nodes may reach.
        self.efa_security_group = ec2.SecurityGroup(
            self,
            "EfaSecurityGroup",
            vpc=self.vpc,
            description="Trainium nodes and EFA interfaces: all traffic to and from itself",
            allow_all_outbound=False,
        )
        self.efa_security_group.add_ingress_rule(
            self.efa_security_group, ec2.Port.all_traffic(), "EFA/collectives: all traffic from itself"
        )
        self.efa_security_group.add_egress_rule(
            self.efa_security_group, ec2.Port.all_traffic(), "EFA/collectives: all traffic to itself"
        )
        # HTTPS to AWS APIs (interface endpoints, S3 gateway, NAT when configured).
        self.efa_security_group.add_egress_rule(ec2.Peer.any_ipv4(), ec2.Port.tcp(443), "HTTPS to AWS APIs")

        self.fsx_security_group = ec2.SecurityGroup(
            self,
            "FsxSecurityGroup",
            vpc=self.vpc,
            description="FSx for Lustre: LNET from Trainium nodes and between file servers",
            allow_all_outbound=False,
        )
        for low, high in LUSTRE_PORTS:
            port = ec2.Port.tcp(low) if low == high else ec2.Port.tcp_range(low, high)
            self.fsx_security_group.add_ingress_rule(self.efa_security_group, port, "Lustre from nodes")
            self.fsx_security_group.add_ingress_rule(self.fsx_security_group, port, "Lustre between file servers")
            self.fsx_security_group.add_egress_rule(self.fsx_security_group, port, "Lustre between file servers")
            self.fsx_security_group.add_egress_rule(self.efa_security_group, port, "Lustre replies to nodes")
            self.efa_security_group.add_egress_rule(self.fsx_security_group, port, "Lustre client to FSx")

        # -- Placement group: all nodes of a job on one low-latency network spine ----------
        self.placement_group = ec2.PlacementGroup(
            self, "ClusterPlacementGroup", strategy=ec2.PlacementGroupStrategy.CLUSTER
        )

        # -- Endpoints (new VPC only: an existing VPC usually has them, and a second endpoint
        #    with private DNS for the same service fails to create) -------------------------
        self.endpoint_security_group: ec2.SecurityGroup | None = None
        if config.vpc_id is None and config.vpc_endpoints:
            self.vpc.add_gateway_endpoint("S3", service=ec2.GatewayVpcEndpointAwsService.S3)
            self.endpoint_security_group = ec2.SecurityGroup(
                self,
                "EndpointSecurityGroup",
                vpc=self.vpc,
                description="Interface VPC endpoints: HTTPS from Trainium nodes",
                allow_all_outbound=False,
            )
            self.endpoint_security_group.add_ingress_rule(
                self.efa_security_group, ec2.Port.tcp(443), "HTTPS from Trainium nodes"
            )
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

        # -- Flow logs ---------------------------------------------------------------------
        flow_log_group = logs.LogGroup(
            self,
            "FlowLogGroup",
            retention=retention_days(config.flow_log_retention_days),
            removal_policy=RemovalPolicy.RETAIN,
        )
        ec2.FlowLog(
            self,
            "FlowLog",
            resource_type=ec2.FlowLogResourceType.from_vpc(self.vpc),
            destination=ec2.FlowLogDestination.to_cloud_watch_logs(flow_log_group),
            traffic_type=ec2.FlowLogTrafficType.ALL,
        )
