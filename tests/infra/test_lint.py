"""cfn-lint (zero errors), cdk-nag AwsSolutions (zero unacknowledged findings) and checkov (zero
failed checks; each skip with its reason in the resource's metadata) on every synthesized template
of both stages, and of the dev stage with two teams."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from aws_cdk.assertions import Annotations, Match

STAGES = ("dev_app_and_stage", "prod_app_and_stage", "teams_app_and_stage")  # teams: the dev stage with two teams


@pytest.mark.parametrize("stage_fixture", STAGES)
def test_cdk_nag_has_no_unacknowledged_findings(request, stage_fixture, template_of):
    _, stacks = request.getfixturevalue(stage_fixture)
    for name, stack in stacks.items():
        template_of(stack)  # synthesizes (runs the nag aspect) once
        annotations = Annotations.from_stack(stack)
        errors = annotations.find_error("*", Match.string_like_regexp(r"AwsSolutions-.*"))
        warnings = annotations.find_warning("*", Match.string_like_regexp(r"AwsSolutions-.*"))
        findings = [f"{m.id}: {str(m.entry.data)[:160]}" for m in [*errors, *warnings]]
        assert not findings, f"{name}:\n" + "\n".join(findings)


def _console_script(name: str) -> str:
    # The console script beside the interpreter: neither linter has a `python -m` entry point.
    script = Path(sys.executable).with_name(name)
    assert script.exists(), f"{script} missing: install the dev extra ({name})"
    return str(script)


def _write_templates(request, stage_fixture, template_of, directory: Path) -> list[str]:
    _, stacks = request.getfixturevalue(stage_fixture)
    paths = []
    for stack in stacks.values():
        path = directory / f"{stack.stack_name}.template.json"
        path.write_text(json.dumps(template_of(stack).to_json(), indent=1))
        paths.append(str(path))
    return paths


def _cfn_lint(paths: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_console_script("cfn-lint"), "--format", "parseable", *paths], capture_output=True,
                          text=True, check=False)


@pytest.mark.parametrize("stage_fixture", STAGES)
def test_cfn_lint_has_no_errors_and_no_hard_coded_zone(request, stage_fixture, template_of, tmp_path: Path):
    result = _cfn_lint(_write_templates(request, stage_fixture, template_of, tmp_path))
    # Exit code bits: 2 errors, 4 warnings, 8 informational; anything else (1) is a crash.
    assert result.returncode & ~(4 | 8) == 0, result.stdout + result.stderr
    findings = [line.split(":")[4] for line in result.stdout.splitlines() if line.count(":") >= 5]
    errors = [f for f in findings if f.startswith("E")]
    # W3010: an availability zone written into a template (zone names differ per account).
    assert not errors and "W3010" not in findings, result.stdout


@pytest.mark.parametrize("stage_fixture", STAGES)
def test_checkov_has_no_failed_checks_and_a_reason_for_each_skip(request, stage_fixture, template_of, tmp_path: Path):
    _write_templates(request, stage_fixture, template_of, tmp_path)
    result = subprocess.run([_console_script("checkov"), "--directory", str(tmp_path), "--framework", "cloudformation",
                             "--output", "json", "--skip-download"],
                            capture_output=True, text=True, check=False)
    report = json.loads(result.stdout)
    assert report["summary"]["parsing_errors"] == 0 and report["summary"]["resource_count"] > 100, report["summary"]
    failed = [f"{c['check_id']} {c['resource']}: {c['check_name']}" for c in report["results"]["failed_checks"]]
    assert not failed, "\n".join(failed)
    for skipped in report["results"]["skipped_checks"]:
        assert len(skipped["check_result"].get("suppress_comment", "")) > 40, skipped["check_id"]
