"""End to end: the synthesized dev pipeline, started by an upload, runs every job's real command
(entrypoint, parameters, environment, nodes) through the local Batch. Runs: conftest.py; what runs
differently here and why: substitutions.py."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest

from pipeline_contract import (
    CHECKPOINTS_DIR,
    COMPILE_REPORT,
    EMBEDDINGS_DIR,
    EMBEDDINGS_MANIFEST,
    GATE_REPORT,
    PREPARE_REPORT,
    PREPARED_DIR,
    TRAIN_SUMMARY,
    VALIDATION_METRICS,
    batch_job,
    run_key,
    run_path,
)
from pipeline_steps.checkpoint import load
from scripts.stage_synth import SNAPSHOT_DIR
from tests.e2e.conftest import DATASET, KILLED_NODE
from tests.e2e.local_batch import JobDefinitionSpec, local_path, substitute
from tests.e2e.substitutions import never_runs_here

pytestmark = pytest.mark.slow

BATCH_STATES = ["Prepare", "Sanity", "Compile", "Train", "Validate", "Embed"]


def product_ids(source) -> set[str]:
    return {json.loads(line)["id"] for f in (source / "products").glob("*.jsonl")
            for line in f.read_text().splitlines() if line.strip()}


# ---- an upload starts a run; every step runs; the model is published ---------------------------

def test_upload_starts_a_run_that_runs_every_step_and_publishes(e2e_world, first_run):
    assert first_run.status == "SUCCEEDED", e2e_world.format_path(first_run)
    assert [s for s in first_run.visited if s in BATCH_STATES] == BATCH_STATES
    assert first_run.visited[-4:] == ["Publish", "NotifyPublishedMessage", "NotifyPublished", "Done"]
    # The starter named the run after the upload, so every job ran in /fsx/runs/<dataset>-<version>.
    assert {job.parameters["run_id"] for job in first_run.jobs} == {f"{DATASET}-v1"}
    by_step = {job.definition: job for job in first_run.jobs}
    assert {name: by_step[name].nodes for name in ("sanity", "compile", "train")} == {
        "sanity": 2, "compile": 2, "train": 2}
    assert sorted(j.array_index for j in first_run.jobs if j.definition == "embed") == [0, 1, 2, 3]
    assert sorted(j.array_index for j in first_run.jobs if j.definition == "prepare-shards") == [0, 1, 2, 3]
    pointer = e2e_world.read_json("artifacts_bucket", "models/current.json")
    assert pointer["run_id"] == f"{DATASET}-v1" and pointer["checkpoint"] == run_path(f"{DATASET}-v1")
    assert pointer["data_version"] == "v1" and pointer["metrics"]["recall@10"] > 0
    assert any("published" in n for n in e2e_world.notifications())


def test_the_manifest_holds_an_embedding_for_every_uploaded_product(e2e_world, first_run, demo_data):
    embeddings = e2e_world.run_dir(f"{DATASET}-v1") / EMBEDDINGS_DIR
    manifest = json.loads((embeddings / EMBEDDINGS_MANIFEST).read_text())
    ids = [row for shard in manifest["shards"]
           for row in pq.read_table(embeddings / shard["file"], columns=["id"]).column("id").to_pylist()]
    assert manifest["total_count"] == len(ids) == len(set(ids))
    assert set(ids) == product_ids(demo_data)


def test_batch_variables_reach_every_node_as_batch_sets_them(first_run):
    train = next(job for job in first_run.jobs if job.definition == "train")
    main, child = train.attempts[0].environments
    assert main["AWS_BATCH_JOB_NODE_INDEX"] == "0" and child["AWS_BATCH_JOB_NODE_INDEX"] == "1"
    assert main["AWS_BATCH_JOB_NUM_NODES"] == child["AWS_BATCH_JOB_NUM_NODES"] == "2"
    # Batch sets the main node's address on the children only; the entrypoint finds its own.
    assert "AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS" not in main
    assert child["AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS"] == "127.0.0.1"
    assert main["INSTANCE_TYPE"] == "trn1.32xlarge" and main["FI_PROVIDER"] == "efa"  # the definition's environment
    embeds = [job for job in first_run.jobs if job.definition == "embed"]
    assert sorted(job.attempts[0].environments[0]["AWS_BATCH_JOB_ARRAY_INDEX"] for job in embeds) == ["0", "1", "2", "3"]
    # Ref::shard_count came from the submit.
    assert {job.attempts[0].argv[job.attempts[0].argv.index("--shard-count") + 1] for job in embeds} == {"4"}


def test_prepare_ran_as_an_array_job_and_its_data_holds_every_uploaded_product(e2e_world, first_run, demo_data):
    children = [job for job in first_run.jobs if job.definition == "prepare-shards"]
    assert {job.attempts[0].argv[job.attempts[0].argv.index("--shard-count") + 1] for job in children} == {"4"}
    run_dir = e2e_world.run_dir(f"{DATASET}-v1")
    report = json.loads((run_dir / PREPARE_REPORT).read_text())
    assert report["status"] == "ok" and report["shards"]["shard_count"] == 4
    assert report["counts"]["pairs"]["good"] == report["split"]["train_pairs"] + report["split"]["holdout_pairs"]
    ids = pq.read_table(run_dir / PREPARED_DIR / "products.parquet", columns=["id"]).column("id").to_pylist()
    assert set(ids) == product_ids(demo_data)


# ---- a node lost during Train: exit 75, Batch retries, the retry resumes --------------------------

def test_a_node_killed_during_train_is_retried_by_batch(first_run):
    train = next(job for job in first_run.jobs if job.definition == "train")
    first, second = train.attempts
    assert first.node_exit_codes[KILLED_NODE] == 137  # the killed node (SIGKILL)
    assert first.exit_code == 75, first.logs[0].read_text()[-3000:]
    assert second.exit_code == 0
    assert [a.environments[0]["AWS_BATCH_JOB_ATTEMPT"] for a in train.attempts] == ["1", "2"]


def test_the_retry_resumes_from_the_checkpoint(first_run):
    train = next(job for job in first_run.jobs if job.definition == "train")
    first_log, second_log = (a.logs[0].read_text() for a in train.attempts)
    assert "saved checkpoint" in first_log and "step-000000020.pt" in first_log
    assert "resuming from" in second_log and "step-000000020.pt (step 20" in second_log



# ---- a second upload: incremental from the published model, gated against it, rejected ------------

def test_a_second_upload_trains_incrementally_from_the_published_model(rejected_run):
    result = rejected_run.result
    assert "UseCurrentModel" in result.visited and "TrainFromScratch" not in result.visited
    by_step = {job.definition: job for job in result.jobs}
    published = run_path(f"{DATASET}-v1")
    assert by_step["prepare"].parameters["init_from"] == by_step["train"].parameters["init_from"] == published
    train_log = by_step["train"].attempts[0].logs[0].read_text().splitlines()
    (line,) = [line for line in train_log if "incremental training: weights from" in line]
    assert run_path(f"{DATASET}-v1", CHECKPOINTS_DIR) + "/" in line


def test_the_worse_model_is_gated_against_the_published_metrics_and_rejected(e2e_world, rejected_run):
    result = rejected_run.result
    assert result.status == "SUCCEEDED", e2e_world.format_path(result)  # a rejection is not a failure
    assert result.visited[-4:] == ["GatePassed", "NotifyGateFailedMessage", "NotifyGateFailed", "ModelRejected"]
    assert "Embed" not in result.visited and "Publish" not in result.visited
    validate = next(job for job in result.jobs if job.definition == "validate")
    assert validate.parameters["previous_metrics"] == run_path(f"{DATASET}-v1", VALIDATION_METRICS)
    gate = e2e_world.read_json("artifacts_bucket", run_key(f"{DATASET}-v2", GATE_REPORT))
    assert gate["passed"] is False
    published = rejected_run.pointer_before["metrics"]
    assert {k: gate["previous"][k] for k in gate["gated_metrics"]} == {k: published[k] for k in gate["gated_metrics"]}
    assert any(gate["metrics"][k] < published[k] for k in gate["gated_metrics"])
    assert e2e_world.read_json("artifacts_bucket", "models/current.json") == rejected_run.pointer_before
    assert any("quality gate" in n for n in e2e_world.notifications())


# ---- compile runs exactly the training command; every run is gated against production -------
def step_arguments(job) -> list[str]:
    """What follows `entrypoint.sh <step>` in the job's command, as the node ran it."""
    return job.attempts[-1].argv[3:]


def without_flag(arguments: list[str], flag: str) -> list[str]:
    if flag not in arguments:
        return arguments
    i = arguments.index(flag)
    return arguments[:i] + arguments[i + 2:]


def test_compile_and_train_get_identical_commands_compiler_flags_and_cache(first_run):
    """What the Compile and Train jobs were given (the command as Batch ran it and the container
    environment): the training arguments (the trial appends its own step count, so train's
    --max-steps is not compared), NEURON_CC_FLAGS and the compile cache location."""
    by_step = {job.definition: job for job in first_run.jobs}
    compile_job, train = by_step["compile"], by_step["train"]
    assert step_arguments(compile_job) == without_flag(step_arguments(train), "--max-steps")
    compile_env, train_env = compile_job.attempts[-1].environments[0], train.attempts[-1].environments[0]
    assert compile_env.get("NEURON_CC_FLAGS") and compile_env.get("NEURON_CC_FLAGS") == train_env.get("NEURON_CC_FLAGS")
    assert compile_env["NEURON_COMPILE_CACHE_URL_BASE"] == train_env["NEURON_COMPILE_CACHE_URL_BASE"]


def test_an_explicit_init_from_run_is_gated_against_the_published_metrics(production_run):
    validate = next(job for job in production_run.jobs if job.definition == "validate")
    assert validate.parameters["previous_metrics"] == run_path(f"{DATASET}-v1", VALIDATION_METRICS)



# ---- one node, one process: the production command unchanged; what no scenario ran ---------------
def flag_values(args: list[str]) -> set[tuple[str, str | None]]:
    """(flag, its value, or None for a switch) of a command line."""
    return {(arg, args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None)
            for i, arg in enumerate(args) if arg.startswith("--")}


def definitions(e2e_world) -> dict[str, JobDefinitionSpec]:
    return {spec.name: spec for spec in e2e_world.batch.definitions.values()}


def test_one_node_compile_and_train_run_their_job_definitions_unchanged(e2e_world, production_run):
    """With one process per job nothing needs gloo: the Compile and Train jobs run exactly what the
    definitions say (Batch's parameters filled in, /fsx at its local place): --backend xla, the
    stage's precision, NEURON_CC_FLAGS and every other variable, on PJRT CPU."""
    specs, fsx = definitions(e2e_world), e2e_world.batch.setup.fsx_root
    by_step = {job.definition: job for job in production_run.jobs}
    for name in ("compile", "train"):
        job, spec = by_step[name], specs[name]
        attempt = job.attempts[-1]
        assert job.nodes == 1 and attempt.exit_code == 0, attempt.logs[0].read_text()[-3000:]
        assert attempt.argv[2:] == [local_path(arg, fsx) for arg in substitute(spec.command, job.parameters)]
        assert {("--backend", "xla"), ("--bf16", None)} <= flag_values(attempt.argv)
        environment = attempt.environments[0]
        assert {k: environment.get(k) for k in spec.environment if k != "NPROC_PER_NODE"} == {
            k: v for k, v in spec.environment.items() if k != "NPROC_PER_NODE"}
        assert environment["NEURON_CC_FLAGS"].startswith("--target trn1 ") and environment["NPROC_PER_NODE"] == "1"
    run_dir = e2e_world.run_dir(production_run.name)
    trial = json.loads((run_dir / COMPILE_REPORT).read_text())
    assert trial["mode"] == "xla-cpu-trial" and len(trial["batch_shapes"]) == len(trial["buckets"])
    summary = json.loads((run_dir / TRAIN_SUMMARY).read_text())
    assert summary["backend"] == "xla" and load(summary["checkpoint"])["config"]["train"]["bf16"] is True
    # Training compiled nothing the Compile job had not traced, and nothing after warm-up.
    assert summary["xla"]["graphs_not_in_compile_cache"] == 0 and summary["xla"]["compiles_after_warmup"] == 0


def production_job_definitions() -> dict[str, tuple[str, set[str]]]:
    """The prod stage's job definitions as deployed (its committed snapshot, which
    tests/infra/test_snapshots.py keeps equal to the synthesis): construct id -> (step command,
    every flag and environment variable)."""
    (path,) = SNAPSHOT_DIR.glob("*-prod-Compute.json")
    out = {}
    for logical_id, resource in json.loads(path.read_text())["Resources"].items():
        if resource["Type"] == "AWS::Batch::JobDefinition":
            props = resource["Properties"]
            container = props.get("ContainerProperties") or props["NodeProperties"]["NodeRangeProperties"][0]["Container"]
            names = {arg for arg in container["Command"] if arg.startswith("--")}
            out[logical_id] = (container["Command"][0], names | {e["Name"] for e in container.get("Environment", [])})
    return out


def ran_unsubstituted(e2e_world) -> dict[str, set[str]]:
    """Per job definition: the flags and variables some attempt ran with the definition's value
    (Batch's parameters filled in, /fsx at its local place)."""
    specs, fsx, out = definitions(e2e_world), e2e_world.batch.setup.fsx_root, {}
    for job in e2e_world.batch.runs:
        spec = specs[job.definition]
        given = flag_values([local_path(arg, fsx) for arg in substitute(spec.command, job.parameters)])
        for attempt in job.attempts:
            ran = given & flag_values(attempt.argv)
            out.setdefault(job.definition, set()).update(flag for flag, _ in ran)
            out[job.definition].update(k for k, v in spec.environment.items() if attempt.environments[0].get(k) == v)
    return out


def test_every_production_flag_and_variable_ran_unsubstituted_in_some_scenario(
        e2e_world, first_run, rejected_run, production_run, canary_run):
    """A flag or variable added to a production job definition must run here as given in some
    scenario, or substitutions.py must say why it cannot (an entry that never runs here)."""
    assert canary_run.succeeded, canary_run.attempts[-1].logs[0].read_text()[-3000:]
    ran = ran_unsubstituted(e2e_world)
    steps = {rf"Jobs{batch_job(name).state}JobDefinition[0-9A-F]{{8}}": name for name in definitions(e2e_world)}
    missing = {}
    for logical_id, (command, names) in production_job_definitions().items():
        (step,) = [name for pattern, name in steps.items() if re.fullmatch(pattern, logical_id)]
        unrun = sorted(n for n in names if n not in ran.get(step, set()) and not never_runs_here(command, n))
        if unrun:
            missing[step] = unrun
    assert missing == {}, f"never ran as the job definition gives them, and not in substitutions.py: {missing}"
