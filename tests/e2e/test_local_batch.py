"""The local Batch's rules against the synthesized job definitions (no job runs here)."""

from __future__ import annotations

import pytest

from tests.e2e.local_batch import JobDefinitionSpec, local_arguments, retry_action, substitute
from tests.e2e.world import BUCKETS, _runtime_fields


@pytest.fixture(scope="module")
def specs(e2e_stage) -> dict[str, JobDefinitionSpec]:
    stage = e2e_stage
    # Bind what the job definitions' runtime fields reference (the cache bucket in the environment).
    stage.bind("storage", stage.stacks["storage"].cache_bucket, BUCKETS["cache_bucket"])
    resources = stage.templates["compute"]["Resources"]
    return {name: JobDefinitionSpec.from_properties(
                name, stage.resolve("compute", _runtime_fields(resources[stage.logical_id(jd)]["Properties"])))
            for name, jd in stage.stacks["compute"].job_definitions.items()}


def test_retryable_exit_is_retried_and_bad_input_is_not(specs):
    for spec in specs.values():
        assert spec.attempts > 1
        assert retry_action(spec.evaluate_on_exit, 75, "Essential container in task exited") == "RETRY"
        assert retry_action(spec.evaluate_on_exit, 65, "Essential container in task exited") == "EXIT"
        assert retry_action(spec.evaluate_on_exit, 1, "Essential container in task exited") == "EXIT"
        assert retry_action(spec.evaluate_on_exit, None, "Host EC2 (instance i-0abc) terminated.") == "RETRY"


def test_no_matching_rule_means_retry():
    # https://docs.aws.amazon.com/batch/latest/APIReference/API_EvaluateOnExit.html: when evaluateOnExit
    # is given and no entry matches, the job is retried.
    assert retry_action([{"Action": "EXIT", "OnExitCode": "6*"}], 75, "") == "RETRY"
    assert retry_action([{"Action": "EXIT", "OnExitCode": "6*"}], 65, "") == "EXIT"


def test_parameters_replace_placeholders_with_defaults_underneath(specs):
    train, prepare = specs["train"], specs["prepare"]
    assert train.num_nodes == 2 and train.main_node == 0
    command = substitute(train.command, {**train.parameters, "run_id": "r1", "init_from": "/fsx/runs/r0"})
    assert command[:3] == ["train", "--run-dir", "/fsx/runs/r1"]
    assert command[command.index("--init-from") + 1] == "/fsx/runs/r0"
    assert command[command.index("--max-steps") + 1] == ""  # dropped by the entrypoint
    assert "Ref::" in " ".join(substitute(train.command, {}))  # nothing supplied: left for the entrypoint to refuse
    command = substitute(prepare.command, {**prepare.parameters, "run_id": "r1", "data_uri": "/fsx/data/d"})
    assert command[command.index("--init-from") + 1] == ""  # the definition's default (dropped by the entrypoint)
    # Prepare tokenizes for the preset Compile and Train run: the stage's training preset.
    assert command[command.index("--preset") + 1] == train.command[train.command.index("--preset") + 1] == "tiny"


def test_local_arguments_apply_only_the_listed_substitutions(tmp_path, specs):
    sanity = ["sanity", "--run-dir", "/fsx/runs/r1", "--fsx-path", "/fsx", "--backend", "xla", "--data", "/fsxdata"]
    assert local_arguments(sanity, tmp_path, processes=2) == [
        "sanity", "--run-dir", f"{tmp_path}/runs/r1", "--backend", "cpu", "--data", "/fsxdata"]
    # One process: the training command as the job definition gives it, /fsx at its local place.
    train = ["train", "--run-dir", "/fsx/runs/r1", "--backend", "xla", "--bf16", "--fsx-path", "/fsx"]
    assert local_arguments(train, tmp_path, processes=1) == [
        "train", "--run-dir", f"{tmp_path}/runs/r1", "--backend", "xla", "--bf16", "--fsx-path", str(tmp_path)]
    assert specs["train"].environment["NEURON_COMPILE_CACHE_URL_BASE"] == f"s3://{BUCKETS['cache_bucket']}/neuron"
