"""The steps honour pipeline_contract: every job's command is a CLI step, and a run writes each file
the other layers read at its contract path."""

from __future__ import annotations

from pipeline_contract import BATCH_JOBS, CHECKPOINTS_DIR, PIPELINE_STEPS
from pipeline_steps.__main__ import STEPS as CLI_STEPS
from tests.contract.test_contract import RUN_FILES
from tests.steps import fixtures_trained
from tests.steps.conftest import run_cli

# The trained tiny run dir, made once per session (pytest finds fixtures by their module-level name).
tiny_trained, trained_run = fixtures_trained.tiny_trained, fixtures_trained.trained_run


def test_every_batch_job_runs_a_cli_step():
    """The job definitions run `python -m pipeline_steps <step.command>`: each must exist."""
    assert {step.command for step in BATCH_JOBS} <= set(CLI_STEPS)
    assert [step.state for step in PIPELINE_STEPS] == \
        ["Prepare", "PrepareShards", "PrepareFinish", "Sanity", "Compile", "Train", "Validate", "Embed", "Export"]


def test_the_steps_write_where_the_contract_says(trained_run):
    """A tiny prepared and trained run, then validate and embed as the Batch jobs run them: every
    file the other layers read is at its contract path."""
    for step, *flags in (("validate", "--gate-report-only"), ("embed",)):
        result = run_cli(step, "--run-dir", trained_run, "--backend", "cpu", *flags)
        assert result.returncode == 0, result.stderr[-3000:]
    missing = [path for path in RUN_FILES if not (trained_run / path).is_file()]
    assert missing == []
    assert sorted((trained_run / CHECKPOINTS_DIR).glob("step-*.pt"))
