"""Contracts across the stacks, the entrypoint and the steps, on the real dev stage templates:
every Batch parameter a job definition's command needs is supplied; the embed shard count travels
with the array size; the stall alarm watches exactly the RunId the train job's heartbeat emits."""

from __future__ import annotations

import io
import json
import re
import subprocess
from pathlib import Path

import pytest

from infra_synth import REPO_ROOT
from pipeline_steps.heartbeat import Heartbeat
from stacks.constructs.training_pipeline import STEPS

ENTRYPOINT = REPO_ROOT / "training_image" / "entrypoint.sh"


def _definition(template, logical_id_prefix: str) -> dict:
    """A state machine's ASL with every CloudFormation token replaced by "X"."""
    (resource,) = [r for k, r in template.find_resources("AWS::StepFunctions::StateMachine").items()
                   if k.startswith(logical_id_prefix)]
    body = resource["Properties"]["DefinitionString"]
    parts = body["Fn::Join"][1] if isinstance(body, dict) else [body]
    return json.loads("".join(p if isinstance(p, str) else "X" for p in parts))


def _job_definition(template, key: str) -> dict:
    (job,) = [r["Properties"] for k, r in template.find_resources("AWS::Batch::JobDefinition").items()
              if k.startswith(f"Jobs{key.capitalize()}JobDefinition")]
    return job


def _command(job: dict) -> list[str]:
    if "NodeProperties" in job:
        return job["NodeProperties"]["NodeRangeProperties"][0]["Container"]["Command"]
    return job["ContainerProperties"]["Command"]


@pytest.fixture(scope="module")
def pipeline(dev_templates):
    return _definition(dev_templates["pipeline"], "TrainingPipelineStateMachine")


@pytest.mark.parametrize("step", STEPS, ids=lambda s: s.name)
def test_every_command_parameter_is_supplied(dev_templates, pipeline, step):
    """A `Ref::x` nobody fills stays literal and the entrypoint refuses it (exit 78) at run time."""
    job = _job_definition(dev_templates["compute"], step.job_definition)
    needed = {m for arg in _command(job) for m in re.findall(r"Ref::(\w+)", arg)}
    submitted = {k.removesuffix(".$") for k in pipeline["States"][step.name]["Parameters"]["Parameters"]}
    missing = needed - submitted - set(job.get("Parameters", {}))
    assert not missing, f"{step.name}: {sorted(missing)} neither submitted nor defaulted"


def test_embed_shard_count_is_the_array_size(dev_templates, pipeline):
    params = pipeline["States"]["Embed"]["Parameters"]
    size_path = params["ArrayProperties"]["Size.$"]
    # Batch parameters are strings: the same input field, formatted.
    assert params["Parameters"]["shard_count.$"] == f"States.Format('{{}}', {size_path})"
    command = _command(_job_definition(dev_templates["compute"], "embed"))
    assert command[command.index("--shard-count") + 1] == "Ref::shard_count"


def test_stall_alarm_watches_the_run_id_the_train_job_emits(dev_templates, pipeline, tmp_path):
    # 1. The alarm's RunId comes from the train job's `run_id` parameter in the Batch event.
    watchdog = _definition(dev_templates["pipeline"], "StallWatchdogStateMachine")
    dimensions = {d["Name"]: d for d in watchdog["States"]["ArmStallAlarm"]["Parameters"]["Dimensions"]}
    assert dimensions["Stage"]["Value"] == "dev"
    assert dimensions["RunId"]["Value.$"] == "$.watch.run_id"
    assert watchdog["States"]["WatchRecord"]["Parameters"]["run_id.$"] == "$.detail.parameters.run_id"
    # 2. The state machine fills that parameter with the run id.
    assert pipeline["States"]["Train"]["Parameters"]["Parameters"]["run_id.$"] == "$.run_id"
    # 3. Batch substitutes it into the train command; the entrypoint exports PIPELINE_RUN_ID ...
    train = _job_definition(dev_templates["compute"], "train")
    parameters = {**train["Parameters"], "run_id": "exec-2026-01-01-catalog-v7"}
    command = [re.sub(r"Ref::(\w+)", lambda m: parameters[m.group(1)], arg) for arg in _command(train)]
    env_vars = {e["Name"]: e["Value"] for e in
                train["NodeProperties"]["NodeRangeProperties"][0]["Container"]["Environment"]}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text('#!/usr/bin/env bash\necho "$PIPELINE_STAGE $PIPELINE_RUN_ID"\n')
    (bin_dir / "torchrun").chmod(0o755)
    result = subprocess.run(["bash", str(ENTRYPOINT), *command], capture_output=True, text=True, check=False,
                            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "TMPDIR": str(tmp_path),
                                 "NPROC_PER_NODE": env_vars["NPROC_PER_NODE"],
                                 "PIPELINE_STAGE": env_vars["PIPELINE_STAGE"]})
    assert result.returncode == 0, result.stderr
    stage, run_id = result.stdout.split()
    # 4. ... and the heartbeat publishes exactly those dimension values.
    stream = io.StringIO()
    Heartbeat(environ={"AWS_BATCH_JOB_ID": "j", "PIPELINE_STAGE": stage, "PIPELINE_RUN_ID": run_id},
              stream=stream).emit(step=1)
    record = json.loads(stream.getvalue())
    assert ["Stage", "RunId"] in record["_aws"]["CloudWatchMetrics"][0]["Dimensions"]
    assert (record["Stage"], record["RunId"]) == ("dev", "exec-2026-01-01-catalog-v7")


def test_every_job_gets_the_compile_cache_base_the_steps_read(dev_templates):
    """pipeline_steps.distributed derives NEURON_COMPILE_CACHE_URL (keyed by compiler version) from
    this variable; `compile` and `train` must see the same base or training recompiles."""
    from pipeline_steps.distributed import NEURON_CACHE_BASE_ENV

    for key in ("sanity", "compile", "train", "prepare", "validate", "embed", "canary"):
        job = _job_definition(dev_templates["compute"], key)
        container = (job["NodeProperties"]["NodeRangeProperties"][0]["Container"] if "NodeProperties" in job
                     else job["ContainerProperties"])
        env = {e["Name"]: e["Value"] for e in container["Environment"]}
        value = json.dumps(env[NEURON_CACHE_BASE_ENV])
        assert value.startswith('{"Fn::Join": ["", ["s3://"') and value.endswith('"/neuron"]]}'), (key, value)


@pytest.mark.parametrize("stage", ["dev", "prod"])
def test_pipeline_outputs_are_what_the_cli_reads(request, stage):
    """trainium-runs (pipeline_ops/cli.py) reads these outputs of the stack <project>-<stage>-Pipeline."""
    from pipeline_ops import cli

    stacks, config = request.getfixturevalue(f"{stage}_stage"), request.getfixturevalue(f"{stage}_config")
    assert stacks["pipeline"].stack_name == f"{cli.DEFAULT_PROJECT}-{stage}-Pipeline"
    outputs = request.getfixturevalue(f"{stage}_templates")["pipeline"].to_json()["Outputs"]
    assert outputs["TrainingInstanceType"]["Value"] == config.compute.training_instance_type
    assert outputs["SingleNodeInstanceType"]["Value"] == config.compute.single_node_instance_type
    source = Path(cli.__file__).read_text()
    assert '"TrainingInstanceType"' in source and '"SingleNodeInstanceType"' in source
    if config.pipeline.mlflow_managed:
        arn = outputs["MlflowTrackingServerArn"]["Value"]
        assert "TrackingServerArn" in json.dumps(arn)  # the compute stack's server, imported
    else:
        assert "MlflowTrackingServerArn" not in outputs
