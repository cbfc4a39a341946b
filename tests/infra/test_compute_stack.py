"""Compute: EFA launch templates, compute environments, fair share, queues, job definitions."""

from __future__ import annotations

import base64
import json
import re

import pytest
from aws_cdk import App, CfnOutput, CfnResource, Environment, Stack
from aws_cdk.assertions import Annotations, Match, Template

from infra_synth import TEST_ONLY_AMI_ID, stage_config
from stacks.config import INSTANCE_TYPES, NEURON_AMI_SSM_PARAMETER, ComputeConfig, NeuronAmi, StageConfig
from stacks.constructs.trainium_compute import neuron_machine_image
from stacks.constructs.efa_launch_template import network_interfaces, node_boot_script
from stacks.constructs.job_definitions import EFA_ENVIRONMENT, construct_name, device_list
from pipeline_steps.contract import PIPELINE_STEPS

PREPARE_JOBS = tuple(step.name for step in PIPELINE_STEPS if step.command == "prepare")


def _resources(template, resource_type):
    return template.find_resources(resource_type)


def _training_launch_template(template):
    lts = [r for r in _resources(template, "AWS::EC2::LaunchTemplate").values()
           if "NetworkInterfaces" in r["Properties"]["LaunchTemplateData"]]
    assert len(lts) == 1
    return lts[0]["Properties"]["LaunchTemplateData"]


def _job_definition(template, step):
    matches = {k: r for k, r in _resources(template, "AWS::Batch::JobDefinition").items()
               if k.startswith(f"Jobs{construct_name(step)}JobDefinition")}
    assert len(matches) == 1, (step, list(matches))
    return next(iter(matches.values()))["Properties"]


def _container(job_definition):
    if "NodeProperties" in job_definition:
        ranges = job_definition["NodeProperties"]["NodeRangeProperties"]
        assert len(ranges) == 1
        return ranges[0]["Container"]
    return job_definition["ContainerProperties"]


# -- Launch templates ------------------------------------------------------------------------
@pytest.mark.parametrize(("templates_fixture", "efa"), [("dev_templates", 8), ("prod_templates", 16)])
def test_efa_interfaces_from_the_table(request, templates_fixture, efa):
    data = _training_launch_template(request.getfixturevalue(templates_fixture)["compute"])
    interfaces = data["NetworkInterfaces"]
    assert len(interfaces) == efa
    assert [i["NetworkCardIndex"] for i in interfaces] == list(range(efa))
    assert [i["DeviceIndex"] for i in interfaces] == [0] + [1] * (efa - 1)
    assert {i["InterfaceType"] for i in interfaces} == {"efa"}
    assert all(len(i["Groups"]) == 1 and i["Groups"] == interfaces[0]["Groups"] for i in interfaces)
    assert "SecurityGroupIds" not in data and "SecurityGroups" not in data


def test_interfaces_helper_without_efa():
    assert network_interfaces(INSTANCE_TYPES["trn1.2xlarge"], "sg-1") == []


def test_launch_templates_root_volume_imdsv2(dev_templates):
    lts = _resources(dev_templates["compute"], "AWS::EC2::LaunchTemplate")
    assert len(lts) == 2
    for lt in lts.values():
        data = lt["Properties"]["LaunchTemplateData"]
        assert data["MetadataOptions"]["HttpTokens"] == "required"
        assert data["InstanceInitiatedShutdownBehavior"] == "terminate"
        (root,) = data["BlockDeviceMappings"]
        assert root["DeviceName"] == "/dev/xvda"
        assert root["Ebs"]["VolumeType"] == "gp3" and root["Ebs"]["VolumeSize"] >= 200 and root["Ebs"]["Encrypted"]
        assert "UserData" in data


def test_user_data_is_mime_multipart(dev_templates):
    for lt in _resources(dev_templates["compute"], "AWS::EC2::LaunchTemplate").values():
        user_data = json.dumps(lt["Properties"]["LaunchTemplateData"]["UserData"])
        assert "Content-Type: multipart/mixed" in user_data and "text/x-shellscript" in user_data


def test_boot_script_fails_fast_and_mounts_fsx():
    spec = INSTANCE_TYPES["trn1n.32xlarge"]
    rendered = node_boot_script(spec, min_driver="2.27", fsx_dns_name="fs-1.fsx", fsx_mount_name="abcd")
    assert "EXPECTED_EFA=16" in rendered and "EXPECTED_NEURON=16" in rendered and "MIN_DRIVER=2.27" in rendered
    assert "sort -V" in rendered and "shutdown -h now" in rendered
    assert 'mount -t lustre -o noatime,flock "$FSX_DNS@tcp:/$FSX_MOUNT_NAME" "$ROOT$FSX"' in rendered
    # Executed for every host type and failure path in test_node_boot.py.
    assert "for attempt in $(seq 1 10)" in rendered
    assert "dnf install -y lustre-client" in rendered


# -- Compute environments --------------------------------------------------------------------
def _compute_environments(template):
    ces = _resources(template, "AWS::Batch::ComputeEnvironment")
    by_type = {r["Properties"]["ComputeResources"]["InstanceTypes"][0]: r["Properties"] for r in ces.values()}
    assert len(by_type) == len(ces) == 2
    return by_type


def test_training_compute_environment(dev_templates, dev_config):
    ce = _compute_environments(dev_templates["compute"])["trn1.32xlarge"]
    resources = ce["ComputeResources"]
    # aws/aws-cdk#21577: security groups live on the launch template's interfaces only.
    assert "SecurityGroupIds" not in resources
    assert resources["InstanceTypes"] == ["trn1.32xlarge"]  # no "optimal"
    assert resources["Type"] == "EC2"  # On-Demand
    assert resources["MaxvCpus"] == 128 * dev_config.compute.max_nodes
    assert resources["MinvCpus"] == 0
    assert "PlacementGroup" in resources and len(resources["Subnets"]) == 1
    (ec2_configuration,) = resources["Ec2Configuration"]
    assert ec2_configuration["ImageType"] == "ECS_AL2023"
    assert ec2_configuration["ImageIdOverride"] == _expected_image(dev_templates["compute"], dev_config)
    assert resources["UpdateToLatestImageVersion"] is False
    lt = resources["LaunchTemplate"]
    assert lt["Version"] == {"Fn::GetAtt": [lt["LaunchTemplateId"]["Ref"], "LatestVersionNumber"]}


def _expected_image(template, config):
    """What the config's AMI policy must render: the pinned id, or a Ref to a template parameter
    that CloudFormation resolves from the SSM parameter at deploy time."""
    ami = config.neuron_ami
    if ami.pinned:
        return ami.image_id
    (name,) = [k for k, p in template.to_json().get("Parameters", {}).items()
               if p["Type"] == "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>"]
    assert template.to_json()["Parameters"][name]["Default"] == NEURON_AMI_SSM_PARAMETER
    return {"Ref": name}


def test_both_compute_environments_use_the_stage_ami(dev_templates, dev_config, prod_templates, prod_config):
    for templates, config in ((dev_templates, dev_config), (prod_templates, prod_config)):
        expected = _expected_image(templates["compute"], config)
        for ce in _compute_environments(templates["compute"]).values():
            assert ce["ComputeResources"]["Ec2Configuration"][0]["ImageIdOverride"] == expected
        templates["compute"].has_output("NeuronAmiId", {"Value": expected})


def test_prod_uses_its_pin_and_never_the_ssm_parameter(prod_templates, prod_stage):
    assert _expected_image(prod_templates["compute"], stage_config("prod")) == TEST_ONLY_AMI_ID
    assert NEURON_AMI_SSM_PARAMETER not in json.dumps(prod_templates["compute"].to_json())
    Annotations.from_stack(prod_stage["compute"]).has_no_warning("*", Match.string_like_regexp("not pinned"))


def test_unpinned_dev_warns_at_synth(dev_stage, dev_config):
    warnings = Annotations.from_stack(dev_stage["compute"]).find_warning("*", Match.string_like_regexp("not pinned"))
    assert len(warnings) == (0 if dev_config.neuron_ami.pinned else 1)


@pytest.mark.parametrize("pinned", [True, False])
def test_neuron_machine_image_policy(pinned):
    """Both policies in isolation (the stages' outcome depends on the committed pin file)."""
    stack = Stack(App(), "AmiTest", env=Environment(account="123456789012", region="us-west-2"))
    ami = NeuronAmi(image_id=TEST_ONLY_AMI_ID) if pinned else NeuronAmi(ssm_parameter=NEURON_AMI_SSM_PARAMETER)
    image = neuron_machine_image(stack, ami, "us-west-2")
    CfnOutput(stack, "Ami", value=image.get_image(stack).image_id)
    CfnResource(stack, "Placeholder", type="AWS::CloudFormation::WaitConditionHandle")  # a template needs a resource
    template = Template.from_stack(stack)
    warnings = Annotations.from_stack(stack).find_warning("*", Match.string_like_regexp(
        r"not pinned for us-west-2.*scripts/infra_pin_ami.sh us-west-2.*commit stacks/neuron_amis.json"))
    if pinned:
        template.has_output("Ami", {"Value": TEST_ONLY_AMI_ID})
        assert NEURON_AMI_SSM_PARAMETER not in json.dumps(template.to_json()) and not warnings
    else:
        assert _expected_image(template, StageConfig(name="t", region="us-west-2", compute=ComputeConfig(
            allow_unpinned_ami=True))) == template.to_json()["Outputs"]["Ami"]["Value"]
        assert len(warnings) == 1


def test_prod_max_vcpus(prod_templates, prod_config):
    ce = _compute_environments(prod_templates["compute"])["trn1n.32xlarge"]
    assert ce["ComputeResources"]["MaxvCpus"] == 128 * prod_config.compute.max_nodes


def test_single_node_compute_environment(dev_templates):
    ce = _compute_environments(dev_templates["compute"])["trn1.2xlarge"]["ComputeResources"]
    assert len(ce["SecurityGroupIds"]) == 1  # no interfaces in its template: the CE carries the group
    assert "PlacementGroup" not in ce


# -- Fair share and queues -------------------------------------------------------------------
def test_fair_share_policy(dev_templates, dev_config, dev_stage):
    dev_templates["compute"].has_resource_properties(
        "AWS::Batch::SchedulingPolicy",
        {
            "FairsharePolicy": {
                "ComputeReservation": dev_config.compute.compute_reservation,
                "ShareDecaySeconds": dev_config.compute.share_decay_seconds,
                "ShareDistribution": [
                    {"ShareIdentifier": s.identifier, "WeightFactor": s.weight} for s in dev_config.compute.shares
                ],
            }
        },
    )
    assert dev_stage["compute"].share_identifiers == ("production", "experiments")


def test_queues_have_policy_and_cancel_stuck_runnable_jobs(dev_templates, dev_stage, dev_config):
    assert set(dev_stage["compute"].queues) == {"training", "single-node"}
    queues = _resources(dev_templates["compute"], "AWS::Batch::JobQueue")
    assert len(queues) == 2
    (policy_id,) = _resources(dev_templates["compute"], "AWS::Batch::SchedulingPolicy")
    for queue in queues.values():
        props = queue["Properties"]
        assert props["SchedulingPolicyArn"] == {"Fn::GetAtt": [policy_id, "Arn"]}
        actions = props["JobStateTimeLimitActions"]
        assert {a["Reason"] for a in actions} == {
            "CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY",
            "MISCONFIGURATION:COMPUTE_ENVIRONMENT_MAX_RESOURCE",
            "MISCONFIGURATION:JOB_RESOURCE_REQUIREMENT",
        }
        for a in actions:
            assert (a["Action"], a["State"]) == ("CANCEL", "RUNNABLE")
            assert a["MaxTimeSeconds"] == 60 * dev_config.compute.runnable_timeout_minutes


def _json_with_references(value) -> dict:
    """A JSON string property (literal or Fn::Join), every CloudFormation reference replaced by "X"."""
    if isinstance(value, dict):
        value = "".join(p if isinstance(p, str) else "X" for p in value["Fn::Join"][1])
    return json.loads(value)


def _state_machine_definition(pipeline_template) -> dict:
    (machine,) = [r for r in pipeline_template.find_resources("AWS::StepFunctions::StateMachine").values()
                  if "Check_share" in json.dumps(r["Properties"]["DefinitionString"])]
    return _json_with_references(machine["Properties"]["DefinitionString"])


@pytest.mark.parametrize("stage", ["dev", "prod"])
def test_every_submit_names_a_share_the_policy_defines(request, stage):
    # Batch gives an identifier the policy does not define the default weight; the shares would
    # then decide nothing. Every submission must name one of the policy's identifiers.
    templates, cfg = request.getfixturevalue(f"{stage}_templates"), request.getfixturevalue(f"{stage}_config")
    (policy,) = _resources(templates["compute"], "AWS::Batch::SchedulingPolicy").values()
    defined = {s["ShareIdentifier"] for s in policy["Properties"]["FairsharePolicy"]["ShareDistribution"]}
    states = _state_machine_definition(templates["pipeline"])["States"]
    assert states["Defaults"]["Result"]["share"] in defined
    # The input's share is checked before anything is submitted: only defined shares pass.
    (accept,) = states["Check_share"]["Choices"]
    assert {c["StringEquals"] for c in accept["Or"]} == defined
    assert states["Check_share"]["Default"] == "Invalid_share"
    submits = {n: s for n, s in states.items() if s.get("Resource") == "arn:aws:states:::batch:submitJob.sync"}
    assert set(submits) == {step.state for step in PIPELINE_STEPS}
    for name, state in submits.items():
        params = state["Parameters"]
        assert params.get("ShareIdentifier.$") == "$.run.share" or params.get("ShareIdentifier") in defined, name
    for schedule in _resources(templates["pipeline"], "AWS::Scheduler::Schedule").values():  # the canary
        submitted = _json_with_references(schedule["Properties"]["Target"]["Input"])
        assert submitted["ShareIdentifier"] in defined
    assert cfg.pipeline.experiments_share in defined


def test_one_fair_share_queue_per_compute_environment(dev_templates):
    # Share identifiers are not aggregated across queues, so two queues on the training compute
    # environment would make the share weights meaningless.
    queues = _resources(dev_templates["compute"], "AWS::Batch::JobQueue").values()
    environments = [q["Properties"]["ComputeEnvironmentOrder"][0]["ComputeEnvironment"] for q in queues]
    assert len(environments) == len({json.dumps(e, sort_keys=True) for e in environments}) == 2


# -- Job definitions ---------------------------------------------------------------------------
def test_job_definition_keys(dev_stage):
    assert {"sanity", "compile", "train", "validate", "embed", "canary"} <= set(dev_stage["compute"].job_definitions)


@pytest.mark.parametrize(("templates_fixture", "efa", "instance"), [("dev_templates", 8, "trn1.32xlarge"), ("prod_templates", 16, "trn1n.32xlarge")])
@pytest.mark.parametrize("step", ["sanity", "compile", "train"])
def test_multi_node_job_definitions(request, templates_fixture, efa, instance, step):
    job = _job_definition(request.getfixturevalue(templates_fixture)["compute"], step)
    assert job["Type"] == "multinode"
    assert job["NodeProperties"]["MainNode"] == 0
    assert job["NodeProperties"]["NodeRangeProperties"][0]["TargetNodes"] == "0:"
    container = _container(job)
    assert container["InstanceType"] == instance
    devices = container["LinuxParameters"]["Devices"]
    uverbs = [d for d in devices if d["HostPath"].startswith("/dev/infiniband/uverbs")]
    neuron = [d for d in devices if d["HostPath"].startswith("/dev/neuron")]
    assert len(uverbs) == efa and len(neuron) == 16
    assert all(d["ContainerPath"] == d["HostPath"] for d in devices)
    assert all(sorted(d["Permissions"]) == ["mknod", "read", "write"] for d in uverbs)
    assert all(sorted(d["Permissions"]) == ["read", "write"] for d in neuron)
    assert container["LinuxParameters"]["SharedMemorySize"] >= 1024
    assert {u["Name"]: (u["SoftLimit"], u["HardLimit"]) for u in container["Ulimits"]} == {
        "memlock": (-1, -1), "nofile": (65535, 65535)
    }
    assert container.get("Privileged") in (None, False)
    env = {e["Name"]: e["Value"] for e in container["Environment"]}
    assert {k: env[k] for k in EFA_ENVIRONMENT} == dict(EFA_ENVIRONMENT)
    assert env["NPROC_PER_NODE"] == "32"
    assert container["MountPoints"] == [{"ContainerPath": "/fsx", "SourceVolume": "fsx"}]
    assert container["Volumes"] == [{"Host": {"SourcePath": "/fsx"}, "Name": "fsx"}]
    assert container["Command"][:3] == [step, "--run-dir", "/fsx/runs/Ref::run_id"]


@pytest.mark.parametrize("step", ["sanity", "compile", "train", *PREPARE_JOBS, "validate", "embed", "export", "canary"])
def test_retry_strategy_and_timeouts(dev_templates, dev_config, step):
    job = _job_definition(dev_templates["compute"], step)
    assert job["RetryStrategy"] == {
        "Attempts": dev_config.compute.retry_attempts,
        "EvaluateOnExit": [
            {"Action": "RETRY", "OnStatusReason": "Host EC2*"},
            {"Action": "RETRY", "OnExitCode": "75"},
            {"Action": "EXIT", "OnExitCode": "*"},
        ],
    }
    hours = {"train": dev_config.compute.train_attempt_timeout_hours, "compile": 3 * dev_config.compute.short_attempt_timeout_hours}
    assert job["Timeout"] == {"AttemptDurationSeconds": 3600 * hours.get(step, dev_config.compute.short_attempt_timeout_hours)}


@pytest.mark.parametrize("step", [*PREPARE_JOBS, "validate", "embed", "export", "canary"])
def test_single_node_job_definitions(dev_templates, step):
    job = _job_definition(dev_templates["compute"], step)
    assert job["Type"] == "container"
    container = _container(job)
    devices = container["LinuxParameters"]["Devices"]
    assert [d["HostPath"] for d in devices] == ["/dev/neuron0"]
    env = {e["Name"]: e["Value"] for e in container["Environment"]}
    assert env["NPROC_PER_NODE"] == "2" and "FI_PROVIDER" not in env
    assert {"Type": "VCPU", "Value": "8"} in container["ResourceRequirements"]
    if step == "canary":
        assert container["Command"][0] == "sanity"


def test_optional_parameters_have_empty_defaults(dev_templates):
    train = _job_definition(dev_templates["compute"], "train")
    assert train["Parameters"] == {"init_from": "", "max_steps": ""}


@pytest.mark.parametrize("templates_fixture", ["dev_templates", "prod_templates"])
def test_compile_and_train_run_the_stage_preset_precision_and_compiler_flags(request, templates_fixture):
    """Baked in from the stage config, not Batch parameters: a submission cannot give Compile and
    Train different values (the compile cache would then miss)."""
    stage = request.getfixturevalue(templates_fixture.replace("templates", "config"))
    config = stage.training
    # The compiler target is the training instance family's (prod trains on trn1n, dev on trn1).
    target = {"trn1.32xlarge": "trn1", "trn1n.32xlarge": "trn1n"}[stage.compute.training_instance_type]
    for step in ("compile", "train"):
        container = _container(_job_definition(request.getfixturevalue(templates_fixture)["compute"], step))
        command = container["Command"]
        assert command[command.index("--preset") + 1] == config.preset == "base"
        assert "--bf16" in command and config.precision == "bf16"
        env = {e["Name"]: e["Value"] for e in container["Environment"]}
        assert env["NEURON_CC_FLAGS"] == f"--target {target} {config.neuron_cc_flags}"
        assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
        # Ranks waiting at the rendezvous while rank 0 writes a checkpoint wait inside an execution.
        assert env["NEURON_RT_EXEC_TIMEOUT"] == "600"


def test_embed_takes_the_shard_count_as_a_parameter(dev_templates):
    """Batch sets AWS_BATCH_JOB_ARRAY_INDEX on array children but no ARRAY_SIZE (and rejects
    AWS_BATCH* overrides): the count must arrive in the command, from the `shard_count` parameter.
    Its default "" makes the entrypoint drop the flag (embed then refuses an index without a count)."""
    embed = _job_definition(dev_templates["compute"], "embed")
    command = _container(embed)["Command"]
    assert command[command.index("--shard-count") + 1] == "Ref::shard_count"
    assert embed["Parameters"]["shard_count"] == ""


def test_export_writes_the_sentence_transformers_folders_beside_the_run_and_uploads_them(dev_templates):
    """The run dir's newest checkpoint -> /fsx/runs/<run>/export, uploaded by the step itself to
    the prefix the state machine passes (FSx auto-export to S3 is asynchronous)."""
    export = _job_definition(dev_templates["compute"], "export")
    command = _container(export)["Command"]
    assert command[:3] == ["export", "--run-dir", "/fsx/runs/Ref::run_id"]  # closes the run's MLflow run
    assert command[command.index("--checkpoint") + 1] == "/fsx/runs/Ref::run_id"
    assert command[command.index("--out") + 1] == "/fsx/runs/Ref::run_id/export"
    assert command[command.index("--s3-uri") + 1] == "Ref::export_s3_uri"
    assert export["Parameters"] == {"export_s3_uri": ""}


def test_device_list_helper():
    devices = device_list(INSTANCE_TYPES["trn1n.32xlarge"])
    assert len(devices) == 16 + 16


# -- IAM ---------------------------------------------------------------------------------------
def _job_role_statements(template):
    policies = [p for k, p in _resources(template, "AWS::IAM::Policy").items() if k.startswith("JobsJobRole")]
    assert len(policies) == 1
    return policies[0]["Properties"]["PolicyDocument"]["Statement"]


def test_job_role_least_privilege(dev_templates):
    statements = _job_role_statements(dev_templates["compute"])
    text = json.dumps(statements)
    for s in statements:
        assert s["Effect"] == "Allow"
        assert s["Resource"] != "*"
        assert "s3:*" not in json.dumps(s["Action"]) and "kms:*" not in json.dumps(s["Action"])
    # Data is read-only for the jobs.
    for s in statements:
        resources = json.dumps(s["Resource"])
        if "DataBucket" in resources:
            assert not any(a.startswith(("s3:Put", "s3:Delete")) for a in s["Action"]), s
    assert "ArtifactsBucket" in text and "CacheBucket" in text and "kms:Decrypt" in text


def _object_keys(resource) -> str:
    """'<bucket>/<key pattern>' of an object ARN in a policy (Fn::Join of the bucket ARN and the keys)."""
    bucket_arn, keys = resource["Fn::Join"][1]
    (bucket,) = set(re.findall(r"(Data|Artifacts|Cache)Bucket", json.dumps(bucket_arn)))
    return f"{bucket}Bucket{keys}"


@pytest.mark.parametrize("stage", ["dev", "prod"])
def test_steps_write_only_below_runs_never_the_published_pointer(dev_templates, prod_templates, stage):
    # models/current.json is written by the pipeline's Publish state alone (conditional writes);
    # a step may write its run's outputs (runs/), the compile cache and, with MLflow, its artifacts.
    statements = _job_role_statements({"dev": dev_templates, "prod": prod_templates}[stage]["compute"])
    writes = {_object_keys(r) for s in statements for r in (s["Resource"] if isinstance(s["Resource"], list)
                                                             else [s["Resource"]])
              if any(a.startswith(("s3:Put", "s3:Delete", "s3:Abort")) for a in s["Action"]) and "Fn::Join" in r}
    expected = {"ArtifactsBucket/runs/*", "CacheBucket/neuron/*"} | ({"ArtifactsBucket/mlflow/*"} if stage == "prod"
                                                                     else set())
    assert writes == expected


def test_no_public_ip_or_admin(dev_templates):
    text = json.dumps(dev_templates["compute"].to_json())
    assert "AdministratorAccess" not in text
    assert base64  # launch template user data is Base64 in the template (checked via the helper above)
    dev_templates["compute"].resource_count_is("AWS::EC2::SecurityGroup", 0)
    dev_templates["compute"].has_resource_properties(
        "AWS::Logs::LogGroup", {"RetentionInDays": Match.any_value()}
    )


# -- Experiment tracking (MLflow) --------------------------------------------------------------
JOB_KEYS = ("sanity", "compile", "train", *PREPARE_JOBS, "validate", "embed", "export", "canary")
MULTI_NODE_KEYS = ("sanity", "compile", "train")


def _env(template, key):
    return {e["Name"]: e["Value"] for e in _container(_job_definition(template, key))["Environment"]}


@pytest.mark.parametrize("stage", ["dev", "prod"])
def test_every_job_gets_the_tracking_env_the_steps_read(request, stage):
    """pipeline_steps/tracking.py reads these; INSTANCE_TYPE is the job's own compute environment's
    type (from the instance table), which is also what the CLI prices the job by."""
    from infra_synth import TEST_IMAGE

    templates, config = request.getfixturevalue(f"{stage}_templates"), request.getfixturevalue(f"{stage}_config")
    for key in JOB_KEYS:
        env = _env(templates["compute"], key)
        expected_type = (config.compute.training_instance_type if key in MULTI_NODE_KEYS
                         else config.compute.single_node_instance_type)
        assert env["INSTANCE_TYPE"] == expected_type, key
        assert env["MLFLOW_EXPERIMENT_NAME"] == f"TrnEmbed-{stage}", key
        assert env["TRAINING_IMAGE_URI"] == TEST_IMAGE, key
        # The commit is baked into the image (Dockerfile ENV), never into the job definitions:
        # a new commit must not change a template by itself.
        assert "GIT_COMMIT" not in env, key
        if stage == "prod":
            logical_id, attribute = env["MLFLOW_TRACKING_URI"]["Fn::GetAtt"]
            assert logical_id.startswith("MlflowServer") and attribute == "TrackingServerArn", key
        else:
            assert "MLFLOW_TRACKING_URI" not in env, key  # each run's file store DIR/mlruns


def test_prod_runs_a_managed_mlflow_server_the_job_role_may_use(prod_templates, prod_stage):
    template = prod_templates["compute"]
    template.resource_count_is("AWS::SageMaker::MlflowTrackingServer", 1)
    template.has_resource_properties("AWS::SageMaker::MlflowTrackingServer", {
        "TrackingServerName": "TrnEmbed-prod",
        "TrackingServerSize": "Small",
        "ArtifactStoreUri": {"Fn::Join": ["", ["s3://", Match.any_value(), "/mlflow"]]},
    })
    job_role = prod_stage["compute"].resolve(prod_stage["compute"].job_role.role_name)
    policies = [p["Properties"] for p in template.find_resources("AWS::IAM::Policy").values()
                if job_role in p["Properties"]["Roles"]]
    statements = [s for p in policies for s in p["PolicyDocument"]["Statement"]]
    (grant,) = [s for s in statements if s["Action"] == "sagemaker-mlflow:*"]
    assert grant["Effect"] == "Allow"
    logical_id, attribute = grant["Resource"]["Fn::GetAtt"]
    assert logical_id.startswith("MlflowServer") and attribute == "TrackingServerArn"


def test_dev_has_no_mlflow_server_and_no_grant(dev_templates):
    template = dev_templates["compute"]
    template.resource_count_is("AWS::SageMaker::MlflowTrackingServer", 0)
    assert "sagemaker-mlflow" not in json.dumps(template.to_json())


def test_a_configured_uri_is_passed_as_is_without_a_server():
    """mlflow_tracking = any other string: used as MLFLOW_TRACKING_URI, no server, no grant."""
    from dataclasses import replace

    from infra_synth import TEST_IMAGE, cdk_json_context, stage_config
    from stacks.stages import build_stage

    uri = "https://mlflow.example.internal"
    cfg = stage_config("dev")
    cfg = replace(cfg, pipeline=replace(cfg.pipeline, mlflow_tracking=uri))
    stacks = build_stage(App(context=cdk_json_context()), cfg, image_uri=TEST_IMAGE)
    template = Template.from_stack(stacks["compute"])
    template.resource_count_is("AWS::SageMaker::MlflowTrackingServer", 0)
    for key in JOB_KEYS:
        assert _env(template, key)["MLFLOW_TRACKING_URI"] == uri, key
    assert "MlflowTrackingServerArn" not in Template.from_stack(stacks["pipeline"]).to_json()["Outputs"]


@pytest.mark.parametrize("templates_fixture", ["dev_templates", "prod_templates"])
def test_every_log_group_is_kms_encrypted_by_a_key_logs_may_use(request, templates_fixture):
    t = request.getfixturevalue(templates_fixture)["compute"]
    groups = t.find_resources("AWS::Logs::LogGroup")
    assert groups
    keys = t.find_resources("AWS::KMS::Key")
    for group in groups.values():
        key_ref = group["Properties"]["KmsKeyId"]
        key = keys[key_ref["Fn::GetAtt"][0]]
        assert key["Properties"]["EnableKeyRotation"] is True
        statements = key["Properties"]["KeyPolicy"]["Statement"]
        logs = [s for s in statements if "logs." in json.dumps(s.get("Principal", {}))]
        assert logs and "kms:GenerateDataKey*" in logs[0]["Action"], statements
        assert "kms:EncryptionContext:aws:logs:arn" in json.dumps(logs[0]["Condition"])


# -- Reserved capacity -----------------------------------------------------------------------
@pytest.mark.parametrize("templates_fixture", ["dev_templates", "prod_templates"])
def test_nodes_launch_on_demand_into_open_reservations_of_the_placement_group(request, templates_fixture):
    # Batch ignores a launch template's instance market options, which a Capacity Block needs, so
    # the templates set neither market options nor reservation targeting: open On-Demand Capacity
    # Reservations created in the stage's cluster placement group (its name is a Network output)
    # are used by matching launches without either.
    templates = request.getfixturevalue(templates_fixture)
    for lt in _resources(templates["compute"], "AWS::EC2::LaunchTemplate").values():
        data = lt["Properties"]["LaunchTemplateData"]
        assert "CapacityReservationSpecification" not in data and "InstanceMarketOptions" not in data
    (group,) = templates["network"].find_resources("AWS::EC2::PlacementGroup")
    outputs = templates["network"].find_outputs("TrainingPlacementGroupName")
    assert [o["Value"] for o in outputs.values()] == [{"Fn::GetAtt": [group, "GroupName"]}]


def test_trn_vcpu_quota_a_stage_needs(dev_config, prod_config):
    # The Running On-Demand Trn instances quota is in vCPUs: the largest job needs vCPUs x max nodes.
    assert dev_config.compute.training_vcpus_needed == 128 * 2
    assert prod_config.compute.training_vcpus_needed == 128 * 8
