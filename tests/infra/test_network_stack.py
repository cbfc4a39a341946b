"""Network: private training subnet, placement group, EFA/FSx security groups, endpoints, flow logs."""

from __future__ import annotations

from aws_cdk.assertions import Match


def _sg_logical_id(template, description_prefix: str) -> str:
    groups = template.find_resources(
        "AWS::EC2::SecurityGroup", {"Properties": {"GroupDescription": Match.string_like_regexp(f"^{description_prefix}")}}
    )
    assert len(groups) == 1, groups
    return next(iter(groups))


def test_private_subnets_only_without_nat(dev_templates):
    t = dev_templates["network"]
    t.resource_count_is("AWS::EC2::NatGateway", 0)
    t.resource_count_is("AWS::EC2::InternetGateway", 0)
    t.all_resources_properties("AWS::EC2::Subnet", {"MapPublicIpOnLaunch": False})
    t.has_resource_properties("AWS::EC2::Subnet", {"AvailabilityZone": "us-east-1a", "CidrBlock": Match.string_like_regexp(r"/20$")})


def test_prod_has_nat(prod_templates):
    prod_templates["network"].resource_count_is("AWS::EC2::NatGateway", 1)


def test_cluster_placement_group(dev_templates):
    dev_templates["network"].has_resource_properties("AWS::EC2::PlacementGroup", {"Strategy": "cluster"})


def test_efa_security_group_all_traffic_to_and_from_itself(dev_templates):
    t = dev_templates["network"]
    efa = _sg_logical_id(t, "Trainium nodes")
    self_ref = {"Fn::GetAtt": [efa, "GroupId"]}
    t.has_resource_properties(
        "AWS::EC2::SecurityGroupIngress", {"IpProtocol": "-1", "GroupId": self_ref, "SourceSecurityGroupId": self_ref}
    )
    t.has_resource_properties(
        "AWS::EC2::SecurityGroupEgress", {"IpProtocol": "-1", "GroupId": self_ref, "DestinationSecurityGroupId": self_ref}
    )


def test_fsx_security_group_lustre_ports(dev_templates):
    t = dev_templates["network"]
    fsx = {"Fn::GetAtt": [_sg_logical_id(t, "FSx for Lustre"), "GroupId"]}
    efa = {"Fn::GetAtt": [_sg_logical_id(t, "Trainium nodes"), "GroupId"]}
    for low, high in ((988, 988), (1018, 1023)):
        for source in (efa, fsx):
            t.has_resource_properties(
                "AWS::EC2::SecurityGroupIngress",
                {"IpProtocol": "tcp", "FromPort": low, "ToPort": high, "GroupId": fsx, "SourceSecurityGroupId": source},
            )
    # Nothing else may reach FSx. (The FSx L2 adds 988-1023 between its own servers, self only.)
    ingress = t.find_resources("AWS::EC2::SecurityGroupIngress", {"Properties": {"GroupId": fsx}})
    rules = {
        (r["Properties"]["FromPort"], r["Properties"]["ToPort"], r["Properties"]["SourceSecurityGroupId"] == fsx)
        for r in ingress.values()
    }
    assert rules <= {(988, 988, True), (988, 988, False), (1018, 1023, True), (1018, 1023, False), (988, 1023, True)}


def test_vpc_endpoints(dev_templates):
    t = dev_templates["network"]
    t.has_resource_properties("AWS::EC2::VPCEndpoint", {"VpcEndpointType": "Gateway"})
    endpoints = t.find_resources("AWS::EC2::VPCEndpoint", {"Properties": {"VpcEndpointType": "Interface"}})
    names = {str(r["Properties"]["ServiceName"]) for r in endpoints.values()}
    for service in ("ecr.api", "ecr.dkr", "logs", "sts", ".ecs'", "ecs-agent", "ecs-telemetry"):
        service = service.strip("'")
        assert any(n.endswith(service) or f".{service}" in n for n in names), (service, names)
    assert len(endpoints) == 7
    for r in endpoints.values():
        assert r["Properties"]["PrivateDnsEnabled"] is True
        assert len(r["Properties"]["SubnetIds"]) == 1  # training AZ only


def test_flow_logs(dev_templates):
    t = dev_templates["network"]
    t.has_resource_properties("AWS::EC2::FlowLog", {"ResourceType": "VPC", "TrafficType": "ALL"})
    t.has_resource_properties("AWS::Logs::LogGroup", {"RetentionInDays": 30})
