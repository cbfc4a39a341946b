"""pipeline_steps.contract: the facts the stacks, the image and the steps share are defined once,
and the copies that cannot import it (the README's exit-code table) match it."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline_steps import contract, errors, heartbeat
from pipeline_steps.__main__ import STEPS as CLI_STEPS

README = Path(__file__).resolve().parents[2] / "README.md"


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
