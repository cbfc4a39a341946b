"""The stacks are generated from the step table (pipeline_contract.steps): a new entry is a new job
definition and a new Batch state in its place, with no other change; a stage's upload marker
reaches the jobs that wait for it."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
from aws_cdk.assertions import Template

from pipeline_contract import CANARY, PIPELINE_STEPS, RUN_DIR, SUCCESS_MARKER_ENV, Launcher, PipelineStep, batch_job
from scripts.stage_synth import build, stage_config

SCORE = PipelineStep(name="score", launcher=Launcher.SINGLE_NODE,
                     arguments=lambda training: ["--run-dir", RUN_DIR, "--preset", training.preset])


def _definition(template: Template) -> dict:
    """The default team's state machine ASL, CloudFormation tokens replaced by "X"."""
    (resource,) = [r for k, r in template.find_resources("AWS::StepFunctions::StateMachine").items()
                   if k.startswith("TrainingPipelineStateMachine")]
    body = resource["Properties"]["DefinitionString"]
    parts = body["Fn::Join"][1] if isinstance(body, dict) else [body]
    return json.loads("".join(p if isinstance(p, str) else "X" for p in parts))


def _job_definitions(template: Template, state: str) -> list[dict]:
    return [r["Properties"] for k, r in template.find_resources("AWS::Batch::JobDefinition").items()
            if k.startswith(f"Jobs{state}JobDefinition")]


@pytest.fixture(scope="module")
def with_score_step():
    """The dev stage synthesized with `score` between Train and Validate in the table: every stack
    module that reads the table sees the new one."""
    steps = (*PIPELINE_STEPS[:6], SCORE, *PIPELINE_STEPS[6:])
    patch = pytest.MonkeyPatch()
    for name, module in list(sys.modules.items()):
        if name.startswith("stacks"):
            for attr, value in (("PIPELINE_STEPS", steps), ("BATCH_JOBS", (*steps, CANARY)),
                                ("PIPELINE_STEP_NAMES", frozenset(s.name for s in steps))):
                if hasattr(module, attr):
                    patch.setattr(module, attr, value)
    try:
        _, stacks = build("dev", nag=False)
        yield Template.from_stack(stacks["compute"]), _definition(Template.from_stack(stacks["pipeline"]))
    finally:
        patch.undo()


def test_a_new_table_entry_is_a_job_definition_and_a_state_in_its_place(with_score_step, dev_config):
    compute, definition = with_score_step
    (job,) = _job_definitions(compute, "Score")
    assert job["ContainerProperties"]["Command"] == ["score", "--run-dir", RUN_DIR, "--preset", dev_config.training.preset]
    assert job["Timeout"]["AttemptDurationSeconds"] > 0 and "NodeProperties" not in job
    states = definition["States"]
    assert states["Train"]["Next"] == "Score" and states["Score"]["Next"] == "Validate"
    score = states["Score"]
    assert score["Parameters"]["JobName"] == "score" and score["Parameters"]["JobDefinition"].endswith("-score")
    assert "NodeOverrides" not in score["Parameters"] and "ArrayProperties" not in score["Parameters"]
    assert score["TimeoutSeconds"] > 0 and score["Catch"][0]["Next"] == "DiagnoseFailure"


def test_the_table_decides_launcher_queue_and_array(dev_templates, dev_config):
    """Each step's job definition and Batch state follow its entry: multi-node steps are multi-node
    jobs given the run's node count, array steps get an array of the input's size."""
    definition = _definition(dev_templates["pipeline"])
    for step in PIPELINE_STEPS:
        (job,) = _job_definitions(dev_templates["compute"], step.state)
        submit = definition["States"][step.state]["Parameters"]
        assert ("NodeProperties" in job) == step.multi_node == ("NodeOverrides" in submit), step.name
        assert ("ArrayProperties" in submit) == (step.launcher is Launcher.ARRAY), step.name
        if step.array_size_field:
            assert submit["Parameters"]["shard_count.$"] == f"States.Format('{{}}', $.run.{step.array_size_field})"


@pytest.mark.parametrize("marker", ["_SUCCESS", "_DONE"])
def test_a_stage_s_upload_marker_reaches_prepare(marker):
    """The trigger fires on PipelineConfig.success_marker; a marker other than the default also goes
    to the jobs (PIPELINE_SUCCESS_MARKER), so prepare waits for that object and not the default one."""
    config = stage_config("dev")
    config = replace(config, pipeline=replace(config.pipeline, success_marker=marker))
    _, stacks = build("dev", nag=False, config=config)
    (job,) = _job_definitions(Template.from_stack(stacks["compute"]), batch_job("prepare").state)
    environment = {e["Name"]: e["Value"] for e in job["ContainerProperties"]["Environment"]}
    assert environment.get(SUCCESS_MARKER_ENV) == (None if marker == "_SUCCESS" else marker)
