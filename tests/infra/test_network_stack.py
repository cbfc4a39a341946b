"""Network: private training subnet in a zone chosen by ID, placement group, the security groups
of nodes, containers and FSx, endpoints, flow logs."""

from __future__ import annotations

import pytest
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
    t.has_resource_properties("AWS::EC2::Subnet", {"CidrBlock": Match.string_like_regexp(r"/20$")})


def test_subnets_name_their_zone_by_id_never_by_name(dev_templates, prod_templates, dev_config):
    # us-east-1a is a different physical zone in every account; use1-az6 is the same everywhere.
    for templates in (dev_templates, prod_templates):
        subnets = templates["network"].find_resources("AWS::EC2::Subnet")
        assert subnets
        for subnet in subnets.values():
            assert "AvailabilityZone" not in subnet["Properties"]
            assert subnet["Properties"]["AvailabilityZoneId"] == dev_config.training_az_id


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


def _group_ids(t) -> dict[str, dict]:
    vpc = next(iter(t.find_resources("AWS::EC2::VPC")))
    return {
        "fsx": {"Fn::GetAtt": [_sg_logical_id(t, "FSx for Lustre"), "GroupId"]},
        "nodes": {"Fn::GetAtt": [_sg_logical_id(t, "Trainium nodes"), "GroupId"]},
        "containers": {"Fn::GetAtt": [vpc, "DefaultSecurityGroup"]},
        "endpoints": {"Fn::GetAtt": [_sg_logical_id(t, "Interface VPC endpoints"), "GroupId"]},
    }


def _rules(t, kind: str, group: dict) -> list[dict]:
    """Properties of the standalone Ingress/Egress rules on `group`."""
    found = t.find_resources(f"AWS::EC2::SecurityGroup{kind}", {"Properties": {"GroupId": group}})
    return [r["Properties"] for r in found.values()]


@pytest.mark.parametrize("client", ["nodes", "containers"])
def test_lustre_ports_are_symmetric_between_fsx_and_each_client(dev_templates, client):
    # FSx for Lustre: the file system's group and its clients' groups both need 988 and 1018-1023,
    # inbound and outbound, to each other.
    t = dev_templates["network"]
    g = _group_ids(t)
    fsx, peer = g["fsx"], g[client]
    for low, high in ((988, 988), (1018, 1023)):
        port = {"IpProtocol": "tcp", "FromPort": low, "ToPort": high}
        t.has_resource_properties("AWS::EC2::SecurityGroupIngress", {**port, "GroupId": fsx, "SourceSecurityGroupId": peer})
        t.has_resource_properties("AWS::EC2::SecurityGroupEgress", {**port, "GroupId": fsx, "DestinationSecurityGroupId": peer})
        t.has_resource_properties("AWS::EC2::SecurityGroupEgress", {**port, "GroupId": peer, "DestinationSecurityGroupId": fsx})
        t.has_resource_properties("AWS::EC2::SecurityGroupIngress", {**port, "GroupId": peer, "SourceSecurityGroupId": fsx})


def test_only_nodes_containers_and_file_servers_reach_fsx(dev_templates):
    t = dev_templates["network"]
    g = _group_ids(t)
    sources = {str(r["SourceSecurityGroupId"]) for r in _rules(t, "Ingress", g["fsx"])}
    assert sources == {str(g["fsx"]), str(g["nodes"]), str(g["containers"])}
    ports = {(r["FromPort"], r["ToPort"]) for r in _rules(t, "Ingress", g["fsx"])}
    # (988, 1023): the FSx L2's own rule between its file servers (self only).
    assert ports <= {(988, 988), (1018, 1023), (988, 1023)}


@pytest.mark.parametrize("templates", ["dev_templates", "prod_templates"])
def test_multi_node_containers_reach_each_other_and_aws_apis(request, templates):
    # MNP containers use awsvpc: their interfaces get the VPC's default group, because the training
    # compute environment has no security groups (they sit on the EFA interfaces instead).
    t = request.getfixturevalue(templates)["network"]
    g = _group_ids(t)
    containers = g["containers"]
    t.has_resource_properties(
        "AWS::EC2::SecurityGroupIngress", {"IpProtocol": "-1", "GroupId": containers, "SourceSecurityGroupId": containers}
    )
    t.has_resource_properties(
        "AWS::EC2::SecurityGroupEgress", {"IpProtocol": "-1", "GroupId": containers, "DestinationSecurityGroupId": containers}
    )
    t.has_resource_properties(
        "AWS::EC2::SecurityGroupEgress",
        {"IpProtocol": "tcp", "FromPort": 443, "ToPort": 443, "GroupId": containers, "CidrIp": "0.0.0.0/0"},
    )
    t.has_resource_properties(
        "AWS::EC2::SecurityGroupIngress",
        {"IpProtocol": "tcp", "FromPort": 443, "ToPort": 443, "GroupId": g["endpoints"], "SourceSecurityGroupId": containers},
    )
    # Nothing but the nodes' own containers may come in.
    assert {str(r["SourceSecurityGroupId"]) for r in _rules(t, "Ingress", containers)} == {str(containers), str(g["fsx"])}


def test_container_rules_are_added_after_the_default_rules_are_stripped(dev_templates):
    # restrict_default_security_group's custom resource revokes the default group's rules when it
    # is created; a rule created before it would be revoked with them (or collide with them).
    t = dev_templates["network"]
    containers = _group_ids(t)["containers"]
    restrict = next(iter(t.find_resources("Custom::VpcRestrictDefaultSG")))
    for kind in ("Ingress", "Egress"):
        found = t.find_resources(f"AWS::EC2::SecurityGroup{kind}", {"Properties": {"GroupId": containers}})
        assert found
        for rule in found.values():
            assert restrict in rule.get("DependsOn", []), rule


def test_training_compute_environment_leaves_containers_on_the_default_group(dev_templates):
    ce = dev_templates["compute"].find_resources(
        "AWS::Batch::ComputeEnvironment", {"Properties": {"ComputeResources": {"PlacementGroup": Match.any_value()}}}
    )
    (training,) = ce.values()
    assert "SecurityGroupIds" not in training["Properties"]["ComputeResources"]


@pytest.mark.parametrize("templates", ["dev_templates", "prod_templates"])
def test_nothing_is_open_to_the_world(request, templates):
    for name, t in request.getfixturevalue(templates).items():
        resources = t.to_json()["Resources"].values()
        inline = [rule for r in resources if r["Type"] == "AWS::EC2::SecurityGroup"
                  for rule in r["Properties"].get("SecurityGroupIngress", [])]
        standalone = [r["Properties"] for r in resources if r["Type"] == "AWS::EC2::SecurityGroupIngress"]
        for rule in inline + standalone:
            assert rule.get("CidrIp") != "0.0.0.0/0" and rule.get("CidrIpv6") != "::/0", (name, rule)


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
