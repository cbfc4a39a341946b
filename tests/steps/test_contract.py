"""pipeline_steps.contract: the facts the stacks, the image and the steps share are defined once,
and the copies that cannot import it (the README's exit-code table and run-directory layout,
pipeline_steps.data's PREPARED) match it."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline_steps import contract, data, errors, heartbeat
from pipeline_steps.__main__ import STEPS as CLI_STEPS
from tests.steps.conftest import run_cli
from tests.steps import fixtures_trained

README = Path(__file__).resolve().parents[2] / "README.md"
# The trained tiny run dir, made once per session (pytest finds fixtures by their module-level name).
tiny_trained, trained_run = fixtures_trained.tiny_trained, fixtures_trained.trained_run


def test_every_pipeline_step_is_a_cli_step():
    """The job definitions run `python -m pipeline_steps <step.command>`: each must exist."""
    assert {step.command for step in contract.PIPELINE_STEPS} <= set(CLI_STEPS)
    assert [step.state for step in contract.PIPELINE_STEPS] == \
        ["Prepare", "PrepareShards", "PrepareFinish", "Sanity", "Compile", "Train", "Validate", "Embed", "Export"]


def test_steps_use_the_contract_objects_not_copies():
    assert errors.ExitCode is contract.ExitCode
    assert errors.EXIT_CODE_FILE_ENV == contract.EXIT_CODE_FILE_ENV
    assert (heartbeat.NAMESPACE, heartbeat.METRIC_STEP, heartbeat.ENV_RUN_ID) == \
        (contract.HEARTBEAT_NAMESPACE, contract.HEARTBEAT_STEP_METRIC, contract.RUN_ID_ENV)
    assert data.PREPARED is contract.PREPARED_DIR  # data.py re-exports it under its own name


def test_fsx_paths_live_under_the_mount_point():
    for path in (contract.FSX_DATA, contract.FSX_RUNS, contract.FSX_CANARY, contract.FSX_INCOMING):
        assert path.startswith(contract.FSX_MOUNT_POINT + "/") and not path.endswith("/")
    assert contract.FSX_INCOMING == f"{contract.FSX_DATA}/{contract.INCOMING_PREFIX}".rstrip("/")


def test_readme_exit_code_table_is_the_contract():
    """The README's exit-code table lists every ExitCode with its value and name, and marks only
    RETRYABLE as retried (the job definitions retry exactly that code)."""
    text = README.read_text()
    start = text.index("### Exit codes")
    section = text[start:text.find("\n#", start + 1)]
    rows = re.findall(r"^\| (\d+) \| (\w+) \|[^\n]*\|([^|\n]*)\|$", section, re.M)
    assert {int(code): name for code, name, _ in rows} == {c.value: c.name.lower() for c in contract.ExitCode}
    retried = {int(code) for code, _, retry in rows if "retried" in retry and "not retried" not in retry}
    assert retried == {contract.ExitCode.RETRYABLE}


# ---- The run directory -----------------------------------------------------------------------------
RUN_FILES = (contract.PREPARE_REPORT, contract.TRAIN_METRICS, contract.TRAIN_SUMMARY, contract.VALIDATION_METRICS,
             contract.GATE_REPORT, f"{contract.EMBEDDINGS_DIR}/{contract.EMBEDDINGS_MANIFEST}")
"""What prepare, train, validate and embed write, where the state machine, trainium-runs, run-local
and parity look for it."""


def test_the_steps_write_where_the_contract_says(trained_run):
    """A tiny prepared and trained run, then validate and embed as the Batch jobs run them: every
    file the other layers read is at its contract path."""
    for step, *flags in (("validate", "--gate-report-only"), ("embed",)):
        result = run_cli(step, "--run-dir", trained_run, "--backend", "cpu", *flags)
        assert result.returncode == 0, result.stderr[-3000:]
    missing = [path for path in RUN_FILES if not (trained_run / path).is_file()]
    assert missing == []
    assert sorted((trained_run / contract.CHECKPOINTS_DIR).glob("step-*.pt"))


def test_run_paths_and_keys_name_the_same_run_directory():
    assert contract.run_path("r1") == f"{contract.FSX_RUNS}/r1"
    assert contract.run_path("r1", contract.GATE_REPORT) == f"{contract.FSX_RUNS}/r1/validation/gate.json"
    assert contract.run_key("r1", contract.GATE_REPORT) == "runs/r1/validation/gate.json"
    assert contract.run_key("r1", contract.GATE_REPORT).removeprefix(contract.RUNS_PREFIX) == \
        contract.run_path("r1", contract.GATE_REPORT).removeprefix(contract.FSX_RUNS + "/")


def _readme_run_directory() -> dict[str, str]:
    """The README's run-directory block as {top-level entry: what its line(s) list}."""
    text = README.read_text()
    start = text.index("### The run directory")
    begin = text.index("```\n", start) + len("```\n")
    block = text[begin:text.index("\n```", begin)]
    entries: dict[str, str] = {}
    for line in block.splitlines():
        if line.startswith("DIR/"):
            name, _, listed = line.removeprefix("DIR/").partition(" ")
            current = name.rstrip("/")
            entries[current] = listed
        else:
            entries[current] += " " + line.strip()
    return entries


def test_readme_run_directory_is_the_contract():
    """Every directory and file of the contract's run layout is in the README's run-directory block,
    under its directory's line."""
    entries = _readme_run_directory()
    for path in (contract.PREPARED_DIR, contract.COMPILE_DIR, contract.CHECKPOINTS_DIR, contract.TRAIN_DIR,
                 contract.VALIDATION_DIR, contract.EMBEDDINGS_DIR, contract.EXPORT_DIR, *RUN_FILES,
                 contract.COMPILE_REPORT, contract.COMPILE_CACHE_DIR):
        directory, _, name = path.partition("/")
        assert directory in entries, f"README's run directory has no DIR/{directory}/ line"
        assert re.search(rf"(^|[\s,(]){re.escape(name)}\b", entries[directory]), f"README: DIR/{path} not listed"


def test_docs_name_the_gate_key_pattern():
    """docs/infrastructure.md's cdk-nag table names the gate reports' S3 keys the state machine reads."""
    text = (README.parent / "docs" / "infrastructure.md").read_text()
    assert f"`{contract.run_key('*', contract.GATE_REPORT)}`" in text
