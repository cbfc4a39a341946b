"""cfn-lint (zero errors) and cdk-nag AwsSolutions (zero unacknowledged findings) on every
synthesized template of both stages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from aws_cdk.assertions import Annotations, Match

STAGES = ("dev_app_and_stage", "prod_app_and_stage")


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


def _cfn_lint(paths: list[str]) -> subprocess.CompletedProcess[str]:
    # The console script beside the interpreter: cfnlint has no `python -m cfnlint` entry point.
    cfn_lint = Path(sys.executable).with_name("cfn-lint")
    assert cfn_lint.exists(), f"{cfn_lint} missing: install the test extra (cfn-lint)"
    return subprocess.run([str(cfn_lint), "--format", "parseable", *paths], capture_output=True, text=True, check=False)


@pytest.mark.parametrize("stage_fixture", STAGES)
def test_cfn_lint_has_no_errors_and_no_hard_coded_zone(request, stage_fixture, template_of, tmp_path: Path):
    _, stacks = request.getfixturevalue(stage_fixture)
    paths = []
    for name, stack in stacks.items():
        path = tmp_path / f"{stack.stack_name}.template.json"
        path.write_text(json.dumps(template_of(stack).to_json(), indent=1))
        paths.append(str(path))
    result = _cfn_lint(paths)
    # Exit code bits: 2 errors, 4 warnings, 8 informational; anything else (1) is a crash.
    assert result.returncode & ~(4 | 8) == 0, result.stdout + result.stderr
    findings = [line.split(":")[4] for line in result.stdout.splitlines() if line.count(":") >= 5]
    errors = [f for f in findings if f.startswith("E")]
    # W3010: an availability zone written into a template (zone names differ per account).
    assert not errors and "W3010" not in findings, result.stdout
