"""pipeline_contract: the facts every layer shares, written once. It imports without torch (or any
layer), its FSx paths and run-directory keys agree, and the copies that cannot import it (the
README's exit-code table and run-directory layout, the docs' gate key) match it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from pipeline_contract import (
    CHECKPOINTS_DIR,
    COMPILE_CACHE_DIR,
    COMPILE_DIR,
    COMPILE_REPORT,
    EMBEDDINGS_DIR,
    EMBEDDINGS_MANIFEST,
    EXPORT_DIR,
    FSX_CANARY,
    FSX_DATA,
    FSX_INCOMING,
    FSX_MOUNT_POINT,
    FSX_RUNS,
    GATE_REPORT,
    INCOMING_PREFIX,
    PREPARE_REPORT,
    PREPARED_DIR,
    RUNS_PREFIX,
    TRAIN_DIR,
    TRAIN_METRICS,
    TRAIN_SUMMARY,
    VALIDATION_DIR,
    VALIDATION_METRICS,
    ExitCode,
    run_key,
    run_path,
)

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
RUN_FILES = (PREPARE_REPORT, TRAIN_METRICS, TRAIN_SUMMARY, VALIDATION_METRICS, GATE_REPORT,
             f"{EMBEDDINGS_DIR}/{EMBEDDINGS_MANIFEST}")
"""What prepare, train, validate and embed write, where the state machine, trainium-runs, run-local
and parity look for it (tests/steps/test_contract.py runs the steps and finds them there)."""


def test_the_contract_imports_no_torch_and_no_layer():
    """`cdk synth` and `trainium-runs` import it on machines without torch; it depends on no layer."""
    probe = ("import sys\n"
             "for blocked in ('torch', 'torch_xla', 'numpy', 'aws_cdk', 'boto3'):\n"
             "    sys.modules[blocked] = None  # an import of it raises ImportError\n"
             "import pipeline_contract, pipeline_contract.steps, pipeline_contract.execution_input\n"
             "layers = sorted(m for m in sys.modules if m.split('.')[0] in ('pipeline_steps', 'pipeline_ops', 'stacks'))\n"
             "assert not layers, layers\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]


def test_fsx_paths_live_under_the_mount_point():
    for path in (FSX_DATA, FSX_RUNS, FSX_CANARY, FSX_INCOMING):
        assert path.startswith(FSX_MOUNT_POINT + "/") and not path.endswith("/")
    assert FSX_INCOMING == f"{FSX_DATA}/{INCOMING_PREFIX}".rstrip("/")


def test_run_paths_and_keys_name_the_same_run_directory():
    assert run_path("r1") == f"{FSX_RUNS}/r1"
    assert run_path("r1", GATE_REPORT) == f"{FSX_RUNS}/r1/validation/gate.json"
    assert run_key("r1", GATE_REPORT) == "runs/r1/validation/gate.json"
    assert run_key("r1", GATE_REPORT).removeprefix(RUNS_PREFIX) == \
        run_path("r1", GATE_REPORT).removeprefix(FSX_RUNS + "/")


def test_readme_exit_code_table_is_the_contract():
    """The README's exit-code table lists every ExitCode with its value and name, and marks only
    RETRYABLE as retried (the job definitions retry exactly that code)."""
    text = README.read_text()
    start = text.index("### Exit codes")
    section = text[start:text.find("\n#", start + 1)]
    rows = re.findall(r"^\| (\d+) \| (\w+) \|[^\n]*\|([^|\n]*)\|$", section, re.M)
    assert {int(code): name for code, name, _ in rows} == {c.value: c.name.lower() for c in ExitCode}
    retried = {int(code) for code, _, retry in rows if "retried" in retry and "not retried" not in retry}
    assert retried == {ExitCode.RETRYABLE}


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
    for path in (PREPARED_DIR, COMPILE_DIR, CHECKPOINTS_DIR, TRAIN_DIR, VALIDATION_DIR, EMBEDDINGS_DIR, EXPORT_DIR,
                 *RUN_FILES, COMPILE_REPORT, COMPILE_CACHE_DIR):
        directory, _, name = path.partition("/")
        assert directory in entries, f"README's run directory has no DIR/{directory}/ line"
        assert re.search(rf"(^|[\s,(]){re.escape(name)}\b", entries[directory]), f"README: DIR/{path} not listed"


def test_docs_name_the_gate_key_pattern():
    """docs/infrastructure.md's cdk-nag table names the gate reports' S3 keys the state machine reads."""
    text = (REPO / "docs" / "infrastructure.md").read_text()
    assert f"`{run_key('*', GATE_REPORT)}`" in text
