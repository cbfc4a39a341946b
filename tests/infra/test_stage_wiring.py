"""Contracts across the stacks, the entrypoint and the steps, on the real stage templates:
every Batch parameter a job definition's command needs is supplied; the embed shard count travels
with the array size; the stall alarm watches exactly the RunId the train job's heartbeat emits;
Compile traces exactly Train's command with Train's flags and cache; sanity expects the devices
the instance table (shared with the stacks) says its job maps."""

from __future__ import annotations

import fnmatch
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from infra_synth import REPO_ROOT
from pipeline_steps.heartbeat import Heartbeat
from pipeline_steps.contract import INSTANCE_TYPES, PIPELINE_STEPS
from stacks.constructs.job_definitions import construct_name

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
              if k.startswith(f"Jobs{construct_name(key)}JobDefinition")]
    return job


def _command(job: dict) -> list[str]:
    if "NodeProperties" in job:
        return job["NodeProperties"]["NodeRangeProperties"][0]["Container"]["Command"]
    return job["ContainerProperties"]["Command"]


@pytest.fixture(scope="module")
def pipeline(dev_templates):
    return _definition(dev_templates["pipeline"], "TrainingPipelineStateMachine")


@pytest.mark.parametrize("step", PIPELINE_STEPS, ids=lambda s: s.state)
def test_every_command_parameter_is_supplied(dev_templates, pipeline, step):
    """A `Ref::x` nobody fills stays literal and the entrypoint refuses it (exit 78) at run time."""
    job = _job_definition(dev_templates["compute"], step.name)
    needed = {m for arg in _command(job) for m in re.findall(r"Ref::(\w+)", arg)}
    submitted = {k.removesuffix(".$") for k in pipeline["States"][step.state]["Parameters"]["Parameters"]}
    missing = needed - submitted - set(job.get("Parameters", {}))
    assert not missing, f"{step.state}: {sorted(missing)} neither submitted nor defaulted"


@pytest.mark.parametrize("state, key", [("Embed", "embed"), ("PrepareShards", "prepare-shards")])
def test_array_shard_count_is_the_array_size(dev_templates, pipeline, state, key):
    params = pipeline["States"][state]["Parameters"]
    size_path = params["ArrayProperties"]["Size.$"]
    # Batch parameters are strings: the same input field, formatted.
    assert params["Parameters"]["shard_count.$"] == f"States.Format('{{}}', {size_path})"
    command = _command(_job_definition(dev_templates["compute"], key))
    assert command[command.index("--shard-count") + 1] == "Ref::shard_count"


def test_stall_alarm_watches_the_run_id_the_train_job_emits(dev_templates, pipeline, tmp_path):
    # 1. The alarm's RunId comes from the train job's `run_id` parameter in the Batch event.
    watchdog = _definition(dev_templates["pipeline"], "StallWatchdogStateMachine")
    dimensions = {d["Name"]: d for d in watchdog["States"]["ArmStallAlarm"]["Parameters"]["Dimensions"]}
    assert dimensions["Stage"]["Value"] == "dev"
    assert dimensions["RunId"]["Value.$"] == "$.watch.run_id"
    assert watchdog["States"]["WatchRecord"]["Parameters"]["watch"]["run_id.$"] == "$.detail.parameters.run_id"
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
    (bin_dir / "python").write_text('#!/usr/bin/env bash\necho "$PIPELINE_STAGE $PIPELINE_RUN_ID"\n')  # the launcher
    (bin_dir / "python").chmod(0o755)
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


# -- Compile and Train: one training command, one environment -------------------------------------
def _render(value) -> str:
    """A CloudFormation value as a deterministic string (tokens named, not resolved): enough to
    compare two job definitions' values, which reference the same resources."""
    if isinstance(value, str):
        return value
    if "Fn::Join" in value:
        separator, parts = value["Fn::Join"]
        return separator.join(_render(p) for p in parts)
    if "Ref" in value:
        return f"<{value['Ref']}>"
    if "Fn::GetAtt" in value:
        return "<{}.{}>".format(*value["Fn::GetAtt"])
    if "Fn::ImportValue" in value:
        return f"<import {_render(value['Fn::ImportValue'])}>"
    return json.dumps(value, sort_keys=True)


def _container_of(job: dict) -> dict:
    if "NodeProperties" in job:
        return job["NodeProperties"]["NodeRangeProperties"][0]["Container"]
    return job["ContainerProperties"]


def _environment(job: dict) -> dict[str, str]:
    return {e["Name"]: _render(e["Value"]) for e in _container_of(job)["Environment"]}


def _batch_command(job: dict, submitted: dict[str, str]) -> list[str]:
    """The command as Batch runs it: `Ref::name` replaced by the submitted parameter, else the job
    definition's default (https://docs.aws.amazon.com/batch/latest/userguide/job_definition_parameters.html)."""
    values = {**job.get("Parameters", {}), **submitted}
    return [re.sub(r"Ref::(\w+)", lambda m: values[m.group(1)], arg) for arg in _command(job)]


# What the state machine's `Parameters` paths resolve to in one execution.
EXAMPLE_RUN = {"run_id": "exec-2026-01-02-catalog-v8", "data_uri": "/fsx/data/incoming/catalog/v8",
               "init_from": "/fsx/runs/exec-2026-01-01-catalog-v7"}


def _run_entrypoint(command: list[str], env: dict[str, str], tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """Run the image's entrypoint on a child node of a 2-node job, with a fake `python` that records
    the argv and environment it was started with (the launcher's too)."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(parents=True)
    out.mkdir()
    (bin_dir / "python").write_text(
        f"#!/usr/bin/env bash\nprintf '%s\\0' \"$@\" > '{out}/argv'\nenv -0 > '{out}/env'\n")
    (bin_dir / "python").chmod(0o755)
    batch_env = {"AWS_BATCH_JOB_NUM_NODES": "2", "AWS_BATCH_JOB_NODE_INDEX": "1",
                 "AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS": "10.0.0.5"}
    result = subprocess.run(["bash", str(ENTRYPOINT), *command], capture_output=True, text=True, check=False,
                            env={**env, **batch_env, "PATH": f"{bin_dir}:/usr/bin:/bin", "TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    argv = (out / "argv").read_text().split("\0")[:-1]
    recorded = dict(line.split("=", 1) for line in (out / "env").read_text().split("\0") if "=" in line)
    return argv, recorded


def _neuron_cache_location(environ: dict[str, str], monkeypatch) -> str | None:
    """Where a `train` process started with `environ` reads and writes the Neuron cache on Trainium:
    the same function train's main() calls."""
    from pipeline_steps import distributed as dist_lib

    with monkeypatch.context() as patch:
        patch.setattr(dist_lib, "neuron_available", lambda: True)
        patch.setattr(dist_lib.os, "environ", dict(environ))
        return dist_lib.configure_neuron_cache()


@pytest.mark.parametrize("stage", ["dev", "prod"])
def test_compile_traces_exactly_the_training_command_with_the_same_flags_and_cache(request, stage, tmp_path,
                                                                                    monkeypatch):
    """The Neuron cache key hashes the graph and NEURON_CC_FLAGS: Train finds what Compile put there
    only if the trial runs the same command (preset, batch shape, precision), with the same flags,
    against the same cache. Rendered from the synthesized job definitions as Batch runs them."""
    from pipeline_steps import aot_compile

    templates, config = request.getfixturevalue(f"{stage}_templates"), request.getfixturevalue(f"{stage}_config")
    pipeline = _definition(templates["pipeline"], "TrainingPipelineStateMachine")
    submitted = {state: pipeline["States"][state]["Parameters"]["Parameters"] for state in ("Compile", "Train")}
    assert submitted["Compile"] == submitted["Train"]  # the same run id, init_from, data
    # The same node count: the world size is part of every graph with a collective.
    node_overrides = [pipeline["States"][state]["Parameters"]["NodeOverrides"] for state in ("Compile", "Train")]
    assert node_overrides[0] == node_overrides[1] == {"NumNodes.$": "$.run.num_nodes"}
    parameters = {k.removesuffix(".$"): EXAMPLE_RUN[k.removesuffix(".$")] for k in submitted["Train"]}
    compile_job, train_job = (_job_definition(templates["compute"], key) for key in ("compile", "train"))

    # One environment for both containers (compiler flags, rounding, cache base, EFA, ...).
    assert _environment(compile_job) == _environment(train_job)

    # Train: the entrypoint starts torchrun with the train step's arguments.
    train_argv, train_env = _run_entrypoint(_batch_command(train_job, parameters), _environment(train_job),
                                            tmp_path / "train")
    # Compile: the entrypoint runs the compile step, which wraps the training command.
    compile_argv, compile_env = _run_entrypoint(_batch_command(compile_job, parameters),
                                                _environment(compile_job), tmp_path / "compile")
    assert compile_argv[:3] == ["-m", "pipeline_steps", "compile"]
    run_dir = Path("/fsx/runs") / EXAMPLE_RUN["run_id"]
    trial_dir = run_dir / aot_compile.TRIALS_DIR / "job-attempt1"
    trial, trial_env = aot_compile.neuron_command(aot_compile.training_argv(compile_argv[3:]), trial_dir, 10,
                                                  compile_env)
    assert trial[0] == "neuron_parallel_compile"
    # The trial is launched as training is (the launcher with the node's torchrun arguments), with
    # the training arguments verbatim; only the trial's step count and directory are added.
    step = train_argv.index("train")
    assert train_argv[:2] == ["-m", "pipeline_steps.launch"]
    assert trial[2:-4] == [*train_argv[:step], "compile", *train_argv[step + 1:]], (trial, train_argv)
    assert trial[-4:] == ["--steps", "10", "--trial-dir", str(trial_dir)]
    assert train_argv[train_argv.index("--preset") + 1] == config.training.preset
    assert train_argv[train_argv.index("--init-from") + 1] == EXAMPLE_RUN["init_from"]
    assert ("--bf16" in train_argv) == (config.training.precision == "bf16")

    # The same compiler flags and rounding mode in the trial's processes and in training.
    for name in ("NEURON_CC_FLAGS", "NEURON_RT_STOCHASTIC_ROUNDING_EN"):
        assert trial_env[name] == train_env[name], name
    assert train_env["NEURON_CC_FLAGS"] == config.training.compiler_flags(config.compute.training)
    # The same cache location, derived the same way (keyed by compiler version) in both.
    trial_cache = _neuron_cache_location(trial_env, monkeypatch)
    assert trial_cache == _neuron_cache_location(train_env, monkeypatch)
    assert trial_cache.startswith("s3://") and "/neuron/neuronx-cc-" in trial_cache


def test_precision_sets_the_train_flag_and_stochastic_rounding_together():
    from stacks.config import TrainingConfig
    from stacks.constructs.job_definitions import training_arguments, training_environment

    bf16, fp32 = TrainingConfig(), TrainingConfig(precision="fp32")
    assert bf16.precision == "bf16"  # the trn1 default
    rounding, trn1 = "NEURON_RT_STOCHASTIC_ROUNDING_EN", INSTANCE_TYPES["trn1.32xlarge"]
    assert "--bf16" in training_arguments(bf16) and training_environment(bf16, trn1)[rounding] == "1"
    assert "--bf16" not in training_arguments(fp32) and training_environment(fp32, trn1)[rounding] == "0"
    with pytest.raises(ValueError, match="precision='fp16'"):
        TrainingConfig(precision="fp16")
    with pytest.raises(ValueError, match="--cache_dir"):
        TrainingConfig(neuron_cc_flags="--optlevel 1 --cache_dir=/tmp/cache")
    with pytest.raises(ValueError, match="must not set --target"):
        TrainingConfig(neuron_cc_flags="--target trn1 --optlevel 1")
    with pytest.raises(ValueError, match="preset='huge'"):
        TrainingConfig(preset="huge")


def _batch_retry_action(evaluate_on_exit: list[dict], exit_code: int) -> str:
    """AWS Batch's decision for a job that exited with `exit_code`: the first rule whose OnExitCode
    glob matches wins; none matching means RETRY.
    https://docs.aws.amazon.com/batch/latest/APIReference/API_EvaluateOnExit.html"""
    for rule in evaluate_on_exit:
        if "OnExitCode" in rule and fnmatch.fnmatchcase(str(exit_code), rule["OnExitCode"]):
            return rule["Action"].upper()
    return "RETRY"


def test_compile_retries_transient_faults_but_not_compiler_errors(dev_templates):
    from pipeline_steps import aot_compile

    rules = _job_definition(dev_templates["compute"], "compile")["RetryStrategy"]["EvaluateOnExit"]
    compiler_error = aot_compile.trial_failure(1, recorded=None)
    worker_fault = aot_compile.trial_failure(1, recorded=75)
    killed = aot_compile.trial_failure(-9, recorded=None)
    assert _batch_retry_action(rules, compiler_error.exit_code) == "EXIT"
    assert _batch_retry_action(rules, worker_fault.exit_code) == "RETRY"
    assert _batch_retry_action(rules, killed.exit_code) == "RETRY"


# -- Sanity: the expected device counts come from the table the stacks use ------------------------
@pytest.mark.parametrize("stage", ["dev", "prod"])
def test_sanity_jobs_expect_the_devices_their_job_definition_maps(request, stage):
    """The sanity step reads INSTANCE_TYPE from its job environment and looks the expected counts up
    in the instance table the job definition's device list was generated from."""
    from pipeline_steps import contract, sanity

    templates, config = request.getfixturevalue(f"{stage}_templates"), request.getfixturevalue(f"{stage}_config")
    for key, instance_type in (("sanity", config.compute.training_instance_type),
                               ("canary", config.compute.single_node_instance_type)):
        job = _job_definition(templates["compute"], key)
        env = _environment(job)
        assert sanity.expected_instance_type(None, env) == instance_type, key
        spec = contract.INSTANCE_TYPES[instance_type]
        devices = [d["HostPath"] for d in _container_of(job)["LinuxParameters"]["Devices"]]
        assert sum(p.startswith("/dev/neuron") for p in devices) == spec.neuron_devices, key
        assert sum(p.startswith("/dev/infiniband/uverbs") for p in devices) == spec.efa_interfaces, key
        assert env["NPROC_PER_NODE"] == str(spec.neuron_cores), key


def test_one_instance_table_and_synth_needs_no_torch():
    """stacks/config.py re-exports the steps' table (not a copy), and importing every stack leaves
    torch unimported, so `cdk synth` runs where torch is not installed."""
    from pipeline_steps import contract
    from stacks import config

    assert config.INSTANCE_TYPES is contract.INSTANCE_TYPES
    probe = ("import sys\nimport stacks.stages, stacks.config\n"
             "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
             "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False,
                            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]


# -- One step list: the state machine and the job definitions run the contract's steps -------------
def test_state_machine_runs_the_contract_steps(dev_templates, pipeline):
    """Every step of pipeline_steps.contract.PIPELINE_STEPS is a Batch state named after it that
    submits the job of the same name, on the queue its node count needs, and nothing else is."""
    submits = {name: state for name, state in pipeline["States"].items()
               if state.get("Resource", "").endswith(":batch:submitJob.sync")}
    assert set(submits) == {s.state for s in PIPELINE_STEPS}
    for step in PIPELINE_STEPS:
        assert submits[step.state]["Parameters"]["JobName"] == step.name
        assert ("NodeOverrides" in submits[step.state]["Parameters"]) == step.multi_node, step.name


def test_job_definitions_run_the_contract_steps(dev_templates):
    """Each step's job definition runs that CLI step, multi-node exactly when the contract says so,
    in the run directory FSX_RUNS/<run id> on the FSx mount; the canary runs sanity under FSX_CANARY."""
    from pipeline_steps.contract import CANARY_JOB, FSX_CANARY, FSX_MOUNT_POINT, FSX_RUNS

    for step in PIPELINE_STEPS:
        job = _job_definition(dev_templates["compute"], step.name)
        command = _command(job)
        assert command[0] == step.command, step.name
        assert ("NodeProperties" in job) == step.multi_node, step.name
        assert command[command.index("--run-dir") + 1] == f"{FSX_RUNS}/Ref::run_id", step.name
        assert _container_of(job)["MountPoints"][0]["ContainerPath"] == FSX_MOUNT_POINT
    canary = _command(_job_definition(dev_templates["compute"], CANARY_JOB))
    assert canary[0] == "sanity" and canary[canary.index("--run-dir") + 1].startswith(f"{FSX_CANARY}/")


def test_every_job_sets_the_environment_the_image_and_steps_read(dev_templates):
    """The variables the entrypoint and the steps read (names in pipeline_steps/contract.py) are in
    every job definition's environment; the torchrun rendezvous bound in the multi-node ones."""
    from pipeline_steps import contract

    for key in [step.name for step in contract.PIPELINE_STEPS] + [contract.CANARY_JOB]:
        job = _job_definition(dev_templates["compute"], key)
        env = _environment(job)
        for name in (contract.STAGE_ENV, contract.INSTANCE_TYPE_ENV, contract.NPROC_PER_NODE_ENV,
                     contract.COMPILE_CACHE_BASE_ENV):
            assert name in env, (key, name)
        if "NodeProperties" in job:
            assert contract.RDZV_TIMEOUT_ENV in env, key
