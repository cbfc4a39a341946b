"""End-to-end properties the current code does not have yet: strict xfails, so each one turns into
a failure (XPASS) the moment the code has the property, and the marker must then go.

- compile must run exactly the training command (same flags, compiler flags and cache location),
  or the Neuron persistent cache misses every graph;
- a run started with an explicit init_from must still be gated against the published model."""

from __future__ import annotations

import shlex

import pytest

from pipeline_steps import distributed as dist_lib
from tests.e2e.conftest import DATASET

pytestmark = pytest.mark.slow


def step_arguments(job) -> list[str]:
    """What follows `entrypoint.sh <step>` in the job's command, as the node ran it."""
    return job.attempts[-1].argv[3:]


@pytest.mark.xfail(strict=True, reason=(
    "the compile job definition passes only --run-dir/--preset/--backend while train also passes "
    "--init-from and --max-steps, and off Neuron compile never calls neuron_parallel_compile"))
def test_compile_and_train_get_identical_commands_compiler_flags_and_cache(e2e_world, first_run):
    by_step = {job.definition: job for job in first_run.jobs}
    compile_job, train = by_step["compile"], by_step["train"]
    assert step_arguments(compile_job) == step_arguments(train)

    records = [r for r in e2e_world.batch.standin_records() if r["tool"] == "neuron_parallel_compile"
               and r["job_id"].split("#")[0] == compile_job.job_id]
    assert records, "compile never called neuron_parallel_compile"
    wrapped = records[0]["argv"][1:]
    assert wrapped[0] == "torchrun" and wrapped[wrapped.index("-m") + 1:wrapped.index("-m") + 3] == ["pipeline_steps", "train"]
    trial_flags = wrapped[wrapped.index("train") + 1:]
    train_flags = step_arguments(train)
    for flag in ("--preset", "--backend", "--init-from"):
        if flag in train_flags:
            assert trial_flags[trial_flags.index(flag) + 1] == train_flags[train_flags.index(flag) + 1], flag
    train_env = train.attempts[-1].environments[0]
    assert records[0]["env"].get("NEURON_CC_FLAGS") == train_env.get("NEURON_CC_FLAGS"), shlex.join(wrapped)
    assert records[0]["env"].get("NEURON_COMPILE_CACHE_URL") == dist_lib.neuron_cache_url(
        train_env["NEURON_COMPILE_CACHE_URL_BASE"])


@pytest.fixture(scope="session")
def explicit_init_run(e2e_world, rejected_run):
    """A manual run of the v1 data with init_from = the published model, given in the input."""
    e2e_world.sfn.start_execution(stateMachineArn=e2e_world.pipeline_arn, name=f"{DATASET}-v1-incremental",
                                  input=f'{{"dataset": "{DATASET}", "version": "v1", "embed_shards": 2, '
                                        f'"data_uri": "/fsx/data/incoming/{DATASET}/v1", '
                                        f'"init_from": "/fsx/runs/{DATASET}-v1"}}')
    result = e2e_world.wait_for_run(f"{DATASET}-v1-incremental")
    print("\n" + e2e_world.format_path(result))
    return result


@pytest.mark.xfail(strict=True, reason=(
    "with init_from in the input the state machine goes InitFromGiven -> Prepare and never reads "
    "models/current.json, so validate gets previous_metrics='' and gates against BM25 only"))
def test_an_explicit_init_from_run_is_gated_against_the_published_metrics(explicit_init_run):
    validate = next(job for job in explicit_init_run.jobs if job.definition == "validate")
    assert validate.parameters["previous_metrics"] == f"/fsx/runs/{DATASET}-v1/validation/metrics.json"
