"""Deploy twice: each stage synthesized for one deploy and again for the next, with everything that
legitimately changes between deploys (the commit and so the training image, a Neuron AMI pin, a job
definition setting, the largest node count, a new step argument), and the pair checked for what
CloudFormation would refuse or destroy (scripts/infra_diff.py, which `make infra-diff` prints):
no export another stack imports changes value, no stateful resource is replaced, and a compute
environment update lets running jobs finish.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace

import aws_cdk as cdk
import pytest

from scripts.stage_synth import REPO_ROOT, cdk_json_context, stage_config
from stacks.config import StageConfig
from stacks.stages import build_stage

_spec = importlib.util.spec_from_file_location("infra_diff", REPO_ROOT / "scripts" / "infra_diff.py")
infra_diff = sys.modules.setdefault("infra_diff", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(infra_diff)

# Destroying one of these loses data or history (the scheduling policy holds the fair-share usage).
STATEFUL = {"AWS::FSx::FileSystem", "AWS::FSx::DataRepositoryAssociation", "AWS::S3::Bucket", "AWS::KMS::Key",
            "AWS::Logs::LogGroup", "AWS::Batch::SchedulingPolicy"}


def this_deploy(stage: str) -> StageConfig:
    cfg = stage_config(stage)
    return replace(cfg, git_commit="a" * 40, training=replace(cfg.training, precision="fp32"))


def next_deploy(cfg: StageConfig) -> StageConfig:
    compute = cfg.compute
    return replace(
        cfg,
        git_commit="b" * 40,  # a new commit: a new training image
        compute=replace(compute, neuron_ami_ids={**compute.neuron_ami_ids, cfg.region: "ami-0123456789abcdef0"},
                        shared_memory_gib=compute.shared_memory_gib * 2, max_nodes=compute.max_nodes + 1),
        training=replace(cfg.training, precision="bf16"),  # train and compile gain --bf16
    )


def synthesize(cfg: StageConfig, outdir) -> dict[str, dict]:
    """Every stack's template, with the training image built from the commit as `cdk deploy` does."""
    app = cdk.App(context=cdk_json_context(), outdir=str(outdir))
    stacks = build_stage(app, cfg)
    assembly = app.synth()
    return {s.stack_name: assembly.get_stack_by_name(s.stack_name).template for s in stacks.values()}


@pytest.fixture(scope="module", params=["dev", "prod"])
def deploys(request, tmp_path_factory):
    first = this_deploy(request.param)
    second = next_deploy(first)
    return first, synthesize(first, tmp_path_factory.mktemp("first")), second, synthesize(second, tmp_path_factory.mktemp("second"))


def _resources(templates: dict[str, dict], kind: str) -> dict[str, dict]:
    return {f"{stack}/{lid}": r for stack, t in templates.items() for lid, r in t["Resources"].items() if r["Type"] == kind}


def test_the_second_deploy_changes_what_it_should(deploys):
    _, old, _, new = deploys
    old_jobs, new_jobs = (_resources(t, "AWS::Batch::JobDefinition") for t in (old, new))
    assert old_jobs.keys() == new_jobs.keys()
    assert all(old_jobs[k]["Properties"] != new_jobs[k]["Properties"] for k in old_jobs)  # the image, at least
    updated = [u for stack in new for u in infra_diff.compute_environment_updates(stack, old[stack], new[stack])]
    assert len(updated) == 2 and all("Ec2Configuration" in u.because for u in updated)  # the AMI


def test_no_export_another_stack_imports_changes(deploys):
    _, old, _, new = deploys
    assert infra_diff.export_changes(old, new) == []


def test_no_stateful_resource_is_replaced(deploys):
    _, old, _, new = deploys
    destroyed = [r for stack in old for r in infra_diff.replacements(stack, old[stack], new[stack])
                 if r.type in STATEFUL or r.retained]
    assert destroyed == []


def test_compute_environment_updates_let_the_longest_job_finish(deploys):
    _, old, cfg, new = deploys
    hours = {cfg.compute.training_instance_type: max(cfg.compute.train_attempt_timeout_hours,
                                                     cfg.compute.compile_attempt_timeout_hours),
             cfg.compute.single_node_instance_type: cfg.compute.short_attempt_timeout_hours}
    for stack in new:
        for update in infra_diff.compute_environment_updates(stack, old[stack], new[stack]):
            props = new[stack]["Resources"][update.logical_id]["Properties"]
            # An infrastructure update in place needs Batch's service-linked role and this allocation
            # strategy (https://docs.aws.amazon.com/batch/latest/userguide/infrastructure-updates.html).
            assert props["ReplaceComputeEnvironment"] is False and "ServiceRole" not in props
            assert props["ComputeResources"]["AllocationStrategy"] == "BEST_FIT_PROGRESSIVE"
            (instance_type,) = props["ComputeResources"]["InstanceTypes"]
            assert not update.terminate_jobs
            assert update.grace_minutes >= 60 * hours[instance_type], update
