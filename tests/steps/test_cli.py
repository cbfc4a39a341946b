"""The CLI dispatcher: usage, exit codes, and the exit-code file torchrun's launcher relies on."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline_steps.__main__ import STEPS, main
from pipeline_steps.errors import EXIT_CODE_FILE_ENV, ExitCode, record_exit_code

from .conftest import cli_env, run_cli


def test_usage_lists_every_step_and_the_exit_codes(capsys) -> None:
    assert main(["--help"]) == ExitCode.OK
    out = capsys.readouterr().out
    assert all(step in out for step in STEPS)
    assert "75=retryable" in out and "79=gate_failed" in out


def test_unknown_step_is_a_usage_error(capsys) -> None:
    assert main(["trian"]) == ExitCode.USAGE
    assert "unknown step 'trian'" in capsys.readouterr().err


def test_a_step_error_is_one_line_its_exit_code_and_recorded_for_the_launcher(tmp_path: Path) -> None:
    exit_file = tmp_path / "exit-code"
    result = run_cli("train", "--run-dir", tmp_path / "never-prepared", "--backend", "cpu",
                     env={**cli_env(),
                          EXIT_CODE_FILE_ENV: str(exit_file)})
    assert result.returncode == ExitCode.BAD_INPUT
    assert "Traceback" not in result.stderr
    assert "prepare" in result.stderr  # the fix-it names the step to run first
    assert exit_file.read_text().strip() == str(int(ExitCode.BAD_INPUT))


def test_the_first_recorded_exit_code_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exit_file = tmp_path / "exit-code"
    monkeypatch.setenv(EXIT_CODE_FILE_ENV, str(exit_file))
    record_exit_code(ExitCode.RETRYABLE)
    record_exit_code(ExitCode.INTERNAL)  # a later rank failing because of the first one
    assert exit_file.read_text().strip() == "75"


def test_recording_is_off_without_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EXIT_CODE_FILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    record_exit_code(ExitCode.RETRYABLE)
    assert list(tmp_path.iterdir()) == []


def test_version_and_no_step_is_a_usage_error(capsys) -> None:
    from pipeline_steps import __version__

    assert main(["--version"]) == ExitCode.OK
    assert capsys.readouterr().out.strip() == f"pipeline-steps {__version__} (trainium-embeddings)"
    assert main([]) == ExitCode.USAGE
    assert "steps:" in capsys.readouterr().err


def test_a_steps_usage_error_exits_2_and_is_recorded_for_the_launcher(tmp_path: Path, monkeypatch) -> None:
    exit_file = tmp_path / "exit-code"
    monkeypatch.setenv(EXIT_CODE_FILE_ENV, str(exit_file))
    with pytest.raises(SystemExit) as exc:
        main(["validate", "--no-such-flag"])
    assert exc.value.code == ExitCode.USAGE
    assert exit_file.read_text().strip() == str(int(ExitCode.USAGE))
