"""pipeline_steps.launch: torchrun, where a rendezvous that never completes is exit 75 (retried)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_steps.errors import EXIT_CODE_FILE_ENV, ExitCode

from .conftest import REPO, cli_env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(node_rank: int, step_args: list[str], code_file: Path, nnodes: int = 2) -> subprocess.CompletedProcess:
    """One node of an `nnodes` job, as the entrypoint starts it; no other node ever starts."""
    argv = [sys.executable, "-m", "pipeline_steps.launch", "--nnodes", str(nnodes), "--node_rank", str(node_rank),
            "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            "--rdzv_conf", "timeout=2", "-m", "pipeline_steps", *step_args]
    return subprocess.run(argv, env=cli_env(**{EXIT_CODE_FILE_ENV: str(code_file)}), capture_output=True, text=True,
                          timeout=120, cwd=REPO)


@pytest.mark.parametrize(("step", "node_rank"), [("train", 0), ("sanity", 1)],
                         ids=["train-main-node-alone", "sanity-child-without-main-node"])
def test_a_rendezvous_that_never_completes_is_retryable(tmp_path, step, node_rank):
    code_file = tmp_path / "exit_code"
    result = launch(node_rank, [step, "--run-dir", str(tmp_path / "run")], code_file)
    assert result.returncode == ExitCode.RETRYABLE, result.stderr[-2000:]
    assert "the rendezvous of the nodes did not complete" in result.stderr
    assert code_file.read_text().strip() == str(int(ExitCode.RETRYABLE))  # what the entrypoint exits with


def test_a_failed_worker_keeps_torchrun_exit_and_its_own_recorded_code(tmp_path):
    code_file = tmp_path / "exit_code"
    result = launch(0, ["train", "--run-dir", str(tmp_path / "no-such-run")], code_file, nnodes=1)
    assert result.returncode == 1, result.stderr[-2000:]  # torchrun's own: a worker failed
    assert int(code_file.read_text()) not in (ExitCode.OK, ExitCode.RETRYABLE)
